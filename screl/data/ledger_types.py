"""The rollout ledger's vocabulary: sibling and group states, recovery granularity and its policy, the
per-group records, the accounting view, attempt ids and the ledger's errors.

The state machine over them is :class:`screl.data.ledger.RolloutLedger`, which re-exports every name here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum

SCHEMA_VERSION = 1


class SiblingState(str, Enum):
    RESERVED = "reserved"
    DISPATCHED = "dispatched"
    SEALED = "sealed"
    FAILED = "failed"
    ABANDONED = "abandoned"


class GroupState(str, Enum):
    GENERATING = "generating"
    FINALIZED = "finalized"
    CLAIMED = "claimed"
    APPLIED = "applied"


class Granularity(str, Enum):
    SIBLING = "sibling"
    PROMPT_GROUP = "prompt_group"


NEEDS_DISPATCH = frozenset({SiblingState.RESERVED, SiblingState.FAILED, SiblingState.ABANDONED})


class LedgerError(RuntimeError):
    """An invalid ledger transition or lookup; nothing was changed."""


class StaleAttemptError(LedgerError):
    """A seal or failure for an attempt that is no longer the sibling's live attempt (drop its result)."""


def _granularity(key: str, value: object) -> Granularity:
    try:
        return Granularity(value)
    except ValueError:
        raise ValueError(
            f"{key}: unknown recovery granularity {value!r}; use one of {[g.value for g in Granularity]}"
        ) from None


@dataclass(frozen=True)
class RecoveryPolicy:
    """``rollout_recovery`` knobs: the default granularity and its overrides."""

    default_granularity: Granularity = Granularity.SIBLING
    task_source_granularity_overrides: Mapping[str, Granularity] = field(default_factory=dict)
    agent_granularity_overrides: Mapping[str, Granularity] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "default_granularity", _granularity("default_granularity", self.default_granularity)
        )
        for name in ("task_source_granularity_overrides", "agent_granularity_overrides"):
            raw = getattr(self, name)
            object.__setattr__(self, name, {k: _granularity(f"{name}.{k}", v) for k, v in raw.items()})

    def resolve(self, task_source: str | None = None, agent: str | None = None) -> Granularity:
        """Granularity for one prompt: agent override > task-source override > default."""
        if agent is not None and agent in self.agent_granularity_overrides:
            return self.agent_granularity_overrides[agent]
        if task_source is not None and task_source in self.task_source_granularity_overrides:
            return self.task_source_granularity_overrides[task_source]
        return self.default_granularity


@dataclass
class SiblingRecord:
    index: int
    state: SiblingState = SiblingState.RESERVED
    attempt: int = 0
    """Dispatches so far; the live attempt is number ``attempt``."""


@dataclass
class GroupRecord:
    group_id: str
    prompt_id: int
    start_weight: int
    target_step: int | None
    granularity: Granularity
    task_source: str | None
    agent: str | None
    state: GroupState
    siblings: list[SiblingRecord]

    @property
    def num_generations(self) -> int:
        return len(self.siblings)

    def pending(self) -> list[int]:
        """Sibling indices that must be (re)dispatched (only while generating)."""
        if self.state is not GroupState.GENERATING:
            return []
        return [s.index for s in self.siblings if s.state in NEEDS_DISPATCH]


@dataclass(frozen=True)
class LedgerAccounting:
    """Where every reserved prompt group is; ``balanced`` when nothing is unaccounted for."""

    reserved: int
    generating: int
    finalized: int
    claimed: int
    applied: int
    trained: int
    evicted: int
    dropped: Mapping[str, int]

    @property
    def live(self) -> int:
        return self.generating + self.finalized + self.claimed + self.applied

    @property
    def ended(self) -> int:
        return self.trained + self.evicted + sum(self.dropped.values())

    @property
    def balanced(self) -> bool:
        return self.reserved == self.live + self.ended


def attempt_id(group_id: str, sibling: int, attempt: int) -> str:
    return f"{group_id}_g{sibling}_a{attempt}"
