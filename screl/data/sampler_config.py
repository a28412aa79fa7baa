"""Typed configs of the five staleness samplers (the ``async_rl.sampler`` block).

Each mode has its own dataclass; a knob of one mode has no effect under another, so it is not
accepted there. ``parse_sampler_config`` turns the block as written in YAML (a mapping with a
``name`` key) into its typed config and reports every problem at once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union


@dataclass(frozen=True)
class InOrderSamplerConfig:
    """Exact batch->step matching: dispatch may lead the trainer by ``max_lookahead_versions`` batches."""

    name: Literal["in_order"] = "in_order"
    max_lookahead_versions: int = 1
    """How many batches dispatch may run ahead of the trainer (0 = sync / on-policy)."""
    warmup_lookahead_versions: int | None = None
    """(PPO) Lookahead while the critic warms up (``ppo.policy_training_start_step``); >= max_lookahead_versions."""

    @property
    def window(self) -> int:
        return self.max_lookahead_versions

    @property
    def peak_window(self) -> int:
        """The widest window the run ever uses (sizes the buffer)."""
        if self.warmup_lookahead_versions is None:
            return self.max_lookahead_versions
        return max(self.max_lookahead_versions, self.warmup_lookahead_versions)


@dataclass(frozen=True)
class WeightFifoSamplerConfig:
    """Strict weight-version FIFO under a bounded lookahead."""

    name: Literal["weight_fifo"] = "weight_fifo"
    max_staleness_versions: int = 1
    """Gate window and staleness window: dispatch leads the trainer by at most this many versions."""

    @property
    def window(self) -> int:
        return self.max_staleness_versions

    peak_window = window


@dataclass(frozen=True)
class ReadyFirstSamplerConfig:
    """Gated admission, completion-order selection, never evicts (needs IS correction)."""

    name: Literal["ready_first"] = "ready_first"
    max_staleness_versions: int = 1
    """Gate window: dispatch leads the trainer by at most this many versions."""

    @property
    def window(self) -> int:
        return self.max_staleness_versions

    peak_window = window


@dataclass(frozen=True)
class WindowedSamplerConfig:
    """Ungated, over-sampled streaming; trains groups with start_weight in [T - S, T]."""

    name: Literal["windowed"] = "windowed"
    max_staleness_versions: int = 1
    """S: groups whose start weight is older than T - S are evicted (and in-flight ones aborted)."""
    sample_freshest_first: bool = False
    """Select the newest start weight first (ties in dispatch order)."""
    over_sampling_ratio: float | None = None
    """Cap on dispatched-but-unconsumed groups, as a multiple of num_prompts_per_step (None = no cap)."""

    @property
    def window(self) -> int:
        return self.max_staleness_versions

    peak_window = window


@dataclass(frozen=True)
class CustomSamplerConfig:
    """Bring your own ``PromptGroupSampler``: ``target: "module:ClassName"``; other keys are kwargs."""

    name: Literal["custom"] = "custom"
    target: str = ""
    """Import path of the sampler class, ``"package.module:ClassName"``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the class (extra keys written beside ``target`` land here too)."""

    @property
    def window(self) -> int:
        return int(self.kwargs.get("max_staleness_versions", self.kwargs.get("max_lookahead_versions", 0)))

    peak_window = window


SamplerConfig = Union[
    InOrderSamplerConfig,
    WeightFifoSamplerConfig,
    ReadyFirstSamplerConfig,
    WindowedSamplerConfig,
    CustomSamplerConfig,
]

SAMPLER_CONFIGS: dict[str, type] = {
    "in_order": InOrderSamplerConfig,
    "weight_fifo": WeightFifoSamplerConfig,
    "ready_first": ReadyFirstSamplerConfig,
    "windowed": WindowedSamplerConfig,
    "custom": CustomSamplerConfig,
}

class SamplerConfigError(ValueError):
    """A sampler block that cannot be used; ``problems`` lists every (dotted key, message) found."""

    def __init__(self, problems: list[tuple[str, str]], prefix: str = "async_rl.sampler") -> None:
        self.problems = [(f"{prefix}.{k}" if k else prefix, msg) for k, msg in problems]
        lines = "\n".join(f"  - {k}: {msg}" for k, msg in self.problems)
        super().__init__(f"invalid sampler config ({len(self.problems)} problem(s)):\n{lines}")


def sampler_config_problems(cfg: SamplerConfig) -> list[tuple[str, str]]:
    """Every problem with a typed sampler config, as (key relative to the sampler block, message)."""
    problems: list[tuple[str, str]] = []
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name.endswith("_versions") and value is not None:
            if isinstance(value, bool) or not isinstance(value, int):
                problems.append((f.name, f"must be an integer, got {value!r}"))
            elif value < 0:
                problems.append((f.name, f"must be >= 0, got {value}"))
    if isinstance(cfg, InOrderSamplerConfig) and cfg.warmup_lookahead_versions is not None:
        if cfg.warmup_lookahead_versions < cfg.max_lookahead_versions:
            problems.append(
                (
                    "warmup_lookahead_versions",
                    f"must be greater than or equal to max_lookahead_versions "
                    f"({cfg.warmup_lookahead_versions} < {cfg.max_lookahead_versions})",
                )
            )
    if isinstance(cfg, WindowedSamplerConfig) and cfg.over_sampling_ratio is not None:
        if not cfg.over_sampling_ratio >= 1.0:
            problems.append(
                (
                    "over_sampling_ratio",
                    f"must be >= 1.0 (a multiple of a step), got {cfg.over_sampling_ratio}",
                )
            )
    if isinstance(cfg, CustomSamplerConfig):
        module, sep, cls = cfg.target.partition(":")
        if not sep or not module or not cls:
            problems.append(("target", f"must look like 'package.module:ClassName', got {cfg.target!r}"))
    return problems


def parse_sampler_config(block: Mapping[str, Any] | SamplerConfig) -> SamplerConfig:
    """The typed config for a sampler block, as written in YAML or already typed.

    Raises ``SamplerConfigError`` naming every bad key at once.
    """
    if dataclasses.is_dataclass(block) and not isinstance(block, type):
        cfg = block
    else:
        if not isinstance(block, Mapping):
            raise SamplerConfigError(
                [("", f"must be a mapping with a 'name' key, got {type(block).__name__}")]
            )
        name = block.get("name", "in_order")
        cls = SAMPLER_CONFIGS.get(name)
        if cls is None:
            raise SamplerConfigError(
                [("name", f"unknown sampler {name!r}; choose one of {sorted(SAMPLER_CONFIGS)}")]
            )
        known = {f.name for f in dataclasses.fields(cls)}
        given = dict(block)
        if cls is CustomSamplerConfig:
            extras = {k: v for k, v in given.items() if k not in known}
            kwargs = {**dict(given.get("kwargs") or {}), **extras}
            cfg = CustomSamplerConfig(target=str(given.get("target", "")), kwargs=kwargs)
        else:
            unknown = sorted(set(given) - known)
            if unknown:
                raise SamplerConfigError(
                    [
                        (k, f"is not a knob of the {name!r} sampler (its knobs: {sorted(known - {'name'})})")
                        for k in unknown
                    ]
                )
            cfg = cls(**given)
    problems = sampler_config_problems(cfg)  # type: ignore[arg-type]
    if problems:
        raise SamplerConfigError(problems)
    return cfg  # type: ignore[return-value]
