"""Group-granular replay buffer: one slot per prompt group, in dispatch order.

Pure metadata bookkeeping (the rollout rows live in the data plane, keyed by group id). A slot is
``reserved`` (unready, in flight) -> ``committed`` (ready) -> ``claimed`` for a train step ->
released once the step's optimizer step and data-plane cleanup are done; or a reserved attempt
fails (``fail`` / ``retry``), or a slot is removed (eviction, drop).

Capacity (``max_buffered_rollouts``) counts every slot that holds data-plane room: in-flight
reservations, ready groups and training claims. In-flight (``max_inflight_prompts``) counts
unready reservations. Both are computed from the slots, so they can never go negative; a reserve
beyond either bound raises ``CapacityError`` (the controller checks ``can_reserve()`` first).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

STATE_SCHEMA_VERSION = 1
_SLOT_KEYS = ("group_id", "prompt_id", "start_weight", "end_weight", "target_step", "seq")


class ReplayBufferError(RuntimeError):
    """An invalid slot transition or lookup; nothing was changed."""


class CapacityError(ReplayBufferError):
    """A reserve or restore that would exceed ``max_buffered_rollouts`` or ``max_inflight_prompts``."""


@dataclass(frozen=True)
class GroupSlot:
    """One prompt group's slot, as samplers see it (immutable: the buffer replaces it on change)."""

    group_id: str
    prompt_id: int
    start_weight: int
    """Trainer weight version live when this attempt was dispatched."""
    end_weight: int | None = None
    """Weight version when the rollout returned (set at commit)."""
    target_step: int | None = None
    """Trainer step this group must train at (``in_order`` stamp), else None."""
    ready: bool = False


