"""Staleness samplers (reference-behaviour section 1), worked examples A-D included."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from screl.data import (
    Admission,
    GroupSlot,
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    ReplayBuffer,
    SamplerConfigError,
    WeightFifoSampler,
    WindowedSampler,
    WindowedSamplerConfig,
    call_admit,
    create_sampler,
    lookahead_schedule,
    required_buffer_capacity,
    sampler_supports_buffer_checkpoint,
    sampler_supports_training_claims,
)


def slot(gid: str, sw: int, ready: bool = True, ts: int | None = None) -> GroupSlot:
    return GroupSlot(
        gid, prompt_id=0, start_weight=sw, end_weight=sw if ready else None, target_step=ts, ready=ready
    )


ALL_BUILTINS = [
    {"name": "in_order", "max_lookahead_versions": 1},
    {"name": "weight_fifo", "max_staleness_versions": 1},
    {"name": "ready_first", "max_staleness_versions": 1},
    {"name": "windowed", "max_staleness_versions": 1},
]


@pytest.mark.parametrize("block", ALL_BUILTINS, ids=lambda b: b["name"])
def test_builtins_satisfy_protocol_and_declare_flags(block: dict[str, object]) -> None:
    sampler = create_sampler(block)
    assert isinstance(sampler, PromptGroupSampler)
    assert sampler_supports_buffer_checkpoint(type(sampler))
    assert sampler_supports_training_claims(type(sampler))


def test_create_sampler_takes_typed_config_too() -> None:
    sampler = create_sampler(WindowedSamplerConfig(max_staleness_versions=3, sample_freshest_first=True))
    assert isinstance(sampler, WindowedSampler)
    assert (sampler.max_staleness_versions, sampler.sample_freshest_first) == (3, True)


def test_create_sampler_reports_bad_block() -> None:
    with pytest.raises(SamplerConfigError, match="unknown sampler 'fastest'"):
        create_sampler({"name": "fastest"})
    with pytest.raises(SamplerConfigError, match="max_staleness_versions: must be >= 0, got -1"):
        create_sampler({"name": "windowed", "max_staleness_versions": -1})
    with pytest.raises(
        SamplerConfigError, match="max_lookahead_versions: is not a knob of the 'windowed' sampler"
    ):
        create_sampler({"name": "windowed", "max_lookahead_versions": 1})


# ------------------------------------------------------------------------------ gated admission


def test_in_order_stamps_consecutive_dispatch_indices() -> None:
    s = InOrderSampler(max_lookahead_versions=5)
    assert s.admit(10) == Admission(True, 0)
    assert s.admit(10) == Admission(True, 1)
    assert s.dispatch_index == 1


def test_weight_fifo_window_zero_admits_one_batch() -> None:
    s = WeightFifoSampler(max_staleness_versions=0)
    assert s.admit(0) == Admission(True, None)
    assert s.admit(0) == Admission(False, None)
    assert s.dispatch_index == 0  # a refused admit does not move the cursor


def test_ready_first_window_one_admits_two_then_one_per_version() -> None:
    s = ReadyFirstSampler(max_staleness_versions=1)
    assert [s.admit(0).allowed for _ in range(3)] == [True, True, False]
    assert [s.admit(1).allowed for _ in range(2)] == [True, False]


def test_windowed_is_ungated_without_a_cap() -> None:
    s = WindowedSampler(max_staleness_versions=0)
    assert all(s.admit(0).allowed for _ in range(50))
    assert s.dispatch_index == 49


def test_resume_seeds_cursor() -> None:
    s = InOrderSampler(max_lookahead_versions=0)
    s.set_dispatch_index(7)
    assert s.dispatch_index == 6
    assert s.admit(7) == Admission(True, 7)
    assert s.admit(7) == Admission(False, None)
    assert s.admit(8) == Admission(True, 8)


def test_resume_weight_fifo_window_zero_admits_one_batch_then_blocks() -> None:
    s = WeightFifoSampler(max_staleness_versions=0)
    s.set_dispatch_index(7)
    assert [s.admit(7).allowed for _ in range(2)] == [True, False]


def test_set_dispatch_index_zero_is_the_fresh_seed_and_negative_is_rejected() -> None:
    s = InOrderSampler()
    s.set_dispatch_index(0)
    assert s.dispatch_index == -1
    with pytest.raises(ValueError, match="resume step >= 0, got -1"):
        s.set_dispatch_index(-1)
    with pytest.raises(ValueError, match="dispatch index must be an integer >= -1, got -2"):
        s.restore_dispatch_index(-2)


def test_set_gate_window_retunes_and_rejects_negative() -> None:
    s = InOrderSampler(max_lookahead_versions=0)
    s.set_gate_window(2)
    assert [s.admit(0).allowed for _ in range(4)] == [True, True, True, False]
    with pytest.raises(ValueError, match="gate window must be an integer >= 0, got -1"):
        s.set_gate_window(-1)


def test_admit_rejects_negative_version() -> None:
    with pytest.raises(ValueError, match="trainer_version must be an integer >= 0, got -1"):
        InOrderSampler().admit(-1)


@pytest.mark.parametrize(
    ("block", "expected"),
    [
        ({"name": "in_order", "max_lookahead_versions": 2}, 12),
        ({"name": "in_order", "max_lookahead_versions": 1, "warmup_lookahead_versions": 3}, 16),
        ({"name": "weight_fifo", "max_staleness_versions": 2}, 12),
        ({"name": "ready_first", "max_staleness_versions": 0}, 4),
        ({"name": "windowed", "max_staleness_versions": 2}, 4),
    ],
)
def test_required_buffer_capacity_matches_config_function(block: dict[str, object], expected: int) -> None:
    sampler = create_sampler(block)
    assert sampler.required_buffer_capacity(4) == expected
    from screl.data import parse_sampler_config

    assert required_buffer_capacity(parse_sampler_config(block), 4) == expected


# ------------------------------------------------------------------------------ select bounds


@pytest.mark.parametrize("block", ALL_BUILTINS, ids=lambda b: b["name"])
def test_select_bounds_checked(block: dict[str, object]) -> None:
    sampler = create_sampler(block)
    with pytest.raises(ValueError, match="min_groups >= 1, got min_groups=0"):
        sampler.select([], 0, 0, 1)
    with pytest.raises(ValueError, match="max_groups >= min_groups, got 1 < 2"):
        sampler.select([], 0, 2, 1)


# ------------------------------------------------------------------------------ in_order


def test_worked_example_a_in_order() -> None:
    """reference-behaviour 1.3, worked example A (W=1, two prompts per step)."""
    s, buf = InOrderSampler(max_lookahead_versions=1), ReplayBuffer()
    t = 0
    batch0 = s.admit(t)
    assert batch0 == Admission(True, 0)
    p0, p1 = (buf.reserve(i, t, batch0.target_step) for i in range(2))
    batch1 = s.admit(t)
    assert batch1 == Admission(True, 1)
    p2, p3 = (buf.reserve(i, t, batch1.target_step) for i in range(2, 4))
    assert s.admit(t) == Admission(False, None)  # 1 >= 0 + 1
    for gid in (p0, p2, p3):
        buf.commit(gid, 0)
    assert s.select(buf.live_slots(), t, 2, 2) is None  # only p0 is eligible
    assert s.select(buf.live_slots(), t, 1, 2) == [p0]  # a streaming chunk
    buf.claim_for_training([p0])
    buf.commit(p1, 0)
    assert s.select(buf.live_slots(), t, 1, 1) == [p1]
    buf.claim_for_training([p1])
    buf.release_training_claims([p0, p1])
    t = 1  # step 0 closes
    assert s.admit(t) == Admission(True, 2)
    assert s.select(buf.live_slots(), t, 2, 2) == [p2, p3]


def test_in_order_ignores_weight_and_never_selects_a_later_stamp() -> None:
    s = InOrderSampler()
    assert s.select([slot("far", 100, ts=5)], 5, 1, 1) == ["far"]
    assert s.select([slot("next", 5, ts=6)], 5, 1, 1) is None


def test_in_order_evicts_by_target_step_never_unready() -> None:
    s = InOrderSampler(max_lookahead_versions=1)
    slots = [slot("keep", 0, ts=5), slot("old", 5, ts=4), slot("old_unready", 0, ready=False, ts=3)]
    assert s.evict(slots, 5) == ["old"]


def test_in_order_never_aborts_inflight() -> None:
    assert not InOrderSampler().should_abort_inflight(0, 100)


def test_in_order_warmup_below_steady_rejected() -> None:
    with pytest.raises(
        ValueError, match=r"must be greater than or equal to max_lookahead_versions \(1 < 2\)"
    ):
        InOrderSampler(max_lookahead_versions=2, warmup_lookahead_versions=1)


@pytest.mark.parametrize(("t", "expected"), [(0, 5), (1, 4), (3, 2), (4, 1), (9, 1)])
def test_lookahead_schedule_table(t: int, expected: int) -> None:
    assert (
        lookahead_schedule(t, max_lookahead=1, warmup_lookahead=5, policy_training_start_step=4) == expected
    )


def test_lookahead_schedule_floor_and_defaults() -> None:
    assert lookahead_schedule(2, max_lookahead=3, warmup_lookahead=2, policy_training_start_step=100) == 3
    assert lookahead_schedule(0, max_lookahead=2, warmup_lookahead=None, policy_training_start_step=4) == 2
    assert lookahead_schedule(0, max_lookahead=2, warmup_lookahead=6, policy_training_start_step=None) == 2


def test_in_order_retune_lookahead_widens_gate_during_warmup() -> None:
    s = InOrderSampler(max_lookahead_versions=1, warmup_lookahead_versions=5)
    assert s.retune_lookahead(0, policy_training_start_step=4) == 5
    assert [s.admit(0).allowed for _ in range(7)] == [True] * 6 + [False]
    assert s.retune_lookahead(4, policy_training_start_step=4) == 1
    assert s.gate_window == 1


# ------------------------------------------------------------------------------ weight_fifo


def test_worked_example_b_weight_fifo() -> None:
    """reference-behaviour 1.4, worked example B (S=2, T=3)."""
    s = WeightFifoSampler(max_staleness_versions=2)
    slots = [slot("a", 0), slot("b", 1, ready=False), slot("c", 1), slot("d", 2), slot("e", 3)]
    assert s.evict(slots, 3) == ["a"]
    rest = slots[1:]
    assert s.select(rest, 3, 1, 4) == ["c"]
    assert s.select(rest, 3, 2, 4) is None  # waits for b, does not skip ahead to d, e


def test_weight_fifo_drains_oldest_weight_first_and_waits_on_it() -> None:
    s = WeightFifoSampler(max_staleness_versions=2)
    slots = [slot("w4a", 4), slot("w5", 5), slot("w4b", 4)]
    assert s.select(slots, 5, 1, 4) == ["w4a", "w4b"]
    assert s.select([slot("w4", 4, ready=False), slot("w5", 5)], 5, 1, 4) is None


def test_weight_fifo_only_future_weights_is_none() -> None:
    assert WeightFifoSampler(max_staleness_versions=1).select([slot("f", 4)], 3, 1, 1) is None


def test_weight_fifo_never_aborts() -> None:
    assert not WeightFifoSampler(max_staleness_versions=0).should_abort_inflight(0, 10)


# ------------------------------------------------------------------------------ ready_first


def test_worked_example_c_ready_first() -> None:
    """reference-behaviour 1.5, worked example C (S=1, T=3)."""
    s = ReadyFirstSampler(max_staleness_versions=1)
    slots = [slot("old", 1), slot("current", 3), slot("middle", 2), slot("future", 4)]
    assert s.select(slots, 3, 3, 3) == ["old", "current", "middle"]


def test_ready_first_keeps_stragglers_and_never_evicts() -> None:
    s = ReadyFirstSampler(max_staleness_versions=1)
    slots = [slot("straggler", 0)]
    assert s.evict(slots, 5) == []
    assert s.select(slots, 5, 1, 1) == ["straggler"]
    assert not s.should_abort_inflight(0, 5)


# ------------------------------------------------------------------------------ windowed


def _example_d() -> list[GroupSlot]:
    return [slot("a", 1), slot("b", 2), slot("c", 2, ready=False), slot("d", 3), slot("e", 3)]


def test_worked_example_d_windowed() -> None:
    """reference-behaviour 1.6, worked example D (S=1, T=3)."""
    s = WindowedSampler(max_staleness_versions=1)
    slots = _example_d()
    assert s.evict(slots, 3) == ["a"]
    rest = slots[1:]
    assert s.select(rest, 3, 2, 3) == ["b", "d", "e"]
    assert s.select(rest, 3, 4, 4) is None
    fresh = WindowedSampler(max_staleness_versions=1, sample_freshest_first=True)
    assert fresh.select(rest, 3, 1, 2) == ["d", "e"]
    assert s.should_abort_inflight(1, 3) and not s.should_abort_inflight(2, 3)


def test_windowed_evict_skips_unready_stale() -> None:
    s = WindowedSampler(max_staleness_versions=1)
    assert s.evict([slot("stale_unready", 0, ready=False), slot("stale", 0)], 5) == ["stale"]


def test_windowed_abort_only_below_window() -> None:
    s = WindowedSampler(max_staleness_versions=2)
    assert s.should_abort_inflight(2, 5) and not s.should_abort_inflight(3, 5)


def test_windowed_freshest_first_ties_keep_dispatch_order() -> None:
    s = WindowedSampler(max_staleness_versions=2, sample_freshest_first=True)
    slots = [slot("x1", 1), slot("y2", 2), slot("x2", 2), slot("z3", 3)]
    assert s.select(slots, 3, 1, 4) == ["z3", "y2", "x2", "x1"]


def test_windowed_over_sampling_cap() -> None:
    s = create_sampler({"name": "windowed", "over_sampling_ratio": 1.5}, groups_per_step=4)
    assert isinstance(s, WindowedSampler) and s.outstanding_cap == 6
    assert s.admit(0, outstanding_groups=0).allowed
    assert s.admit(0, outstanding_groups=2).allowed  # 2 + 4 <= 6
    assert s.admit(0, outstanding_groups=3) == Admission(False, None)
    assert s.dispatch_index == 1
    with pytest.raises(ValueError, match="needs admit\\(..., outstanding_groups=N\\)"):
        s.admit(0)


def test_windowed_over_sampling_needs_groups_per_step() -> None:
    with pytest.raises(ValueError, match="needs groups_per_step >= 1"):
        create_sampler({"name": "windowed", "over_sampling_ratio": 2.0})
    with pytest.raises(ValueError, match="over_sampling_ratio must be >= 1.0, got 0.5"):
        WindowedSampler(over_sampling_ratio=0.5, groups_per_step=2)


def test_call_admit_passes_outstanding_only_when_accepted() -> None:
    s = create_sampler({"name": "windowed", "over_sampling_ratio": 1.0}, groups_per_step=2)
    assert not call_admit(s, 0, outstanding_groups=1).allowed
    assert call_admit(s, 0, outstanding_groups=0).allowed


# ------------------------------------------------------------------------------ state


@pytest.mark.parametrize("block", ALL_BUILTINS, ids=lambda b: b["name"])
def test_state_round_trip_continues_identically(block: dict[str, object]) -> None:
    a = create_sampler(block)
    for t in (0, 0, 1):
        a.admit(t)
    b = create_sampler(block)
    b.load_state_dict(a.state_dict())
    assert [a.admit(t) for t in (1, 1, 2, 2, 3)] == [b.admit(t) for t in (1, 1, 2, 2, 3)]


def test_in_order_state_keeps_retuned_window() -> None:
    a = InOrderSampler(max_lookahead_versions=1, warmup_lookahead_versions=4)
    a.retune_lookahead(0, policy_training_start_step=10)
    b = InOrderSampler(max_lookahead_versions=1, warmup_lookahead_versions=4)
    b.load_state_dict(a.state_dict())
    assert b.gate_window == 4


def test_load_state_from_other_sampler_rejected() -> None:
    with pytest.raises(ValueError, match="saved by the 'windowed' sampler; this run uses 'in_order'"):
        InOrderSampler().load_state_dict(WindowedSampler().state_dict())


# ------------------------------------------------------------------------------ custom


@pytest.fixture
def custom_path() -> Iterator[None]:
    import sys

    here = os.path.dirname(__file__)
    sys.path.insert(0, here)
    try:
        yield
    finally:
        sys.path.remove(here)
        sys.modules.pop("_custom_samplers", None)


def test_custom_sampler_is_imported_with_kwargs(custom_path: None) -> None:
    s = create_sampler({"name": "custom", "target": "_custom_samplers:NewestFirst", "limit": 1})
    assert type(s).__name__ == "NewestFirst" and s.limit == 1  # type: ignore[attr-defined]
    assert s.select([slot("o", 1), slot("n", 3)], 3, 1, 5) == ["n"]
    s.set_dispatch_index(4)
    assert s.admit(4) == Admission(True, None)


def test_custom_plain_protocol_class_and_call_admit(custom_path: None) -> None:
    s = create_sampler({"name": "custom", "target": "_custom_samplers:PlainProtocol"})
    assert call_admit(s, 0, outstanding_groups=5).allowed
    assert not sampler_supports_buffer_checkpoint(type(s))


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("no_colon", SamplerConfigError, "must look like 'package.module:ClassName', got 'no_colon'"),
        ("screl_missing_mod:X", SamplerConfigError, "cannot import module 'screl_missing_mod'"),
        ("_custom_samplers:Nope", SamplerConfigError, "has no class 'Nope'"),
        ("_custom_samplers:NOT_A_CLASS", SamplerConfigError, "has no class 'NOT_A_CLASS'"),
        ("_custom_samplers:MissingSelect", TypeError, r"missing \['select', 'evict'"),
        ("_custom_samplers:InheritsCheckpointFlag", TypeError, "must declare `supports_buffer_checkpoint"),
    ],
)
def test_custom_target_errors(custom_path: None, target: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        create_sampler({"name": "custom", "target": target})


def test_custom_bad_kwargs_named(custom_path: None) -> None:
    with pytest.raises(
        TypeError, match="cannot construct custom sampler '_custom_samplers:NewestFirst' with kwargs"
    ):
        create_sampler({"name": "custom", "target": "_custom_samplers:NewestFirst", "bogus": 1})


def test_supports_flags_must_be_declared_on_the_class_itself() -> None:
    class Sub(InOrderSampler):
        pass

    class Declared(InOrderSampler):
        supports_buffer_checkpoint = True
        supports_training_claims = False

    assert not sampler_supports_buffer_checkpoint(Sub)
    assert sampler_supports_buffer_checkpoint(Declared)
    assert not sampler_supports_training_claims(Declared)
