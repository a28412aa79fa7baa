"""What a TRL user writes, end to end: ``configs/grpo_trl_style_tiny.yaml`` (a conversational dataset with string ids,
reward functions with weights, one returning None, a cosine schedule with warmup) trains on CPU, with a wandb logger
in offline mode holding the metrics and the completions table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from screl.data.event_check import check_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_the_trl_style_config_learns_and_logs_what_it_writes(tmp_path: Path) -> None:
    data = tmp_path / "data"
    subprocess.run([sys.executable, str(ROOT / "examples" / "make_trl_style_data.py"), "--out", str(data)],
                   check=True, capture_output=True)
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_trl_style_tiny.yaml").read_text())
    cfg["data"]["init_args"]["task"]["init_args"]["path"] = str(data)
    cfg["trainer"].update(default_root_dir=str(tmp_path / "root"), enable_progress_bar=False,
                          logger=[{"class_path": "lightning.pytorch.loggers.CSVLogger",
                                   "init_args": {"save_dir": str(tmp_path / "root")}},
                                  {"class_path": "lightning.pytorch.loggers.WandbLogger",
                                   "init_args": {"offline": True, "save_dir": str(tmp_path / "wandb"),
                                                 "project": "screl-tests"}}])
    run_dir = run_fit(cfg, tmp_path)
    rows = metrics(run_dir)
    reward = column(rows, "reward")
    assert len(reward) == 40
    # the untrained policy's first steps are the control, measured the same way
    first, last = sum(reward[:8]) / 8, sum(reward[-8:]) / 8
    assert last > first + 0.4, (first, last)
    lr = column(rows, "train/lr")  # 4 warmup steps to 3e-3, then cosine to 0 at step 40
    assert lr[:4] == pytest.approx([0.00075, 0.0015, 0.00225, 0.003], rel=1e-12) and lr[-1] < 1e-4
    for name in ("letter_share", "starts_with_letter"):
        assert len(column(rows, f"train/rewards/{name}/mean")) > 10, name
    assert check_events(run_dir, cfg["async_rl"]["sampler"], final=True).ok
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {0, 5, 10, 15, 20, 25, 30, 35} and len(samples) == 32
    assert all(s["prompt"].startswith("<bos>") and "assistant" in s["prompt"] for s in samples)  # chat-rendered
    # each reward function's own value beside the row's reward, which is their weighted sum (a None counts 0, as in TRL)
    for s in samples:
        share, starts = s["rewards/letter_share"], s["rewards/starts_with_letter"]
        assert share is not None and (starts is None) == (s["completion"] == ""), s
        assert s["raw_reward"] == pytest.approx(1.0 * share + 0.2 * (starts or 0.0), abs=1e-6), s
    assert len({s["rewards/letter_share"] for s in samples}) > 1  # the values differ row to row
    _check_wandb(tmp_path / "wandb")


def _check_wandb(root: Path) -> None:
    """The offline run: its summary (the SDK's, in this process) holds the last metrics; its media folder the
    completions tables, one per logged step."""
    import wandb

    assert wandb.run is not None
    summary, files = dict(wandb.run.summary), Path(wandb.run.dir)  # the run's own folder, wherever wandb put it
    wandb.finish()
    assert summary["reward"] > 0.5 and "train/rewards/letter_share/mean" in summary and "train/lr" in summary
    assert summary["completions"]["_type"] == "table-file"
    tables = sorted((files / "media" / "table").glob("completions_*.table.json"))
    assert len(tables) == 8, tables
    table = json.loads(tables[-1].read_text())
    assert table["columns"][:3] == ["step", "prompt", "completion"] and len(table["data"]) == 4
