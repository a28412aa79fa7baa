"""Unit tests of the real ``RolloutCore`` (no Ray, no asyncio): every transition and its effects."""

from __future__ import annotations

import pytest
from _core_driver import Driver, G, P, make_core

from screl.data import check_events
from screl.data.core_types import ControllerState, FailureBudget, SiblingReport
from screl.data.events import AbortEvent, CommitEvent, DropEvent, EvictEvent, FailEvent, ReserveEvent

BUDGET = FailureBudget(max_infra_attempts=2, max_data_attempts=2, backoff_base_s=0.5, max_backoff_s=4.0,
                       max_skipped_prompts=3, max_consecutive_dropped_prompts=3, min_step_batch_fraction=0.3)


def _names(events: list) -> list[str]:
    return [e.name for e in events]


def test_pump_admits_a_step_and_reserves_each_group_on_one_worker() -> None:
    d = Driver(make_core())
    eff = d.pump()
    # lookahead 1: steps 0 and 1 admitted, P + 1 groups fit the in-flight bound
    assert _names(eff.events)[:2] == ["admit", "reserve"]
    reserved = [e.group_id for e in eff.events if isinstance(e, ReserveEvent)]
    assert len(reserved) == P + 1 == d.core.buffer.num_inflight
    assert len(eff.dispatch) == (P + 1) * G
    for gid in reserved:
        workers = {x.worker for x in eff.dispatch if x.group_id == gid}
        assert len(workers) == 1, "a group's siblings share one worker"
    assert {x.worker for x in eff.dispatch} == {0, 1}, "groups spread over the least loaded workers"
    assert len({x.attempt for x in eff.dispatch}) == len(eff.dispatch)
    assert d.pump().dispatch == [], "nothing more fits until a group ends"


def test_seed_depends_on_prompt_sibling_and_resamples_not_on_the_attempt() -> None:
    d = Driver(make_core(failure=BUDGET))
    d.pump()
    first = d.outstanding[0]
    d.apply(d.core.call_failed([first.attempt] + [o.attempt for o in d.outstanding
                                                  if o.group_id == first.group_id and o is not first], "dead"))
    retry = next(o for o in d.outstanding[::-1] if o.group_id == first.group_id and o.sibling == first.sibling)
    assert retry.attempt != first.attempt and retry.seed == first.seed
    assert retry.delay_s == 0.5, "infra retries back off"
    d.outstanding.remove(retry)
    d.apply(d.core.report(SiblingReport(retry.attempt, "data_error", detail="boom")))
    resampled = next(o for o in d.outstanding[::-1] if o.group_id == first.group_id and o.sibling == first.sibling)
    assert resampled.seed != first.seed and resampled.delay_s == 0.0


def test_a_group_commits_when_its_last_sibling_seals_and_trains_by_its_row_keys() -> None:
    d = Driver(make_core())
    d.pump()
    gid = d.outstanding[0].group_id
    d.seal(0)
    assert gid in d.core.runs and not any(isinstance(e, CommitEvent) for e in d.events)
    sibling = next(i for i, o in enumerate(d.outstanding) if o.group_id == gid)
    eff = d.seal(sibling)
    assert eff is not None and [type(e) for e in eff.events] == [CommitEvent]
    assert d.core.buffer.get(gid).ready and len(d.core.group_keys[gid]) == G
    d.seal_all()
    eff, plan = d.core.next_chunk()
    assert plan.kind == "chunk" and plan.last_chunk and len(plan.group_ids) == P
    assert set(plan.keys) <= d.rows
    done = d.core.complete_step()
    assert set(done.clear) == set(plan.keys), "the trained rows are cleared"
    assert d.core.refitting and d.core.pump().dispatch == [], "reservation waits for the refit"
    assert _names(d.core.refit_done(0.1).events) == ["refit"]
    assert d.core.gen_version == d.core.trainer_version == 1


WINDOWED = {"name": "windowed", "max_staleness_versions": 0}


def _step_leaving_one_group_in_flight(d: Driver) -> tuple[dict[str, int], str, object]:
    """Train step 0, then train step 1 while one group reserved at version 1 keeps generating: at version 2 it
    (start_weight 1 < T - S) can never train. Returns (attempt -> worker, that group, complete_step effects)."""
    d.pump()
    d.seal_all()
    assert d.train()
    d.pump()
    victim = next(o.group_id for o in d.outstanding if d.core.runs[o.group_id].start_weight == 1)
    running: dict[str, int] = {}
    while True:
        running.update({o.attempt: o.worker for o in d.outstanding})
        eff, plan = d.core.next_chunk()
        d.apply(eff)
        if plan.kind == "chunk" and plan.last_chunk:
            return running, victim, d.apply(d.core.complete_step())
        others = [i for i, o in enumerate(d.outstanding) if o.group_id != victim]
        assert others, "nothing left to seal but the victim"
        d.seal(others[0])
        d.pump()


