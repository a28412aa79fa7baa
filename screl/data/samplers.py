"""Staleness samplers: which prompt groups the rollout pump may dispatch and the train pump may consume.

All built-ins are pure values over a dispatch cursor ``d`` (starts at -1, +1 per admitted batch):

==============  ===================  ==========  =========================================  ===============
sampler         admit gate           stamps ts   select (ready slots, dispatch order)        evict (ready)
==============  ===================  ==========  =========================================  ===============
in_order        d < T + W            ts = d      ts == T                                     ts < T
weight_fifo     d < T + S            no          sw == oldest in-window sw (waits on unready) sw < T - S
ready_first     d < T + S            no          sw <= T                                     never
windowed        over_sampling cap    no          T - S <= sw <= T (optionally freshest first) sw < T - S
==============  ===================  ==========  =========================================  ===============

``select`` is greedy: fewer eligible groups than ``min_groups`` -> None (wait); otherwise the first
``min(len(eligible), max_groups)``. Only ``windowed`` aborts in-flight rollouts (``sw < T - S``).

Outstanding groups (``windowed``'s ``over_sampling_ratio`` cap): ``admit`` takes an optional
keyword ``outstanding_groups`` = groups admitted but not yet consumed (selected), evicted or dropped
-- for the controller, the buffer's live slots plus admitted prompts not yet reserved. A custom
sampler may omit the keyword: the controller calls ``call_admit``, which passes it only to an
``admit`` that accepts it.
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from screl.data.buffer import GroupSlot
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


@dataclass(frozen=True)
class Admission:
    """Result of ``admit``: may the next step's batch of prompts be dispatched, and its stamp."""

    allowed: bool
    target_step: int | None = None


