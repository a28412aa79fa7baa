"""What a TRL-style reward function is given: a batch of records and completions laid out as TRL lays them out.

``prompts``: each record's text, or, for a conversational prompt (the record's ``metadata["prompt_messages"]``, a
list of ``{"role", "content"}`` messages), that list. ``completions``: the decoded text, or for a conversational
prompt ``[{"role": "assistant", "content": text}]``. ``completion_ids``: the sampled token ids. Every other key of
the records' metadata (the dataset's columns) is a keyword argument: one list per column, aligned with the batch
(``None`` where a record lacks the column).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from screl.envs.base import PromptRecord

#: The metadata key under which a record carries its prompt as chat messages (a conversational prompt).
PROMPT_MESSAGES = "prompt_messages"

#: Names a reward function receives that a column may not take.
_RESERVED = frozenset({"prompts", "completions", "completion_ids", PROMPT_MESSAGES})


@dataclass(frozen=True)
class RewardInputs:
    """One batch, laid out for ``fn(prompts=..., completions=..., completion_ids=..., **columns)``."""

    prompts: list[Any]
    completions: list[Any]
    completion_ids: list[list[int]]
    columns: dict[str, list[Any]]

    def __len__(self) -> int:
        return len(self.prompts)

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of one call."""
        return {"prompts": self.prompts, "completions": self.completions, "completion_ids": self.completion_ids,
                **self.columns}


def is_conversational(record: PromptRecord) -> bool:
    """Whether the record's prompt is a list of chat messages (``metadata["prompt_messages"]``)."""
    messages = record.metadata.get(PROMPT_MESSAGES)
    return isinstance(messages, list) and bool(messages)


def reward_inputs(records: Sequence[PromptRecord], completions: Sequence[str],
                  completion_ids: Sequence[Sequence[int]]) -> RewardInputs:
    """The batch as TRL gives it to a reward function (see the module docstring)."""
    if not len(records) == len(completions) == len(completion_ids):
        raise ValueError(f"reward inputs: {len(records)} records, {len(completions)} completions and "
                         f"{len(completion_ids)} completion_ids (one each per sample)")
    prompts: list[Any] = []
    shaped: list[Any] = []
    for rec, text in zip(records, completions, strict=True):
        if is_conversational(rec):
            prompts.append(list(rec.metadata[PROMPT_MESSAGES]))
            shaped.append([{"role": "assistant", "content": text}])
        else:
            prompts.append(rec.text)
            shaped.append(text)
    names = sorted({k for rec in records for k in rec.metadata} - _RESERVED)
    columns = {k: [rec.metadata.get(k) for rec in records] for k in names}
    return RewardInputs(prompts, shaped, [list(ids) for ids in completion_ids], columns)


def completion_text(completion: Any) -> str:
    """A completion's text, whether given as text or as ``[{"role": "assistant", "content": text}]``."""
    if isinstance(completion, list):
        return "".join(str(m.get("content", "")) for m in completion)
    return str(completion)
