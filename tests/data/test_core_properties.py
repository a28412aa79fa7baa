"""Property tests on the real ``RolloutCore``: random interleavings of worker reports (seals, data and infra
failures), train steps, checkpoints and crash-restores, for every sampler and both recovery granularities.
Every log must pass ``check_events(final=True)`` once the run is shut down, and no row may outlive it."""

from __future__ import annotations

import copy
from typing import Any

import pytest
from _core_driver import Driver, make_core
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from screl.data import GatedSampler, GroupState, SelectEvent, TrainStepEvent, check_events
from screl.data.core_types import Dispatch, FailureBudget, RolloutFailure
from screl.data.reserve import ReservePolicy

SAMPLERS: list[dict[str, Any]] = [
    {"name": "in_order", "max_lookahead_versions": 0},
    {"name": "in_order", "max_lookahead_versions": 2},
    {"name": "weight_fifo", "max_staleness_versions": 0},
    {"name": "weight_fifo", "max_staleness_versions": 2},
    {"name": "ready_first", "max_staleness_versions": 1},
    {"name": "windowed", "max_staleness_versions": 0},
    {"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": True},
    {"name": "windowed", "max_staleness_versions": 1, "over_sampling_ratio": 1.5},
]
LENIENT = FailureBudget(max_infra_attempts=3, max_data_attempts=2, max_skipped_prompts=10_000,
                        max_consecutive_dropped_prompts=10_000, min_step_batch_fraction=0.01)
CAP = 8

OPS: tuple[str, ...] = ("pump",) * 3 + ("seal",) * 10 + ("train",) * 4 + ("data_fail", "infra_fail")
OPS += ("save", "crash_and_resume")
ops_strategy = st.lists(st.tuples(st.sampled_from(OPS), st.integers(0, 40)), max_size=90)
PROPS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _driver(block: dict[str, Any], granularity: str, dynamic: bool = False) -> Driver:
    reserve = ReservePolicy(enabled=True, size=2, max_per_slot=2) if dynamic else None
    core = make_core(block, granularity=granularity, failure=LENIENT, cap=CAP, dynamic=dynamic, reserve=reserve)
    return Driver(core, block=block, reward_of=_sometimes_agreeing if dynamic else None)


def _sometimes_agreeing(d: Dispatch, k: int) -> float:
    """Every fourth prompt's siblings always agree (filtered); the others agree when the ops say so."""
    return 1.0 if d.prompt_id % 4 == 0 else float((k + d.sibling) % 2)


def check_invariants(d: Driver) -> None:
    core, buf = d.core, d.core.buffer
    acc = core.ledger.accounting()
    assert buf.num_buffered <= CAP and acc.balanced
    assert (acc.generating, acc.finalized, acc.claimed) == (len(core.runs), buf.num_ready, buf.num_claimed)
    assert set(core.ledger.group_ids(GroupState.GENERATING)) == set(core.runs)
    assert set(core.attempts) <= {o.attempt for o in d.outstanding}, "a live attempt no worker holds"
    for gid in core.ledger.group_ids(GroupState.FINALIZED) + core.ledger.group_ids(GroupState.CLAIMED):
        assert set(core.group_keys[gid]) <= d.rows, f"committed group {gid} lost a row"
    for run in core.runs.values():
        assert set(run.keys.values()) <= d.rows
    if isinstance(core.sampler, GatedSampler):
        assert core.sampler.dispatch_index <= core.trainer_version + core.sampler.peak_window + 1
    state = buf.state_dict()
    core.ledger.check_replay_index(g["group_id"] for g in state["groups"] + state["claims"])


def run_ops(d: Driver, ops: list[tuple[str, int]]) -> None:
    for name, arg in ops:
        if d.error is not None:
            return
        try:
            getattr(d, name)(arg)
        except RuntimeError as err:  # a step lost to drops or rollout exhausted: the run stops, like the shell
            assert "lost all" in str(err) or "exhausted" in str(err), err
            d.error = err
            return
        check_invariants(d)