@runtime_checkable
class PromptGroupSampler(Protocol):
    """The contract a sampler implements (built-in or ``custom``); see DESIGN.md "Sampler plugin API"."""

    supports_buffer_checkpoint: ClassVar[bool]
    """Completed buffered groups may be restored into this sampler after a restart."""
    supports_training_claims: ClassVar[bool]
    """Selected groups stay checkpoint-visible (claims) until the step's cleanup."""

    def admit(self, trainer_version: int) -> Admission:
        """Non-blocking gate for one step's batch; advances the dispatch cursor only when allowed."""
        ...

    def select(
        self, slots: Sequence[GroupSlot], trainer_version: int, min_groups: int, max_groups: int
    ) -> list[str] | None:
        """Group ids to train next, in training order, or None to wait."""
        ...

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        """Ready group ids that can never be selected any more."""
        ...

    def should_abort_inflight(self, start_weight: int, trainer_version: int) -> bool:
        """Whether an in-flight rollout started at ``start_weight`` is useless at ``trainer_version``."""
        ...

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        """Smallest ``max_buffered_rollouts`` that cannot deadlock the rollout pump, or None."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...

    @property
    def dispatch_index(self) -> int:
        """Index of the last admitted batch (-1 before the first)."""
        ...

    def set_dispatch_index(self, resume_step: int) -> None:
        """Seed the cursor for a run resumed at trainer step ``resume_step`` (cursor = resume_step - 1)."""
        ...


def _check_nonneg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _check_select_bounds(min_groups: int, max_groups: int) -> None:
    if min_groups < 1:
        raise ValueError(f"select needs min_groups >= 1, got min_groups={min_groups}")
    if max_groups < min_groups:
        raise ValueError(f"select needs max_groups >= min_groups, got {max_groups} < {min_groups}")


def _weight_floor(trainer_version: int, window: int) -> int:
    return max(0, trainer_version - window)


class StalenessSampler:
    """Shared machinery of the built-ins: dispatch cursor, greedy select, checkpoint state.

    Subclasses define ``_eligible`` (and usually ``evict``); a custom sampler may subclass it but
    must still declare ``supports_buffer_checkpoint`` on its own class.
    """

    name: ClassVar[str] = "base"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def __init__(self) -> None:
        self._dispatch_index = -1

    @property
    def dispatch_index(self) -> int:
        """Index of the last admitted batch (-1 before the first)."""
        return self._dispatch_index

    def set_dispatch_index(self, resume_step: int) -> None:
        """Seed the cursor for a run resumed at trainer step ``resume_step`` (cursor = resume_step - 1)."""
        if isinstance(resume_step, bool) or not isinstance(resume_step, int) or resume_step < 0:
            raise ValueError(f"set_dispatch_index needs a resume step >= 0, got {resume_step!r}")
        self._dispatch_index = resume_step - 1

    def restore_dispatch_index(self, index: int) -> None:
        """Restore the exact cursor saved with a checkpoint (>= -1)."""
        if isinstance(index, bool) or not isinstance(index, int) or index < -1:
            raise ValueError(f"dispatch index must be an integer >= -1, got {index!r}")
        self._dispatch_index = index

    def admit(self, trainer_version: int, outstanding_groups: int | None = None) -> Admission:
        """Admit the next batch if the gate allows; advances the cursor only then."""
        _check_nonneg("trainer_version", trainer_version)
        if not self._admissible(trainer_version, outstanding_groups):
            return Admission(False, None)
        self._dispatch_index += 1
        return Admission(True, self._stamp())

    def select(
        self, slots: Sequence[GroupSlot], trainer_version: int, min_groups: int, max_groups: int
    ) -> list[str] | None:
        _check_select_bounds(min_groups, max_groups)
        eligible = self._eligible(slots, trainer_version)
        if len(eligible) < min_groups:
            return None
        return [s.group_id for s in eligible[:max_groups]]

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return []

    def should_abort_inflight(self, start_weight: int, trainer_version: int) -> bool:
        return False

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"name": self.name, "dispatch_index": self._dispatch_index}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("name", self.name) != self.name:
            raise ValueError(
                f"sampler state was saved by the {state.get('name')!r} sampler; this run uses {self.name!r}"
            )
        self.restore_dispatch_index(state.get("dispatch_index", -1))

    def _admissible(self, trainer_version: int, outstanding_groups: int | None) -> bool:
        return True

    def _stamp(self) -> int | None:
        return None

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        raise NotImplementedError

    @staticmethod
    def _evict_below_weight(slots: Sequence[GroupSlot], trainer_version: int, window: int) -> list[str]:
        lo = _weight_floor(trainer_version, window)
        return [s.group_id for s in slots if s.ready and s.start_weight < lo]


class GatedSampler(StalenessSampler):
    """Admits batch ``d + 1`` only while ``d < T + gate_window`` (the trainer caps how far ahead dispatch runs)."""

    name: ClassVar[str] = "gated"

    def __init__(self, gate_window: int) -> None:
        super().__init__()
        self._gate_window = _check_nonneg("gate_window", gate_window)

    @property
    def gate_window(self) -> int:
        return self._gate_window

    @property
    def peak_window(self) -> int:
        """The widest gate window this sampler can use (sizes the buffer)."""
        return self._gate_window

    def set_gate_window(self, window: int) -> None:
        """Retune the gate at runtime (PPO critic warmup); already-admitted batches are unaffected."""
        self._gate_window = _check_nonneg("gate window", window)

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        _check_nonneg("groups_per_step", groups_per_step)
        return groups_per_step * (self.peak_window + 1)

    def _admissible(self, trainer_version: int, outstanding_groups: int | None) -> bool:
        return self._dispatch_index < trainer_version + self._gate_window


class InOrderSampler(GatedSampler):
    """Exact batch->step matching: batch ``d`` is stamped ``target_step = d`` and trains at ``T == d``."""

    name: ClassVar[str] = "in_order"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def __init__(self, max_lookahead_versions: int = 1, warmup_lookahead_versions: int | None = None) -> None:
        super().__init__(max_lookahead_versions)
        self.max_lookahead_versions = max_lookahead_versions
        if warmup_lookahead_versions is not None:
            _check_nonneg("warmup_lookahead_versions", warmup_lookahead_versions)
            if warmup_lookahead_versions < max_lookahead_versions:
                raise ValueError(
                    f"warmup_lookahead_versions must be greater than or equal to max_lookahead_versions "
                    f"({warmup_lookahead_versions} < {max_lookahead_versions})"
                )
        self.warmup_lookahead_versions = warmup_lookahead_versions

    @property
    def peak_window(self) -> int:
        return max(self.max_lookahead_versions, self.warmup_lookahead_versions or 0, self._gate_window)

    def retune_lookahead(self, trainer_version: int, policy_training_start_step: int | None) -> int:
        """Set the gate to ``lookahead_schedule(...)`` for this trainer version and return it."""
        window = lookahead_schedule(
            trainer_version,
            self.max_lookahead_versions,
            self.warmup_lookahead_versions,
            policy_training_start_step,
        )
        self.set_gate_window(window)
        return window

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return [
            s.group_id
            for s in slots
            if s.ready and s.target_step is not None and s.target_step < trainer_version
        ]

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "gate_window": self._gate_window}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if "gate_window" in state:
            self.set_gate_window(state["gate_window"])

    def _stamp(self) -> int | None:
        return self._dispatch_index

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        return [s for s in slots if s.ready and s.target_step == trainer_version]


class WeightFifoSampler(GatedSampler):
    """Strict weight-version FIFO: drain the oldest in-window start weight, waiting for its in-flight groups."""

    name: ClassVar[str] = "weight_fifo"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def __init__(self, max_staleness_versions: int = 1) -> None:
        super().__init__(max_staleness_versions)
        self.max_staleness_versions = max_staleness_versions

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return self._evict_below_weight(slots, trainer_version, self.max_staleness_versions)

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        lo = _weight_floor(trainer_version, self.max_staleness_versions)
        in_window = [s.start_weight for s in slots if lo <= s.start_weight <= trainer_version]
        if not in_window:
            return []
        oldest = min(in_window)
        return [s for s in slots if s.ready and s.start_weight == oldest]


class ReadyFirstSampler(GatedSampler):
    """Gated admission, completion-order selection of any ready group with ``sw <= T``; never evicts."""

    name: ClassVar[str] = "ready_first"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def __init__(self, max_staleness_versions: int = 1) -> None:
        super().__init__(max_staleness_versions)
        self.max_staleness_versions = max_staleness_versions

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        return [s for s in slots if s.ready and s.start_weight <= trainer_version]


class WindowedSampler(StalenessSampler):
    """Ungated, over-sampled streaming over the weight window ``[T - S, T]``.

    With ``over_sampling_ratio`` r, ``admit`` refuses a batch when ``outstanding_groups +
    groups_per_step`` would exceed ``ceil(r * groups_per_step)``.
    """

    name: ClassVar[str] = "windowed"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def __init__(
        self,
        max_staleness_versions: int = 1,
        sample_freshest_first: bool = False,
        over_sampling_ratio: float | None = None,
        groups_per_step: int | None = None,
    ) -> None:
        super().__init__()
        self.max_staleness_versions = _check_nonneg("max_staleness_versions", max_staleness_versions)
        self.sample_freshest_first = sample_freshest_first
        self.over_sampling_ratio = over_sampling_ratio
        self.groups_per_step = groups_per_step
        if over_sampling_ratio is not None:
            if not over_sampling_ratio >= 1.0:
                raise ValueError(f"over_sampling_ratio must be >= 1.0, got {over_sampling_ratio}")
            if groups_per_step is None or groups_per_step < 1:
                raise ValueError(
                    f"windowed over_sampling_ratio={over_sampling_ratio} needs groups_per_step >= 1 "
                    f"(num_prompts_per_step), got {groups_per_step!r}; pass create_sampler(..., groups_per_step=N)"
                )

    @property
    def outstanding_cap(self) -> int | None:
        """Most dispatched-but-unconsumed groups allowed, or None (uncapped)."""
        if self.over_sampling_ratio is None or self.groups_per_step is None:
            return None
        return math.ceil(self.over_sampling_ratio * self.groups_per_step)

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return self._evict_below_weight(slots, trainer_version, self.max_staleness_versions)

    def should_abort_inflight(self, start_weight: int, trainer_version: int) -> bool:
        return start_weight < _weight_floor(trainer_version, self.max_staleness_versions)

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        _check_nonneg("groups_per_step", groups_per_step)
        return groups_per_step

    def _admissible(self, trainer_version: int, outstanding_groups: int | None) -> bool:
        cap = self.outstanding_cap
        if cap is None or self.groups_per_step is None:
            return True
        if outstanding_groups is None:
            raise ValueError(
                "windowed sampler with over_sampling_ratio needs admit(..., outstanding_groups=N): the "
                "count of admitted groups not yet selected, evicted or dropped"
            )
        _check_nonneg("outstanding_groups", outstanding_groups)
        return outstanding_groups + self.groups_per_step <= cap

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        lo = _weight_floor(trainer_version, self.max_staleness_versions)
        eligible = [s for s in slots if s.ready and lo <= s.start_weight <= trainer_version]
        if self.sample_freshest_first:
            eligible.sort(key=lambda s: trainer_version - s.start_weight)  # stable: ties keep dispatch order
        return eligible


# ------------------------------------------------------------------------------------ helpers


def lookahead_schedule(
    trainer_version: int,
    max_lookahead: int,
    warmup_lookahead: int | None,
    policy_training_start_step: int | None,
) -> int:
    """Gate window of ``in_order`` at ``trainer_version`` during (PPO) critic warmup.

    ``m`` steady, ``w`` warmup, ``s`` policy start step: ``m`` when ``w`` or ``s`` is None or
    ``T >= s``; else ``max(m, min(w, s + m - T))`` -- the lead shrinks so dispatch never runs past
    ``s + m`` batches while the policy is frozen.
    """
    if (
        warmup_lookahead is None
        or policy_training_start_step is None
        or trainer_version >= policy_training_start_step
    ):
        return max_lookahead
    return max(
        max_lookahead, min(warmup_lookahead, policy_training_start_step + max_lookahead - trainer_version)
    )


def call_admit(sampler: PromptGroupSampler, trainer_version: int, outstanding_groups: int) -> Admission:
    """``sampler.admit``, passing ``outstanding_groups`` only when its ``admit`` accepts that keyword."""
    params = inspect.signature(sampler.admit).parameters.values()
    if any(p.name == "outstanding_groups" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return sampler.admit(trainer_version, outstanding_groups=outstanding_groups)  # type: ignore[call-arg]
    return sampler.admit(trainer_version)


def sampler_supports_buffer_checkpoint(cls: type) -> bool:
    """Whether ``cls`` itself declares ``supports_buffer_checkpoint = True`` (inherited values do not count)."""
    return cls.__dict__.get("supports_buffer_checkpoint") is True


def sampler_supports_training_claims(cls: type) -> bool:
    """Whether ``cls`` itself declares ``supports_training_claims = True`` (inherited values do not count)."""
    return cls.__dict__.get("supports_training_claims") is True


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
