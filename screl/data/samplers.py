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

import inspect
import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from screl.data.buffer import GroupSlot
from screl.data.sampler_api import (
    Admission,
    PromptGroupSampler,
    StalenessSampler,
    check_nonneg,
    off_policy_rule,
    weight_floor,
)

__all__ = [
    "Admission",
    "GatedSampler",
    "InOrderSampler",
    "PromptGroupSampler",
    "ReadyFirstSampler",
    "StalenessSampler",
    "WeightFifoSampler",
    "WindowedSampler",
    "call_admit",
    "lookahead_schedule",
]

class GatedSampler(StalenessSampler):
    """Admits batch ``d + 1`` only while ``d < T + gate_window`` (the trainer caps how far ahead dispatch runs)."""

    name: ClassVar[str] = "gated"

    def __init__(self, gate_window: int) -> None:
        super().__init__()
        self._gate_window = check_nonneg("gate_window", gate_window)

    @property
    def gate_window(self) -> int:
        return self._gate_window

    @property
    def peak_window(self) -> int:
        """The widest gate window this sampler can use (sizes the buffer)."""
        return self._gate_window

    def max_admitted_batch(self, trainer_version: int) -> int | None:
        return trainer_version + self.peak_window

    def capacity_rule(self) -> str:
        return f"num_prompts_per_step x (window {self.peak_window} + 1) for a gated sampler"

    def overlaps_training(self) -> bool:
        return self.peak_window > 0

    def describe(self) -> str:
        w = self.peak_window
        return f"dispatch leads the trainer by <= {w} version(s); staleness 0..{w}"

    def set_gate_window(self, window: int) -> None:
        """Retune the gate at runtime (PPO critic warmup); already-admitted batches are unaffected."""
        self._gate_window = check_nonneg("gate window", window)

    def required_buffer_capacity(self, groups_per_step: int, min_groups: int | None = None) -> int | None:
        check_nonneg("groups_per_step", groups_per_step)
        return groups_per_step * (self.peak_window + 1)

    def _admissible(self, trainer_version: int, outstanding_groups: int | None) -> bool:
        return self._dispatch_index < trainer_version + self._gate_window

class InOrderSampler(GatedSampler):
    """Exact batch->step matching: batch ``d`` is stamped ``target_step = d`` and trains at ``T == d``."""

    name: ClassVar[str] = "in_order"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True
    audited: ClassVar[bool] = True

    def __init__(self, max_lookahead_versions: int = 1, warmup_lookahead_versions: int | None = None) -> None:
        super().__init__(max_lookahead_versions)
        self.max_lookahead_versions = max_lookahead_versions
        if warmup_lookahead_versions is not None:
            check_nonneg("warmup_lookahead_versions", warmup_lookahead_versions)
            if warmup_lookahead_versions < max_lookahead_versions:
                raise ValueError(
                    f"warmup_lookahead_versions must be greater than or equal to max_lookahead_versions "
                    f"({warmup_lookahead_versions} < {max_lookahead_versions})"
                )
        self.warmup_lookahead_versions = warmup_lookahead_versions

    @property
    def peak_window(self) -> int:
        return max(self.max_lookahead_versions, self.warmup_lookahead_versions or 0, self._gate_window)

    def retune(self, trainer_version: int, policy_training_start_step: int | None) -> int | None:
        if self.warmup_lookahead_versions is None:
            return None
        return self.retune_lookahead(trainer_version, policy_training_start_step)

    def capacity_rule(self) -> str:
        knob = "max_lookahead_versions" if self.warmup_lookahead_versions is None else "warmup_lookahead_versions"
        return f"num_prompts_per_step x ({knob} {self.peak_window} + 1)"

    def expected_stamp(self, batch: int) -> int | None:
        return batch

    def ineligible_reason(self, slot: GroupSlot, trainer_version: int) -> str:
        return f"target_step {slot.target_step} != T={trainer_version}"

    def correction_needed(self) -> tuple[str, str] | None:
        return off_policy_rule("max_lookahead_versions", self.max_lookahead_versions)

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
    audited: ClassVar[bool] = True
    supports_drop_budgets: ClassVar[bool] = False

    def __init__(self, max_staleness_versions: int = 1) -> None:
        super().__init__(max_staleness_versions)
        self.max_staleness_versions = max_staleness_versions

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return self._evict_below_weight(slots, trainer_version, self.max_staleness_versions)

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        lo = weight_floor(trainer_version, self.max_staleness_versions)
        in_window = [s.start_weight for s in slots if lo <= s.start_weight <= trainer_version]
        if not in_window:
            return []
        oldest = min(in_window)
        return [s for s in slots if s.ready and s.start_weight == oldest]

    def ineligible_reason(self, slot: GroupSlot, trainer_version: int) -> str:
        lo = weight_floor(trainer_version, self.max_staleness_versions)
        if not lo <= slot.start_weight <= trainer_version:
            return f"start_weight {slot.start_weight} outside the window [{lo}, {trainer_version}]"
        return f"start_weight {slot.start_weight} is not the oldest in-window weight"

    def correction_needed(self) -> tuple[str, str] | None:
        return off_policy_rule("max_staleness_versions", self.max_staleness_versions)

