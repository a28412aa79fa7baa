"""Samplers own their rules: config checks, ``screl check``, the thread plan and the event checker ask the
sampler's hooks, for a built-in and a custom class alike."""

from __future__ import annotations

from typing import Any

import pytest

from screl.config import RunConfig
from screl.data import check_events, parse_sampler_config, required_buffer_capacity, sampler_rules
from screl.data.events import CommitEvent, EvictEvent, ReserveEvent, SelectEvent, TrainStepEvent
from screl.rules import config_problems
from screl.threads import phases_overlap

FRESH = {"name": "custom", "target": "_custom_samplers:FreshOnly"}
PLAIN = {"name": "custom", "target": "_custom_samplers:PlainProtocol", "max_staleness_versions": 2}


@pytest.mark.parametrize(
    ("block", "capacity", "inflight", "needs_is", "drops", "overlaps", "line"),
    [
        ({"name": "in_order", "max_lookahead_versions": 0}, 4, 4, False, True, False,
         "dispatch leads the trainer by <= 0 version(s); staleness 0..0"),
        ({"name": "in_order", "max_lookahead_versions": 1, "warmup_lookahead_versions": 2}, 12, 12, True, True,
         True, "dispatch leads the trainer by <= 2 version(s); staleness 0..2"),
        ({"name": "weight_fifo", "max_staleness_versions": 2}, 12, 12, True, False, True,
         "dispatch leads the trainer by <= 2 version(s); staleness 0..2"),
        ({"name": "ready_first", "max_staleness_versions": 0}, 4, 4, True, False, False,
         "dispatch leads the trainer by <= 0 version(s); staleness 0..0"),
        ({"name": "windowed", "max_staleness_versions": 1, "over_sampling_ratio": 1.5}, 2, 8, True, False, True,
         "window [T-1, T]; dispatch ungated, at most 1.5 x a step outstanding"),
        (FRESH, 4, 4, True, False, False, "fresh groups only"),
        (PLAIN, 4, 12, False, True, True, "decided by the custom sampler"),
    ],
    ids=["sync", "in_order_warmup", "weight_fifo", "ready_first", "windowed", "custom_hooks", "custom_defaults"],
)
def test_each_sampler_answers_its_rules(
    block: dict[str, Any], capacity: int, inflight: int, needs_is: bool, drops: bool, overlaps: bool, line: str
) -> None:
    rules = sampler_rules(block, groups_per_step=4)
    assert required_buffer_capacity(parse_sampler_config(block), 4, min_groups=2) == capacity
    assert rules.inflight_bound(4) == inflight
    assert (rules.correction_needed() is not None) == needs_is
    assert rules.supports_drop_budgets is drops
    assert rules.overlaps_training() is overlaps
    assert rules.describe() == line


def _run(sampler: dict[str, Any], min_groups: int = 4) -> RunConfig:
    return RunConfig.from_dict({
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
        "async_rl": {"sampler": sampler, "min_groups_for_streaming_train": min_groups},
    })


def test_the_thread_plan_asks_the_sampler() -> None:
    assert phases_overlap(_run(FRESH)) is False  # the custom class says generation waits for training
    assert phases_overlap(_run(PLAIN)) is True  # no hook: the safe default splits the cores
    assert phases_overlap(_run(FRESH, min_groups=2)) is True  # streaming chunks overlap whatever the sampler


def _config(sampler: dict[str, Any], **rollout_failure: int) -> dict[str, Any]:
    return {
        "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
        "async_rl": {"sampler": sampler, "rollout_failure": rollout_failure},
        "model": {"init_args": {"loss_fn": {"init_args": {"use_importance_sampling_correction": False}}}},
    }


def test_config_check_asks_a_custom_sampler_for_its_needs() -> None:
    problems = {p.key: p for p in config_problems(_config(FRESH, max_skipped_prompts=1))}
    is_key = "model.init_args.loss_fn.init_args.use_importance_sampling_correction"
    assert problems[is_key].message == "fresh_only trains groups that finished after a refit"
    assert problems[is_key].fix == "turn it on"
    assert "fresh_only would wait forever" in problems["async_rl.rollout_failure.max_skipped_prompts"].message
    plain = {p.key for p in config_problems(_config(PLAIN, max_skipped_prompts=1))}
    assert is_key not in plain and "async_rl.rollout_failure.max_skipped_prompts" not in plain


def _fresh_log(select: str) -> list[Any]:
    return [
        TrainStepEvent(step=0, group_ids=()),
        ReserveEvent(group_id="old", prompt_id=0, start_weight=0),
        ReserveEvent(group_id="new", prompt_id=1, start_weight=1),
        CommitEvent(group_id="old", end_weight=1),
        CommitEvent(group_id="new", end_weight=1),
        SelectEvent(trainer_version=1, group_ids=(select,)),
    ]


def test_the_event_checker_replays_an_audited_custom_sampler() -> None:
    assert check_events(_fresh_log("new"), FRESH).ok
    bad = check_events(_fresh_log("old"), FRESH).violations
    assert [v.rule for v in bad] == ["select-rule"]
    assert "start_weight 0 is not the current weight 1" in bad[0].message
    evict_new = _fresh_log("old")[:-1] + [EvictEvent(group_id="new", trainer_version=1)]
    assert [v.rule for v in check_events(evict_new, FRESH).violations] == ["evict-rule"]
    # a sampler that is not audited: only the structural rules are checked
    assert check_events(_fresh_log("old"), PLAIN).ok
