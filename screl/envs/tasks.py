"""Tasks shipped with screl: the TRL benchmark peer's two tasks, and prompts from a JSONL file."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterator
from typing import Any

from screl.envs.base import PromptRecord, Task, load_reward_fn


def split_holdout(records: list[PromptRecord], holdout: int) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """(train, held out): ``holdout`` prompts chosen by a fixed hash of their ids (the same on every machine and
    run), the rest in their original order."""
    if not 0 <= holdout < len(records):
        raise ValueError(f"holdout={holdout} must be in [0, {len(records) - 1}] (the task has {len(records)} prompts)")
    ranked = sorted(records, key=lambda r: hashlib.sha256(f"holdout:{r.prompt_id}".encode()).digest())
    held = {r.prompt_id for r in ranked[:holdout]}
    return [r for r in records if r.prompt_id not in held], [r for r in records if r.prompt_id in held]


class _Arithmetic(Task):
    """The 100 arithmetic prompts, ``holdout`` of them kept back for validation; ``question`` (with ``{a}`` and
    ``{b}``) rewords them, ids and metadata unchanged."""

    def __init__(self, holdout: int = 0, question: str | None = None) -> None:
        self.holdout = holdout
        records = arithmetic_prompts()
        if question is not None:
            records = [PromptRecord(p.prompt_id, question.format(**p.metadata), p.metadata) for p in records]
        self._train, self._held = split_holdout(records, holdout)

    def prompts(self) -> list[PromptRecord]:
        """The arithmetic prompts less the held-out ones (the reward may ignore them)."""
        return list(self._train)

    def val_prompts(self) -> list[PromptRecord]:
        """The ``holdout`` held-out prompts (validation during training)."""
        return list(self._held)


def arithmetic_prompts() -> list[PromptRecord]:
    """The 100 prompts ``"{a}+{b}="`` for single digits, a-major; ``prompt_id = 10 * a + b``."""
    return [
        PromptRecord(prompt_id=10 * a + b, text=f"{a}+{b}=", metadata={"a": a, "b": b})
        for a in range(10)
        for b in range(10)
    ]


class CountLetter(_Arithmetic):
    """Dense toy reward: the fraction of ``letter`` among the completion's characters.

    Args:
        letter: The single character to count.
        threshold: If set, the reward is pass/fail instead: 1.0 when the fraction reaches ``threshold``, else 0.0
            (a sparse reward whose groups often agree: what dynamic sampling filters).
        holdout: Prompts kept back from training for validation (``val_prompts()``).
    """

    def __init__(self, letter: str = "a", threshold: float | None = None, holdout: int = 0) -> None:
        super().__init__(holdout)
        if len(letter) != 1:
            raise ValueError(f"CountLetter(letter={letter!r}) must be a single character.")
        if threshold is not None and not 0.0 < threshold <= 1.0:
            raise ValueError(f"CountLetter(threshold={threshold!r}) must be in (0, 1], or None for the dense reward.")
        self.letter = letter
        self.threshold = threshold

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """``completion.count(letter) / max(1, len(completion))`` (pass/fail against ``threshold`` if set)."""
        fraction = completion.count(self.letter) / max(1, len(completion))
        if self.threshold is None:
            return fraction
        return 1.0 if fraction >= self.threshold else 0.0


class Addition(_Arithmetic):
    """Verifiable single-digit addition: 1.0 if the completion starts with the sum's digits, else 0.0.

    Args:
        holdout: Prompts kept back from training for validation (``val_prompts()``).
    """

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """Exact-prefix match of ``str(a + b)``."""
        a, b = int(prompt.metadata["a"]), int(prompt.metadata["b"])
        return 1.0 if completion.startswith(str(a + b)) else 0.0


class JsonlTask(Task):
    """Prompts from a JSONL file, scored by a user reward function.

    Each line is a JSON object; ``text_key`` holds the prompt, ``id_key`` (if given) its integer id,
    else the line number (0-based, blank lines skipped). The other fields become ``metadata``.

    Args:
        path: Local JSONL file.
        reward_fn: ``"package.module:function"``; called as ``fn(prompt, completion) -> float``.
        text_key: Field holding the prompt text.
        id_key: Field holding a stable integer id; ``None`` numbers lines.
    """

    def __init__(
        self, path: str, reward_fn: str, text_key: str = "prompt", id_key: str | None = None
    ) -> None:
        self.path = path
        self.reward_fn = reward_fn
        self.text_key = text_key
        self.id_key = id_key
        self._fn = load_reward_fn(reward_fn)
        self._records: list[PromptRecord] | None = None

    def prompts(self) -> list[PromptRecord]:
        """The file's prompts in file order (read once)."""
        if self._records is None:
            self._records = self._read()
        return list(self._records)

    def _read(self) -> list[PromptRecord]:
        """Every row, checked as it is read: ValueError/KeyError name the file's line (1-based) and the fix."""
        records: list[PromptRecord] = []
        seen: dict[int, int] = {}
        for i, (number, line) in enumerate(text_lines(self.path, lambda n: f"JsonlTask: line {n} of {self.path}")):
            row = json_object(line, f"JsonlTask: line {number} of {self.path}")
            if self.text_key not in row or row[self.text_key] is None:
                raise KeyError(f"JsonlTask: line {number} of {self.path} has no text_key={self.text_key!r}.")
            if self.id_key is not None and not isinstance(row.get(self.id_key), int):
                raise ValueError(f"JsonlTask: line {number} of {self.path} has {self.id_key}="
                                 f"{row.get(self.id_key)!r}: every row needs an integer id (id_key={self.id_key!r}).")
            pid = int(row.pop(self.id_key)) if self.id_key is not None else i
            if pid in seen:
                raise ValueError(f"JsonlTask: duplicate prompt id {pid} in {self.path}: lines {seen[pid]} and"
                                 f" {number}; ids must be unique.")
            seen[pid] = number
            records.append(PromptRecord(prompt_id=pid, text=str(row.pop(self.text_key)), metadata=row))
        if not records:
            raise ValueError(f"JsonlTask: {self.path} has no rows (it is empty): no prompts to train on.")
        return records

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """The user function's score."""
        return float(self._fn(prompt, completion))


def text_lines(path: str, located: Callable[[int], str]) -> Iterator[tuple[int, str]]:
    """The non-blank lines of the file ``path`` as (1-based line number, text), read as UTF-8; a line that is not
    UTF-8 is a ValueError naming it (``located(number)``: where the message says it is) and the fix."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{located(number)} is not UTF-8 (byte {raw[err.start]:#04x} at column "
                                 f"{err.start + 1}); re-encode the file as UTF-8") from None
            if line.strip():
                yield number, line


def json_object(line: str, located: str) -> dict[str, Any]:
    """One JSON Lines row: a ValueError names where it is (``located``) when it is not JSON or not an object."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{located} is not JSON ({err.msg} at column {err.colno}): {line.strip()[:80]!r}") from None
    if not isinstance(row, dict):
        raise ValueError(f"{located} is a JSON {type(row).__name__}, not an object of columns: "
                         f"{line.strip()[:80]!r}")
    return row
