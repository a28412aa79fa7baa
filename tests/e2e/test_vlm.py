"""Multimodal GRPO end to end (``configs/grpo_vlm_tiny.yaml``, shortened): the worker draws ShapesTask's images and
processes them, the engine generates with them, the rows carry the pixel values and grids through the data plane,
the trainer recomputes the logprobs on the same images. The reward rises and the event audit passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from screl.data.event_check import check_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 24


def test_vlm_grpo_learns_to_count_shapes_and_audits(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_vlm_tiny.yaml").read_text())
    assert cfg["model"]["init_args"]["policy"]["class_path"] == "screl.models.TinyVisionLM"
    cfg["trainer"].update(max_steps=STEPS, default_root_dir=str(tmp_path), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"].update(max_num_steps=STEPS, num_prompts_per_step=8)  # half the config's images a step: a shorter test
    cfg["async_rl"].update(min_groups_for_streaming_train=8, max_inflight_prompts=16, max_buffered_rollouts=16)
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    run_dir = run_fit(cfg, tmp_path)
    rows = metrics(run_dir)
    reward = column(rows, "reward")
    assert len(reward) == STEPS
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    assert last > first + 0.08, reward
    # engine and trainer agree on the tokens the current version generated (same images, fp32 both sides)
    assert max(column(rows, "train/logprob_mismatch")) < 1e-4
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
