"""``RowSchema``: the one declaration of a rollout row's fields (writer, data-plane read and collate use it).

A row is one sibling: the prompt and completion tokens, the prompt length, the sampled tokens' logprobs and
weight versions (one per completion token), and the reward. A workflow that adds a field (a loss mask over
the model's own tokens, a value estimate) adds it here, and every reader sees it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from screl.rollout.engine import GenerationResult


@dataclass(frozen=True)
class RowField:
    name: str
    dtype: torch.dtype
    doc: str


@dataclass(frozen=True)
class RowSchema:
    fields: tuple[RowField, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    def build(self, result: GenerationResult, reward: float) -> dict[str, torch.Tensor]:
        """The row of one finished single-turn sample."""
        values: dict[str, Sequence[float] | Sequence[int]] = {
            "input_ids": list(result.prompt_token_ids) + list(result.token_ids),
            "prompt_len": [len(result.prompt_token_ids)],
            "generation_logprobs": result.logprobs,
            "token_versions": result.weight_versions,
            "reward": [reward],
        }
        return {f.name: torch.tensor(values[f.name], dtype=f.dtype) for f in self.fields}

    def merge(self, rows: Sequence[dict[str, torch.Tensor]]) -> dict[str, list[torch.Tensor]]:
        """Per-field lists for one data-plane put; every row must have exactly the schema's fields."""
        for row in rows:
            if set(row) != set(self.names):
                raise ValueError(f"a row has fields {sorted(row)}, the schema {sorted(self.names)}")
        return {name: [row[name] for row in rows] for name in self.names}


ROW_SCHEMA = RowSchema((
    RowField("input_ids", torch.int64, "prompt + completion token ids"),
    RowField("prompt_len", torch.int64, "[prompt length]"),
    RowField("generation_logprobs", torch.float32, "sampled-token logprobs, one per completion token"),
    RowField("token_versions", torch.int64, "weight version that sampled each completion token"),
    RowField("reward", torch.float32, "[reward]"),
))

#: Fields of every rollout row in the data plane.
ROW_FIELDS = ROW_SCHEMA.names