class ReadyFirstSampler(GatedSampler):
    """Gated admission, completion-order selection of any ready group with ``sw <= T``; never evicts."""

    name: ClassVar[str] = "ready_first"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True
    audited: ClassVar[bool] = True
    supports_drop_budgets: ClassVar[bool] = False

    def __init__(self, max_staleness_versions: int = 1) -> None:
        super().__init__(max_staleness_versions)
        self.max_staleness_versions = max_staleness_versions

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        return [s for s in slots if s.ready and s.start_weight <= trainer_version]

    def ineligible_reason(self, slot: GroupSlot, trainer_version: int) -> str:
        return f"start_weight {slot.start_weight} > T={trainer_version}"

    def correction_needed(self) -> tuple[str, str] | None:
        return ("the ready_first sampler trains late stragglers from older policies", "set it to true")

class WindowedSampler(StalenessSampler):
    """Ungated, over-sampled streaming over the weight window ``[T - S, T]``.

    With ``over_sampling_ratio`` r, ``admit`` refuses a batch when ``outstanding_groups +
    groups_per_step`` would exceed ``ceil(r * groups_per_step)``.
    """

    name: ClassVar[str] = "windowed"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True
    audited: ClassVar[bool] = True
    supports_drop_budgets: ClassVar[bool] = False

    def __init__(
        self,
        max_staleness_versions: int = 1,
        sample_freshest_first: bool = False,
        over_sampling_ratio: float | None = None,
        groups_per_step: int | None = None,
    ) -> None:
        super().__init__()
        self.max_staleness_versions = check_nonneg("max_staleness_versions", max_staleness_versions)
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
        return start_weight < weight_floor(trainer_version, self.max_staleness_versions)

    @property
    def peak_window(self) -> int:
        return self.max_staleness_versions

    def required_buffer_capacity(self, groups_per_step: int, min_groups: int | None = None) -> int | None:
        check_nonneg("groups_per_step", groups_per_step)
        return groups_per_step if min_groups is None else min_groups

    def capacity_rule(self) -> str:
        return "one streaming chunk (min_groups_for_streaming_train) for the windowed sampler"

    def overlaps_training(self) -> bool:
        return self.max_staleness_versions > 0

    def describe(self) -> str:
        text = f"window [T-{self.max_staleness_versions}, T]; dispatch ungated"
        if self.over_sampling_ratio:
            text += f", at most {self.over_sampling_ratio} x a step outstanding"
        return text

    def ineligible_reason(self, slot: GroupSlot, trainer_version: int) -> str:
        lo = weight_floor(trainer_version, self.max_staleness_versions)
        return f"start_weight {slot.start_weight} outside the window [{lo}, {trainer_version}]"

    def correction_needed(self) -> tuple[str, str] | None:
        return off_policy_rule("max_staleness_versions", self.max_staleness_versions)

    def _admissible(self, trainer_version: int, outstanding_groups: int | None) -> bool:
        cap = self.outstanding_cap
        if cap is None or self.groups_per_step is None:
            return True
        if outstanding_groups is None:
            raise ValueError(
                "windowed sampler with over_sampling_ratio needs admit(..., outstanding_groups=N): the "
                "count of admitted groups not yet selected, evicted or dropped"
            )
        check_nonneg("outstanding_groups", outstanding_groups)
        return outstanding_groups + self.groups_per_step <= cap

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        lo = weight_floor(trainer_version, self.max_staleness_versions)
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
