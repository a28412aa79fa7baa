"""ReplayBuffer slot lifecycle (reference-behaviour section 2)."""

from __future__ import annotations

import pytest

from screl.data import CapacityError, GroupSlot, ReplayBuffer, ReplayBufferError


def _ready(buf: ReplayBuffer, prompt_id: int, sw: int, ts: int | None = None) -> str:
    gid = buf.reserve(prompt_id, sw, ts)
    buf.commit(gid, sw)
    return gid


def test_reserve_appends_unready_placeholder_in_dispatch_order() -> None:
    buf = ReplayBuffer()
    a = buf.reserve(0, start_weight=0, target_step=0)
    b = buf.reserve(1, start_weight=1)
    assert a != b
    assert buf.live_slots() == [
        GroupSlot(a, 0, 0, None, 0, False),
        GroupSlot(b, 1, 1, None, None, False),
    ]
    assert (buf.num_inflight, buf.num_ready, buf.num_buffered) == (2, 0, 2)


def test_reserve_with_given_id_and_duplicate_rejected() -> None:
    buf = ReplayBuffer()
    assert buf.reserve(3, 0, group_id="ledger-7") == "ledger-7"
    with pytest.raises(ReplayBufferError, match="'ledger-7' is already buffered"):
        buf.reserve(3, 0, group_id="ledger-7")


def test_fresh_ids_skip_a_given_id_that_mimics_them() -> None:
    buf = ReplayBuffer()
    buf.reserve(0, 0, group_id="g1")
    buf.reserve(1, 0)  # seq 1 -> "g1" is taken
    assert len({s.group_id for s in buf.live_slots()}) == 2


def test_commit_records_end_weight_and_flips_ready() -> None:
    buf = ReplayBuffer()
    gid = buf.reserve(0, 2)
    slot = buf.commit(gid, 3)
    assert slot == GroupSlot(gid, 0, 2, 3, None, True)
    assert buf.get(gid).ready


def test_commit_unknown_or_twice_errors_before_any_write() -> None:
    buf = ReplayBuffer()
    gid = _ready(buf, 0, 0)
    before = buf.state_dict()
    with pytest.raises(ReplayBufferError, match="cannot commit unknown group 'nope'"):
        buf.commit("nope", 0)
    with pytest.raises(ReplayBufferError, match="already committed"):
        buf.commit(gid, 5)
    assert buf.state_dict() == before


def test_commit_end_weight_below_start_rejected() -> None:
    buf = ReplayBuffer()
    gid = buf.reserve(0, 4)
    with pytest.raises(ReplayBufferError, match="end_weight=3 below its start_weight=4"):
        buf.commit(gid, 3)
    assert not buf.get(gid).ready


def test_dispatch_order_survives_out_of_order_commits() -> None:
    buf = ReplayBuffer()
    ids = [buf.reserve(i, 0) for i in range(4)]
    for gid in reversed(ids):
        buf.commit(gid, 1)
    assert [s.group_id for s in buf.live_slots()] == ids


def test_fail_removes_unready_attempt_and_frees_capacity() -> None:
    buf = ReplayBuffer(max_buffered_rollouts=1, max_inflight_prompts=1)
    gid = buf.reserve(0, 0)
    assert not buf.can_reserve()
    assert buf.fail(gid).group_id == gid
    assert buf.can_reserve() and buf.num_buffered == 0


def test_fail_of_committed_or_unknown_group_rejected() -> None:
    buf = ReplayBuffer()
    gid = _ready(buf, 0, 0)
    with pytest.raises(ReplayBufferError, match="cannot fail group .* already committed"):
        buf.fail(gid)
    with pytest.raises(ReplayBufferError, match="cannot fail unknown group 'x'"):
        buf.fail("x")


def test_retry_gets_fresh_id_same_stamp_and_keeps_its_permits() -> None:
    buf = ReplayBuffer(max_buffered_rollouts=1, max_inflight_prompts=1)
    first = buf.reserve(7, 0, target_step=3)
    second = buf.retry(first, start_weight=1)
    assert second != first and first not in buf
    assert buf.live_slots() == [GroupSlot(second, 7, 1, None, 3, False)]


