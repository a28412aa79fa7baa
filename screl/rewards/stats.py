"""``RewardStats``: each reward function's mean and standard deviation over the samples reported since the last
training step, logged as ``train/rewards/<name>/mean`` and ``train/rewards/<name>/std``.

The controller adds every sealed sample's per-function values (``SiblingReport.reward_parts``) as the reports come
in, and hands the figures to the trainer with each step's refit (``complete_step``). A function that returned
``None`` for a sample does not count for it (TRL's ``nanmean`` and ``nanstd``: the standard deviation is the sample
one, with Bessel's correction; 0.0 for a single value)."""

from __future__ import annotations

import math
from collections.abc import Mapping


class RewardStats:
    """Running sums per reward function, taken (and reset) once a step."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}  # name -> [count, sum, sum of squares]

    def add(self, parts: Mapping[str, float] | None) -> None:
        """One sample's values (``None`` or empty: a task without reward functions)."""
        for name, value in (parts or {}).items():
            acc = self._sums.setdefault(name, [0.0, 0.0, 0.0])
            acc[0] += 1.0
            acc[1] += float(value)
            acc[2] += float(value) ** 2

    def take(self) -> dict[str, float]:
        """``rewards/<name>/mean`` and ``rewards/<name>/std`` since the last take, then start again."""
        out: dict[str, float] = {}
        for name, (n, s, sq) in sorted(self._sums.items()):
            mean = s / n
            var = max(sq - n * mean * mean, 0.0) / (n - 1) if n > 1 else 0.0
            out[f"rewards/{name}/mean"] = mean
            out[f"rewards/{name}/std"] = math.sqrt(var)
        self._sums.clear()
        return out


REWARD_PART = "rewards/"
"""A collated chunk's ``rewards/<name>``: each reward function's value per row, NaN where a row has none (a function
that returned None, a row restored from a snapshot); ``completions.jsonl`` writes them under the same names."""


class RowRewardParts:
    """Each sealed row's per-function values, kept by its key until its chunk is handed to the trainer, which writes
    them beside the row's reward (``rewards/<name>`` in ``completions.jsonl``). At most ``capacity`` rows are kept
    (the oldest go first: rows dropped or filtered before training are never taken); a row restored from a snapshot
    has none."""

    def __init__(self, capacity: int = 1 << 16) -> None:
        self.capacity = capacity
        self._rows: dict[str, Mapping[str, float]] = {}  # insertion order: the oldest first

    def add(self, key: str, parts: Mapping[str, float] | None) -> None:
        if not parts:
            return
        self._rows[key] = parts
        while len(self._rows) > self.capacity:
            del self._rows[next(iter(self._rows))]

    def take(self, keys: list[str]) -> dict[str, list[float | None]]:
        """``name -> value per key`` (None where a row has no value for it) for the rows ``keys``, forgotten here; {}
        when none of them has any."""
        found = [self._rows.pop(k, None) for k in keys]
        names = sorted({name for parts in found if parts for name in parts})
        return {name: [None if parts is None or parts.get(name) is None else float(parts[name]) for parts in found]
                for name in names}

    def __len__(self) -> int:
        return len(self._rows)
