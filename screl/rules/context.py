"""The context every config rule reads, and the small helpers rules share."""

from __future__ import annotations

import dataclasses
import importlib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from screl.algorithms import Algorithm, algorithm_of_model, algorithm_of_run
from screl.config import (
    AsyncRLConfig,
    CheckpointingConfig,
    DataPlaneConfig,
    RolloutCheckpointingConfig,
    RolloutRecoveryConfig,
    RunConfig,
    TokenCaptureConfig,
)
from screl.config_algo import GRPOConfig
from screl.config_generation import GenerationConfig
from screl.data.sampler_api import StalenessSampler
from screl.data.sampler_config import (
    SamplerConfig,
    SamplerConfigError,
    parse_sampler_config,
)
from screl.data.sampler_factory import declared_capabilities, sampler_rules
from screl.rollout.engines.protocol import EngineCapabilities
from screl.rollout.engines.registry import engine_capabilities, engine_title
from screl.rules.blocks import block_type, field_default, typed_block

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


def rule_at(path: str) -> Any:
    """The config rule a ``package.module:function`` path names (an engine's or an algorithm's own rules)."""
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


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
    """What every rule reads: the config as a mapping, its blocks as typed views (:mod:`screl.rules.blocks`: the
    values as written, the defaults of the config dataclasses for the rest) and the values derived from them
    (clamped to usable values, so one bad knob is reported once, by its own rule, and does not cascade)."""

    cfg: Mapping[str, Any]
    problems: list[Problem] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.cfg
        self.algorithm = algorithm_of_run(cfg)
        self.algo_key = self.algorithm.config_key
        self._typed_blocks(cfg)
        self.unreadable = {p.key for p in self.problems}
        """The blocks that could not be read (reported; their views hold the defaults)."""
        P, G = self.algo_cfg.num_prompts_per_step, self.algo_cfg.num_generations_per_prompt
        self.P = P if isinstance(P, int) and P >= 1 else 1
        self.G = G if isinstance(G, int) and G >= 1 else 1
        m = self.async_cfg.min_groups_for_streaming_train
        self.min_groups_raw = self.P if m is None else m
        ok = isinstance(self.min_groups_raw, int) and 1 <= self.min_groups_raw
        self.min_groups = self.min_groups_raw if ok else self.P
        self.sampler_errors: list[tuple[str, str]] = []
        self.sampler: SamplerConfig | None = None
        try:
            self.sampler = parse_sampler_config(self.async_cfg.sampler or field_default(AsyncRLConfig, "sampler"))
        except SamplerConfigError as err:
            self.sampler_errors = err.problems
        self.rules: StalenessSampler | None = (
            sampler_rules(self.sampler, self.P) if self.sampler is not None else None
        )
        self.dp_backend = self.dp_cfg.backend
        self.engine_name = str(self.gen_cfg.backend)
        """The configured engine as messages name it; ``engine`` holds what it declares (None: it does not resolve,
        which the generation rules report)."""
        self.engine: EngineCapabilities | None = None
        try:
            self.engine = engine_capabilities(self.engine_name)
            self.engine_name = engine_title(self.engine_name)
        except ValueError:
            pass

    def _typed_blocks(self, cfg: Mapping[str, Any]) -> None:
        """The raw blocks (``algo``, ``async_rl``, ``rf``, ``gen``, ``ck``: for a rule that must see what was
        written) and their typed views (``*_cfg``), each built once; a block that cannot be read is a problem."""
        algo_cls = _block_class(self.algorithm)
        raw = {key: cfg.get(key) for key in (self.algo_key, *_RUN_BLOCKS)}
        self.gen_key = gen_key = GEN if get(cfg, GEN) is not None else "data.generation"
        self.algo: Mapping[str, Any] = _mapping(raw[self.algo_key])
        self.async_rl: Mapping[str, Any] = _mapping(raw["async_rl"])
        self.rf: Mapping[str, Any] = _mapping(self.async_rl.get("rollout_failure"))
        self.gen: Mapping[str, Any] = _mapping(get(cfg, gen_key))
        self.ck: Mapping[str, Any] = _mapping(raw["checkpointing"])
        self.algo_cfg: GRPOConfig = typed_block(algo_cls, raw[self.algo_key], self.algo_key, self.bad)
        self.async_cfg = typed_block(AsyncRLConfig, raw["async_rl"], "async_rl", self.bad)
        self.rf_cfg = self.async_cfg.rollout_failure
        self.dp_cfg = typed_block(DataPlaneConfig, raw["data_plane"], "data_plane", self.bad)
        self.ck_cfg = typed_block(CheckpointingConfig, raw["checkpointing"], "checkpointing", self.bad)
        self.snapshot_cfg = typed_block(RolloutCheckpointingConfig, raw["rollout_checkpointing"],
                                        "rollout_checkpointing", self.bad)
        self.recovery_cfg = typed_block(RolloutRecoveryConfig, raw["rollout_recovery"], "rollout_recovery", self.bad)
        self.capture_cfg = typed_block(TokenCaptureConfig, raw["token_capture"], "token_capture", self.bad)
        self.gen_cfg = typed_block(GenerationConfig, get(cfg, gen_key), gen_key, self.bad)

    def bad(self, key: str, value: Any, message: str, fix: str) -> None:
        self.problems.append(Problem(key, value, message, fix))


GEN = "data.init_args.generation"
_RUN_BLOCKS = ("async_rl", "data_plane", "checkpointing", "rollout_checkpointing", "rollout_recovery",
               "token_capture")


def _block_class(algorithm: Algorithm) -> type[GRPOConfig]:
    """The dataclass of the algorithm's run block: the one it registers, else ``RunConfig``'s field type."""
    declared: type[GRPOConfig] | None = getattr(algorithm, "block", None)
    if declared is None:
        declared, _ = block_type(typing.get_type_hints(RunConfig).get(algorithm.config_key))
    if declared is None:
        raise ValueError(f"algorithm {algorithm.name!r}: no dataclass for its `{algorithm.config_key}` block")
    return declared


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}
