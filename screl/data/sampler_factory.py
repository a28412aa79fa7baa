"""Build a sampler from its config block, and answer the rules questions for a config.

``create_sampler(cfg)`` is what the controller runs. ``sampler_rules(cfg, groups_per_step)`` is what config
checks, ``screl check``, the thread plan and the event checker ask: a sampler instance whose rule hooks
(``StalenessSampler``'s) answer for the configured class. A custom sampler that does not subclass
``StalenessSampler``, or cannot be built, answers with the base class's safe defaults.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping
from typing import Any

from screl.data.sampler_api import PromptGroupSampler, StalenessSampler
from screl.data.sampler_config import (
    CustomSamplerConfig,
    InOrderSamplerConfig,
    ReadyFirstSamplerConfig,
    SamplerConfig,
    SamplerConfigError,
    WeightFifoSamplerConfig,
    WindowedSamplerConfig,
    parse_sampler_config,
)
from screl.data.samplers import InOrderSampler, ReadyFirstSampler, WeightFifoSampler, WindowedSampler


class _CustomDefaults(StalenessSampler):
    """The rule answers for a custom sampler that has no hooks of its own: the base defaults, with the
    window read from its kwargs (``max_staleness_versions`` or ``max_lookahead_versions``)."""

    name = "custom"

    def __init__(self, window: int) -> None:
        super().__init__()
        self._window = window

    @property
    def peak_window(self) -> int:
        return self._window


def sampler_rules(config: Mapping[str, Any] | SamplerConfig, groups_per_step: int | None = None) -> StalenessSampler:
    """The sampler whose rule hooks answer for ``config`` (never raises for a custom target that fails to
    import or build: config checks report that on their own)."""
    cfg = parse_sampler_config(config)
    if not isinstance(cfg, CustomSamplerConfig):
        # the rule hooks never read groups_per_step; windowed's over_sampling cap needs one to build
        sampler = create_sampler(cfg, groups_per_step if groups_per_step is not None else 1)
        assert isinstance(sampler, StalenessSampler)
        return sampler
    try:
        custom: PromptGroupSampler | None = _create_custom(cfg)
    except (SamplerConfigError, TypeError, ValueError):
        custom = None
    if isinstance(custom, StalenessSampler):
        return custom
    return _CustomDefaults(cfg.window)


def required_buffer_capacity(cfg: SamplerConfig, groups_per_step: int, min_groups: int | None = None) -> int:
    """Smallest ``max_buffered_rollouts`` that cannot deadlock the rollout pump under this sampler.

    The sampler's own ``required_buffer_capacity`` (gated: ``groups_per_step * (peak window + 1)``;
    windowed: one streaming chunk); a full step when it has no answer.
    """
    sampler = sampler_rules(cfg, groups_per_step)
    accepts_min = "min_groups" in inspect.signature(sampler.required_buffer_capacity).parameters
    need = (
        sampler.required_buffer_capacity(groups_per_step, min_groups)
        if accepts_min
        else sampler.required_buffer_capacity(groups_per_step)
    )
    return groups_per_step if need is None else need


def sampler_supports_buffer_checkpoint(cls: type) -> bool:
    """Whether ``cls`` itself declares ``supports_buffer_checkpoint = True`` (inherited values do not count)."""
    return cls.__dict__.get("supports_buffer_checkpoint") is True


def sampler_supports_training_claims(cls: type) -> bool:
    """Whether ``cls`` itself declares ``supports_training_claims = True`` (inherited values do not count)."""
    return cls.__dict__.get("supports_training_claims") is True


def declared_capabilities(cfg: SamplerConfig) -> tuple[bool, bool]:
    """(supports_buffer_checkpoint, supports_training_claims) of a configured sampler: True for the built-ins; a
    custom class's own declarations (inherited values do not count), both False when its target does not import."""
    if not isinstance(cfg, CustomSamplerConfig):
        return True, True
    try:
        cls = _import_sampler_class(cfg.target)
    except SamplerConfigError:
        return False, False
    return sampler_supports_buffer_checkpoint(cls), sampler_supports_training_claims(cls)


def _missing_protocol_members(obj: object) -> list[str]:
    members = [
        "supports_buffer_checkpoint",
        "supports_training_claims",
        "admit",
        "select",
        "evict",
        "should_abort_inflight",
        "required_buffer_capacity",
        "state_dict",
        "load_state_dict",
        "dispatch_index",
        "set_dispatch_index",
    ]
    return [m for m in members if not hasattr(obj, m)]


def _import_sampler_class(target: str) -> type:
    module_name, sep, class_name = target.partition(":")
    if not sep or not module_name or not class_name:
        raise SamplerConfigError([("target", f"must look like 'package.module:ClassName', got {target!r}")])
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise SamplerConfigError(
            [("target", f"cannot import module {module_name!r} of {target!r} ({type(exc).__name__}: {exc})")]
        ) from exc
    cls = getattr(module, class_name, None)
    if not isinstance(cls, type):
        raise SamplerConfigError(
            [("target", f"module {module_name!r} has no class {class_name!r} (target {target!r})")]
        )
    return cls


def _create_custom(cfg: CustomSamplerConfig) -> PromptGroupSampler:
    cls = _import_sampler_class(cfg.target)
    missing = _missing_protocol_members(cls)
    if missing:
        raise TypeError(
            f"custom sampler {cfg.target!r} does not implement PromptGroupSampler: missing {missing}"
        )
    if not isinstance(cls.__dict__.get("supports_buffer_checkpoint"), bool):
        raise TypeError(
            f"custom sampler {cfg.target!r} must declare `supports_buffer_checkpoint = True|False` on its own "
            "class (an inherited value does not count): say whether its buffered groups may be restored"
        )
    try:
        sampler = cls(**cfg.kwargs)
    except TypeError as exc:
        raise TypeError(
            f"cannot construct custom sampler {cfg.target!r} with kwargs {cfg.kwargs!r}: {exc}"
        ) from exc
    if not isinstance(sampler, PromptGroupSampler):
        raise TypeError(
            f"custom sampler {cfg.target!r} instance does not satisfy PromptGroupSampler: "
            f"missing {_missing_protocol_members(sampler)}"
        )
    return sampler


def create_sampler(
    config: Mapping[str, Any] | SamplerConfig, groups_per_step: int | None = None
) -> PromptGroupSampler:
    """The sampler for a config block (mapping as written in YAML, or its typed config).

    ``groups_per_step`` (= ``num_prompts_per_step``) is needed by ``windowed`` with ``over_sampling_ratio``.
    Raises ``SamplerConfigError`` for a bad block or custom target, ``TypeError`` for a custom
    class that does not satisfy the protocol.
    """
    cfg = parse_sampler_config(config)
    if isinstance(cfg, InOrderSamplerConfig):
        return InOrderSampler(cfg.max_lookahead_versions, cfg.warmup_lookahead_versions)
    if isinstance(cfg, WeightFifoSamplerConfig):
        return WeightFifoSampler(cfg.max_staleness_versions)
    if isinstance(cfg, ReadyFirstSamplerConfig):
        return ReadyFirstSampler(cfg.max_staleness_versions)
    if isinstance(cfg, WindowedSamplerConfig):
        return WindowedSampler(
            cfg.max_staleness_versions, cfg.sample_freshest_first, cfg.over_sampling_ratio, groups_per_step
        )
    if isinstance(cfg, CustomSamplerConfig):
        return _create_custom(cfg)
    raise SamplerConfigError([("name", f"no sampler implementation for {cfg!r}")])
