"""The sampler plugin API: the ``PromptGroupSampler`` protocol and ``StalenessSampler``, the base class
every built-in (``screl.data.samplers``) and most custom samplers extend.

``StalenessSampler`` carries the shared machinery (dispatch cursor, greedy select, checkpoint state) and the
rules the rest of screl asks a sampler: its buffer capacity and in-flight bound, its gate and stamps (for
the event checker), whether it needs importance-sampling correction, its thread-plan hint and its
``screl check`` line. A custom sampler that subclasses it gets safe defaults for each.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol, runtime_checkable

from screl.data.buffer import GroupSlot


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


def check_nonneg(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
    return value


def _check_select_bounds(min_groups: int, max_groups: int) -> None:
    if min_groups < 1:
        raise ValueError(f"select needs min_groups >= 1, got min_groups={min_groups}")
    if max_groups < min_groups:
        raise ValueError(f"select needs max_groups >= min_groups, got {max_groups} < {min_groups}")


def weight_floor(trainer_version: int, window: int) -> int:
    return max(0, trainer_version - window)


def off_policy_rule(knob: str, window: int) -> tuple[str, str] | None:
    if window == 0:
        return None
    return (
        f"async_rl.sampler.{knob}={window} admits off-policy data, which needs importance-sampling correction",
        f"set it to true, or async_rl.sampler.{knob}: 0 for sync",
    )


class StalenessSampler:
    """Shared machinery of the built-ins: dispatch cursor, greedy select, checkpoint state.

    Subclasses define ``_eligible`` (and usually ``evict``); a custom sampler may subclass it but
    must still declare ``supports_buffer_checkpoint`` on its own class.
    """

    name: ClassVar[str] = "base"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True
    audited: ClassVar[bool] = False
    """``screl events check`` replays this class's own gate, ``eligible``, ``evict`` and
    ``should_abort_inflight`` against the log (a sampler with state the log does not show: False)."""
    supports_drop_budgets: ClassVar[bool] = True
    """A dropped group shrinks its step instead of being waited for (the sampler stamps target steps,
    or, for a custom sampler, says it copes)."""

    def __init__(self) -> None:
        self._dispatch_index = -1

    # ----------------------------------------------------------- rules the rest of screl asks
    # (config checks, ``screl check``, the thread plan, the event checker; a custom sampler that
    # subclasses this class inherits these safe defaults and may override any of them)

    @property
    def peak_window(self) -> int:
        """The widest lookahead or staleness window the run uses (sizes the buffer and in-flight bound)."""
        return 0

    def required_buffer_capacity(self, groups_per_step: int, min_groups: int | None = None) -> int | None:
        """Smallest ``max_buffered_rollouts`` that cannot deadlock the rollout pump, or None (a full step)."""
        return None

    def capacity_rule(self) -> str:
        """How ``required_buffer_capacity`` is derived, for error messages."""
        return "one full step (num_prompts_per_step)"

    def inflight_bound(self, groups_per_step: int) -> int:
        """Default ``max_inflight_prompts``: a step per version of the window."""
        return groups_per_step * (self.peak_window + 1)

    def max_admitted_batch(self, trainer_version: int) -> int | None:
        """The latest batch index ``admit`` may allow at ``trainer_version``; None when ungated."""
        return None

    def expected_stamp(self, batch: int) -> int | None:
        """The ``target_step`` batch ``batch`` must carry, or None when the sampler does not stamp."""
        return None

    def eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot] | None:
        """The groups ``select`` takes a prefix of, in order; None when the sampler is not ``audited``."""
        return self._eligible(slots, trainer_version) if self.audited else None

    def ineligible_reason(self, slot: GroupSlot, trainer_version: int) -> str:
        """Why ``slot`` may not be selected at ``trainer_version`` (for the event checker's report)."""
        return "not eligible"

    def correction_needed(self) -> tuple[str, str] | None:
        """(why, fix) when this sampler trains off-policy data and so needs importance-sampling
        correction; None when it stays on-policy (or, for a custom sampler, leaves it to the user)."""
        return None

    def retune(self, trainer_version: int, policy_training_start_step: int | None) -> int | None:
        """Adjust the gate for ``trainer_version`` (PPO critic warmup) and return the window now in force, or
        None when this sampler's window never changes."""
        return None

    def overlaps_training(self) -> bool:
        """Thread-plan hint: whether generation may run while the trainer computes."""
        return True

    def describe(self) -> str:
        """One line for ``screl check``: how far dispatch leads the trainer, how stale data may be."""
        return "decided by the custom sampler"

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
        check_nonneg("trainer_version", trainer_version)
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
        lo = weight_floor(trainer_version, window)
        return [s.group_id for s in slots if s.ready and s.start_weight < lo]
