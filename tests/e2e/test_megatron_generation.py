"""Megatron generation end to end, each shipped config as a real 2-rank ``screl fit`` (TP=2 training on CPU):

- ``configs/grpo_megatron_generation_tiny.yaml``: a Ray generation worker decodes with its own GPTModel (TP=1),
  refitted in Megatron's names every step;
- ``configs/grpo_megatron_colocated_tiny.yaml``: the trainer's two ranks generate with their own shards between
  train steps (rank 0 leads, rank 1 follows each forward), with validation during training.

Each: the reward rises, ``screl events check --final`` passes; colocated, no generation worker process exists at
any poll of the run's process tree, and validation lands at the steps it validated."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from _launch import launch

from screl.data.event_check import check_events

from .conftest import ROOT, column, metrics

pytestmark = pytest.mark.slow

STEPS = 8


def _fit(config: str, tmp_path: Path, holdout: int = 0, **changes: Any) -> tuple[Path, int]:
    """Run the config (``changes`` merged into ``grpo``; ``holdout`` prompts of the task held out for validation) as
    a subprocess; returns its run directory and how many polls of its process tree saw a generation-worker process."""
    cfg = yaml.safe_load((ROOT / "configs" / config).read_text())
    cfg["trainer"].update(max_steps=STEPS, default_root_dir=str(tmp_path / "root"), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"].update(max_num_steps=STEPS, **changes)
    if holdout:
        cfg["data"]["init_args"]["task"]["init_args"]["holdout"] = holdout
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = launch(["-m", "screl.cli", "fit", "--config", str(path)], tmp_path / "fit.log")
    seen = 0
    try:
        while proc.poll() is None:
            seen += any("GenerationWorker" in " ".join(_cmdline(p)) for p in _tree(proc.pid))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.wait(timeout=600) == 0, (tmp_path / "fit.log").read_text()[-3000:]
    return tmp_path / "root" / "lightning_logs" / "version_0", seen  # the run directory: events and metrics


def _tree(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


def _cmdline(p: psutil.Process) -> list[str]:
    try:
        return p.cmdline()
    except psutil.Error:
        return []


def _rises(run_dir: Path) -> list[float]:
    reward = column(metrics(run_dir), "train/raw_reward")
    assert len(reward) == STEPS
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.02, reward
    return reward


def test_megatron_worker_generation_learns_and_audits(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_megatron_generation_tiny.yaml").read_text())
    run_dir, seen = _fit("grpo_megatron_generation_tiny.yaml", tmp_path)
    assert seen > 0  # the Megatron engine runs in a Ray generation worker
    _rises(run_dir)
    assert max(column(metrics(run_dir), "train/logprob_mismatch")) < 1e-5  # the worker holds the trainer's weights
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()


def test_megatron_colocated_generation_learns_validates_and_audits(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_megatron_colocated_tiny.yaml").read_text())
    run_dir, seen = _fit("grpo_megatron_colocated_tiny.yaml", tmp_path, holdout=8, val_period=4,
                         validation={"num_samples": 2, "temperature": 1.0})
    assert seen == 0  # no generation worker: the trainer's ranks generate
    _rises(run_dir)
    rows = metrics(run_dir)
    assert max(column(rows, "train/logprob_mismatch")) < 1e-5  # the engine decodes with the trainer's shards
    validated = [(r["step"], r["val/version"]) for r in rows if "val/version" in r]
    assert validated == [(4.0, 4.0), (8.0, 8.0)], validated
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
