"""``RewardFuncs``: several TRL-style reward functions and their weights, scoring a batch into weighted totals.

A reward function has TRL's signature, ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]``
(called with keywords; ``kwargs`` are the dataset's columns, :mod:`screl.rewards.inputs`), and may be ``async``.
``None`` means "does not apply": it is left out of the weighted sum (TRL's ``nansum``) and of the function's
metrics; a sample for which every function returned ``None`` is unscorable (total 0.0, masked out of the loss:
TRL gives it a NaN reward, left out of its group's baseline, and a zero advantage).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from screl.envs.base import PromptRecord, Scored
from screl.rewards.inputs import RewardInputs, reward_inputs

RewardFunc = Callable[..., Any]
"""``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]`` (or an awaitable of it)."""

EXPECTED = "fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]"


class RewardFuncError(ValueError):
    """A reward function broke its contract (its signature, the length of what it returned)."""


class NonFiniteRewardError(RewardFuncError):
    """A reward function returned NaN or infinity for a sample: a data failure (the sample is resampled)."""


class Scores(NamedTuple):
    """A scored batch: the weighted totals and each function's values (``None``: did not apply)."""

    totals: list[float]
    values: dict[str, list[float | None]]


def load_reward_func(target: str | RewardFunc) -> RewardFunc:
    """A callable as given, or the object ``"package.module:function"`` names."""
    if not isinstance(target, str):
        if not callable(target):
            raise TypeError(f"reward function {target!r} is not callable; expected {EXPECTED}")
        return target
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function {target!r} must be a callable or a path 'package.module:function'")
    fn: Any = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"reward function {target!r} resolves to {fn!r}, which is not callable")
    return fn  # type: ignore[no-any-return]


def func_name(fn: RewardFunc) -> str:
    """The name a function's metrics carry: its ``__name__`` (a reward model's: its directory's name)."""
    name = getattr(fn, "__name__", None)
    return str(name) if name else type(fn).__name__


def check_signature(fn: RewardFunc, name: str) -> inspect.Signature:
    """``fn``'s signature, if it takes TRL's keywords (``completions`` at least, by name or through ``**kwargs``)
    and needs no positional-only argument; else a ``RewardFuncError`` naming the expected signature."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise RewardFuncError(f"reward function {name!r}: cannot read its signature ({err}); expected "
                              f"{EXPECTED}") from err
    params = sig.parameters.values()
    has_var_kw = any(p.kind is p.VAR_KEYWORD for p in params)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    positional_only = [p.name for p in params if p.kind is p.POSITIONAL_ONLY and p.default is p.empty]
    if positional_only or not (has_var_kw or "completions" in named):
        raise RewardFuncError(f"reward function {name!r} has the signature {name}{sig}; expected TRL's {EXPECTED} "
                              "(called with keywords; the dataset's columns come as keyword arguments)")
    return sig


def _bind(fn: RewardFunc, sig: inspect.Signature, name: str, inputs: RewardInputs) -> dict[str, Any]:
    """The keywords ``fn`` takes (all of them with ``**kwargs``); a missing column is named."""
    kwargs = inputs.kwargs()
    if not any(p.kind is p.VAR_KEYWORD for p in sig.parameters.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in sig.parameters}
    try:
        sig.bind(**kwargs)
    except TypeError as err:
        raise RewardFuncError(f"reward function {name!r} cannot be called with the batch's columns "
                              f"{sorted(inputs.columns)} ({err}); expected {EXPECTED}") from err
    return kwargs


def _checked(name: str, out: Any, rows: int) -> list[float | None]:
    """The function's values as floats (``None`` kept); a wrong length or a non-finite value is named."""
    try:
        values = list(out)
    except TypeError as err:
        raise RewardFuncError(f"reward function {name!r} returned {type(out).__name__}, not a list of "
                              f"{rows} rewards; expected {EXPECTED}") from err
    if len(values) != rows:
        raise RewardFuncError(f"reward function {name!r} returned {len(values)} rewards for {rows} completions "
                              "(one per completion, None where it does not apply)")
    return [None if v is None else float(v) for v in values]


def _run_coroutines(coros: list[Any]) -> list[Any]:
    """Await the async functions' calls together, in a fresh event loop (in a thread of its own when this thread
    already runs one)."""

    async def gather() -> list[Any]:
        return list(await asyncio.gather(*coros))

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(gather())
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["out"] = asyncio.run(gather())
        except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
            box["err"] = err

    t = threading.Thread(target=run, name="screl-async-rewards")
    t.start()
    t.join()
    if "err" in box:
        raise box["err"]
    return box["out"]  # type: ignore[no-any-return]


