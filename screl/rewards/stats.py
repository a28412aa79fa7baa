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
