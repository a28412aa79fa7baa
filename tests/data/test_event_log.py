"""Event records, serializer, writer, and the log checker's rules."""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from typing import Any

import pytest

from screl.data import (
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
    check_events,
    parse_event,
)

SAMPLE_EVENTS: list[Event] = [
    AdmitEvent(trainer_version=0, step=0, target_step=0, prompt_ids=(3, 5), time=1.5),
    SpareEvent(trainer_version=0, prompt_ids=(7, 8)),
    ReplaceEvent(group_id="g5", prompt_id=5, replacement=7, target_step=0),
    ReserveEvent(group_id="g0", prompt_id=3, start_weight=0, target_step=0, trainer_version=0),
    CommitEvent(group_id="g0", end_weight=1, start_weight=0),
    FailEvent(group_id="g1", sibling=2, reason="infra"),
    PromoteEvent(group_id="g0", target_step=0, step=2),
    SelectEvent(trainer_version=0, group_ids=("g0", "g2"), step=0),
    EvictEvent(group_id="g3", trainer_version=2, start_weight=0, reason="stale"),
    AbortEvent(group_id="g4", trainer_version=2, start_weight=0),
    DropEvent(reason="data_error", prompt_id=9),
    TrainStepEvent(step=0, group_ids=("g0",), trainer_version=0),
    RefitEvent(trainer_version=1),
    WindowEvent(trainer_version=1, window=2),
    ValidateEvent(trainer_version=1, extra={"token_versions": [1], "reward_mean": 0.5}),
    CheckpointEvent(step=1),
    SnapshotEvent(step=1),
    RestoreEvent(step=1, group_ids=("g2",)),
]


def test_every_design_event_name_has_a_record() -> None:
    design = {"admit", "reserve", "commit", "fail", "select", "evict", "abort", "drop", "train_step"}
    design |= {"refit", "checkpoint", "snapshot", "restore"}
    assert design <= set(EVENT_TYPES)
    assert {type(e).name for e in SAMPLE_EVENTS} == set(EVENT_TYPES)


@pytest.mark.parametrize("event", SAMPLE_EVENTS, ids=lambda e: e.name)
def test_json_round_trip(event: Event) -> None:
    line = event.to_json()
    assert "\n" not in line and json.loads(line)["event"] == event.name
    assert parse_event(line) == event


def test_none_fields_are_omitted() -> None:
    assert json.loads(RefitEvent(trainer_version=3).to_json()) == {"event": "refit", "trainer_version": 3}


