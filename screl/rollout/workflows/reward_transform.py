"""Reward shaping and scaling, applied on the worker to each sealed sibling before its row is written.

``raw`` is the task's reward. Shaping (``grpo.reward_shaping`` / ``ppo.reward_shaping``) adds DAPO's soft overlong
penalty and then calls an optional function of yours; scaling (``reward_scaling``) clips into
``[source_min, source_max]`` and maps that range linearly onto ``[target_min, target_max]``. The row keeps both:
``raw_reward`` (logged as ``train/raw_reward``) and ``reward``, which advantages are computed from.

DAPO's overlong penalty, with ``L_max`` = ``max_response_length`` (default: ``generation.max_new_tokens``) and
``L_buf`` = ``overlong_buffer_length``: 0 up to ``L_max - L_buf`` tokens, then falling linearly to
``-overlong_penalty_factor`` at ``L_max`` (``(L_max - L_buf - len) / L_buf`` times the factor).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from screl.rollout.moved import refuse_moved

ShapingFn = Callable[[float, int, str], float]
"""``fn(reward, response_length, finish_reason) -> shaped reward``."""


def load_shaping_fn(path: str, key: str = "reward_shaping.class_path") -> ShapingFn:
    """The callable named ``package.module.name`` (a function, or a class built with no arguments)."""
    refuse_moved(path, key)
    module, _, name = path.replace(":", ".").rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"{key}={path!r}: cannot import it ({type(err).__name__}: {err})") from err
    fn = obj() if isinstance(obj, type) else obj
    if not callable(fn):
        raise ValueError(f"{key}={path!r} is not callable as fn(reward, response_length, finish_reason)")
    return fn  # type: ignore[no-any-return]


@dataclass(frozen=True)
class RewardTransform:
    """The run's shaping and scaling, picklable (workers rebuild the custom function by its path)."""

    overlong_buffer_length: int = 0
    overlong_penalty_factor: float = 1.0
    max_response_length: int | None = None
    shaping_fn: str | None = None
    scaling: tuple[float, float, float, float] | None = None
    """``(source_min, source_max, target_min, target_max)``."""

    @property
    def active(self) -> bool:
        return bool(self.overlong_buffer_length) or self.shaping_fn is not None or self.scaling is not None

    def overlong_penalty(self, response_length: int) -> float:
        if not self.overlong_buffer_length or self.max_response_length is None:
            return 0.0
        start = self.max_response_length - self.overlong_buffer_length
        if response_length <= start:
            return 0.0
        over = min(response_length, self.max_response_length) - start
        return -self.overlong_penalty_factor * over / self.overlong_buffer_length

    def __call__(self, reward: float, response_length: int, finish_reason: str) -> float:
        shaped = reward + self.overlong_penalty(response_length)
        if self.shaping_fn is not None:
            shaped = float(self._fn()(shaped, response_length, finish_reason))
        if self.scaling is not None:
            lo, hi, t_lo, t_hi = self.scaling
            shaped = t_lo + (min(max(shaped, lo), hi) - lo) * (t_hi - t_lo) / (hi - lo)
        return shaped

    def _fn(self) -> ShapingFn:
        cached = self.__dict__.get("_loaded")
        if cached is None:
            assert self.shaping_fn is not None
            cached = load_shaping_fn(self.shaping_fn)
            object.__setattr__(self, "_loaded", cached)
        return cached  # type: ignore[no-any-return]

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "_loaded"}


def reward_transform(algo: Any, max_new_tokens: int) -> RewardTransform | None:
    """The transform of an algorithm block (``GRPOConfig``/``PPOConfig``), or None when both are off."""
    sh, sc = algo.reward_shaping, algo.reward_scaling
    out = RewardTransform(
        overlong_buffer_length=sh.overlong_buffer_length if sh.enabled else 0,
        overlong_penalty_factor=sh.overlong_penalty_factor,
        max_response_length=sh.max_response_length or max_new_tokens,
        shaping_fn=sh.class_path if sh.enabled else None,
        scaling=(sc.source_min, sc.source_max, sc.target_min, sc.target_max) if sc.enabled else None,
    )
    return out if out.active else None
