"""A mixture-of-experts policy with rollout routing replay end to end (``configs/grpo_moe_tiny.yaml``, shortened):
the engine decodes a tiny Qwen3-MoE in bf16 and records its routing, the rows carry it, the fp32 trainer replays
it. The reward rises and the event audit passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from screl.data.event_check import check_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 16


def test_moe_with_routing_replay_learns_and_audits(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_moe_tiny.yaml").read_text())
    assert cfg["model"]["init_args"]["routing_replay"] is True
    cfg["trainer"].update(max_steps=STEPS, default_root_dir=str(tmp_path), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"]["max_num_steps"] = STEPS
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    run_dir = run_fit(cfg, tmp_path)
    rows = metrics(run_dir)
    reward = column(rows, "reward")
    assert len(reward) == STEPS
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.1, reward
    # the engine's and the trainer's logprobs stay close (the raw IS weights are near uniform, and almost none fall
    # outside is_truncation's bound: 2.0); is_weight_max is the raw weight, which may pass the bound now and then
    assert min(column(rows, "train/is_ess")) > 0.9, column(rows, "train/is_ess")
    oob = column(rows, "train/is_oob_fraction")
    assert len(oob) == STEPS and max(oob) < 0.01, oob
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
