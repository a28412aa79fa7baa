"""Dynamic sampling with the replacement reserve end to end: figures from events.jsonl and metrics.csv."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import base_config, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def dynamic_config(run_dir: Path, steps: int = 4) -> dict[str, Any]:
    """base_config with a pass/fail reward (at least one 'a' in 8 characters): about a third of the untrained
    policy's groups of four agree (all fail, mostly) and are filtered."""
    cfg = base_config(run_dir)
    cfg["trainer"]["max_steps"] = steps
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.CountLetter",
                                        "init_args": {"letter": "a", "threshold": 0.125}}
    cfg["grpo"].update(use_dynamic_sampling=True, max_num_steps=steps, num_generations_per_prompt=4)
    cfg["async_rl"]["rollout_failure"] = {"on_dropped_prompt": "replace", "replacement_reserve_prompts": 4,
                                          "max_replacement_attempts": 12, "min_step_batch_fraction": 0.5}
    return cfg


def _events(run_dir: Path) -> list[Any]:
    return [parse_event(line) for _, line in read_events(run_dir)]


def test_filtered_groups_are_replaced_and_every_prompt_is_accounted_for(tmp_path: Path) -> None:
    cfg = dynamic_config(tmp_path / "run")
    run_dir = run_fit(cfg, tmp_path)
    events = _events(run_dir)
    filtered = [e for e in events if e.name == "drop" and e.reason == "filtered"]
    replaced = [e for e in events if e.name == "replace"]
    assert filtered, "the pass/fail reward filters some groups"
    committed = {e.group_id for e in events if e.name == "commit"}
    assert not committed & {e.group_id for e in filtered}, "a filtered group never reaches the buffer"
    assert {e.extra["reward"] for e in filtered} <= {0.0, 1.0}
    # a replacement names a group filtered just before it, and keeps its step's stamp
    stamps = {e.group_id: e.target_step for e in events if e.name == "reserve"}
    assert all(stamps[r.group_id] == r.target_step for r in replaced)
    steps = [e for e in events if e.name == "train_step"]
    assert [len(s.group_ids) for s in steps] == [4] * 4, "every step kept its full size"
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
    assert report.prompts["replacements"] == len(replaced) and report.prompts["spares"] >= 4
    # trained groups had reward spread: every trained group's commit shows a mean strictly inside (0, 1)
    means = {e.group_id: e.extra["reward_mean"] for e in events if e.name == "commit"}
    assert all(0.0 < means[g] < 1.0 for s in steps for g in s.group_ids)
    rows = metrics(run_dir)
    logged_filtered, logged_replaced = column(rows, "rollout/filtered"), column(rows, "rollout/replaced")
    assert len(logged_filtered) == 4 and logged_filtered == sorted(logged_filtered), "a running count per step"
    assert 0 < logged_filtered[-1] <= len(filtered) and logged_replaced[-1] <= len(replaced)