def test_a_stale_group_is_aborted_where_it_runs_and_its_late_row_cleared() -> None:
    d = Driver(make_core(WINDOWED, workers=3), block=WINDOWED)
    running, victim, eff = _step_leaving_one_group_in_flight(d)
    aborts = [e for e in eff.events if isinstance(e, AbortEvent)]
    assert victim in {e.group_id for e in aborts} and {e.reason for e in aborts} == {"stale"}
    aborted = [a for ids in eff.abort.values() for a in ids]
    assert aborted and all(running[a] == w for w, ids in eff.abort.items() for a in ids)
    holders = {running[o.attempt] for o in d.outstanding if o.attempt in aborted}
    assert set(eff.abort) == holders, "only the workers holding an aborted request are told"
    late = next(o for o in d.outstanding if o.attempt in aborted)
    d.rows.add(late.attempt)
    eff = d.core.report(SiblingReport(late.attempt, "sealed"))
    assert eff.clear == [late.attempt] and not eff.events
    assert victim not in d.core.runs and victim not in d.core.ledger


@pytest.mark.parametrize("kind", ["data", "infra"])
def test_prompt_group_failure_with_siblings_in_flight_restarts_the_group(kind: str) -> None:
    """Was a crash: the first fail abandoned the peers and their fail/seal raised StaleAttemptError."""
    d = Driver(make_core(granularity="prompt_group", failure=BUDGET))
    d.pump()
    gid = d.outstanding[0].group_id
    peers = [o for o in d.outstanding if o.group_id == gid]
    d.seal(d.outstanding.index(peers[1]))  # sibling 1 sealed: its row must go when the group restarts
    sealed_key = peers[1].attempt
    if kind == "data":
        eff = d.data_fail(d.outstanding.index(peers[0]))
    else:
        eff = d.infra_fail(d.outstanding.index(peers[0]))
    assert eff is not None and eff.error is None
    assert sealed_key in eff.clear and sealed_key not in d.rows
    redo = [o for o in eff.dispatch if o.group_id == gid]
    assert sorted(o.sibling for o in redo) == list(range(G)), "the whole group is regenerated"
    d.seal_all()
    assert d.core.buffer.get(gid).ready
    assert check_events(d.events, {"name": "in_order", "max_lookahead_versions": 1}).ok


def test_prompt_group_cascade_aborts_in_flight_peers_and_ignores_their_reports() -> None:
    d = Driver(make_core(granularity="prompt_group", failure=BUDGET))
    d.pump()
    gid = d.outstanding[0].group_id
    peer = [o for o in d.outstanding if o.group_id == gid][1]
    eff = d.data_fail(0)
    assert eff is not None and eff.abort == {peer.worker: [peer.attempt]}
    d.outstanding.remove(peer)
    d.rows.add(peer.attempt)
    late = d.core.report(SiblingReport(peer.attempt, "sealed"))
    assert late.clear == [peer.attempt] and not late.events


def test_sibling_granularity_keeps_sealed_siblings_on_failure() -> None:
    d = Driver(make_core(failure=BUDGET))
    d.pump()
    gid = d.outstanding[0].group_id
    peers = [o for o in d.outstanding if o.group_id == gid]
    d.seal(d.outstanding.index(peers[1]))
    eff = d.data_fail(d.outstanding.index(peers[0]))
    assert eff is not None and not eff.clear and not eff.abort
    assert [o.sibling for o in eff.dispatch] == [0]


def test_granularity_overrides_come_from_the_prompt_record() -> None:
    overrides = {"task_source_granularity_overrides": {"math": "prompt_group"},
                 "agent_granularity_overrides": {"coder": "sibling"}}
    routing = {i: ("math", "coder" if i % 2 else None) for i in range(12)}
    core = make_core(overrides=overrides, routing=routing)
    d = Driver(core)
    d.pump()
    seen = {core.ledger.group(g).prompt_id: core.ledger.group(g).granularity.value for g in core.runs}
    assert seen and all(v == ("sibling" if pid % 2 else "prompt_group") for pid, v in seen.items())
    assert {core.ledger.group(g).task_source for g in core.runs} == {"math"}