@pytest.mark.parametrize(
    ("line", "match"),
    [
        ("not json", "not a JSON object"),
        ("[1]", "an event must be a JSON object, got list"),
        ('{"event": "teleport"}', "unknown event 'teleport'"),
        ('{"event": "refit"}', r"refit event: missing fields \['trainer_version'\]"),
        ('{"event": "refit", "trainer_version": "1"}', "field 'trainer_version' has invalid value '1'"),
        ('{"event": "refit", "trainer_version": true}', "field 'trainer_version' has invalid value True"),
        ('{"event": "drop", "reason": "x"}', "name the dropped group_id or prompt_id"),
        ('{"event": "drop", "reason": "", "prompt_id": 1}', "field 'reason' has invalid value ''"),
        ('{"event": "select", "trainer_version": 0, "group_ids": [1]}', "field 'group_ids'"),
    ],
)
def test_parse_errors_name_the_problem(line: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_event(line)


def test_extra_fields_round_trip_as_diagnostics() -> None:
    event = parse_event('{"event": "refit", "trainer_version": 1, "refit_s": 0.5, "aborted": 2}')
    assert event.trainer_version == 1  # type: ignore[attr-defined]
    assert event.extra == {"aborted": 2, "refit_s": 0.5}
    assert parse_event(event.to_json()) == event
    with pytest.raises(ValueError, match=r"extra fields \['trainer_version'\] shadow contract fields"):
        type(event)(trainer_version=1, extra={"trainer_version": 2})


def test_writer_appends_flushed_lines_with_injected_clock() -> None:
    class Stream(io.StringIO):
        flushes = 0

        def flush(self) -> None:
            self.flushes += 1
            super().flush()

    stream = Stream()
    writer = EventLogWriter(stream, clock=lambda: 42.0)
    writer.write(RefitEvent(trainer_version=1))
    writer.write(CheckpointEvent(step=1, time=7.0))
    lines = stream.getvalue().splitlines()
    assert [parse_event(x).time for x in lines] == [42.0, 7.0]
    assert stream.flushes == 2


# ------------------------------------------------------------------------------ checker

IN_ORDER = {"name": "in_order", "max_lookahead_versions": 1}


def _rules(events: Sequence[Event], sampler: Any = IN_ORDER, **kwargs: Any) -> list[str]:
    return [v.rule for v in check_events(events, sampler, **kwargs).violations]


def _step(t: int, ids: list[tuple[str, int]], sw: int | None = None) -> list[Event]:
    """Reserve + commit + select + train a whole in_order step ``t`` of groups (id, prompt)."""
    sw = t if sw is None else sw
    out: list[Event] = []
    for gid, pid in ids:
        out += [
            ReserveEvent(group_id=gid, prompt_id=pid, start_weight=sw, target_step=t),
            CommitEvent(group_id=gid, end_weight=sw),
        ]
    gids = tuple(g for g, _ in ids)
    return out + [
        SelectEvent(trainer_version=t, group_ids=gids),
        TrainStepEvent(step=t, group_ids=gids),
        RefitEvent(trainer_version=t + 1),
    ]


def test_clean_in_order_run_passes() -> None:
    log = [AdmitEvent(trainer_version=0, step=0, target_step=0)] + _step(0, [("a", 0), ("b", 1)])
    log += [AdmitEvent(trainer_version=1, step=1, target_step=1)] + _step(1, [("c", 2), ("d", 3)])
    report = check_events([e.to_json() for e in log], IN_ORDER, final=True)
    assert report.ok, report.format()
    assert report.outcomes == {"trained": 4}
    assert "OK: no violations" in report.format()


def test_trained_twice_detected() -> None:
    log = _step(0, [("a", 0)]) + [SelectEvent(trainer_version=1, group_ids=("a",))]
    assert "trained-twice" in _rules(log)
    log = _step(0, [("a", 0)]) + [TrainStepEvent(step=1, group_ids=("a",))]
    assert "trained-twice" in _rules(log)


def test_selected_twice_detected() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=0),
        CommitEvent(group_id="a", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("a",)),
        SelectEvent(trainer_version=0, group_ids=("a",)),
    ]
    assert _rules(log) == ["selected-twice"]


def test_in_order_select_at_wrong_step_flagged() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=1),
        CommitEvent(group_id="a", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("a",)),
    ]
    assert "select-rule" in _rules(log)


def test_select_order_must_be_the_eligible_prefix() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=0),
        ReserveEvent(group_id="b", prompt_id=1, start_weight=0, target_step=0),
        CommitEvent(group_id="a", end_weight=0),
        CommitEvent(group_id="b", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("b",)),
    ]
    assert _rules(log) == ["select-order"]


def test_select_of_unready_group_flagged() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=0),
        SelectEvent(trainer_version=0, group_ids=("a",)),
    ]
    assert "select-state" in _rules(log)


def test_windowed_outside_window_flagged_and_in_window_ok() -> None:
    windowed = {"name": "windowed", "max_staleness_versions": 1}
    base: list[Event] = []
    for t in range(3):
        base += [TrainStepEvent(step=t, group_ids=()), RefitEvent(trainer_version=t + 1)]
    log = base + [
        ReserveEvent(group_id="old", prompt_id=0, start_weight=1),
        ReserveEvent(group_id="ok", prompt_id=1, start_weight=2),
        CommitEvent(group_id="old", end_weight=3),
        CommitEvent(group_id="ok", end_weight=3),
    ]
    assert _rules(log + [SelectEvent(trainer_version=3, group_ids=("ok",))], windowed) == []
    assert "select-rule" in _rules(log + [SelectEvent(trainer_version=3, group_ids=("old",))], windowed)


def test_weight_fifo_must_take_oldest_in_window_weight() -> None:
    fifo = {"name": "weight_fifo", "max_staleness_versions": 2}
    log: list[Event] = [TrainStepEvent(step=0, group_ids=()), TrainStepEvent(step=1, group_ids=())]
    log += [
        ReserveEvent(group_id="w1", prompt_id=0, start_weight=1),
        ReserveEvent(group_id="w2", prompt_id=1, start_weight=2),
        CommitEvent(group_id="w2", end_weight=2),
    ]
    # w1 is in flight: weight_fifo waits for it instead of taking w2
    assert "select-rule" in _rules(log + [SelectEvent(trainer_version=2, group_ids=("w2",))], fifo)


