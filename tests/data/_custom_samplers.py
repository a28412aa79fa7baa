"""Importable custom samplers for the ``custom`` factory tests (target ``_custom_samplers:<Class>``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from screl.data import Admission, GroupSlot, InOrderSampler, StalenessSampler


class NewestFirst(StalenessSampler):
    """Newest ready groups first; takes a kwarg."""

    name: ClassVar[str] = "newest_first"
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def __init__(self, limit: int = 100) -> None:
        super().__init__()
        self.limit = limit

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        return sorted((s for s in slots if s.ready), key=lambda s: -s.start_weight)[: self.limit]


class PlainProtocol:
    """Satisfies the protocol without subclassing anything; its admit takes no outstanding_groups."""

    supports_buffer_checkpoint: ClassVar[bool] = False
    supports_training_claims: ClassVar[bool] = False

    def __init__(self) -> None:
        self.admits = 0
        self.cursor = -1

    @property
    def dispatch_index(self) -> int:
        return self.cursor

    def set_dispatch_index(self, resume_step: int) -> None:
        self.cursor = resume_step - 1

    def admit(self, trainer_version: int) -> Admission:
        self.admits += 1
        return Admission(True, None)

    def select(
        self, slots: Sequence[GroupSlot], trainer_version: int, min_groups: int, max_groups: int
    ) -> list[str] | None:
        return None

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return []

    def should_abort_inflight(self, start_weight: int, trainer_version: int) -> bool:
        return False

    def required_buffer_capacity(self, groups_per_step: int) -> int | None:
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        pass


class InheritsCheckpointFlag(InOrderSampler):
    """Does not declare supports_buffer_checkpoint itself."""


class MissingSelect:
    supports_buffer_checkpoint: ClassVar[bool] = True
    supports_training_claims: ClassVar[bool] = True

    def admit(self, trainer_version: int) -> Admission:
        return Admission(True, None)


NOT_A_CLASS = 3


class FreshOnly(StalenessSampler):
    """Answers every rule hook itself: trains only groups started at the current weight, evicts older ones."""

    name: ClassVar[str] = "fresh_only"
    supports_buffer_checkpoint: ClassVar[bool] = False
    audited: ClassVar[bool] = True
    supports_drop_budgets: ClassVar[bool] = False

    def _eligible(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[GroupSlot]:
        return [s for s in slots if s.ready and s.start_weight == trainer_version]

    def evict(self, slots: Sequence[GroupSlot], trainer_version: int) -> list[str]:
        return [s.group_id for s in slots if s.ready and s.start_weight < trainer_version]

    def ineligible_reason(self, slot: GroupSlot, trainer_version: int) -> str:
        return f"start_weight {slot.start_weight} is not the current weight {trainer_version}"

    def correction_needed(self) -> tuple[str, str] | None:
        return ("fresh_only trains groups that finished after a refit", "turn it on")

    def overlaps_training(self) -> bool:
        return False

    def describe(self) -> str:
        return "fresh groups only"
