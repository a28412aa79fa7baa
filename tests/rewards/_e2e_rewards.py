"""Reward functions for the end-to-end run (pickled by value: the rollout workers cannot import the tests)."""

from __future__ import annotations

from typing import Any


def count_a(completions: list[Any], **kwargs: Any) -> list[float]:
    return [str(c).count("a") / 16.0 for c in completions]


def quarter_if_even(completions: list[Any], b: list[int], **kwargs: Any) -> list[float | None]:
    return [0.25 if v % 2 == 0 else None for v in b]
