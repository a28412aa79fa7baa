"""PPO end to end: configs/ppo_tiny.yaml trains (value loss falls, reward rises), warmup leaves no refit."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch import Callback

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


class _PolicyAtWarmupEnd(Callback):
    """The policy's weights before the first step and after the last warmup step."""

    def __init__(self, start: int) -> None:
        self.start = start
        self.before: dict[str, torch.Tensor] = {}
        self.after_warmup: dict[str, torch.Tensor] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.before = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if int(batch["trainer_version"]) == self.start - 1:
            self.after_warmup = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}


def test_ppo_tiny_trains_and_its_warmup_leaves_the_policy_alone(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "ppo_tiny.yaml").read_text())
    cfg["trainer"].update(default_root_dir=str(tmp_path / "run"), enable_progress_bar=False)
    start = cfg["ppo"]["policy_training_start_step"]
    probe = _PolicyAtWarmupEnd(start)
    run_dir = run_fit(cfg, tmp_path, callbacks=[probe])
    rows = metrics(run_dir)
    rewards, value_loss = column(rows, "reward"), column(rows, "critic/value_loss")
    steps = cfg["ppo"]["max_num_steps"]
    assert len(rewards) == len(value_loss) == steps
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.5, rewards
    assert sum(value_loss[-10:]) / 10 < 0.1 * max(value_loss), value_loss  # the critic catches up with the policy
    assert column(rows, "ppo/policy_frozen")[:start] == [1.0] * start
    assert column(rows, "ppo/policy_updates")[-1] == (steps - start) * cfg["ppo"]["ppo_epochs"]
    assert column(rows, "ppo/critic_updates")[-1] == steps * cfg["ppo"]["critic_ppo_epochs"]

    assert probe.after_warmup and all(torch.equal(v, probe.before[k]) for k, v in probe.after_warmup.items())
    events = [parse_event(line) for _, line in read_events(run_dir)]
    refits = [e.trainer_version for e in events if e.name == "refit"]
    assert refits == list(range(start + 1, steps + 1)), "a warmup step was refit"
    windows = [(e.trainer_version, e.window) for e in events if e.name == "window"]
    sampler = cfg["async_rl"]["sampler"]
    assert windows == [(0, sampler["warmup_lookahead_versions"]), (start, sampler["max_lookahead_versions"])]
    report = check_events(run_dir, sampler, final=True)
    assert report.ok, report.format()


def test_ppo_with_dynamic_sampling_refills_every_filtered_slot(tmp_path: Path) -> None:
    """PPO keeps full steps: filtered groups (a pass/fail reward: one 'a' in 16 characters, which about a third of
    the untrained policy's completions pass) are replaced, never shrink the step."""
    cfg = yaml.safe_load((ROOT / "configs" / "ppo_tiny.yaml").read_text())
    steps = 4
    cfg["trainer"].update(default_root_dir=str(tmp_path / "run"), enable_progress_bar=False, max_steps=steps)
    cfg["data"]["init_args"]["task"]["init_args"] = {"letter": "a", "threshold": 0.0625}
    cfg["ppo"].update(max_num_steps=steps, use_dynamic_sampling=True)
    cfg["async_rl"]["rollout_failure"] = {"on_dropped_prompt": "replace", "replacement_reserve_prompts": 8,
                                          "max_replacement_attempts": 16}
    run_dir = run_fit(cfg, tmp_path)
    events = [parse_event(line) for _, line in read_events(run_dir)]
    filtered = [e.group_id for e in events if e.name == "drop" and e.reason == "filtered"]
    assert filtered and sorted(filtered) == sorted(e.group_id for e in events if e.name == "replace")
    P = cfg["ppo"]["num_prompts_per_step"]
    assert [len(e.group_ids) for e in events if e.name == "train_step"] == [P] * steps
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
    assert len(column(metrics(run_dir), "critic/value_loss")) == steps