def _check_int(name: str, value: object, minimum: int | None = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_bound(name: str, value: int | None) -> int | None:
    if value is not None:
        _check_int(name, value, minimum=1)
    return value


class ReplayBuffer:
    """Ordered slots of prompt groups with reserve/commit/claim accounting.

    Args:
        max_buffered_rollouts: most slots holding data-plane room (in flight + ready + claimed); None = no bound.
        max_inflight_prompts: most unready reservations at once; None = no bound.
        id_prefix: prefix of the fresh group ids this buffer assigns (``<prefix><dispatch seq>``).
    """

    def __init__(
        self,
        max_buffered_rollouts: int | None = None,
        max_inflight_prompts: int | None = None,
        *,
        id_prefix: str = "g",
    ) -> None:
        self.max_buffered_rollouts = _check_bound("max_buffered_rollouts", max_buffered_rollouts)
        self.max_inflight_prompts = _check_bound("max_inflight_prompts", max_inflight_prompts)
        self.id_prefix = id_prefix
        self._live: dict[str, GroupSlot] = {}  # insertion order == dispatch order
        self._claims: dict[str, GroupSlot] = {}  # claim order
        self._seq: dict[str, int] = {}  # dispatch sequence number of every live or claimed slot
        self._next_seq = 0

    # ----------------------------------------------------------------------------- views

    def live_slots(self) -> list[GroupSlot]:
        """Unclaimed slots (in flight and ready) in dispatch order: the input of ``sampler.select``."""
        return list(self._live.values())

    def claimed_slots(self) -> list[GroupSlot]:
        """Slots claimed by the open train step, in claim order."""
        return list(self._claims.values())

    def get(self, group_id: str) -> GroupSlot:
        """The live or claimed slot of ``group_id``."""
        slot = self._live.get(group_id) or self._claims.get(group_id)
        if slot is None:
            raise ReplayBufferError(f"unknown group {group_id!r}: it is neither buffered nor claimed")
        return slot

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._live or group_id in self._claims

    @property
    def num_live(self) -> int:
        """Unclaimed slots (in flight + ready): dispatched but not yet consumed."""
        return len(self._live)

    @property
    def num_inflight(self) -> int:
        return sum(1 for s in self._live.values() if not s.ready)

    @property
    def num_ready(self) -> int:
        return sum(1 for s in self._live.values() if s.ready)

    @property
    def num_claimed(self) -> int:
        return len(self._claims)

    @property
    def num_buffered(self) -> int:
        """Slots counted against ``max_buffered_rollouts``: in flight + ready + claimed."""
        return len(self._live) + len(self._claims)

    @property
    def capacity_left(self) -> int | None:
        if self.max_buffered_rollouts is None:
            return None
        return self.max_buffered_rollouts - self.num_buffered

    @property
    def inflight_left(self) -> int | None:
        if self.max_inflight_prompts is None:
            return None
        return self.max_inflight_prompts - self.num_inflight

    def can_reserve(self) -> bool:
        """Whether one more ``reserve`` fits both bounds."""
        return (self.capacity_left is None or self.capacity_left > 0) and (
            self.inflight_left is None or self.inflight_left > 0
        )

    def count_for_target_step(self, target_step: int) -> int:
        """Live slots stamped ``target_step``, unready reservations included (tops up a restored step)."""
        return sum(1 for s in self._live.values() if s.target_step == target_step)

    # ----------------------------------------------------------------------------- transitions

    def reserve(
        self,
        prompt_id: int,
        start_weight: int,
        target_step: int | None = None,
        group_id: str | None = None,
    ) -> str:
        """Append an unready slot for one dispatch attempt and return its group id.

        A fresh id is assigned unless ``group_id`` is given (e.g. a ledger group redispatched after a
        restart). Raises ``CapacityError`` when the buffer or the in-flight bound is full.
        """
        self._check_new_slot(prompt_id, start_weight, target_step, group_id)
        if self.capacity_left is not None and self.capacity_left <= 0:
            raise CapacityError(
                f"cannot reserve prompt {prompt_id}: {self.num_buffered} groups already hold the "
                f"max_buffered_rollouts={self.max_buffered_rollouts} slots; wait for the train pump to "
                "consume or evict groups (check can_reserve() first)"
            )
        if self.inflight_left is not None and self.inflight_left <= 0:
            raise CapacityError(
                f"cannot reserve prompt {prompt_id}: {self.num_inflight} rollouts already in flight "
                f"(max_inflight_prompts={self.max_inflight_prompts}); wait for a commit or failure"
            )
        return self._append(prompt_id, start_weight, target_step, group_id)

    def commit(self, group_id: str, end_weight: int) -> GroupSlot:
        """Record ``end_weight`` and flip the slot ready. Unknown or already-committed -> error, nothing written."""
        slot = self._require_unready(group_id, "commit")
        _check_int("end_weight", end_weight)
        if end_weight < slot.start_weight:
            raise ReplayBufferError(
                f"cannot commit group {group_id!r} with end_weight={end_weight} below its "
                f"start_weight={slot.start_weight}; weight versions only grow"
            )
        committed = dataclasses.replace(slot, end_weight=end_weight, ready=True)
        self._live[group_id] = committed
        return committed

    def fail(self, group_id: str) -> GroupSlot:
        """Remove a failed or cancelled unready attempt; frees its capacity and in-flight slot."""
        slot = self._require_unready(group_id, "fail")
        del self._live[group_id]
        del self._seq[group_id]
        return slot

    def retry(self, group_id: str, start_weight: int, new_group_id: str | None = None) -> str:
        """Replace a failed unready attempt with a new one for the same prompt (fresh id, same stamp).

        Atomic: the capacity and in-flight slot pass straight to the new attempt, which goes to
        the end of the dispatch order.
        """
        slot = self._require_unready(group_id, "retry")
        self._check_new_slot(slot.prompt_id, start_weight, slot.target_step, new_group_id)
        del self._live[group_id]
        del self._seq[group_id]
        return self._append(slot.prompt_id, start_weight, slot.target_step, new_group_id)

    def remove(self, group_ids: Iterable[str]) -> list[GroupSlot]:
        """Remove live slots (eviction, drops); every id is checked before anything changes."""
        ids = self._distinct(group_ids, "remove")
        missing = [g for g in ids if g not in self._live]
        if missing:
            raise ReplayBufferError(f"cannot remove {missing}: not live slots (claimed, consumed or unknown)")
        removed = [self._live.pop(g) for g in ids]
        for g in ids:
            del self._seq[g]
        return removed

    def claim_for_training(self, group_ids: Sequence[str]) -> list[GroupSlot]:
        """Move ready groups out of the live index into the open step's claims (they keep capacity)."""
        ids = self._distinct(group_ids, "claim")
        unknown = [g for g in ids if g not in self._live and g not in self._claims]
        claimed = [g for g in ids if g in self._claims]
        unready = [g for g in ids if g in self._live and not self._live[g].ready]
        if unknown or claimed or unready:
            raise ReplayBufferError(
                f"cannot claim {list(ids)}: unknown {unknown}, already claimed {claimed}, not committed "
                f"{unready}; only ready live groups can be claimed"
            )
        slots = [self._live.pop(g) for g in ids]
        self._claims.update((s.group_id, s) for s in slots)
        return slots

    def release_training_claims(self, group_ids: Iterable[str]) -> list[GroupSlot]:
        """Drop the claims of a finished step; ``group_ids`` must equal the claim set exactly."""
        ids = self._distinct(group_ids, "release")
        unknown = sorted(set(ids) - set(self._claims))
        unreleased = sorted(set(self._claims) - set(ids))
        if unknown or unreleased:
            raise ReplayBufferError(
                f"release must name exactly the claimed groups: unknown {unknown}, unreleased {unreleased}"
            )
        released = list(self._claims.values())
        for g in self._claims:
            del self._seq[g]
        self._claims.clear()
        return released

    def rollback_training_claims(self) -> list[str]:
        """Return every claim to the live index at its dispatch position (an open step that never committed)."""
        ids = list(self._claims)
        merged = {**self._live, **self._claims}
        self._live = {g: merged[g] for g in sorted(merged, key=self._seq.__getitem__)}
        self._claims.clear()
        return ids

    def promote_ready_group(self, to_target_step: int) -> int | None:
        """Re-stamp the ready group with the furthest-ahead ``target_step > to_target_step`` to it.

        Ties go to the first in dispatch order. Returns the lender's old stamp, or None when no
        ready stamped group lies ahead (unready and unstamped groups never lend).
        """
        _check_int("to_target_step", to_target_step)
        best: GroupSlot | None = None
        best_ts = to_target_step
        for slot in self._live.values():
            ts = slot.target_step
            if slot.ready and ts is not None and ts > best_ts:  # strict: ties keep the first in order
                best, best_ts = slot, ts
        if best is None:
            return None
        self._live[best.group_id] = dataclasses.replace(best, target_step=to_target_step)
        return best_ts

    # ----------------------------------------------------------------------------- checkpoint

    def state_dict(self) -> dict[str, Any]:
        """Checkpoint metadata: ready live groups and claims (unready reservations belong to the ledger)."""

        def row(slot: GroupSlot) -> dict[str, Any]:
            return {**dataclasses.asdict(slot), "seq": self._seq[slot.group_id]}

        return {
            "schema_version": STATE_SCHEMA_VERSION,
            "next_seq": self._next_seq,
            "saved_capacity": self.max_buffered_rollouts,
            "groups": [row(s) for s in self._live.values() if s.ready],
            "claims": [row(s) for s in self._claims.values()],
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore groups and claims into an empty buffer; every problem is checked before any change."""
        if self._live or self._claims:
            raise ReplayBufferError(
                f"load_state_dict needs an empty buffer, this one holds {self.num_buffered} groups"
            )
        if state.get("schema_version") != STATE_SCHEMA_VERSION:
            raise ReplayBufferError(
                f"replay state schema_version {state.get('schema_version')!r} is not {STATE_SCHEMA_VERSION}"
            )
        groups = [_slot_from_row(r, "groups") for r in state.get("groups", [])]
        claims = [_slot_from_row(r, "claims") for r in state.get("claims", [])]
        ids = [s.group_id for s, _ in groups + claims]
        dupes = sorted({g for g in ids if ids.count(g) > 1})
        if dupes:
            raise ReplayBufferError(f"replay state lists groups {dupes} more than once")
        cap = self.max_buffered_rollouts
        if cap is not None and len(ids) > cap:
            raise CapacityError(
                f"replay state holds {len(ids)} groups but max_buffered_rollouts={cap}; resume with "
                f"max_buffered_rollouts >= {len(ids)}"
            )
        next_seq = _check_int("next_seq", state.get("next_seq"))
        for slot, seq in sorted(groups, key=lambda p: p[1]):
            self._live[slot.group_id] = slot
            self._seq[slot.group_id] = seq
        for slot, seq in claims:
            self._claims[slot.group_id] = slot
            self._seq[slot.group_id] = seq
        self._next_seq = max([next_seq, *(seq + 1 for _, seq in groups + claims)])

    # ----------------------------------------------------------------------------- internals

    def _append(
        self, prompt_id: int, start_weight: int, target_step: int | None, group_id: str | None
    ) -> str:
        seq = self._next_seq
        self._next_seq += 1
        if group_id is None:
            group_id, n = f"{self.id_prefix}{seq}", 0
            while group_id in self:  # only when a caller-given id mimics the fresh-id pattern
                n += 1
                group_id = f"{self.id_prefix}{seq}_{n}"
        self._live[group_id] = GroupSlot(group_id, prompt_id, start_weight, None, target_step, False)
        self._seq[group_id] = seq
        return group_id

    def _check_new_slot(
        self, prompt_id: int, start_weight: int, target_step: int | None, group_id: str | None
    ) -> None:
        _check_int("prompt_id", prompt_id, minimum=None)
        _check_int("start_weight", start_weight)
        if target_step is not None:
            _check_int("target_step", target_step)
        if group_id is not None and group_id in self:
            raise ReplayBufferError(
                f"group id {group_id!r} is already buffered; each attempt needs its own id"
            )

    def _require_unready(self, group_id: str, action: str) -> GroupSlot:
        if group_id in self._claims:
            raise ReplayBufferError(f"cannot {action} group {group_id!r}: it is claimed for training")
        slot = self._live.get(group_id)
        if slot is None:
            raise ReplayBufferError(f"cannot {action} unknown group {group_id!r}: reserve it first")
        if slot.ready:
            raise ReplayBufferError(f"cannot {action} group {group_id!r}: it is already committed")
        return slot

    @staticmethod
    def _distinct(group_ids: Iterable[str], action: str) -> list[str]:
        ids = list(group_ids)
        if len(set(ids)) != len(ids):
            raise ReplayBufferError(f"cannot {action} {ids}: a group id is repeated")
        return ids


def _slot_from_row(row: Mapping[str, Any], where: str) -> tuple[GroupSlot, int]:
    missing = [k for k in _SLOT_KEYS if k not in row]
    if missing:
        raise ReplayBufferError(f"replay state {where} entry {dict(row)!r} lacks keys {missing}")
    if row.get("ready") is not True or row["end_weight"] is None:
        raise ReplayBufferError(f"replay state {where} entry {row['group_id']!r} is not a committed group")
    slot = GroupSlot(
        group_id=str(row["group_id"]),
        prompt_id=_check_int("prompt_id", row["prompt_id"], minimum=None),
        start_weight=_check_int("start_weight", row["start_weight"]),
        end_weight=_check_int("end_weight", row["end_weight"]),
        target_step=None if row["target_step"] is None else _check_int("target_step", row["target_step"]),
        ready=True,
    )
    return slot, _check_int("seq", row["seq"])
