"""RolloutLedger: sibling/group ownership, granularity, restart plans, accounting."""

from __future__ import annotations

import json

import pytest

from screl.data import (
    Granularity,
    GroupState,
    LedgerError,
    RecoveryPolicy,
    RolloutLedger,
    SiblingState,
    StaleAttemptError,
)


def _states(ledger: RolloutLedger, gid: str) -> list[str]:
    return [s.state.value for s in ledger.group(gid).siblings]


def _seal_all(ledger: RolloutLedger, gid: str) -> None:
    for i in ledger.pending_siblings(gid):
        ledger.seal(gid, i, ledger.dispatch(gid, i))


def test_reserve_creates_reserved_siblings_all_pending() -> None:
    ledger = RolloutLedger()
    assert (
        ledger.reserve("g0", prompt_id=3, num_generations=4, start_weight=0, target_step=0)
        is Granularity.SIBLING
    )
    assert _states(ledger, "g0") == ["reserved"] * 4
    assert ledger.pending_siblings("g0") == [0, 1, 2, 3]
    assert ledger.redispatch_plan() == {"g0": [0, 1, 2, 3]}


def test_reserve_twice_and_bad_generations_rejected() -> None:
    ledger = RolloutLedger()
    ledger.reserve("g0", 0, 2, start_weight=0)
    with pytest.raises(LedgerError, match="'g0' is already in the ledger"):
        ledger.reserve("g0", 0, 2, start_weight=0)
    with pytest.raises(ValueError, match="num_generations must be an integer >= 1, got 0"):
        ledger.reserve("g1", 0, 0, start_weight=0)


def test_sibling_lifecycle_and_full_group_lifecycle() -> None:
    ledger = RolloutLedger()
    ledger.reserve("g", 0, 2, start_weight=0)
    a0 = ledger.dispatch("g", 0)
    assert a0 == "g_g0_a1"
    ledger.seal("g", 0, a0)
    ledger.seal("g", 0, a0)  # a duplicate identical seal is a no-op
    with pytest.raises(LedgerError, match="siblings \\[1\\] are not sealed"):
        ledger.finalize("g")
    ledger.seal("g", 1, ledger.dispatch("g", 1))
    assert ledger.finalizable() == ["g"]
    ledger.finalize("g")
    ledger.claim(["g"])
    ledger.apply(["g"])
    ledger.retire(["g"])
    acc = ledger.accounting()
    assert (acc.reserved, acc.trained, acc.live, acc.balanced) == (1, 1, 0, True)
    assert "g" not in ledger


def test_seal_of_stale_or_conflicting_attempt_refused() -> None:
    ledger = RolloutLedger()
    ledger.reserve("g", 0, 1, start_weight=0)
    first = ledger.dispatch("g", 0)
    ledger.fail("g", 0, first)
    second = ledger.dispatch("g", 0)
    with pytest.raises(StaleAttemptError, match="cannot seal attempt 'g_g0_a1'.*live attempt 'g_g0_a2'"):
        ledger.seal("g", 0, first)
    ledger.seal("g", 0, second)
    with pytest.raises(StaleAttemptError, match="sibling 0 of group 'g' is sealed"):
        ledger.seal("g", 0, first)


def test_dispatch_of_inflight_or_sealed_sibling_refused() -> None:
    ledger = RolloutLedger()
    ledger.reserve("g", 0, 2, start_weight=0)
    ledger.dispatch("g", 0)
    with pytest.raises(LedgerError, match="it is dispatched .*abandon it first"):
        ledger.dispatch("g", 0)
    with pytest.raises(LedgerError, match="has siblings 0..1, got sibling 2"):
        ledger.dispatch("g", 2)


def test_sibling_granularity_failure_redispatches_only_that_sibling() -> None:
    ledger = RolloutLedger()
    ledger.reserve("g", 0, 3, start_weight=0)
    attempts = [ledger.dispatch("g", i) for i in range(3)]
    ledger.seal("g", 0, attempts[0])
    assert ledger.fail("g", 1, attempts[1]) == []
    assert _states(ledger, "g") == ["sealed", "failed", "dispatched"]
    assert ledger.pending_siblings("g") == [1]


def test_prompt_group_failure_restarts_the_whole_group() -> None:
    ledger = RolloutLedger(RecoveryPolicy(default_granularity=Granularity.PROMPT_GROUP))
    ledger.reserve("g", 0, 3, start_weight=0)
    attempts = [ledger.dispatch("g", i) for i in range(3)]
    ledger.seal("g", 0, attempts[0])
    assert ledger.fail("g", 1, attempts[1]) == [2]  # sibling 2 is in flight: abort it
    assert _states(ledger, "g") == ["abandoned", "failed", "abandoned"]
    assert ledger.pending_siblings("g") == [0, 1, 2]
    with pytest.raises(StaleAttemptError, match="drop this result"):
        ledger.seal("g", 2, attempts[2])


