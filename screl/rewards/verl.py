"""verl's reward signature, ``compute_score(data_source, solution_str, ground_truth, extra_info) -> float | dict``,
as a TRL-style reward function (:func:`verl_score`).

The adapter reads the columns verl's parquet files carry: ``data_source``, ``ground_truth`` (or
``reward_model["ground_truth"]``, verl's layout) and ``extra_info`` (optional); ``solution_str`` is the completion's
text. ``compute_score`` may return a number or a dict with a ``"score"`` key (verl's richer results).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from screl.rewards.funcs import RewardFuncError, load_reward_func
from screl.rewards.inputs import completion_text


def _ground_truth(i: int, kwargs: dict[str, Any]) -> Any:
    if "ground_truth" in kwargs and kwargs["ground_truth"][i] is not None:
        return kwargs["ground_truth"][i]
    reward_model = kwargs.get("reward_model", [None] * (i + 1))[i]
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return reward_model["ground_truth"]
    raise RewardFuncError(f"verl_score: sample {i} has no ground truth: give a 'ground_truth' column or a "
                          "'reward_model' column holding {'ground_truth': ...} (verl's layout); the batch has "
                          f"columns {sorted(kwargs)}")


def _as_score(out: Any, name: str) -> float | None:
    if isinstance(out, dict):
        if "score" not in out:
            raise RewardFuncError(f"verl_score({name}) returned a dict without a 'score' key: {sorted(out)}")
        out = out["score"]
    return None if out is None else float(out)


class VerlScore:
    """A verl ``compute_score`` (a callable or ``"package.module:function"``) with TRL's reward signature.

    Picklable when given as a path (the function is imported where it runs). Its metrics name is the function's.
    """

    def __init__(self, compute_score: str | Callable[..., Any]) -> None:
        self.compute_score = compute_score
        self._fn: Callable[..., Any] | None = None if isinstance(compute_score, str) else compute_score
        fn = self.fn
        self.__name__ = str(getattr(fn, "__name__", "compute_score"))

    @property
    def fn(self) -> Callable[..., Any]:
        if self._fn is None:
            self._fn = load_reward_func(self.compute_score)
        return self._fn

    def __call__(self, prompts: list[Any], completions: list[Any], completion_ids: list[list[int]] | None = None,
                 **kwargs: Any) -> list[float | None]:
        if "data_source" not in kwargs:
            raise RewardFuncError(f"verl_score({self.__name__}) needs a 'data_source' column; the batch has "
                                  f"columns {sorted(kwargs)}")
        extra = kwargs.get("extra_info", [None] * len(completions))
        return [_as_score(self.fn(data_source=kwargs["data_source"][i], solution_str=completion_text(c),
                                  ground_truth=_ground_truth(i, kwargs), extra_info=extra[i]), self.__name__)
                for i, c in enumerate(completions)]

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        if isinstance(self.compute_score, str):
            state["_fn"] = None  # imported again where it runs
        return state


def verl_score(compute_score: str | Callable[..., Any]) -> VerlScore:
    """verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` as a reward function for
    ``reward_funcs`` (see :class:`VerlScore`)."""
    return VerlScore(compute_score)
