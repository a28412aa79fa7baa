"""The reward functions of ``configs/grpo_trl_style_tiny.yaml``, written as a TRL user writes them: TRL's signature
(``prompts``, ``completions``, ``completion_ids`` and the dataset's columns as keywords), completions as messages for
conversational data, ``None`` where a function does not apply."""

from __future__ import annotations

from typing import Any


def _text(completion: Any) -> str:
    return str(completion[0]["content"]) if isinstance(completion, list) else str(completion)


def letter_share(completions: list[Any], letter: list[str], **kwargs: Any) -> list[float]:
    """The share of the row's ``letter`` among the completion's characters (dense: every extra one counts)."""
    return [_text(c).count(x) / max(1, len(_text(c))) for c, x in zip(completions, letter, strict=True)]


def starts_with_letter(completions: list[Any], letter: list[str], **kwargs: Any) -> list[float | None]:
    """1.0 when the completion opens with the row's letter; None for an empty completion (nothing to judge)."""
    return [None if not _text(c) else float(_text(c).startswith(x)) for c, x in zip(completions, letter, strict=True)]