def test_abandon_sibling_and_prompt_group_cascade() -> None:
    ledger = RolloutLedger(RecoveryPolicy(default_granularity="prompt_group"))  # type: ignore[arg-type]
    ledger.reserve("g", 0, 2, start_weight=0)
    ledger.dispatch("g", 0)
    ledger.dispatch("g", 1)
    assert ledger.abandon("g", 0) == [1]
    with pytest.raises(LedgerError, match="it is abandoned, not dispatched"):
        ledger.abandon("g", 1)


class TestGranularityResolution:
    POLICY = RecoveryPolicy(
        default_granularity=Granularity.SIBLING,
        task_source_granularity_overrides={"math": Granularity.PROMPT_GROUP, "code": Granularity.SIBLING},
        agent_granularity_overrides={"solver": Granularity.SIBLING, "judge": Granularity.PROMPT_GROUP},
    )

    @pytest.mark.parametrize(
        ("task_source", "agent", "expected"),
        [
            (None, None, Granularity.SIBLING),
            ("math", None, Granularity.PROMPT_GROUP),
            ("math", "solver", Granularity.SIBLING),  # agent wins
            ("code", "judge", Granularity.PROMPT_GROUP),  # agent wins
            ("other", "unknown-agent", Granularity.SIBLING),
            ("math", "unknown-agent", Granularity.PROMPT_GROUP),
        ],
    )
    def test_agent_then_task_source_then_default(
        self, task_source: str | None, agent: str | None, expected: Granularity
    ) -> None:
        assert self.POLICY.resolve(task_source, agent) is expected

    def test_bad_granularity_named(self) -> None:
        with pytest.raises(
            ValueError, match="task_source_granularity_overrides.math: unknown recovery granularity 'group'"
        ):
            RecoveryPolicy(task_source_granularity_overrides={"math": "group"})  # type: ignore[dict-item]

    def test_resolved_once_and_persisted(self) -> None:
        ledger = RolloutLedger(self.POLICY)
        ledger.reserve("g", 0, 2, start_weight=0, task_source="math")
        data = ledger.to_dict()
        # a restart under a changed config keeps the persisted granularity
        restored = RolloutLedger.from_dict(data, RecoveryPolicy())
        assert restored.group("g").granularity is Granularity.PROMPT_GROUP


class TestRecover:
    def test_sibling_keeps_sealed_and_redispatches_unfinished(self) -> None:
        ledger = RolloutLedger()
        ledger.reserve("g", 0, 4, start_weight=0)
        a = [ledger.dispatch("g", i) for i in range(3)]  # sibling 3 never dispatched
        ledger.seal("g", 0, a[0])
        ledger.fail("g", 2, a[2])
        restored = RolloutLedger.from_dict(json.loads(json.dumps(ledger.to_dict())))
        assert restored.recover() == {"g": [1, 2, 3]}
        assert _states(restored, "g") == ["sealed", "abandoned", "failed", "reserved"]

    def test_prompt_group_regenerates_everything_when_anything_is_unfinished(self) -> None:
        ledger = RolloutLedger(RecoveryPolicy(default_granularity=Granularity.PROMPT_GROUP))
        ledger.reserve("g", 0, 3, start_weight=0)
        ledger.seal("g", 0, ledger.dispatch("g", 0))
        ledger.seal("g", 1, ledger.dispatch("g", 1))  # sibling 2 never dispatched
        assert ledger.recover() == {"g": [0, 1, 2]}

    def test_all_sealed_group_is_finalizable_not_redispatched(self) -> None:
        ledger = RolloutLedger(RecoveryPolicy(default_granularity=Granularity.PROMPT_GROUP))
        ledger.reserve("g", 0, 2, start_weight=0)
        _seal_all(ledger, "g")
        assert ledger.recover() == {}
        assert ledger.finalizable() == ["g"]

    def test_finalized_groups_are_not_redispatched(self) -> None:
        ledger = RolloutLedger()
        ledger.reserve("done", 0, 1, start_weight=0)
        _seal_all(ledger, "done")
        ledger.finalize("done")
        ledger.reserve("open", 1, 1, start_weight=0)
        assert ledger.recover() == {"open": [0]}

    def test_recover_rolls_back_open_claims(self) -> None:
        ledger = RolloutLedger()
        ledger.reserve("g", 0, 1, start_weight=0)
        _seal_all(ledger, "g")
        ledger.finalize("g")
        ledger.claim(["g"])
        ledger.recover()
        assert ledger.group("g").state is GroupState.FINALIZED