def test_ready_first_future_weight_flagged() -> None:
    log = [
        ReserveEvent(group_id="f", prompt_id=0, start_weight=1),
        CommitEvent(group_id="f", end_weight=1),
        SelectEvent(trainer_version=0, group_ids=("f",)),
    ]
    assert "select-rule" in _rules(log, {"name": "ready_first"})


def test_gate_and_cursor_and_stamp_rules() -> None:
    log = [
        AdmitEvent(trainer_version=0, step=0, target_step=0),
        AdmitEvent(trainer_version=0, step=1, target_step=1),
        AdmitEvent(trainer_version=0, step=2, target_step=2),
    ]
    assert _rules(log) == ["gate"]
    assert _rules([AdmitEvent(trainer_version=0, step=1, target_step=1)]) == ["dispatch-cursor"]
    assert _rules([AdmitEvent(trainer_version=0, step=0, target_step=5)]) == ["in_order-stamp"]
    assert (
        _rules([AdmitEvent(trainer_version=3, step=0, target_step=0)])
        == ["admit-version", "in_order-stamp"][:1]
    )
    assert _rules(log, {"name": "windowed"}) == []


def test_evict_rules() -> None:
    log: list[Event] = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=1),
        CommitEvent(group_id="a", end_weight=0),
        EvictEvent(group_id="a", trainer_version=0),
    ]
    assert _rules(log) == ["evict-rule"]  # in_order may still train it at step 1
    assert _rules(log, {"name": "ready_first"}) == ["evict-rule"]  # ready_first never evicts
    inflight = [
        ReserveEvent(group_id="b", prompt_id=0, start_weight=0),
        EvictEvent(group_id="b", trainer_version=5),
    ]
    assert _rules(inflight, {"name": "windowed"}) == ["evict-unready"]


def test_abort_rules() -> None:
    log: list[Event] = [ReserveEvent(group_id="a", prompt_id=0, start_weight=2)]
    aborted = log + [AbortEvent(group_id="a", trainer_version=3)]
    assert _rules(aborted, {"name": "windowed", "max_staleness_versions": 1}) == ["abort-rule"]
    assert _rules(aborted, {"name": "windowed", "max_staleness_versions": 0}) == []
    assert _rules(aborted, {"name": "weight_fifo"}) == ["abort-rule"]
    shutdown = log + [AbortEvent(group_id="a", trainer_version=3, reason="shutdown")]
    assert _rules(shutdown, {"name": "weight_fifo"}) == []


def test_commit_rules() -> None:
    log: list[Event] = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=2),
        CommitEvent(group_id="a", end_weight=1),
    ]
    assert _rules(log) == ["commit-weights"]
    twice = log[:1] + [CommitEvent(group_id="a", end_weight=2), CommitEvent(group_id="a", end_weight=2)]
    assert _rules(twice) == ["commit-state"]
    assert _rules([CommitEvent(group_id="zz", end_weight=0)]) == ["unknown-group"]


def test_train_step_must_match_its_selections() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=0),
        CommitEvent(group_id="a", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("a",)),
        TrainStepEvent(step=0, group_ids=()),
    ]
    assert _rules(log) == ["train-step-mismatch"]
    assert _rules([TrainStepEvent(step=3, group_ids=())]) == ["train-step-order"]
    assert _rules([RefitEvent(trainer_version=4)]) == ["refit-version"]


def test_every_reserved_prompt_is_accounted_for() -> None:
    log: list[Event] = [
        ReserveEvent(group_id="trained", prompt_id=0, start_weight=0, target_step=0),
        CommitEvent(group_id="trained", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("trained",)),
        TrainStepEvent(step=0, group_ids=("trained",)),
        ReserveEvent(group_id="f1", prompt_id=1, start_weight=1, target_step=1),
        FailEvent(group_id="f1", reason="infra"),
        ReserveEvent(group_id="f2", prompt_id=1, start_weight=1, target_step=1),  # retried
        ReserveEvent(group_id="dropped", prompt_id=2, start_weight=1, target_step=1),
        FailEvent(group_id="dropped"),
        DropEvent(group_id="dropped", reason="data_error"),
        ReserveEvent(group_id="inflight", prompt_id=3, start_weight=1, target_step=1),
        ReserveEvent(group_id="waiting", prompt_id=4, start_weight=1, target_step=1),
        FailEvent(group_id="waiting"),
    ]
    report = check_events(log, IN_ORDER)
    assert report.ok
    assert report.outcomes == {"trained": 1, "retried": 1, "inflight": 2, "dropped": 1, "failed": 1}
    final = check_events(log, IN_ORDER, final=True)
    assert [v.rule for v in final.violations] == ["unfinished"]
    assert "'inflight': 2, 'failed': 1" in final.violations[0].message
    # a drop by prompt id settles a failed attempt too
    settled = check_events(
        [*log[:-1], FailEvent(group_id="waiting"), DropEvent(prompt_id=4, reason="budget")], IN_ORDER
    )
    assert settled.outcomes["dropped"] == 2