def test_remove_checks_every_id_before_mutating() -> None:
    buf = ReplayBuffer()
    a = _ready(buf, 0, 0)
    with pytest.raises(ReplayBufferError, match=r"cannot remove \['zz'\]"):
        buf.remove([a, "zz"])
    assert a in buf
    assert buf.remove([]) == []
    assert [s.group_id for s in buf.remove([a])] == [a]


def test_capacity_is_enforced_and_claims_hold_it_until_release() -> None:
    buf = ReplayBuffer(max_buffered_rollouts=2)
    a, b = _ready(buf, 0, 0), _ready(buf, 1, 0)
    with pytest.raises(CapacityError, match="max_buffered_rollouts=2"):
        buf.reserve(2, 0)
    buf.claim_for_training([a])
    assert buf.num_buffered == 2 and buf.capacity_left == 0
    with pytest.raises(CapacityError, match="2 groups already hold"):
        buf.reserve(2, 0)
    buf.release_training_claims([a])
    assert buf.capacity_left == 1
    buf.reserve(2, 0)
    assert b in buf


def test_inflight_bound_counts_only_unready() -> None:
    buf = ReplayBuffer(max_inflight_prompts=1)
    a = buf.reserve(0, 0)
    with pytest.raises(CapacityError, match="max_inflight_prompts=1"):
        buf.reserve(1, 0)
    buf.commit(a, 0)
    assert buf.inflight_left == 1
    buf.reserve(1, 0)


def test_claim_moves_out_of_live_index_but_stays_in_state() -> None:
    buf = ReplayBuffer()
    a, b = _ready(buf, 0, 0), _ready(buf, 1, 0)
    buf.claim_for_training([b])
    assert [s.group_id for s in buf.live_slots()] == [a]
    assert [s.group_id for s in buf.claimed_slots()] == [b]
    state = buf.state_dict()
    assert [g["group_id"] for g in state["claims"]] == [b]


def test_claim_rejects_unready_claimed_unknown_and_repeats() -> None:
    buf = ReplayBuffer()
    a = _ready(buf, 0, 0)
    u = buf.reserve(1, 0)
    with pytest.raises(ReplayBufferError, match=r"not committed \['" + u):
        buf.claim_for_training([a, u])
    assert a in [s.group_id for s in buf.live_slots()]
    buf.claim_for_training([a])
    with pytest.raises(ReplayBufferError, match=r"already claimed \['" + a):
        buf.claim_for_training([a])
    with pytest.raises(ReplayBufferError, match=r"unknown \['q'\]"):
        buf.claim_for_training(["q"])
    with pytest.raises(ReplayBufferError, match="repeated"):
        buf.claim_for_training([u, u])


def test_release_must_equal_claim_set() -> None:
    buf = ReplayBuffer()
    a, b = _ready(buf, 0, 0), _ready(buf, 1, 0)
    buf.claim_for_training([a, b])
    with pytest.raises(ReplayBufferError, match=r"unknown \['x'\], unreleased \['" + b):
        buf.release_training_claims([a, "x"])
    assert buf.num_claimed == 2
    assert [s.group_id for s in buf.release_training_claims([b, a])] == [a, b]
    assert buf.num_buffered == 0


def test_rollback_returns_claims_to_dispatch_position() -> None:
    buf = ReplayBuffer()
    a, b, c = (_ready(buf, i, 0) for i in range(3))
    buf.claim_for_training([a, c])
    assert buf.rollback_training_claims() == [a, c]
    assert [s.group_id for s in buf.live_slots()] == [a, b, c]


def test_commit_or_fail_of_claimed_group_rejected() -> None:
    buf = ReplayBuffer()
    a = _ready(buf, 0, 0)
    buf.claim_for_training([a])
    with pytest.raises(ReplayBufferError, match="claimed for training"):
        buf.commit(a, 1)
    with pytest.raises(ReplayBufferError, match="not live slots"):
        buf.remove([a])


def test_count_for_target_step_includes_unready_reservations() -> None:
    buf = ReplayBuffer()
    _ready(buf, 0, 0, ts=1)
    buf.reserve(1, 0, target_step=1)
    buf.reserve(2, 0, target_step=2)
    assert buf.count_for_target_step(1) == 2
    assert buf.count_for_target_step(5) == 0


