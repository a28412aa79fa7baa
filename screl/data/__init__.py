"""Pure core of the single controller: replay buffer slots, staleness samplers, rollout ledger, event log.

No Ray, Lightning, threads or clocks in here: every piece is a deterministic value. The event-log
names load lazily: importing the package loads neither the event log nor its checker.
"""

import importlib
from typing import TYPE_CHECKING, Any

from screl.data.buffer import CapacityError, GroupSlot, ReplayBuffer, ReplayBufferError
from screl.data.ledger import (
    Granularity,
    GroupState,
    LedgerAccounting,
    LedgerError,
    RecoveryPolicy,
    RolloutLedger,
    SiblingState,
    StaleAttemptError,
)
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
from screl.data.sampler_factory import (
    create_sampler,
    required_buffer_capacity,
    sampler_rules,
    sampler_supports_buffer_checkpoint,
    sampler_supports_training_claims,
)
from screl.data.samplers import (
    Admission,
    GatedSampler,
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    StalenessSampler,
    WeightFifoSampler,
    WindowedSampler,
    call_admit,
    lookahead_schedule,
)

if TYPE_CHECKING:
    from screl.data.event_check import EventCheckReport, Violation, check_events
    from screl.data.events import (
        EVENT_TYPES,
        AbortEvent,
        AdmitEvent,
        CheckpointEvent,
        CommitEvent,
        DropEvent,
        Event,
        EventLogWriter,
        EvictEvent,
        FailEvent,
        PromoteEvent,
        RefitEvent,
        ReplaceEvent,
        ReserveEvent,
        RestoreEvent,
        SelectEvent,
        SnapshotEvent,
        SpareEvent,
        TrainStepEvent,
        ValidateEvent,
        WindowEvent,
        parse_event,
        read_events,
    )

_LAZY = {
    "EVENT_TYPES": "screl.data.events",
    "AbortEvent": "screl.data.events",
    "AdmitEvent": "screl.data.events",
    "CheckpointEvent": "screl.data.events",
    "CommitEvent": "screl.data.events",
    "DropEvent": "screl.data.events",
    "Event": "screl.data.events",
    "EventLogWriter": "screl.data.events",
    "EvictEvent": "screl.data.events",
    "FailEvent": "screl.data.events",
    "PromoteEvent": "screl.data.events",
    "RefitEvent": "screl.data.events",
    "WindowEvent": "screl.data.events",
    "ValidateEvent": "screl.data.events",
    "ReserveEvent": "screl.data.events",
    "ReplaceEvent": "screl.data.events",
    "SpareEvent": "screl.data.events",
    "RestoreEvent": "screl.data.events",
    "SelectEvent": "screl.data.events",
    "SnapshotEvent": "screl.data.events",
    "TrainStepEvent": "screl.data.events",
    "parse_event": "screl.data.events",
    "read_events": "screl.data.events",
    "EventCheckReport": "screl.data.event_check",
    "Violation": "screl.data.event_check",
    "check_events": "screl.data.event_check",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'screl.data' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "AbortEvent",
    "Admission",
    "AdmitEvent",
    "CapacityError",
    "CheckpointEvent",
    "CommitEvent",
    "CustomSamplerConfig",
    "DropEvent",
    "EVENT_TYPES",
    "Event",
    "EventCheckReport",
    "EventLogWriter",
    "EvictEvent",
    "FailEvent",
    "GatedSampler",
    "Granularity",
    "GroupSlot",
    "GroupState",
    "InOrderSampler",
    "InOrderSamplerConfig",
    "LedgerAccounting",
    "LedgerError",
    "PromoteEvent",
    "PromptGroupSampler",
    "ReadyFirstSampler",
    "ReadyFirstSamplerConfig",
    "RecoveryPolicy",
    "RefitEvent",
    "WindowEvent",
    "ValidateEvent",
    "ReplayBuffer",
    "ReplayBufferError",
    "ReserveEvent",
    "ReplaceEvent",
    "SpareEvent",
    "RestoreEvent",
    "RolloutLedger",
    "SamplerConfig",
    "SamplerConfigError",
    "SelectEvent",
    "SiblingState",
    "SnapshotEvent",
    "StaleAttemptError",
    "StalenessSampler",
    "TrainStepEvent",
    "Violation",
    "WeightFifoSampler",
    "WeightFifoSamplerConfig",
    "WindowedSampler",
    "WindowedSamplerConfig",
    "call_admit",
    "check_events",
    "create_sampler",
    "lookahead_schedule",
    "parse_event",
    "parse_sampler_config",
    "read_events",
    "required_buffer_capacity",
    "sampler_rules",
    "sampler_supports_buffer_checkpoint",
    "sampler_supports_training_claims",
]
