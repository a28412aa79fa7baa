"""Token capture: the turns of a multi-turn rollout, and the one training row they become.

Each turn is one engine call: the prompt it was given and the tokens the model sampled. A conversation is
token-exact when every turn's prompt starts with the previous turn's prompt and completion (the server and
the direct workflow both splice that way), so the last turn's prompt + completion holds every turn. The row
is that sequence: its prompt is the first turn's prompt; after it, ``loss_mask`` is 1 on the model's own
tokens and 0 on the environment's and tools' (the tokens spliced in between turns), ``generation_logprobs``
and ``token_versions`` are the engine's on model tokens (0 and the preceding model token's version
elsewhere, never read: the mask drops them).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from screl.rollout.engines.protocol import GenerationResult
from screl.rollout.rows import FINISH_CODES, ROW_SCHEMA, RowSchema

__all__ = ["Turn", "TrajectoryError", "build_row", "turn_of"]


class TrajectoryError(ValueError):
    """The turns do not form one token-exact conversation (a turn re-tokenized the past)."""


@dataclass(frozen=True)
class Turn:
    """One engine call of a conversation."""

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    weight_versions: tuple[int, ...]
    finish_reason: str
    tags: Mapping[str, Any] = field(default_factory=dict)
    """What the turn belongs to (``group``, ``sibling``, ``turn``), as the request said."""

    def __post_init__(self) -> None:
        n = len(self.token_ids)
        if len(self.logprobs) != n or len(self.weight_versions) != n:
            raise ValueError(f"a turn has {n} tokens but {len(self.logprobs)} logprobs and "
                             f"{len(self.weight_versions)} versions")

    def as_dict(self) -> dict[str, Any]:
        """Plain containers (for Ray and JSON)."""
        return {"prompt_token_ids": list(self.prompt_token_ids), "token_ids": list(self.token_ids),
                "logprobs": list(self.logprobs), "weight_versions": list(self.weight_versions),
                "finish_reason": self.finish_reason, "tags": dict(self.tags)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Turn:
        return cls(tuple(d["prompt_token_ids"]), tuple(d["token_ids"]), tuple(d["logprobs"]),
                   tuple(d["weight_versions"]), str(d["finish_reason"]), dict(d.get("tags", {})))


def turn_of(result: GenerationResult, tags: Mapping[str, Any] | None = None) -> Turn:
    """The turn an engine result records."""
    return Turn(tuple(result.prompt_token_ids), tuple(result.token_ids), tuple(result.logprobs),
                tuple(result.weight_versions), result.finish_reason, dict(tags or {}))


def build_row(turns: Sequence[Turn], reward: float, schema: RowSchema = ROW_SCHEMA, *,
              sample_mask: float = 1.0) -> dict[str, torch.Tensor]:
    """The training row of one finished conversation (TrajectoryError if it is not token-exact)."""
    if not turns:
        raise TrajectoryError("a conversation with no turns has no row")
    seq = list(turns[0].prompt_token_ids)
    prompt_len = len(seq)
    mask: list[float] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for k, turn in enumerate(turns):
        head = turn.prompt_token_ids[:len(seq)]
        if tuple(seq) != head:
            at = next((i for i, (a, b) in enumerate(zip(seq, head, strict=False)) if a != b), len(head))
            raise TrajectoryError(f"turn {k}'s prompt does not extend the conversation so far (they differ at "
                                  f"token {at} of {len(seq)}): the past was re-tokenized instead of spliced")
        spliced = turn.prompt_token_ids[len(seq):]  # the environment's and tools' tokens since the last turn
        last_version = versions[-1] if versions else (turn.weight_versions[0] if turn.weight_versions else 0)
        seq += spliced
        mask += [0.0] * len(spliced)
        logprobs += [0.0] * len(spliced)
        versions += [last_version] * len(spliced)
        seq += turn.token_ids
        mask += [1.0] * len(turn.token_ids)
        logprobs += turn.logprobs
        versions += turn.weight_versions
    values: dict[str, Sequence[float] | Sequence[int]] = {
        "input_ids": seq, "prompt_len": [prompt_len], "loss_mask": mask, "generation_logprobs": logprobs,
        "token_versions": versions, "reward": [reward], "raw_reward": [reward],
        "finish_reason": [FINISH_CODES.get(turns[-1].finish_reason, FINISH_CODES["stop"])],
        "sample_mask": [sample_mask],
    }
    return schema.tensors(values, "a multi-turn workflow fills the standard ones only")