@pytest.mark.parametrize("block", SAMPLERS, ids=lambda b: "-".join(str(v) for v in b.values()))
@PROPS
@given(ops=ops_strategy, granularity=st.sampled_from(["sibling", "prompt_group"]))
def test_random_interleavings_pass_the_final_check_and_leave_no_row(
    block: dict[str, Any], ops: list[tuple[str, int]], granularity: str
) -> None:
    _run_to_the_end_and_check(_driver(block, granularity), block, ops)


def _run_to_the_end_and_check(d: Driver, block: dict[str, Any], ops: list[tuple[str, int]]) -> None:
    """Play ``ops``, shut down, and check the log (final), the rows and the ledger."""
    run_ops(d, ops)
    if d.error is not None and not isinstance(d.error, RolloutFailure):
        return
    d.finish()
    report = check_events([e.to_json() for e in d.events], block, max_buffered_rollouts=CAP, final=True)
    assert report.ok, report.format()
    assert d.rows == set(), f"rows outlived the run: {sorted(d.rows)[:4]}"
    assert d.core.ledger.accounting().live == 0


@pytest.mark.parametrize("block", [SAMPLERS[1], SAMPLERS[3], SAMPLERS[7]], ids=lambda b: b["name"])
@PROPS
@given(ops=ops_strategy)
def test_dynamic_sampling_with_a_reserve_passes_the_final_check_and_leaves_no_row(
    block: dict[str, Any], ops: list[tuple[str, int]]
) -> None:
    _run_to_the_end_and_check(_driver(block, "sibling", dynamic=True), block, ops)


@pytest.mark.parametrize(("block", "dynamic"), [(SAMPLERS[1], False), (SAMPLERS[3], False), (SAMPLERS[5], False),
                                                (SAMPLERS[7], False), (SAMPLERS[1], True)],
                         ids=["in_order", "weight_fifo", "windowed", "windowed-cap", "in_order-dynamic"])
@PROPS
@given(prefix=ops_strategy, suffix=ops_strategy)
def test_state_round_trip_reproduces_identical_future_decisions(
    block: dict[str, Any], dynamic: bool, prefix: list[tuple[str, int]], suffix: list[tuple[str, int]]
) -> None:
    d = _driver(block, "sibling", dynamic)
    run_ops(d, prefix)
    if d.error is not None or d.core.step_claims:
        return
    d.seal_all()
    if d.error is not None:
        return
    twin = copy.deepcopy(d)
    twin.checkpoint = None
    twin.save()
    twin.crash_and_resume()
    suffix = [(name, k) for name, k in suffix if name not in ("save", "crash_and_resume")]
    mark, twin_mark = len(d.events), len(twin.events)
    run_ops(d, suffix)
    run_ops(twin, suffix)
    assert [e.to_json() for e in twin.events[twin_mark:]] == [e.to_json() for e in d.events[mark:]]
    assert twin.core.buffer.state_dict() == d.core.buffer.state_dict()


@PROPS
@given(ops=ops_strategy, k=st.integers(0, 1000))
def test_checker_catches_a_group_trained_twice(ops: list[tuple[str, int]], k: int) -> None:
    d = _driver(SAMPLERS[1], "sibling")
    run_ops(d, ops)
    trained = [g for e in d.events if isinstance(e, TrainStepEvent) for g in e.group_ids]
    if not trained or d.error is not None:
        return
    replay = TrainStepEvent(step=d.core.trainer_version, group_ids=(trained[k % len(trained)],))
    assert "trained-twice" in {v.rule for v in check_events([*d.events, replay], SAMPLERS[1]).violations}


@PROPS
@given(ops=ops_strategy)
def test_checker_catches_an_in_order_select_off_step(ops: list[tuple[str, int]]) -> None:
    d = _driver(SAMPLERS[1], "sibling")
    run_ops(d, ops)
    ahead = [s for s in d.core.buffer.live_slots() if s.ready and s.target_step != d.core.trainer_version]
    if not ahead or d.error is not None:
        return
    bad = SelectEvent(trainer_version=d.core.trainer_version, group_ids=(ahead[0].group_id,))
    assert "select-rule" in {v.rule for v in check_events([*d.events, bad], SAMPLERS[1]).violations}
