"""The context every config rule reads, and the small helpers rules share."""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from screl.algorithms import Algorithm, algorithm_of_model, algorithm_of_run
from screl.data.sampler_api import StalenessSampler
from screl.data.sampler_config import (
    SamplerConfig,
    SamplerConfigError,
    parse_sampler_config,
)
from screl.data.sampler_factory import declared_capabilities, sampler_rules
from screl.rollout.engines.protocol import EngineCapabilities
from screl.rollout.engines.registry import engine_capabilities, engine_title

#: Legacy async knobs and where they went (the spec's migration table).
LEGACY_MIGRATION = (
    "port it to `async_rl`: enabled -> implicit (use async_rl.sampler.max_lookahead_versions: 0 for sync); "
    "max_trajectory_age_steps: N -> async_rl.sampler {name: in_order, max_lookahead_versions: N}; "
    "warmup_generation_lead_steps -> async_rl.sampler.warmup_lookahead_versions; "
    "recompute_kv_cache_after_weight_updates -> async_rl.recompute_kv_cache_after_weight_updates; "
    "then set the legacy block to null"
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config."""

    key: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A config that cannot run; ``problems`` holds every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        super().__init__(f"the config has {len(problems)} problem(s):\n{lines}")


def get(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]["c"]`` for ``"a.b.c"``, or ``default`` when any level is missing or None."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node or node[part] is None:
            return default
        node = node[part]
    return node


def to_mapping(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: to_mapping(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [to_mapping(v) for v in obj]
    return obj


def model_algorithm(cfg: Mapping[str, Any]) -> Algorithm | None:
    """The registered algorithm of ``model.class_path`` (None when no model is configured or it is none)."""
    return algorithm_of_model(get(cfg, "model.class_path"))


def import_target(target: str) -> type | None:
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name, None)  # type: ignore[no-any-return]
    except ImportError:
        return None


def workflow_problem(target: str) -> str | None:
    """Why ``generation.workflow`` cannot be used (not importable, no ``run``), or None."""
    from screl.rollout.workflows.workflow import load_workflow

    try:
        load_workflow(target)
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def construct_problem(class_path: str, init_args: Mapping[str, Any]) -> str | None:
    """The ValueError message of building a small config object (a loss), or None when it builds."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        cls(**dict(init_args))
    except (ValueError, TypeError) as err:
        return str(err).replace("\n", "; ")
    except (ImportError, AttributeError):
        return None  # the parser reports unknown classes itself
    return None


def sampler_declares(cls: type, attribute: str) -> bool:
    """Whether ``cls`` itself (not a base class) sets ``attribute`` to True."""
    return vars(cls).get(attribute) is True


def sampler_capabilities(sampler: SamplerConfig) -> tuple[bool, bool]:
    """(supports_buffer_checkpoint, supports_training_claims) of the configured sampler."""
    return declared_capabilities(sampler)


def fingerprint_path_problem(path: Any) -> str | None:
    if not isinstance(path, str) or not path:
        return "must be a non-empty dotpath string"
    if path != path.strip():
        return "has surrounding whitespace"
    if path in ("*", "**"):
        return "a bare wildcard would exclude the whole config"
    if any(seg == "" for seg in path.split(".")):
        return "has an empty dot segment"
    return None


@dataclass
class RuleContext:
    """What every rule reads: the config as a mapping plus the values derived from it (clamped to usable
    values, so one bad knob is reported once, by its own rule, and does not cascade)."""

    cfg: Mapping[str, Any]
    problems: list[Problem] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.algorithm = algorithm_of_run(cfg)
        self.algo_key = self.algorithm.config_key
        self.algo: Mapping[str, Any] = cfg.get(self.algo_key) or {}
        P, G = self.algo.get("num_prompts_per_step", 8), self.algo.get("num_generations_per_prompt", 4)
        self.P = P if isinstance(P, int) and P >= 1 else 1
        self.G = G if isinstance(G, int) and G >= 1 else 1
        self.async_rl: Mapping[str, Any] = cfg.get("async_rl") or {}
        self.rf: Mapping[str, Any] = self.async_rl.get("rollout_failure") or {}
        m = self.async_rl.get("min_groups_for_streaming_train")
        self.min_groups_raw = self.P if m is None else m
        ok = isinstance(self.min_groups_raw, int) and 1 <= self.min_groups_raw
        self.min_groups = self.min_groups_raw if ok else self.P
        self.sampler_errors: list[tuple[str, str]] = []
        self.sampler: SamplerConfig | None = None
        try:
            self.sampler = parse_sampler_config(get(cfg, "async_rl.sampler", {"name": "in_order"}))
        except SamplerConfigError as err:
            self.sampler_errors = err.problems
        self.rules: StalenessSampler | None = (
            sampler_rules(self.sampler, self.P) if self.sampler is not None else None
        )
        self.dp_backend = get(cfg, "data_plane.backend", "simple")
        self.gen: Mapping[str, Any] = get(cfg, "data.init_args.generation", None) or get(cfg, "data.generation", {}) or {}
        self.ck: Mapping[str, Any] = cfg.get("checkpointing") or {}
        self.engine_name = str(self.gen.get("backend", "torch"))
        """The configured engine as messages name it; ``engine`` holds what it declares (None: it does not resolve,
        which the generation rules report)."""
        self.engine: EngineCapabilities | None = None
        try:
            self.engine = engine_capabilities(self.engine_name)
            self.engine_name = engine_title(self.engine_name)
        except ValueError:
            pass

    def bad(self, key: str, value: Any, message: str, fix: str) -> None:
        self.problems.append(Problem(key, value, message, fix))