def test_capacity_rule() -> None:
    log = [ReserveEvent(group_id=f"g{i}", prompt_id=i, start_weight=0) for i in range(3)]
    assert _rules(log, max_buffered_rollouts=2) == ["capacity"]
    assert _rules(log, max_buffered_rollouts=3) == []


def test_promotion_restamps_for_in_order() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=2),
        CommitEvent(group_id="a", end_weight=0),
        PromoteEvent(group_id="a", target_step=0, step=2),
        SelectEvent(trainer_version=0, group_ids=("a",)),
    ]
    assert _rules(log) == []
    assert _rules([*log[:2], PromoteEvent(group_id="a", target_step=3, step=2)]) == ["promote-state"]


class TestRestore:
    def _before_crash(self) -> list[Event]:
        log = _step(0, [("a", 0)]) + [
            ReserveEvent(group_id="b", prompt_id=1, start_weight=1, target_step=1),
            CommitEvent(group_id="b", end_weight=1),
            ReserveEvent(group_id="c", prompt_id=2, start_weight=1, target_step=1),  # in flight at the anchor
            CheckpointEvent(step=1),
            SelectEvent(trainer_version=1, group_ids=("b",)),
            CommitEvent(group_id="c", end_weight=1),
            SelectEvent(trainer_version=1, group_ids=("c",)),
            TrainStepEvent(step=1, group_ids=("b", "c")),  # step 1 trained, then the run crashed
        ]
        return log

    def test_restore_supersedes_later_steps_so_retraining_is_fine(self) -> None:
        log = self._before_crash() + [
            RestoreEvent(step=1, group_ids=("b",)),
            ReserveEvent(group_id="c", prompt_id=2, start_weight=1, target_step=1),  # ledger redispatch
            CommitEvent(group_id="c", end_weight=1),
            SelectEvent(trainer_version=1, group_ids=("b", "c")),
            TrainStepEvent(step=1, group_ids=("b", "c")),
        ]
        report = check_events(log, IN_ORDER, final=True)
        assert report.ok, report.format()
        assert report.restores == 1 and report.outcomes == {"trained": 3}

    def test_steps_before_the_restore_point_stay_trained(self) -> None:
        log = self._before_crash() + [
            RestoreEvent(step=1, group_ids=("b", "a")),
        ]
        assert "restore-state" in _rules(log)
        log = self._before_crash() + [RestoreEvent(step=1), SelectEvent(trainer_version=1, group_ids=("a",))]
        assert "trained-twice" in _rules(log)

    def test_buffered_group_missing_from_restore_is_lost(self) -> None:
        log = self._before_crash() + [RestoreEvent(step=1, group_ids=())]
        assert _rules(log) == ["lost-on-restore"]

    def test_restore_without_group_ids_assumes_anchor_buffer(self) -> None:
        log = self._before_crash() + [
            RestoreEvent(step=1),
            SelectEvent(trainer_version=1, group_ids=("b",)),
        ]
        assert _rules(log) == []

    def test_snapshot_anchor_mid_step_restores_claimed_groups(self) -> None:
        log = _step(0, [("a", 0)]) + [
            ReserveEvent(group_id="b", prompt_id=1, start_weight=1, target_step=1),
            CommitEvent(group_id="b", end_weight=1),
            SelectEvent(trainer_version=1, group_ids=("b",)),
            SnapshotEvent(step=1),
            RestoreEvent(step=1, group_ids=("b",)),
            SelectEvent(trainer_version=1, group_ids=("b",)),
            TrainStepEvent(step=1, group_ids=("b",)),
        ]
        assert _rules(log) == []

    def _unpublished_snapshot(self) -> list[Event]:
        """Step 1's checkpoint (b buffered, c in flight), then c commits and a snapshot is captured, then a crash
        (perhaps before the snapshot was published)."""
        return _step(0, [("a", 0)]) + [
            ReserveEvent(group_id="b", prompt_id=1, start_weight=1, target_step=1),
            CommitEvent(group_id="b", end_weight=1),
            ReserveEvent(group_id="c", prompt_id=2, start_weight=1, target_step=1),
            CheckpointEvent(step=1, mutation_version=4),
            CommitEvent(group_id="c", end_weight=1),
            SnapshotEvent(step=1, mutation_version=5),
        ]

    def test_restore_names_its_anchor_among_the_steps_captures(self) -> None:
        # resumed from the checkpoint (the snapshot never got published): c is redispatched, nothing is lost
        from_checkpoint = self._unpublished_snapshot() + [
            RestoreEvent(step=1, group_ids=("b",), mutation_version=4),
            ReserveEvent(group_id="c", prompt_id=2, start_weight=1, target_step=1),
            CommitEvent(group_id="c", end_weight=1),
            SelectEvent(trainer_version=1, group_ids=("b", "c")),
            TrainStepEvent(step=1, group_ids=("b", "c")),
        ]
        report = check_events(from_checkpoint, IN_ORDER, final=True)
        assert report.ok, report.format()
        # resumed from the snapshot, c must come back as buffered
        assert _rules(self._unpublished_snapshot() + [
            RestoreEvent(step=1, group_ids=("b",), mutation_version=5)]) == ["lost-on-restore"]
        assert _rules(self._unpublished_snapshot() + [
            RestoreEvent(step=1, group_ids=("b", "c"), mutation_version=5)]) == []
        # without a mutation version the step's latest anchor is assumed (logs written before it existed)
        assert _rules(self._unpublished_snapshot() + [RestoreEvent(step=1, group_ids=("b",))]) == ["lost-on-restore"]

    def test_a_fresh_start_voids_every_capture_before_it(self) -> None:
        # the first snapshot was captured (b and c buffered) and the run was killed before it was published,
        # so the next run starts fresh: nothing is lost, and the same prompts are trained anew
        log = [
            ReserveEvent(group_id="b", prompt_id=1, start_weight=0, target_step=0),
            CommitEvent(group_id="b", end_weight=0),
            SnapshotEvent(step=0, mutation_version=2),
            RestoreEvent(step=0, group_ids=(), extra={"fresh": True}),
            ReserveEvent(group_id="b2", prompt_id=1, start_weight=0, target_step=0),
            CommitEvent(group_id="b2", end_weight=0),
            SelectEvent(trainer_version=0, group_ids=("b2",)),
            TrainStepEvent(step=0, group_ids=("b2",)),
        ]
        report = check_events(log, IN_ORDER, final=True)
        assert report.ok, report.format()
        assert report.outcomes == {"superseded": 1, "trained": 1}
        # the void capture's groups cannot come back later either
        assert _rules([*log[:4], RestoreEvent(step=0, group_ids=("b",), mutation_version=2)]) == ["restore-state"]
        # without the fresh mark, the same log loses b (the capture is taken as the anchor)
        assert _rules([*log[:3], RestoreEvent(step=0, group_ids=())]) == ["lost-on-restore"]

    def test_restore_from_an_unlogged_anchor_is_flagged(self) -> None:
        log = self._unpublished_snapshot() + [RestoreEvent(step=1, group_ids=("b", "c"), mutation_version=9)]
        assert "restore-anchor" in _rules(log)

    def test_anchor_step_must_match_progress(self) -> None:
        assert _rules([CheckpointEvent(step=2)]) == ["anchor-step"]


def test_checker_without_sampler_checks_structure_only() -> None:
    log = [
        ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=7),
        CommitEvent(group_id="a", end_weight=0),
        SelectEvent(trainer_version=0, group_ids=("a",)),
        SelectEvent(trainer_version=0, group_ids=("a",)),
    ]
    report = check_events(log)
    assert [v.rule for v in report.violations] == ["selected-twice"]
    assert "sampler rules not checked" in report.format()


def test_parse_errors_are_violations_with_line_numbers() -> None:
    report = check_events(['{"event": "refit", "trainer_version": 0}', "", "garbage"])
    assert [(v.rule, v.line) for v in report.violations] == [("parse", 3)]
