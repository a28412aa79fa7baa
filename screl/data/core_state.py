"""Capture and restore of :class:`~screl.data.core.RolloutCore` (kept apart so the core file stays about its
transitions). Pure, like the core: the shell takes the data-plane barrier around both and moves the native
TransferQueue snapshot.

The promise a capture keeps: the replay index and the data plane describe the same groups. Every row the
state counts on (a committed group's, or a sealed sibling's of a group in flight) was written before the
core recorded it sealed, so a data-plane snapshot taken under the same barrier holds it; a row written but not
yet recorded is an orphan there, cleared on restore, and its sibling is regenerated with the same seed.

The core hands itself in as :class:`CoreFields`, the fields a capture reads and a restore sets; these functions
call nothing of the core's, so this module does not import it.
"""

from __future__ import annotations

import collections
from dataclasses import replace
from typing import Any, Protocol

from screl.data.buffer import ReplayBuffer
from screl.data.core_types import ControllerState, Effects, GroupRun, replay_digest
from screl.data.events import CheckpointEvent, ReserveEvent, RestoreEvent, SnapshotEvent
from screl.data.ledger import GroupState, RecoveryPolicy, RolloutLedger
from screl.data.reserve import ReplacementReserve
from screl.data.sampler_factory import sampler_supports_buffer_checkpoint
from screl.data.samplers import PromptGroupSampler


class CoreFields(Protocol):
    """What a capture reads and a restore sets of the core's state."""

    G: int
    policy: RecoveryPolicy
    sampler: PromptGroupSampler
    buffer: ReplayBuffer
    ledger: RolloutLedger
    reserve: ReplacementReserve
    runs: dict[str, GroupRun]
    group_keys: dict[str, list[str]]
    step_claims: list[str]
    admitted: collections.deque[tuple[int, int | None, int, int]]
    shortfall: dict[int, int]
    train_steps: int
    trainer_version: int
    gen_version: int
    epoch: int
    batch_index: int
    skipped_prompts: int
    mutation_version: int


def replay_index(core: CoreFields, with_claims: bool = False) -> list[dict[str, Any]]:
    """The completed groups a restore re-offers: the ready ones, and with ``with_claims`` (a snapshot taken
    mid-step, whose open step is rolled back) also the groups that step claimed."""
    claimed = core.buffer.claimed_slots() if with_claims else []
    return [
        {"group_id": s.group_id, "prompt_id": s.prompt_id, "start_weight": s.start_weight,
         "end_weight": s.end_weight, "target_step": s.target_step, "keys": list(core.group_keys[s.group_id])}
        for s in [*claimed, *core.buffer.live_slots()] if s.ready
    ]


def capture(core: CoreFields, open_step: str) -> tuple[ControllerState, Effects]:
    if core.step_claims and open_step != "rollback":
        raise RuntimeError("a trainer checkpoint is captured between steps: the open step still holds claims")
    rollback = open_step == "rollback"
    authoritative = sampler_supports_buffer_checkpoint(type(core.sampler))  # its own declaration, not a base's
    # shadow mode: no authoritative replay index (the data-plane snapshot is kept, nothing is re-offered from it)
    replay = replay_index(core, with_claims=rollback) if authoritative else []
    state = ControllerState(
        train_steps=core.train_steps, trainer_version=core.trainer_version, epoch=core.epoch,
        batch_index=core.batch_index, admitted=[list(a) for a in core.admitted],
        sampler_name=type(core.sampler).__name__, sampler=core.sampler.state_dict(),
        dispatch_index=core.sampler.dispatch_index, buffer=core.buffer.state_dict(),
        replay_index={"groups": replay, "digest": replay_digest(replay), "group_size": core.G},
        ledger=core.ledger.to_dict(open_step="rollback" if rollback else "reject"),
        rolled_back_groups=len(core.step_claims), in_flight={g: r.info() for g, r in core.runs.items()},
        shortfall={str(k): v for k, v in core.shortfall.items()}, skipped_prompts=core.skipped_prompts,
        mutation_version=core.mutation_version, replacement_reserve=core.reserve.state_dict(),
        mode="authoritative" if authoritative else "shadow",
    )
    kind = SnapshotEvent if rollback else CheckpointEvent
    event = kind(step=core.train_steps, mutation_version=core.mutation_version,
                 extra={"groups": len(replay), "in_flight": len(core.runs), "rolled_back": len(core.step_claims)})
    return state, Effects(events=[event])


def _check(core: CoreFields, state: ControllerState) -> None:
    replay = state.replay_index
    if replay_digest(replay["groups"]) != replay["digest"]:
        raise ValueError("the replay index does not match its digest: the checkpoint is corrupt")
    if replay["group_size"] != core.G:
        raise ValueError(f"the checkpoint has groups of {replay['group_size']} rows, the config {core.G}: "
                         "num_generations_per_prompt cannot change on resume")


