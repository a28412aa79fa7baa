"""Rollout ownership ledger: who owns every admitted prompt group and each of its siblings.

A prompt group has ``num_generations`` siblings. Sibling states::

    reserved -> dispatched -> sealed            (its tokens are final)
                           -> failed            (retryable: dispatch again)
                           -> abandoned         (aborted, or lost in a restart: dispatch again)

Each dispatch is one *attempt* with the id ``<group>_g<sibling>_a<n>``; a seal or failure names its
attempt, so a late result of an abandoned attempt is refused (``StaleAttemptError``).

Group states: ``generating -> finalized`` (every sibling sealed; the replay buffer holds it)
``-> claimed`` (selected by the open train step) ``-> applied`` (optimizer step done) -> retired
(counted as trained). A generating or finalized group may also be dropped (with a reason) or, once
finalized, evicted.

Recovery granularity is resolved once per group at reservation and persisted: ``sibling`` keeps
sealed siblings and redispatches only unfinished ones; ``prompt_group`` regenerates the whole group
when any sibling is unfinished (a failure or abandonment discards the group's sealed siblings and
abandons its in-flight ones). Agent overrides win over task-source overrides, which win over the
default.

Accounting: ``reserved == generating + finalized + claimed + applied + trained + evicted + dropped``.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import Any, Literal

from screl.data.ledger_types import (
    NEEDS_DISPATCH,
    SCHEMA_VERSION,
    Granularity,
    GroupRecord,
    GroupState,
    LedgerAccounting,
    LedgerError,
    RecoveryPolicy,
    SiblingRecord,
    SiblingState,
    StaleAttemptError,
    _granularity,
    attempt_id,
)

__all__ = [
    "Granularity",
    "GroupRecord",
    "GroupState",
    "LedgerAccounting",
    "LedgerError",
    "NEEDS_DISPATCH",
    "RecoveryPolicy",
    "RolloutLedger",
    "SCHEMA_VERSION",
    "SiblingRecord",
    "SiblingState",
    "StaleAttemptError",
    "attempt_id",
]


class RolloutLedger:
    """Ownership ledger of prompt groups and siblings (pure; persisted with ``to_dict``)."""

    def __init__(self, policy: RecoveryPolicy | None = None) -> None:
        self.policy = policy or RecoveryPolicy()
        self._groups: dict[str, GroupRecord] = {}
        self._reserved = 0
        self._trained = 0
        self._evicted = 0
        self._dropped: dict[str, int] = {}

    # ----------------------------------------------------------------------------- views

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._groups

    def __len__(self) -> int:
        return len(self._groups)

    def group(self, group_id: str) -> GroupRecord:
        """A copy of the group's record."""
        return copy.deepcopy(self._get(group_id))

    def group_ids(self, state: GroupState | None = None) -> list[str]:
        """Live group ids in reservation order, optionally only those in ``state``."""
        return [g for g, r in self._groups.items() if state is None or r.state is state]

    def pending_siblings(self, group_id: str) -> list[int]:
        """Sibling indices of a generating group that must be (re)dispatched, honouring its granularity."""
        return self._get(group_id).pending()

    def redispatch_plan(self) -> dict[str, list[int]]:
        """Every generating group with siblings to (re)dispatch -> those sibling indices."""
        return {g: r.pending() for g, r in self._groups.items() if r.pending()}

    def finalizable(self) -> list[str]:
        """Generating groups whose siblings are all sealed: ready for ``finalize`` (and the buffer commit)."""
        return [
            g
            for g, r in self._groups.items()
            if r.state is GroupState.GENERATING and all(s.state is SiblingState.SEALED for s in r.siblings)
        ]

    def check_replay_index(self, replay_group_ids: Iterable[str]) -> None:
        """Raise unless the replay index (buffer groups + claims) holds exactly the finalized and claimed groups."""
        replay = set(replay_group_ids)
        owned = {g for g, r in self._groups.items() if r.state in (GroupState.FINALIZED, GroupState.CLAIMED)}
        if replay != owned:
            raise LedgerError(
                f"replay index and ledger disagree: only in the replay index {sorted(replay - owned)}, "
                f"finalized or claimed in the ledger but not in the replay index {sorted(owned - replay)}"
            )

    def accounting(self) -> LedgerAccounting:
        counts = {s: 0 for s in GroupState}
        for r in self._groups.values():
            counts[r.state] += 1
        return LedgerAccounting(
            reserved=self._reserved,
            generating=counts[GroupState.GENERATING],
            finalized=counts[GroupState.FINALIZED],
            claimed=counts[GroupState.CLAIMED],
            applied=counts[GroupState.APPLIED],
            trained=self._trained,
            evicted=self._evicted,
            dropped=dict(self._dropped),
        )

    def accounts_for(self, num_admitted: int) -> bool:
        """Whether every one of ``num_admitted`` admitted prompts is reserved here and accounted for."""
        acc = self.accounting()
        return acc.balanced and acc.reserved == num_admitted

    # ----------------------------------------------------------------------------- group lifecycle

    def reserve(
        self,
        group_id: str,
        prompt_id: int,
        num_generations: int,
        *,
        start_weight: int,
        target_step: int | None = None,
        task_source: str | None = None,
        agent: str | None = None,
    ) -> Granularity:
        """Record an admitted prompt group (all siblings reserved); returns its resolved granularity."""
        if group_id in self._groups:
            raise LedgerError(
                f"group {group_id!r} is already in the ledger; give each prompt group its own id"
            )
        if isinstance(num_generations, bool) or not isinstance(num_generations, int) or num_generations < 1:
            raise ValueError(f"num_generations must be an integer >= 1, got {num_generations!r}")
        granularity = self.policy.resolve(task_source, agent)
        self._groups[group_id] = GroupRecord(
            group_id=group_id,
            prompt_id=prompt_id,
            start_weight=start_weight,
            target_step=target_step,
            granularity=granularity,
            task_source=task_source,
            agent=agent,
            state=GroupState.GENERATING,
            siblings=[SiblingRecord(i) for i in range(num_generations)],
        )
        self._reserved += 1
        return granularity

    def finalize(self, group_id: str) -> None:
        """generating -> finalized once every sibling is sealed (the group is committed to the buffer)."""
        record = self._require(group_id, GroupState.GENERATING, "finalize")
        unsealed = [s.index for s in record.siblings if s.state is not SiblingState.SEALED]
        if unsealed:
            raise LedgerError(f"cannot finalize group {group_id!r}: siblings {unsealed} are not sealed")
        record.state = GroupState.FINALIZED

    def claim(self, group_ids: Iterable[str]) -> None:
        """finalized -> claimed for the open train step."""
        self._move(group_ids, GroupState.FINALIZED, GroupState.CLAIMED, "claim")

    def rollback_claims(self) -> list[str]:
        """claimed -> finalized for every claim (the open step never committed)."""
        ids = self.group_ids(GroupState.CLAIMED)
        self._move(ids, GroupState.CLAIMED, GroupState.FINALIZED, "roll back")
        return ids

    def apply(self, group_ids: Iterable[str]) -> None:
        """claimed -> applied: the step's optimizer update is done."""
        self._move(group_ids, GroupState.CLAIMED, GroupState.APPLIED, "apply")

    def retire(self, group_ids: Iterable[str]) -> None:
        """Forget applied groups after the step's cleanup; they count as trained."""
        ids = self._move(group_ids, GroupState.APPLIED, GroupState.APPLIED, "retire")
        for g in ids:
            del self._groups[g]
        self._trained += len(ids)

    def evict(self, group_ids: Iterable[str]) -> None:
        """Forget finalized groups the sampler evicted."""
        ids = self._move(group_ids, GroupState.FINALIZED, GroupState.FINALIZED, "evict")
        for g in ids:
            del self._groups[g]
        self._evicted += len(ids)

    def drop(self, group_id: str, reason: str) -> list[int]:
        """Forget a generating or finalized group with a reason; returns in-flight siblings to abort."""
        if not isinstance(reason, str) or not reason:
            raise ValueError(f"dropping group {group_id!r} needs a non-empty reason, got {reason!r}")
        record = self._get(group_id)
        if record.state not in (GroupState.GENERATING, GroupState.FINALIZED):
            raise LedgerError(f"cannot drop group {group_id!r}: it is {record.state.value} by the train step")
        inflight = [s.index for s in record.siblings if s.state is SiblingState.DISPATCHED]
        del self._groups[group_id]
        self._dropped[reason] = self._dropped.get(reason, 0) + 1
        return inflight

    # ----------------------------------------------------------------------------- siblings

    def dispatch(self, group_id: str, sibling: int) -> str:
        """Start a new attempt of a sibling that needs dispatch; returns its attempt id."""
        record = self._require(group_id, GroupState.GENERATING, "dispatch")
        sib = self._sibling(record, sibling)
        if sib.state not in NEEDS_DISPATCH:
            raise LedgerError(
                f"cannot dispatch sibling {sibling} of group {group_id!r}: it is {sib.state.value} "
                f"(attempt {attempt_id(group_id, sibling, sib.attempt)}); abandon it first"
            )
        sib.attempt += 1
        sib.state = SiblingState.DISPATCHED
        return attempt_id(group_id, sibling, sib.attempt)

    def seal(self, group_id: str, sibling: int, attempt: str) -> None:
        """dispatched -> sealed. Repeating the same seal is a no-op; a stale attempt raises."""
        record = self._get(group_id)
        sib = self._sibling(record, sibling)
        live = attempt_id(group_id, sibling, sib.attempt)
        if sib.state is SiblingState.SEALED and attempt == live:
            return
        self._require_live_attempt(record, sib, attempt, "seal")
        sib.state = SiblingState.SEALED

    def fail(self, group_id: str, sibling: int, attempt: str) -> list[int]:
        """dispatched -> failed (retry by dispatching again). Returns in-flight siblings to abort
        (``prompt_group``: the whole group restarts)."""
        record = self._get(group_id)
        sib = self._sibling(record, sibling)
        self._require_live_attempt(record, sib, attempt, "fail")
        sib.state = SiblingState.FAILED
        return self._cascade(record)

    def abandon(self, group_id: str, sibling: int) -> list[int]:
        """dispatched -> abandoned (aborted). Returns further in-flight siblings to abort (``prompt_group``)."""
        record = self._require(group_id, GroupState.GENERATING, "abandon")
        sib = self._sibling(record, sibling)
        if sib.state is not SiblingState.DISPATCHED:
            raise LedgerError(
                f"cannot abandon sibling {sibling} of group {group_id!r}: it is {sib.state.value}, not dispatched"
            )
        sib.state = SiblingState.ABANDONED
        return self._cascade(record)

    def recover(self) -> dict[str, list[int]]:
        """After a restart: in-flight attempts died with the process, open claims roll back.

        Returns ``redispatch_plan()``: per generating group, the sibling indices to dispatch again
        (``prompt_group`` groups with any unfinished sibling: all of them). Groups whose siblings
        are all sealed are not in the plan: ``finalize`` them (see ``finalizable``).
        """
        self.rollback_claims()
        for record in self._groups.values():
            if record.state is GroupState.APPLIED:
                raise LedgerError(
                    f"group {record.group_id!r} was applied but never retired; the ledger state is not a "
                    "checkpointable one"
                )
            if record.state is not GroupState.GENERATING:
                continue
            unfinished = False
            for sib in record.siblings:
                if sib.state is SiblingState.DISPATCHED:
                    sib.state = SiblingState.ABANDONED
                unfinished = unfinished or sib.state is not SiblingState.SEALED
            if unfinished and record.granularity is Granularity.PROMPT_GROUP:
                for sib in record.siblings:  # the whole group comes from the weights live at redispatch
                    sib.state = SiblingState.ABANDONED if sib.state is SiblingState.SEALED else sib.state
        return self.redispatch_plan()

    # ----------------------------------------------------------------------------- persistence

    def to_dict(self, open_step: Literal["reject", "rollback"] = "reject") -> dict[str, Any]:
        """Plain-dict state. A full-step checkpoint (``reject``) refuses claimed or applied groups; a
        periodic snapshot (``rollback``) persists claimed groups as finalized so a restart retrains them."""
        applied = self.group_ids(GroupState.APPLIED)
        claimed = self.group_ids(GroupState.CLAIMED)
        if applied or (claimed and open_step == "reject"):
            raise LedgerError(
                f"cannot persist the ledger with an open train step (claimed {claimed}, applied {applied}); "
                "save at a step boundary, or use open_step='rollback' for a periodic snapshot before the "
                "optimizer commit"
            )
        groups = []
        for r in self._groups.values():
            state = GroupState.FINALIZED if r.state is GroupState.CLAIMED else r.state
            groups.append(
                {
                    "group_id": r.group_id,
                    "prompt_id": r.prompt_id,
                    "start_weight": r.start_weight,
                    "target_step": r.target_step,
                    "granularity": r.granularity.value,
                    "task_source": r.task_source,
                    "agent": r.agent,
                    "state": state.value,
                    "siblings": [[s.state.value, s.attempt] for s in r.siblings],
                }
            )
        return {
            "schema_version": SCHEMA_VERSION,
            "groups": groups,
            "counts": {
                "reserved": self._reserved,
                "trained": self._trained,
                "evicted": self._evicted,
                "dropped": dict(self._dropped),
            },
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], policy: RecoveryPolicy | None = None) -> RolloutLedger:
        """Rebuild a ledger; persisted granularities are kept (changed config does not reinterpret groups)."""
        if data.get("schema_version") != SCHEMA_VERSION:
            raise LedgerError(f"ledger schema_version {data.get('schema_version')!r} is not {SCHEMA_VERSION}")
        ledger = cls(policy)
        try:
            for g in data["groups"]:
                record = GroupRecord(
                    group_id=str(g["group_id"]),
                    prompt_id=int(g["prompt_id"]),
                    start_weight=int(g["start_weight"]),
                    target_step=None if g["target_step"] is None else int(g["target_step"]),
                    granularity=_granularity("granularity", g["granularity"]),
                    task_source=g["task_source"],
                    agent=g["agent"],
                    state=GroupState(g["state"]),
                    siblings=[
                        SiblingRecord(i, SiblingState(st), int(a)) for i, (st, a) in enumerate(g["siblings"])
                    ],
                )
                if record.group_id in ledger._groups:
                    raise LedgerError(f"ledger state lists group {record.group_id!r} twice")
                ledger._groups[record.group_id] = record
            counts = data["counts"]
            ledger._reserved = int(counts["reserved"])
            ledger._trained = int(counts["trained"])
            ledger._evicted = int(counts["evicted"])
            ledger._dropped = {str(k): int(v) for k, v in counts["dropped"].items()}
        except (KeyError, TypeError, ValueError) as exc:
            raise LedgerError(f"malformed ledger state: {type(exc).__name__}: {exc}") from exc
        if not ledger.accounting().balanced:
            raise LedgerError(f"ledger state does not balance: {ledger.accounting()}")
        return ledger

    # ----------------------------------------------------------------------------- internals

    def _get(self, group_id: str) -> GroupRecord:
        record = self._groups.get(group_id)
        if record is None:
            raise LedgerError(f"unknown group {group_id!r}: it was never reserved or has already ended")
        return record

    def _require(self, group_id: str, state: GroupState, action: str) -> GroupRecord:
        record = self._get(group_id)
        if record.state is not state:
            raise LedgerError(
                f"cannot {action} group {group_id!r}: it is {record.state.value}, not {state.value}"
            )
        return record

    def _move(self, group_ids: Iterable[str], src: GroupState, dst: GroupState, action: str) -> list[str]:
        ids = list(group_ids)
        if len(set(ids)) != len(ids):
            raise LedgerError(f"cannot {action} {ids}: a group id is repeated")
        wrong = {g: (self._groups[g].state.value if g in self._groups else "unknown") for g in ids}
        wrong = {g: st for g, st in wrong.items() if st != src.value}
        if wrong:
            raise LedgerError(f"cannot {action} groups {wrong}: each must be {src.value}")
        for g in ids:
            self._groups[g].state = dst
        return ids

    @staticmethod
    def _sibling(record: GroupRecord, sibling: int) -> SiblingRecord:
        if (
            isinstance(sibling, bool)
            or not isinstance(sibling, int)
            or not 0 <= sibling < len(record.siblings)
        ):
            raise LedgerError(
                f"group {record.group_id!r} has siblings 0..{len(record.siblings) - 1}, got sibling {sibling!r}"
            )
        return record.siblings[sibling]

    @staticmethod
    def _require_live_attempt(record: GroupRecord, sib: SiblingRecord, attempt: str, action: str) -> None:
        live = attempt_id(record.group_id, sib.index, sib.attempt)
        if (
            record.state is not GroupState.GENERATING
            or sib.state is not SiblingState.DISPATCHED
            or attempt != live
        ):
            raise StaleAttemptError(
                f"cannot {action} attempt {attempt!r}: sibling {sib.index} of group {record.group_id!r} is "
                f"{sib.state.value} with live attempt {live!r}; drop this result"
            )

    @staticmethod
    def _cascade(record: GroupRecord) -> list[int]:
        """``prompt_group``: once a sibling is unfinished, discard sealed and abandon in-flight siblings."""
        if record.granularity is not Granularity.PROMPT_GROUP:
            return []
        if not any(s.state in (SiblingState.FAILED, SiblingState.ABANDONED) for s in record.siblings):
            return []
        inflight = []
        for s in record.siblings:
            if s.state is SiblingState.DISPATCHED:
                inflight.append(s.index)
                s.state = SiblingState.ABANDONED
            elif s.state is SiblingState.SEALED:
                s.state = SiblingState.ABANDONED
        return inflight
