"""Dynamic sampling and the replacement reserve on the real ``RolloutCore`` (no Ray): zero-std groups are
filtered, their slots refilled from spares held back from the dataloader, and the log accounts for every prompt."""

from __future__ import annotations

import copy
from typing import Any

from _core_driver import Driver, G, P, make_core

from screl.data import check_events
from screl.data.core_types import Dispatch, FailureBudget, RolloutFailure
from screl.data.events import (
    AdmitEvent,
    DropEvent,
    Event,
    ReplaceEvent,
    ReserveEvent,
    SpareEvent,
    TrainStepEvent,
)
from screl.data.reserve import ReservePolicy

IN_ORDER = {"name": "in_order", "max_lookahead_versions": 1}
RESERVE = ReservePolicy(enabled=True, size=1, max_per_slot=1)


def _core(block: dict[str, Any] | None = None, **kw: Any) -> Driver:
    block = block or IN_ORDER
    kw.setdefault("reserve", RESERVE)
    return Driver(make_core(block, prompts=12, epochs=1, dynamic=True, **kw), block=block)


def _varied(d: Dispatch, _: int) -> float:
    return float(d.sibling)  # siblings disagree: never filtered


def _uniform_for(*prompts: int) -> Any:
    return lambda d, _: 1.0 if d.prompt_id in prompts else float(d.sibling)


def _seal_group(d: Driver, gid: str, rewards: list[float]) -> None:
    for reward in rewards:
        d.seal(next(i for i, o in enumerate(d.outstanding) if o.group_id == gid), reward=reward)


def _drive(d: Driver, rounds: int = 100) -> None:
    """Play workers and trainer until the rollout is exhausted or the run fails; then shut down."""
    for _ in range(rounds):
        if d.error is not None or (d.core.finished and not d.core.step_claims):
            break
        d.pump()
        d.seal_all()
        while d.error is None and d.train():
            d.pump()
    d.finish()


def _of(events: list[Event], kind: type) -> list[Any]:
    return [e for e in events if isinstance(e, kind)]


def _trained_prompts(d: Driver) -> list[int]:
    prompt_of = {e.group_id: e.prompt_id for e in _of(d.events, ReserveEvent)}
    return [prompt_of[g] for e in _of(d.events, TrainStepEvent) for g in e.group_ids]


def test_the_reserve_holds_back_the_second_batch_and_a_filtered_slot_gets_its_first_spare() -> None:
    d = _core()
    order = d.core.epoch_order(0)
    d.pump()
    admits, spares = _of(d.events, AdmitEvent), _of(d.events, SpareEvent)
    # batch 0 is admitted for step 0; batch 1 is held back whole; batch 2 is admitted for step 1 (lookahead 1)
    assert [a.prompt_ids for a in admits] == [tuple(order[0:3]), tuple(order[6:9])]
    assert [a.target_step for a in admits] == [0, 1] and [a.step for a in admits] == [0, 1]
    assert [s.prompt_ids for s in spares] == [tuple(order[3:6])]
    gid = next(e.group_id for e in _of(d.events, ReserveEvent) if e.prompt_id == order[0])
    mark = len(d.events)
    _seal_group(d, gid, [0.5] * G)
    drop, replace = d.events[mark:mark + 2]
    assert isinstance(drop, DropEvent) and (drop.reason, drop.group_id) == ("filtered", gid)
    assert replace == ReplaceEvent(group_id=gid, prompt_id=order[0], replacement=order[3], target_step=0)
    assert d.core.metrics["filtered"] == 1 and d.core.metrics["replaced"] == 1 and len(d.core.reserve) == 2
    d.pump()
    refill = _of(d.events[mark:], ReserveEvent)
    assert [(e.prompt_id, e.target_step) for e in refill] == [(order[3], 0)], "the spare fills step 0's slot"