def test_data_failures_beyond_the_budget_drop_the_group_and_shrink_its_step() -> None:
    d = Driver(make_core(failure=BUDGET))
    d.pump()
    gid = d.outstanding[0].group_id
    for _ in range(BUDGET.max_data_attempts):
        d.data_fail(next(i for i, o in enumerate(d.outstanding) if o.group_id == gid))
    drops = [e for e in d.events if isinstance(e, DropEvent)]
    assert [(e.group_id, e.reason) for e in drops] == [(gid, "data_attempts_exhausted")]
    assert d.error is None and d.core.skipped_prompts == 1 and d.core.shortfall == {0: 1}
    assert sum(isinstance(e, FailEvent) and e.reason == "data" for e in d.events) == 2
    d.seal_all()
    _, plan = d.core.next_chunk()
    assert plan.kind == "chunk" and plan.step_groups == P - 1 and plan.last_chunk


def test_a_drop_with_no_budget_stops_the_pump_with_the_config_key() -> None:
    d = Driver(make_core(failure=FailureBudget(max_infra_attempts=1)))
    d.pump()
    d.infra_fail(0)
    assert d.error is not None and "max_consecutive_dropped_prompts" in str(d.error)


def test_a_step_shrunk_below_min_step_batch_fraction_fails() -> None:
    budget = FailureBudget(max_data_attempts=1, max_skipped_prompts=5, min_step_batch_fraction=0.9)
    d = Driver(make_core(failure=budget))
    d.pump()
    d.data_fail(0)
    assert d.error is not None and "min_step_batch_fraction=0.9" in str(d.error)


def test_infra_failures_back_off_then_drop_when_exhausted() -> None:
    d = Driver(make_core(failure=BUDGET))
    d.pump()
    gid = d.outstanding[0].group_id
    d.infra_fail(0)
    assert d.core.metrics["retried"] == 1
    retries = [o for o in d.outstanding if o.group_id == gid]
    assert retries and {o.delay_s for o in retries} == {0.5}
    d.infra_fail(d.outstanding.index(retries[0]))
    assert [e.reason for e in d.events if isinstance(e, DropEvent)] == ["infra_attempts_exhausted"]
    assert gid not in d.core.runs and d.error is None


def test_capture_and_restore_keep_sealed_siblings_and_clear_orphan_rows() -> None:
    d = Driver(make_core())
    d.pump()
    d.seal_all()
    d.train()
    d.pump()
    d.seal(0)  # one sibling of a group in flight is sealed
    sealed = next(k for r in d.core.runs.values() for k in r.keys.values())
    orphan = d.outstanding[0].attempt
    d.rows.add(orphan)  # written by its worker, not yet reported when the state is captured
    state, eff = d.core.capture()
    assert _names(eff.events) == ["checkpoint"]
    state = ControllerState.from_dict(state.to_dict())
    fresh = make_core()
    eff, summary = fresh.restore(state, set(d.rows))
    assert eff.clear == [orphan], "a row written but never recorded is cleared"
    assert summary["redispatched_groups"] == len(state.in_flight)
    run = next(r for r in fresh.runs.values() if r.keys)
    assert sealed in run.keys.values()
    redo = fresh.resume()
    assert all(x.sibling not in run.keys for x in redo.dispatch if x.group_id == run.group_id)
    with pytest.raises(ValueError, match="lacks 1 rows the trainer checkpoint expects"):
        make_core().restore(state, set(d.rows) - {sealed})


def test_capture_mid_step_needs_rollback_and_restore_needs_a_fresh_core() -> None:
    d = Driver(make_core(min_groups=1))
    d.pump()
    first = d.outstanding[0].group_id
    for o in [o for o in d.outstanding if o.group_id == first]:
        d.seal(d.outstanding.index(o))
    _, plan = d.core.next_chunk()
    assert plan.kind == "chunk" and not plan.last_chunk
    with pytest.raises(RuntimeError, match="the open step still holds claims"):
        d.core.capture()
    state, eff = d.core.capture("rollback")
    assert _names(eff.events) == ["snapshot"] and state.rolled_back_groups == len(plan.group_ids)
    assert set(plan.group_ids) <= {g["group_id"] for g in state.replay_index["groups"]}
    with pytest.raises(RuntimeError, match="restore\\(\\) must run on a fresh core"):
        d.core.restore(state, set(d.rows))
    with pytest.raises(ValueError, match="controller state schema 1 is not 2"):
        ControllerState.from_dict({**state.to_dict(), "schema_version": 1})