class RewardFuncs:
    """Reward functions and their weights (TRL's ``reward_funcs`` and ``reward_weights``).

    Args:
        reward_funcs: Callables or ``"package.module:function"`` paths with TRL's signature (a
            :class:`screl.rewards.RewardModel`, a :func:`screl.rewards.verl_score` adapter, ``trl.rewards``' own).
        reward_weights: One weight per function (default: all 1.0).
        reward_names: The metric names (``train/rewards/<name>/mean``); default each function's ``__name__``.
    """

    def __init__(self, reward_funcs: Sequence[str | RewardFunc], reward_weights: Sequence[float] | None = None,
                 reward_names: Sequence[str] | None = None) -> None:
        if not reward_funcs:
            raise ValueError("reward_funcs is empty: give at least one reward function")
        self.funcs = [load_reward_func(f) for f in reward_funcs]
        self.weights = [1.0] * len(self.funcs) if reward_weights is None else [float(w) for w in reward_weights]
        if len(self.weights) != len(self.funcs):
            raise ValueError(f"reward_weights has {len(self.weights)} weights for {len(self.funcs)} reward_funcs "
                             "(one weight per function)")
        self.names = [func_name(f) for f in self.funcs] if reward_names is None else [str(n) for n in reward_names]
        if len(self.names) != len(self.funcs):
            raise ValueError(f"reward_names has {len(self.names)} names for {len(self.funcs)} reward_funcs")
        twice = sorted({n for n in self.names if self.names.count(n) > 1})
        if twice:
            raise ValueError(f"reward functions named {twice} appear more than once: their metrics would clash; "
                             "give reward_names")
        self.signatures = [check_signature(f, n) for f, n in zip(self.funcs, self.names, strict=True)]

    def values(self, inputs: RewardInputs) -> dict[str, list[float | None]]:
        """Each function's values on the batch (async functions awaited together, after the others)."""
        rows = len(inputs)
        out: dict[str, list[float | None]] = {}
        pending: list[tuple[str, Any]] = []
        for fn, sig, name in zip(self.funcs, self.signatures, self.names, strict=True):
            result = fn(**_bind(fn, sig, name, inputs))
            if inspect.isawaitable(result):
                pending.append((name, result))
            else:
                out[name] = _checked(name, result, rows)
        if pending:
            for (name, _), result in zip(pending, _run_coroutines([c for _, c in pending]), strict=True):
                out[name] = _checked(name, result, rows)
        return {name: out[name] for name in self.names}

    def score(self, records: Sequence[PromptRecord], completions: Sequence[str],
              completion_ids: Sequence[Sequence[int]]) -> Scores:
        """The weighted totals (``None`` skipped; 0.0 where every function returned ``None``) and each function's
        values; a non-finite value raises :class:`NonFiniteRewardError`."""
        values = self.values(reward_inputs(records, completions, completion_ids))
        errors = _non_finite(records, values)
        if errors:
            raise next(iter(errors.values()))
        return Scores(self._totals(values), values)

    def scored(self, records: Sequence[PromptRecord], completions: Sequence[str],
               completion_ids: Sequence[Sequence[int]]) -> list[Scored]:
        """:meth:`score` as :meth:`screl.envs.Task.scored` gives it: per sample, the total and the parts; a sample
        with a non-finite value carries the error (a data failure), the others are scored as usual."""
        values = self.values(reward_inputs(records, completions, completion_ids))
        errors = _non_finite(records, values)
        out = []
        for i, total in enumerate(self._totals(values)):
            if i in errors:
                out.append(Scored(0.0, error=errors[i]))
                continue
            parts = {name: v for name, column in values.items() if (v := column[i]) is not None}
            out.append(Scored(total, parts, unscorable=not parts))
        return out

    def _totals(self, values: dict[str, list[float | None]]) -> list[float]:
        """Per sample, the weighted sum of the values that are not ``None`` (TRL's ``nansum``)."""
        rows = zip(*(values[n] for n in self.names), strict=True)
        return [math.fsum(w * v for w, v in zip(self.weights, row, strict=True) if v is not None and math.isfinite(v))
                for row in rows]


def _non_finite(records: Sequence[PromptRecord], values: dict[str, list[float | None]]) -> dict[int, Exception]:
    """The samples given a NaN or infinite value, each with its error (the first function that gave one)."""
    errors: dict[int, Exception] = {}
    for name, column in values.items():
        for i, v in enumerate(column):
            if v is not None and not math.isfinite(v) and i not in errors:
                errors[i] = NonFiniteRewardError(
                    f"reward function {name!r} returned {v} for sample {i} (prompt_id {records[i].prompt_id}): "
                    "rewards must be finite (None where a function does not apply)")
    return errors