def test_an_epoch_with_one_filtered_group_trains_full_steps_and_accounts_for_every_prompt() -> None:
    d = _core()
    order = d.core.epoch_order(0)
    d.reward_of = _uniform_for(order[0])
    _drive(d)
    assert d.error is None
    steps = _of(d.events, TrainStepEvent)
    assert [len(s.group_ids) for s in steps] == [P, P, P], "every step keeps its size"
    assert sorted(_trained_prompts(d)) == sorted(order[1:4] + order[6:12])
    unused = [e.prompt_id for e in _of(d.events, DropEvent) if e.reason == "reserve_unused"]
    assert unused == order[4:6], "the two spares left (fewer than a step) are released at the end"
    report = check_events(d.events, IN_ORDER, final=True)
    assert report.ok, report.format()
    assert report.outcomes["replaced"] == 1 and report.outcomes["trained"] == 3 * P
    assert report.prompts == {"admitted": 9, "spares": 3, "replacements": 1, "dropped_unreserved": 0,
                              "spares_unused": 2}


def test_spares_left_when_the_dataloader_ends_are_trained_as_a_whole_step() -> None:
    d = _core()
    d.reward_of = _varied
    _drive(d)
    admits = _of(d.events, AdmitEvent)
    assert [bool((a.extra or {}).get("from_reserve")) for a in admits] == [False, False, False, True]
    assert sorted(_trained_prompts(d)) == list(range(12)), "every prompt of the epoch trains exactly once"
    assert check_events(d.events, IN_ORDER, final=True).ok


def test_a_slot_past_max_replacement_attempts_shrinks_the_step_and_fails_below_the_floor() -> None:
    d = _core()
    order = d.core.epoch_order(0)
    d.reward_of = _uniform_for(order[0], order[3])  # the first prompt and its replacement both agree
    _drive(d)
    assert isinstance(d.error, RolloutFailure)
    msg = str(d.error)
    assert "step 0 lost 1 of 3 groups to dynamic sampling (grpo.use_dynamic_sampling)" in msg
    assert "min_step_batch_fraction=0.9" in msg and "slot spent its async_rl.rollout_failure.max_replacement_attempts=1" in msg
    assert [e.replacement for e in _of(d.events, ReplaceEvent)] == [order[3]], "one spare per slot"
    assert check_events(d.events, IN_ORDER, final=True).ok


def test_a_shrinkable_step_trains_short_when_the_slot_cannot_be_refilled() -> None:
    lenient = FailureBudget(min_step_batch_fraction=0.5)
    d = _core(failure=lenient, reserve=ReservePolicy())  # dynamic sampling without a reserve: shrink
    order = d.core.epoch_order(0)
    d.reward_of = _uniform_for(order[0])
    _drive(d)
    assert d.error is None
    assert [len(s.group_ids) for s in _of(d.events, TrainStepEvent)] == [P - 1, P, P, P]
    assert not _of(d.events, SpareEvent) and check_events(d.events, IN_ORDER, final=True).ok


def test_when_every_group_agrees_the_run_fails_naming_the_knobs_instead_of_waiting() -> None:
    d = _core()
    d.reward_of = lambda _d, _k: 0.0
    _drive(d)
    assert isinstance(d.error, RolloutFailure) and "max_replacement_attempts=1: raise it" in str(d.error)
    assert not _of(d.events, TrainStepEvent)


def test_ppo_steps_never_shrink() -> None:
    d = _core(reserve=ReservePolicy(), failure=FailureBudget(min_step_batch_fraction=0.01), step_may_shrink=False)
    d.reward_of = _uniform_for(d.core.epoch_order(0)[0])
    _drive(d)
    assert isinstance(d.error, RolloutFailure) and "PPO trains full steps only" in str(d.error)
    assert "on_dropped_prompt: replace" in str(d.error) and "min_step_batch_fraction" not in str(d.error)


