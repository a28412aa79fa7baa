"""Multimodal GRPO end to end (``configs/grpo_vlm_tiny.yaml``, shortened): the worker draws ShapesTask's images and
processes them, the engine generates with them, the rows carry the pixel values and grids through the data plane,
the trainer recomputes the logprobs on the same images. The reward rises above what a policy blind to the images can
reach (the majority answer's share: the task's answers are balanced) and the event audit passes."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from screl.data.event_check import check_events
from screl.envs import ShapesTask

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 160  # bench/vlm_learning.py: over steps 140-160 the image runs score 0.72-0.76, their blind controls 0.43-0.46
MARGIN = 0.1


def test_vlm_grpo_learns_to_count_shapes_and_audits(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_vlm_tiny.yaml").read_text())
    assert cfg["model"]["init_args"]["policy"]["class_path"] == "screl.models.TinyVisionLM"
    cfg["trainer"].update(max_steps=STEPS, default_root_dir=str(tmp_path), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"].update(max_num_steps=STEPS)
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    task = ShapesTask(**cfg["data"]["init_args"]["task"]["init_args"])
    answers = [r.metadata["answer"] for r in task.prompts()]
    majority = max(answers.count(a) for a in set(answers)) / len(answers)  # the best a blind policy can score
    assert majority == 0.5
    run_dir = run_fit(cfg, tmp_path)
    rows = metrics(run_dir)
    reward = column(rows, "reward")
    assert len(reward) == STEPS
    last = sum(reward[-20:]) / 20
    assert last >= majority + MARGIN, reward
    # engine and trainer agree on the tokens the current version generated (same images, fp32 both sides)
    assert max(column(rows, "train/logprob_mismatch")) < 1e-4
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