class TestPromotion:
    def test_furthest_ahead_ready_group_lends(self) -> None:
        buf = ReplayBuffer()
        _ready(buf, 0, 0, ts=2)
        far = _ready(buf, 1, 0, ts=4)
        _ready(buf, 2, 0, ts=4)  # tie: the first in order lends
        assert buf.promote_ready_group(to_target_step=1) == 4
        assert buf.get(far).target_step == 1

    def test_unready_unstamped_and_not_later_never_lend(self) -> None:
        buf = ReplayBuffer()
        buf.reserve(0, 0, target_step=5)
        _ready(buf, 1, 0, ts=None)
        _ready(buf, 2, 0, ts=3)
        assert buf.promote_ready_group(to_target_step=3) is None
        assert ReplayBuffer().promote_ready_group(0) is None

    def test_two_borrows_take_two_distinct_groups(self) -> None:
        buf = ReplayBuffer()
        a, b = _ready(buf, 0, 0, ts=3), _ready(buf, 1, 0, ts=3)
        assert buf.promote_ready_group(1) == 3
        assert buf.promote_ready_group(1) == 3
        assert {buf.get(a).target_step, buf.get(b).target_step} == {1}
        assert buf.promote_ready_group(1) is None


class TestStateDict:
    def test_round_trip_keeps_ready_groups_claims_end_weight_and_stamp(self) -> None:
        buf = ReplayBuffer(max_buffered_rollouts=8)
        a = _ready(buf, 0, 0, ts=0)
        buf.reserve(1, 0, target_step=0)  # unready: not persisted
        c = buf.reserve(2, 1, target_step=1)
        buf.commit(c, 2)
        d = _ready(buf, 3, 1)
        buf.claim_for_training([d])
        state = buf.state_dict()
        fresh = ReplayBuffer(max_buffered_rollouts=8)
        fresh.load_state_dict(state)
        assert fresh.live_slots() == [buf.get(a), buf.get(c)]
        assert fresh.claimed_slots() == [buf.get(d)]
        assert fresh.state_dict() == state
        # fresh ids continue past the saved sequence: no collision with restored ids
        assert fresh.reserve(9, 2) == buf.reserve(9, 2)

    def test_load_needs_empty_buffer(self) -> None:
        buf = ReplayBuffer()
        _ready(buf, 0, 0)
        with pytest.raises(ReplayBufferError, match="needs an empty buffer"):
            buf.load_state_dict(buf.state_dict())

    def test_load_over_capacity_raises_naming_the_fix(self) -> None:
        buf = ReplayBuffer()
        for i in range(3):
            _ready(buf, i, 0)
        with pytest.raises(CapacityError, match="resume with max_buffered_rollouts >= 3"):
            ReplayBuffer(max_buffered_rollouts=2).load_state_dict(buf.state_dict())

    def test_load_rejects_bad_rows_before_any_change(self) -> None:
        buf = ReplayBuffer()
        _ready(buf, 0, 0)
        state = buf.state_dict()
        dup = {**state, "groups": state["groups"] * 2}
        fresh = ReplayBuffer()
        with pytest.raises(ReplayBufferError, match="more than once"):
            fresh.load_state_dict(dup)
        bad = {**state, "groups": [{**state["groups"][0], "ready": False}]}
        with pytest.raises(ReplayBufferError, match="is not a committed group"):
            fresh.load_state_dict(bad)
        with pytest.raises(ReplayBufferError, match="lacks keys"):
            fresh.load_state_dict({**state, "groups": [{"group_id": "x"}]})
        with pytest.raises(ReplayBufferError, match="schema_version"):
            fresh.load_state_dict({**state, "schema_version": 99})
        assert fresh.num_buffered == 0


def test_invalid_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="max_buffered_rollouts must be >= 1, got 0"):
        ReplayBuffer(max_buffered_rollouts=0)
    buf = ReplayBuffer()
    with pytest.raises(ValueError, match="start_weight must be >= 0, got -1"):
        buf.reserve(0, -1)
    with pytest.raises(ValueError, match="target_step must be an integer, got True"):
        buf.reserve(0, 0, target_step=True)
    with pytest.raises(ReplayBufferError, match="unknown group 'u'"):
        buf.get("u")