def test_a_sampler_without_stamps_gets_replacements_too() -> None:
    windowed = {"name": "windowed", "max_staleness_versions": 3}  # wide enough that nothing ages out here
    d = _core(windowed)
    order = d.core.epoch_order(0)
    d.reward_of = _uniform_for(order[0])
    _drive(d)
    assert d.error is None
    # no stamp to keep: the spare keeps the count of groups the sampler's gate expects
    assert [(e.replacement, e.target_step) for e in _of(d.events, ReplaceEvent)] == [(order[3], None)]
    assert [len(s.group_ids) for s in _of(d.events, TrainStepEvent)] == [P, P, P]
    assert check_events(d.events, windowed, final=True).ok


def test_a_failed_group_beyond_its_retries_is_replaced_too() -> None:
    budget = FailureBudget(max_data_attempts=1, max_skipped_prompts=1)
    d = _core(failure=budget)
    d.reward_of = _varied
    d.pump()
    victim = d.outstanding[0]
    d.data_fail(0)
    drop = _of(d.events, DropEvent)[-1]
    assert (drop.reason, drop.group_id) == ("data_attempts_exhausted", victim.group_id)
    assert _of(d.events, ReplaceEvent)[-1].group_id == victim.group_id and d.core.skipped_prompts == 1
    _drive(d)
    assert d.error is None and [len(s.group_ids) for s in _of(d.events, TrainStepEvent)] == [P, P, P]


def test_capture_and_restore_keep_the_reserve_and_each_slots_replacement_count() -> None:
    d = _core()
    order = d.core.epoch_order(0)
    d.pump()
    gid = next(e.group_id for e in _of(d.events, ReserveEvent) if e.prompt_id == order[0])
    _seal_group(d, gid, [1.0] * G)
    d.pump()
    state, _ = d.core.capture()
    assert state.replacement_reserve == {"spares": [[order[4], 0], [order[5], 0]], "started": True}
    replacement = next(g for g, r in d.core.runs.items() if r.prompt_id == order[3])
    assert state.in_flight[replacement]["replacements"] == 1
    d.checkpoint = (copy.deepcopy(state), set(d.rows))
    d.crash_and_resume()
    assert d.core.reserve.state_dict() == state.replacement_reserve
    assert d.core.runs[replacement].replacements == 1
    d.reward_of = _uniform_for(order[3])  # the restored replacement agrees again: its slot's budget is spent
    _drive(d)
    assert isinstance(d.error, RolloutFailure) and "max_replacement_attempts=1: raise it" in str(d.error)


def _admit_two() -> list[Event]:
    return [AdmitEvent(trainer_version=0, step=0, target_step=0, prompt_ids=(1, 2)),
            ReserveEvent(group_id="g1", prompt_id=1, start_weight=0, target_step=0)]


def test_the_checker_flags_a_replacement_that_was_never_held_and_a_prompt_never_reserved() -> None:
    log = [*_admit_two(), SpareEvent(trainer_version=0, prompt_ids=(5,)),
           DropEvent(reason="filtered", group_id="g1", prompt_id=1),
           ReplaceEvent(group_id="g1", prompt_id=1, replacement=9, target_step=0)]
    report = check_events(log, IN_ORDER, final=True)
    rules = [(v.rule, v.message) for v in report.violations]
    assert ("prompt-accounting", "replace with prompt 9, which is not held in the reserve") in rules
    assert ("unfinished", "the run ended with prompts [2, 9] admitted, never reserved") in rules
    assert ("unfinished", "the run ended with prompts [5] held as spares") in rules


def test_the_checker_flags_a_reserve_of_a_prompt_no_admit_named() -> None:
    log = [*_admit_two(), ReserveEvent(group_id="g7", prompt_id=7, start_weight=0, target_step=0)]
    rules = [(v.rule, v.message) for v in check_events(log, IN_ORDER).violations]
    assert rules == [("prompt-accounting", "reserve of prompt 7, which is not admitted and unreserved")]