class TestPersistence:
    def _ledger_with_step(self) -> RolloutLedger:
        ledger = RolloutLedger()
        for gid in ("a", "b"):
            ledger.reserve(gid, 0, 1, start_weight=0, target_step=0)
            _seal_all(ledger, gid)
            ledger.finalize(gid)
        ledger.claim(["a"])
        return ledger

    def test_full_checkpoint_rejects_open_step(self) -> None:
        with pytest.raises(LedgerError, match=r"open train step \(claimed \['a'\], applied \[\]\)"):
            self._ledger_with_step().to_dict()

    def test_snapshot_rolls_claims_back_to_finalized_in_the_copy_only(self) -> None:
        ledger = self._ledger_with_step()
        data = ledger.to_dict(open_step="rollback")
        assert [g["state"] for g in data["groups"]] == ["finalized", "finalized"]
        assert ledger.group("a").state is GroupState.CLAIMED

    def test_applied_groups_are_never_persisted(self) -> None:
        ledger = self._ledger_with_step()
        ledger.apply(["a"])
        with pytest.raises(LedgerError, match=r"applied \['a'\]"):
            ledger.to_dict(open_step="rollback")

    def test_round_trip_is_json_plain_and_identical(self) -> None:
        ledger = RolloutLedger()
        ledger.reserve("g", 5, 2, start_weight=1, target_step=2, task_source="math", agent="x")
        ledger.dispatch("g", 0)
        ledger.reserve("h", 6, 1, start_weight=1)
        ledger.drop("h", reason="data_error")
        data = json.loads(json.dumps(ledger.to_dict()))
        restored = RolloutLedger.from_dict(data)
        assert restored.to_dict() == ledger.to_dict()
        assert restored.accounting() == ledger.accounting()
        assert restored.dispatch("g", 1) == ledger.dispatch("g", 1)

    def test_from_dict_rejects_malformed_or_unbalanced(self) -> None:
        ledger = RolloutLedger()
        ledger.reserve("g", 0, 1, start_weight=0)
        data = ledger.to_dict()
        with pytest.raises(LedgerError, match="does not balance"):
            RolloutLedger.from_dict({**data, "counts": {**data["counts"], "reserved": 5}})
        with pytest.raises(LedgerError, match="malformed ledger state: KeyError"):
            RolloutLedger.from_dict({**data, "groups": [{"group_id": "g"}]})
        with pytest.raises(LedgerError, match="schema_version 0"):
            RolloutLedger.from_dict({**data, "schema_version": 0})
        with pytest.raises(LedgerError, match="lists group 'g' twice"):
            RolloutLedger.from_dict({**data, "groups": data["groups"] * 2})


def test_drop_and_evict_are_accounted_with_reasons() -> None:
    ledger = RolloutLedger()
    ledger.reserve("a", 0, 2, start_weight=0)
    ledger.dispatch("a", 1)
    assert ledger.drop("a", reason="stale") == [1]
    ledger.reserve("b", 1, 1, start_weight=0)
    _seal_all(ledger, "b")
    ledger.finalize("b")
    ledger.evict(["b"])
    acc = ledger.accounting()
    assert (acc.evicted, dict(acc.dropped), acc.balanced) == (1, {"stale": 1}, True)
    assert ledger.accounts_for(2) and not ledger.accounts_for(3)


def test_invalid_group_transitions_raise_and_change_nothing() -> None:
    ledger = RolloutLedger()
    ledger.reserve("g", 0, 1, start_weight=0)
    with pytest.raises(
        LedgerError, match=r"cannot claim groups \{'g': 'generating'\}: each must be finalized"
    ):
        ledger.claim(["g"])
    with pytest.raises(LedgerError, match=r"cannot evict groups \{'x': 'unknown'\}"):
        ledger.evict(["x"])
    with pytest.raises(ValueError, match="needs a non-empty reason"):
        ledger.drop("g", reason="")
    with pytest.raises(LedgerError, match="unknown group 'zz'"):
        ledger.seal("zz", 0, "zz_g0_a1")
    _seal_all(ledger, "g")
    ledger.finalize("g")
    ledger.claim(["g"])
    with pytest.raises(LedgerError, match="it is claimed by the train step"):
        ledger.drop("g", reason="x")
    with pytest.raises(LedgerError, match="repeated"):
        ledger.apply(["g", "g"])
    assert ledger.group("g").state is GroupState.CLAIMED
    assert ledger.group("g").siblings[0].state is SiblingState.SEALED


def test_check_replay_index_names_the_mismatch() -> None:
    ledger = RolloutLedger()
    for gid in ("a", "b"):
        ledger.reserve(gid, 0, 1, start_weight=0)
    _seal_all(ledger, "a")
    ledger.finalize("a")
    ledger.check_replay_index(["a"])
    with pytest.raises(
        LedgerError, match=r"only in the replay index \['b'\], .* not in the replay index \['a'\]"
    ):
        ledger.check_replay_index(["b"])
