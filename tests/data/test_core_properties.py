"""Property tests: random interleavings of reserve/seal/fail/drop/select/evict/step over buffer + sampler + ledger.

``Sim`` plays a minimal single controller (rollout pump and train pump serialised) on the pure core,
logs every decision as events, and asserts the invariants after every operation.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from screl.data import (
    AbortEvent,
    AdmitEvent,
    CapacityError,
    CheckpointEvent,
    CommitEvent,
    DropEvent,
    Event,
    EvictEvent,
    FailEvent,
    GatedSampler,
    Granularity,
    GroupState,
    RecoveryPolicy,
    RefitEvent,
    ReplayBuffer,
    ReserveEvent,
    RestoreEvent,
    RolloutLedger,
    SelectEvent,
    TrainStepEvent,
    WindowedSampler,
    call_admit,
    check_events,
    create_sampler,
    parse_sampler_config,
)

P = 3  # groups per step
G = 2  # generations per prompt

SAMPLERS: list[dict[str, Any]] = [
    {"name": "in_order", "max_lookahead_versions": 0},
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "in_order", "max_lookahead_versions": 2},
    {"name": "weight_fifo", "max_staleness_versions": 0},
    {"name": "weight_fifo", "max_staleness_versions": 2},
    {"name": "ready_first", "max_staleness_versions": 1},
    {"name": "windowed", "max_staleness_versions": 0},
    {"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": True},
    {"name": "windowed", "max_staleness_versions": 1, "over_sampling_ratio": 1.5},
]

# weighted so that steps complete often; rare failures, drops and short steps still interleave
OPS: tuple[str, ...] = ("admit",) * 2 + ("reserve",) * 4 + ("seal",) * 8 + ("train",) * 4
OPS += ("fail_sibling", "drop", "retry", "close_step")
ops_strategy = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 40)), max_size=80)


@dataclass
class Sim:
    block: dict[str, Any]
    granularity: str = "sibling"
    min_groups: int = 1
    cap: int = 2 * P + 2
    inflight_cap: int = P + 1
    T: int = 0
    next_prompt: int = 0
    pending: list[tuple[int, int | None]] = field(default_factory=list)
    shortfall: dict[int, int] = field(default_factory=dict)
    step_groups: list[str] = field(default_factory=list)
    ever_selected: set[str] = field(default_factory=set)
    attempts: dict[tuple[str, int], str] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.sampler = create_sampler(self.block, groups_per_step=P)
        self.cfg = parse_sampler_config(self.block)
        self.buffer = ReplayBuffer(self.cap, self.inflight_cap)
        self.ledger = RolloutLedger(RecoveryPolicy(default_granularity=Granularity(self.granularity)))

    # -------------------------------------------------------------------- rollout side

    def admit(self, _: int) -> None:
        if self.pending:
            return
        outstanding = self.buffer.num_live
        adm = call_admit(self.sampler, self.T, outstanding_groups=outstanding)
        if not adm.allowed:
            return
        self.events.append(
            AdmitEvent(trainer_version=self.T, step=self.sampler.dispatch_index, target_step=adm.target_step)
        )  # type: ignore[attr-defined]
        for _ in range(P):
            self.pending.append((self.next_prompt, adm.target_step))
            self.next_prompt += 1

    def reserve(self, _: int) -> None:
        if not self.pending:
            return
        pid, ts = self.pending[0]
        if not self.buffer.can_reserve():
            with pytest.raises(CapacityError, match="cannot reserve prompt"):
                self.buffer.reserve(pid, self.T, ts)
            return
        self.pending.pop(0)
        self._start(pid, ts, self.buffer.reserve(pid, self.T, ts))

    def _start(self, pid: int, ts: int | None, gid: str) -> None:
        self.events.append(ReserveEvent(group_id=gid, prompt_id=pid, start_weight=self.T, target_step=ts))
        self.ledger.reserve(gid, pid, G, start_weight=self.T, target_step=ts)
        for i in self.ledger.pending_siblings(gid):
            self.attempts[gid, i] = self.ledger.dispatch(gid, i)

    def _inflight(self, k: int) -> str | None:
        ids = [s.group_id for s in self.buffer.live_slots() if not s.ready]
        return ids[k % len(ids)] if ids else None

    def seal(self, k: int) -> None:
        gid = self._inflight(k)
        if gid is None:
            return
        rec = self.ledger.group(gid)
        sib = next(s.index for s in rec.siblings if s.state.value == "dispatched")
        self.ledger.seal(gid, sib, self.attempts[gid, sib])
        if self.ledger.finalizable() and gid in self.ledger.finalizable():
            self.ledger.finalize(gid)
            slot = self.buffer.commit(gid, self.T)
            self.events.append(CommitEvent(group_id=gid, end_weight=self.T, start_weight=slot.start_weight))

    def fail_sibling(self, k: int) -> None:
        gid = self._inflight(k)
        if gid is None:
            return
        rec = self.ledger.group(gid)
        sib = next(s.index for s in rec.siblings if s.state.value == "dispatched")
        to_abort = self.ledger.fail(gid, sib, self.attempts[gid, sib])
        self.events.append(FailEvent(group_id=gid, sibling=sib, reason="infra"))
        pending = self.ledger.pending_siblings(gid)
        if self.granularity == "sibling":
            assert (to_abort, pending) == ([], [sib])
        else:  # the whole group is regenerated
            assert pending == list(range(G)) and sib not in to_abort
        for i in pending:
            self.attempts[gid, i] = self.ledger.dispatch(gid, i)

    def drop(self, k: int) -> None:
        gid = self._inflight(k)
        if gid is None:
            return
        slot = self.buffer.fail(gid)
        self.ledger.drop(gid, reason="data_error")
        self.events += [FailEvent(group_id=gid), DropEvent(group_id=gid, reason="data_error")]
        if slot.target_step is not None:
            self.shortfall[slot.target_step] = self.shortfall.get(slot.target_step, 0) + 1

    def retry(self, k: int) -> None:
        gid = self._inflight(k)
        if gid is None:
            return
        slot = self.buffer.get(gid)
        new = self.buffer.retry(gid, self.T)
        self.ledger.drop(gid, reason="retried")
        self.events.append(FailEvent(group_id=gid, reason="infra"))
        self._start(slot.prompt_id, slot.target_step, new)

    # -------------------------------------------------------------------- train side

    def _target(self) -> int:
        return P - self.shortfall.get(self.T, 0)

    def train(self, k: int) -> None:
        evicted = self.sampler.evict(self.buffer.live_slots(), self.T)
        for slot in self.buffer.remove(evicted):
            self.ledger.evict([slot.group_id])
            self.events.append(EvictEvent(group_id=slot.group_id, trainer_version=self.T))
        remaining = self._target() - len(self.step_groups)
        if remaining <= 0:
            self._finish_step()
            return
        chosen = self.sampler.select(self.buffer.live_slots(), self.T, min(1 + k % 2, remaining), remaining)
        if chosen is None:
            return
        assert not set(chosen) & self.ever_selected, "a selected group was selected again"
        slots = self.buffer.claim_for_training(chosen)
        self._check_select_rule(slots)
        self.ledger.claim(chosen)
        self.ever_selected |= set(chosen)
        self.step_groups += chosen
        self.events.append(SelectEvent(trainer_version=self.T, group_ids=tuple(chosen)))
        if len(self.step_groups) >= self._target():
            self._finish_step()

    def close_step(self, k: int) -> None:
        """Now and then a step closes short (a shortfall landed): train what was selected."""
        if k % 4 == 0:
            self._finish_step()

    def _finish_step(self) -> None:
        ids = list(self.step_groups)
        self.ledger.apply(ids)
        self.buffer.release_training_claims(ids)
        self.ledger.retire(ids)
        self.events.append(TrainStepEvent(step=self.T, group_ids=tuple(ids)))
        self.step_groups = []
        self.T += 1
        self.events.append(RefitEvent(trainer_version=self.T))
        for slot in self.buffer.live_slots():
            if not slot.ready and self.sampler.should_abort_inflight(slot.start_weight, self.T):
                self.buffer.fail(slot.group_id)
                self.ledger.drop(slot.group_id, reason="stale")
                self.events.append(AbortEvent(group_id=slot.group_id, trainer_version=self.T))

    def _check_select_rule(self, slots: list[Any]) -> None:
        for s in slots:
            assert s.ready
            if self.cfg.name == "in_order":
                assert s.target_step == self.T, "in_order trained a group off its target_step"
            elif self.cfg.name == "windowed":
                assert max(0, self.T - self.cfg.window) <= s.start_weight <= self.T, (
                    "windowed trained outside window"
                )
            elif self.cfg.name == "ready_first":
                assert s.start_weight <= self.T

    # -------------------------------------------------------------------- invariants

    def check_invariants(self) -> None:
        buf, acc = self.buffer, self.ledger.accounting()
        assert buf.num_buffered <= self.cap and buf.num_inflight <= self.inflight_cap
        assert min(buf.num_live, buf.num_inflight, buf.num_ready, buf.num_claimed) >= 0
        if isinstance(self.sampler, GatedSampler):
            assert self.sampler.dispatch_index <= self.T + self.sampler.peak_window, (
                "dispatch ran past the gate"
            )
        if isinstance(self.sampler, WindowedSampler) and self.sampler.outstanding_cap is not None:
            assert buf.num_live + len(self.pending) <= self.sampler.outstanding_cap
        assert acc.balanced
        assert acc.reserved - acc.dropped.get("retried", 0) == self.next_prompt - len(self.pending)
        assert (acc.generating, acc.finalized, acc.claimed) == (
            buf.num_inflight,
            buf.num_ready,
            buf.num_claimed,
        )
        assert set(self.ledger.group_ids(GroupState.FINALIZED)) == {
            s.group_id for s in buf.live_slots() if s.ready
        }
        state = buf.state_dict()
        self.ledger.check_replay_index(g["group_id"] for g in state["groups"] + state["claims"])

    def run(self, ops: list[tuple[str, int]]) -> None:
        for name, arg in ops:
            getattr(self, name)(arg)
            self.check_invariants()

    # -------------------------------------------------------------------- checkpoint

    def restart(self, seal_inflight: bool) -> Sim:
        """Checkpoint at a step boundary and rebuild a fresh Sim from the checkpointable state only
        (plus the controller's own counters); the ledger's unfinished groups are redispatched."""
        while seal_inflight and self._inflight(0) is not None:
            self.seal(0)
        if self.step_groups:
            self._finish_step()
        clone = Sim(self.block, self.granularity, self.min_groups, self.cap, self.inflight_cap)
        clone.buffer.load_state_dict(copy.deepcopy(self.buffer.state_dict()))
        clone.sampler.load_state_dict(copy.deepcopy(self.sampler.state_dict()))
        clone.ledger = RolloutLedger.from_dict(copy.deepcopy(self.ledger.to_dict()), self.ledger.policy)
        for name in ("T", "next_prompt", "pending", "shortfall", "ever_selected", "attempts"):
            setattr(clone, name, copy.deepcopy(getattr(self, name)))
        for gid, siblings in clone.ledger.recover().items():
            rec = clone.ledger.group(gid)
            clone.buffer.reserve(rec.prompt_id, rec.start_weight, rec.target_step, group_id=gid)
            clone.events.append(
                ReserveEvent(
                    group_id=gid,
                    prompt_id=rec.prompt_id,
                    start_weight=rec.start_weight,
                    target_step=rec.target_step,
                )
            )
            for i in siblings:
                clone.attempts[gid, i] = clone.ledger.dispatch(gid, i)
        clone.check_invariants()
        return clone


PROPS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("block", SAMPLERS, ids=lambda b: "-".join(str(v) for v in b.values()))
@PROPS
@given(ops=ops_strategy, granularity=st.sampled_from(["sibling", "prompt_group"]))
def test_random_interleavings_keep_every_invariant_and_pass_the_checker(
    block: dict[str, Any], ops: list[tuple[str, int]], granularity: str
) -> None:
    sim = Sim(block, granularity)
    sim.run(ops)
    report = check_events(sim.events, block, max_buffered_rollouts=sim.cap)
    assert report.ok, report.format()
    reserves = sum(isinstance(e, ReserveEvent) for e in sim.events)
    assert sum(report.outcomes.values()) == reserves


@pytest.mark.parametrize("block", SAMPLERS[1::2], ids=lambda b: b["name"])
@PROPS
@given(prefix=ops_strategy, suffix=ops_strategy)
def test_state_round_trip_reproduces_identical_future_decisions(
    block: dict[str, Any], prefix: list[tuple[str, int]], suffix: list[tuple[str, int]]
) -> None:
    sim = Sim(block)
    sim.run(prefix)
    clone = sim.restart(seal_inflight=True)
    mark = len(sim.events)
    sim.run(suffix)
    clone.run(suffix)
    assert clone.events == sim.events[mark:]
    assert clone.buffer.state_dict() == sim.buffer.state_dict()
    assert clone.sampler.state_dict() == sim.sampler.state_dict()


@PROPS
@given(ops=ops_strategy, k=st.integers(0, 1000))
def test_checker_catches_a_group_trained_twice(ops: list[tuple[str, int]], k: int) -> None:
    sim = Sim(SAMPLERS[1])
    sim.run(ops + [("admit", 0)] + [("reserve", 0)] * P + [("seal", 0)] * (P * G) + [("train", 0)] * 2)
    trained = [g for e in sim.events if isinstance(e, TrainStepEvent) for g in e.group_ids]
    if not trained:
        return
    replay = TrainStepEvent(step=sim.T, group_ids=(trained[k % len(trained)],))
    rules = {v.rule for v in check_events([*sim.events, replay], SAMPLERS[1]).violations}
    assert "trained-twice" in rules


@PROPS
@given(ops=ops_strategy)
def test_checker_catches_an_in_order_select_off_step(ops: list[tuple[str, int]]) -> None:
    sim = Sim(SAMPLERS[2])
    sim.run(ops)
    ahead = [s for s in sim.buffer.live_slots() if s.ready and s.target_step != sim.T]
    if not ahead:
        return
    bad = SelectEvent(trainer_version=sim.T, group_ids=(ahead[0].group_id,))
    rules = {v.rule for v in check_events([*sim.events, bad], SAMPLERS[2]).violations}
    assert "select-rule" in rules


@pytest.mark.parametrize("block", SAMPLERS[::2], ids=lambda b: b["name"])
@PROPS
@given(
    prefix=ops_strategy,
    doomed=ops_strategy,
    suffix=ops_strategy,
    granularity=st.sampled_from(["sibling", "prompt_group"]),
)
def test_checker_accepts_a_restart_and_still_sees_every_group(
    block: dict[str, Any],
    prefix: list[tuple[str, int]],
    doomed: list[tuple[str, int]],
    suffix: list[tuple[str, int]],
    granularity: str,
) -> None:
    """Checkpoint (with rollouts in flight), run on, crash, restore from the checkpoint, run on."""
    sim = Sim(block, granularity)
    sim.run(prefix)
    clone = sim.restart(seal_inflight=False)  # closes the open step first
    sim.events.append(CheckpointEvent(step=sim.T))
    restored = tuple(s.group_id for s in clone.buffer.live_slots() if s.ready)
    resume_step = clone.T
    sim.run(doomed)  # this progress is lost in the crash
    clone.run(suffix)
    log = [*sim.events, RestoreEvent(step=resume_step, group_ids=restored), *clone.events]
    report = check_events([e.to_json() for e in log], block, max_buffered_rollouts=sim.cap)
    assert report.ok, report.format()
    if restored:
        dropped = RestoreEvent(step=resume_step, group_ids=restored[1:])
        lossy = [*sim.events, dropped, *clone.events]
        assert "lost-on-restore" in {v.rule for v in check_events(lossy, block).violations}
