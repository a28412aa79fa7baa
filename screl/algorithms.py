"""The algorithm registry: what the CLI, the rules, the data module and the controller ask of an algorithm.

Each algorithm registers once (``register_algorithm``), beside its run block: its name, the block that holds its
step settings (and that block's dataclass, from which the CLI makes ``--grpo`` / ``--ppo``), its LightningModule's
class path (resolved only when needed) and its step rules. Code outside an algorithm's own files asks the registry
(``algorithm_of_run``, ``algorithm_of_model``, ``run_blocks``) instead of testing which algorithm it is. Plain values
only: the controller (a Ray actor that never imports Lightning) reads the same specs, so the built-in entries are
registered by light files (``BUILTIN_ENTRIES``: the run blocks' own), never by the LightningModules' files.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "Algorithm", "algorithm", "algorithm_of_model", "algorithm_of_run", "algorithms", "register_algorithm", "run_blocks",
]

BUILTIN_ENTRIES = ("screl.config_algo", "screl.config_distill")
"""The files whose import registers the built-in algorithms (GRPO and PPO beside their blocks, Distill beside its
``distillation`` block), loaded by the first lookup."""


@dataclass(frozen=True)
class Algorithm:
    """One registered algorithm and the rules the rest of screl reads from it."""

    name: str
    """Its registry name (``grpo``)."""
    title: str
    """How ``screl check`` and the logs name it (``GRPO``)."""
    config_key: str
    """The run's block with its step settings (``grpo`` or ``ppo``)."""
    module: str
    """The class path of its LightningModule."""
    step_may_shrink: bool
    """Whether a step may train on fewer groups than ``num_prompts_per_step`` (after drops)."""
    needs_critic: bool
    """Whether it trains a critic: its advantages come from values (``needs_values`` estimators), it supports
    critic warmup (``policy_training_start_step``), and its model needs ``value`` and ``value_loss_fn``."""
    default_adv_estimator: str
    """``adv_estimator.name`` when the block leaves it out."""
    min_generations_per_prompt: int = 1
    """The smallest ``num_generations_per_prompt`` its advantages work with (a group baseline needs 2)."""
    samplers: tuple[str, ...] | None = None
    """The staleness samplers it supports (None: all of them)."""
    multi_process_strategies: tuple[str, ...] | None = None
    """The strategies (class names) under which it reduces over data-parallel replicas, when it needs one of
    them for a multi-process run (None: the trainer rules decide alone)."""
    megatron_context_parallel: bool = True
    """Whether it supports ``context_parallel_size > 1`` under MegatronStrategy."""
    vision_refusal: str | None = None
    """Why it cannot train a vision-language policy (None: it can)."""
    block: type[Any] | None = None
    """The dataclass of its run block (``GRPOConfig``): the type of the CLI's ``--<config_key>``; of the entries
    sharing a block, the first registered gives it."""
    rules: tuple[str, ...] = ()
    """Its own config rules, as ``package.module:function`` paths (each takes a ``screl.rules.RuleContext``); they
    run when the run's block or its model is this algorithm, after the rules every algorithm shares."""


_REGISTRY: dict[str, Algorithm] = {}


def register_algorithm(spec: Algorithm) -> Algorithm:
    """Add ``spec``; a second registration of one name or module is refused."""
    clash = [a.name for a in _REGISTRY.values() if a.name == spec.name or a.module == spec.module]
    if clash:
        raise ValueError(f"algorithm {spec.name!r} ({spec.module}) clashes with the registered {clash}")
    _REGISTRY[spec.name] = spec
    return spec


def _registry() -> dict[str, Algorithm]:
    """Every registered algorithm, the built-in ones loaded first (a dynamic import: their files import this one)."""
    for entries in BUILTIN_ENTRIES:
        importlib.import_module(entries)
    return _REGISTRY


def algorithm(name: str) -> Algorithm:
    try:
        return _registry()[name]
    except KeyError:
        raise ValueError(f"unknown algorithm {name!r}; registered: {sorted(_REGISTRY)}") from None


def algorithms() -> list[Algorithm]:
    return list(_registry().values())


def block_keys() -> list[str]:
    """The run-config blocks an algorithm may hold its step settings in (``grpo``, ``ppo``)."""
    return sorted({a.config_key for a in _registry().values()})


def run_blocks() -> dict[str, tuple[type[Any], str]]:
    """Each run block's key -> its dataclass and its help line (``GRPO step settings.``), in registration order."""
    blocks: dict[str, tuple[type[Any], str]] = {}
    for a in _registry().values():
        if a.block is not None and a.config_key not in blocks:
            blocks[a.config_key] = (a.block, f"{a.title} step settings.")
    return blocks


def algorithm_of_run(run: Any) -> Algorithm:
    """The algorithm whose block a run config (a ``RunConfig`` or its raw mapping) sets: the block's own
    algorithm (``grpo`` for the ``grpo`` block, whichever module trains on it). GRPO when none is set."""
    get = run.get if isinstance(run, Mapping) else lambda key: getattr(run, key, None)
    present = [key for key in block_keys() if get(key) is not None]
    key = present[0] if len(present) == 1 else "grpo"
    return next(a for a in _registry().values() if a.name == key)


def algorithm_of_model(class_path: Any) -> Algorithm | None:
    """The algorithm of a configured ``model.class_path``: a registered module, its short ``screl.<Class>`` name,
    or a class derived from one (the most derived registered base wins). None when it is none of these or cannot
    be imported (the parser reports that)."""
    if not isinstance(class_path, str) or not class_path:
        return None
    by_path = {a.module: a for a in _registry().values()}
    short = {f"screl.{a.module.rsplit('.', 1)[-1]}": a for a in by_path.values()}
    if class_path in by_path or class_path in short:
        return by_path.get(class_path) or short[class_path]
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    for base in getattr(cls, "__mro__", ()):
        found = by_path.get(f"{base.__module__}.{base.__qualname__}")
        if found is not None:
            return found
    return None