def _shadow(core: CoreFields, state: ControllerState) -> ControllerState:
    """A sampler without buffer checkpoints: keep the cursor and counters, restore no group."""
    return replace(state, replay_index={"groups": [], "digest": replay_digest([]), "group_size": core.G},
                   in_flight={}, ledger=RolloutLedger(core.policy).to_dict(), buffer=ReplayBuffer().state_dict())


def _expected_keys(state: ControllerState) -> set[str]:
    keys = {k for g in state.replay_index["groups"] for k in g["keys"]}
    return keys | {k for info in state.in_flight.values() for k in info["keys"].values()}


def restore(core: CoreFields, state: ControllerState,
            present_keys: set[str] | None) -> tuple[Effects, dict[str, Any], list[GroupRun]]:
    """Load ``state`` into a fresh core; also returns the groups reopened, whose unfinished siblings the core
    dispatches when it resumes."""
    if core.runs or core.train_steps or core.mutation_version:
        raise RuntimeError("restore() must run on a fresh core, before the rollout pump starts")
    _check(core, state)
    warnings = []
    if state.mode == "shadow":
        warnings.append("the checkpoint's sampler does not support buffer checkpoints (supports_buffer_checkpoint): "
                        "completed buffered groups are not restored")
        state, present_keys = _shadow(core, state), None
    expected, present = _expected_keys(state), set(present_keys or ())
    missing = sorted(expected - present)
    if missing:
        raise ValueError(f"the TransferQueue snapshot lacks {len(missing)} rows the trainer checkpoint expects "
                         f"(e.g. {missing[:3]}): refusing to resume from an inconsistent bundle")
    eff = Effects(clear=sorted(present - expected))  # written, never recorded: regenerated under a new key
    core.buffer.load_state_dict(state.buffer)
    core.buffer.rollback_training_claims()
    core.ledger = RolloutLedger.from_dict(state.ledger, core.policy)
    plan = core.ledger.recover()  # abandons attempts that were in flight: {group: siblings to redo}
    if state.sampler_name == type(core.sampler).__name__:
        core.sampler.load_state_dict(state.sampler)
    else:
        core.sampler.set_dispatch_index(state.train_steps)
    core.train_steps = core.trainer_version = core.gen_version = int(state.train_steps)
    core.epoch, core.batch_index = int(state.epoch), int(state.batch_index)
    core.admitted.extend((int(a[0]), a[1], int(a[2]), int(a[3]) if len(a) > 3 else 0) for a in state.admitted)
    core.reserve.load_state_dict(state.replacement_reserve)
    core.shortfall = {int(k): int(v) for k, v in state.shortfall.items()}
    core.skipped_prompts, core.mutation_version = int(state.skipped_prompts), int(state.mutation_version)
    core.group_keys = {g["group_id"]: list(g["keys"]) for g in state.replay_index["groups"]}
    ready = [g["group_id"] for g in state.replay_index["groups"]]
    eff.events.append(RestoreEvent(step=core.train_steps, group_ids=tuple(ready),
                                   mutation_version=core.mutation_version))
    reopened: list[GroupRun] = []
    for gid in core.ledger.group_ids(GroupState.GENERATING):
        eff.extend(_reopen(core, gid, state.in_flight.get(gid), plan.get(gid, []), reopened))
    return eff, {"ready_groups": len(ready), "redispatched_groups": len(reopened),
                 "redispatched_siblings": sum(len(v) for v in plan.values()), "orphan_rows": len(eff.clear),
                 "warnings": warnings}, reopened


def _reopen(core: CoreFields, gid: str, info: dict[str, Any] | None, redo: list[int],
            reopened: list[GroupRun]) -> Effects:
    """Re-reserve a group that was generating at capture; keep the rows of siblings that stay sealed."""
    rec = core.ledger.group(gid)
    info = info or {"epoch": core.epoch, "end_weight": rec.start_weight, "resamples": {}, "keys": {},
                    "rewards": {}}
    keys = {int(s): k for s, k in info["keys"].items()}
    run = GroupRun(gid, rec.prompt_id, rec.start_weight, rec.target_step, int(info["epoch"]),
                   end_weight=int(info["end_weight"]), keys={s: k for s, k in keys.items() if s not in redo},
                   resamples={int(k): int(v) for k, v in info["resamples"].items()},
                   rewards={int(s): float(r) for s, r in info["rewards"].items() if int(s) not in redo},
                   replacements=int(info.get("replacements", 0)))
    core.buffer.reserve(rec.prompt_id, rec.start_weight, rec.target_step, group_id=gid)
    core.runs[gid] = run
    reopened.append(run)
    eff = Effects(clear=[k for s, k in keys.items() if s in redo])  # prompt_group: the whole group is redone
    eff.events.append(ReserveEvent(group_id=gid, prompt_id=rec.prompt_id, start_weight=rec.start_weight,
                                   target_step=rec.target_step, trainer_version=core.trainer_version))
    return eff