def test_shutdown_ends_every_group_and_the_log_passes_the_final_check() -> None:
    d = Driver(make_core())
    d.pump()
    d.seal_all()
    d.train()
    d.pump()
    d.seal(0)
    d.finish()
    reasons = {(e.name, e.reason) for e in d.events if isinstance(e, (AbortEvent, EvictEvent))}
    assert ("abort", "shutdown") in reasons
    report = check_events(d.events, {"name": "in_order", "max_lookahead_versions": 1}, final=True)
    assert report.ok, report.format()
    assert d.rows == set(), "no row outlives the run"
    acc = d.core.ledger.accounting()
    assert acc.balanced and acc.live == 0


def test_a_worker_dead_for_good_gets_no_more_work_and_its_rollouts_move() -> None:
    d = Driver(make_core(failure=FailureBudget(max_infra_attempts=3, backoff_base_s=0.5, max_backoff_s=1.0)))
    d.pump()
    on_0 = {o.attempt for o in d.outstanding if o.worker == 0}
    assert on_0, "worker 0 had work"
    d.apply(d.core.worker_lost(0, "ActorDiedError"))
    fails = [e for e in d.events if isinstance(e, FailEvent)]
    assert len(fails) == len(on_0) and all(e.reason == "infra" for e in fails)
    assert all(e.extra["detail"] == "worker 0 is dead: ActorDiedError" for e in fails)
    moved = [o for o in d.outstanding if o.attempt not in on_0 and o.delay_s > 0]
    assert moved and {o.worker for o in moved} == {1}, "retries go to the live worker"
    for _ in range(8):  # everything dispatched from now on avoids worker 0
        d.seal(0)
        d.pump()
    assert {o.worker for o in d.outstanding if o.attempt not in on_0} == {1}
    assert d.core.worker_lost(0, "again").events == [], "a worker is lost once"
    d.apply(d.core.worker_lost(1, "ActorDiedError"))
    assert d.error is not None and "every generation worker is dead for good (workers [0, 1]" in str(d.error)
    assert "data.init_args.generation.max_worker_restarts" in str(d.error)


def test_workers_lost_with_their_node_fail_the_run_without_blaming_restarts() -> None:
    d = Driver(make_core())
    d.pump()
    d.apply(d.core.worker_lost(0, "worker 0 was on Ray node n1 (10.0.0.7), which left the Ray cluster",
                               restartable=False))
    assert d.error is None, "worker 1 carries on"
    d.apply(d.core.worker_lost(1, "worker 1 was on Ray node n1 (10.0.0.7), which left the Ray cluster",
                               restartable=False))
    assert d.error is not None
    assert str(d.error).endswith("which left the Ray cluster); add capacity and resume the run from its last "
                                 "checkpoint")
    assert "max_worker_restarts" not in str(d.error)


def test_a_sampler_without_buffer_checkpoints_captures_in_shadow_mode() -> None:
    """A custom sampler declaring ``supports_buffer_checkpoint = False``: the capture writes no replay index (mode
    shadow), and a restore re-offers nothing and warns; the dispatch cursor and counters carry over (the buffered
    groups' prompts are skipped this epoch, as the spec's shadow mode drops them)."""
    block = {"name": "custom", "target": "tests.sampler_plugins:NoReplay", "max_lookahead_versions": 1}
    d = Driver(make_core(block), block=block)
    d.pump()
    d.seal_all()
    d.train()
    d.pump()
    d.seal_all()  # completed, untrained groups in the buffer
    assert d.core.buffer.num_ready > 0
    state, _ = d.core.capture()
    assert state.mode == "shadow" and state.replay_index["groups"] == []
    authoritative = Driver(make_core())
    authoritative.pump()
    authoritative.seal_all()
    assert authoritative.core.capture()[0].mode == "authoritative"  # the built-in in_order sampler
    fresh = make_core(block)
    eff, summary = fresh.restore(ControllerState.from_dict(state.to_dict()), set(d.rows))
    assert any("does not support buffer checkpoints" in w for w in summary["warnings"])
    assert fresh.buffer.num_live == 0 and fresh.runs == {}
    assert eff.clear == []  # nothing of the snapshot is expected (the controller does not even load it)
    assert fresh.batch_index == d.core.batch_index and fresh.train_steps == d.core.train_steps
