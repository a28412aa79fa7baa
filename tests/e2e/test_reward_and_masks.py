"""Reward shaping/scaling and loss masks end to end: figures from metrics.csv and events.jsonl."""

from __future__ import annotations

import io
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import ray
from lightning.pytorch import Callback
from rich.console import Console

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events
from screl.dataplane import tq_actors_alive
from screl.envs import CountLetter

from .conftest import base_config, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


class _BarProbe(Callback):
    """What the progress bar shows when training ends: its class, label, count and total, and its text."""

    def __init__(self) -> None:
        self.seen: tuple[str, str, float, float | None] | None = None
        self.text = ""

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        bar = trainer.progress_bar_callback
        task = bar.progress.tasks[bar.train_progress_bar_id]
        self.seen = (type(bar).__name__, task.description, task.completed, task.total)
        console = Console(file=io.StringIO(), width=400, color_system=None)
        console.print(bar.progress.make_tasks_table([task]))
        self.text = console.file.getvalue()


def test_shaped_and_scaled_rewards_reach_the_trainer_and_the_raw_ones_are_kept(tmp_path: Path) -> None:
    """Also: what the model writes, as ``screl.callbacks.Completions`` logs it (figures each step, samples in
    ``completions.jsonl``), read back against the task's own reward of the logged text."""
    cfg = base_config(tmp_path / "run")
    cfg["trainer"].update(max_steps=3, enable_progress_bar=True,  # the bar counts RL steps against a total
                          callbacks=[{"class_path": "screl.callbacks.Completions",
                                      "init_args": {"every_n_steps": 1, "num_rows": 3}}])
    cfg["grpo"].update(max_num_steps=3,
                       reward_shaping={"enabled": True, "overlong_buffer_length": 4, "overlong_penalty_factor": 0.5},
                       reward_scaling={"enabled": True, "source_min": -1.0, "source_max": 1.0})
    probe = _BarProbe()
    run_dir = run_fit(cfg, tmp_path, callbacks=[probe])
    assert probe.seen == ("RichRLProgressBar", "RL steps", 3, 3)
    # the bar's text: count/total, elapsed and ETA, the rate in steps/s, and the rollout side's figures
    assert re.search(r"RL steps .* 3/3 \d+:\d\d:\d\d • 0:00:00 \d+\.\d\d steps/s", probe.text), probe.text
    for name in ("reward", "staleness", "buffer", "inflight"):
        assert re.search(rf"\b{name}: \d", probe.text), (name, probe.text)
    assert "v_num" not in probe.text and "Epoch" not in probe.text and "rollout/" not in probe.text
    rows = metrics(run_dir)
    shaped, raw = column(rows, "reward"), column(rows, "train/raw_reward")
    assert len(shaped) == len(raw) == 3
    # every completion is 8 tokens = max_new_tokens: the full penalty -0.5, then [-1, 1] -> [0, 1]
    for s, r in zip(shaped, raw, strict=True):
        assert s == pytest.approx((r - 0.5 + 1.0) / 2.0, abs=1e-6)
    assert column(rows, "train/truncated_fraction") == [1.0, 1.0, 1.0]
    assert check_events(run_dir, cfg["async_rl"]["sampler"], final=True).ok
    _check_completions(run_dir, rows)


def _check_completions(run_dir: Path, rows: list[dict[str, float]]) -> None:
    # every completion is exactly 8 tokens and cut at max_new_tokens
    for key, value in (("train/completion_length_mean", 8.0), ("train/completion_length_min", 8.0),
                       ("train/completion_length_max", 8.0), ("train/clipped_ratio", 1.0)):
        assert column(rows, key) == [value] * 3, key
    assert len(column(rows, "train/reward_std")) == len(column(rows, "train/zero_std_groups_ratio")) == 3
    samples = [json.loads(line) for line in (run_dir / "completions.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    task, texts = CountLetter(letter="a"), {}
    for record in task.prompts():
        texts[record.text] = record
    for s in samples:
        assert s["raw_reward"] == pytest.approx(task.reward(texts[s["prompt"]], s["completion"]), abs=1e-6)
        assert s["completion_tokens"] == 8 and len(s["completion"]) <= 8 and s["finish_reason"] == "length"
        assert s["staleness"] == s["step"] - s["version"] >= 0 and abs(s["advantage"]) < 10
        assert s["reward"] == pytest.approx((s["raw_reward"] - 0.5 + 1.0) / 2.0, abs=1e-6)
    out = subprocess.run([sys.executable, "-m", "screl.cli", "samples", str(run_dir), "--last", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.count("[completion]") == 2
    assert samples[-1]["completion"] in out.stdout and "step=2" in out.stdout


def test_a_run_whose_every_completion_is_filtered_stops_naming_the_step(tmp_path: Path) -> None:
    cfg = base_config(tmp_path / "run")
    cfg["grpo"]["overlong_filtering"] = True  # min_new_tokens = max_new_tokens: every completion is truncated
    with pytest.raises(RuntimeError, match=r"step 0: every sample is filtered out of the loss \(0 masked by the "
                                           r"task or environment, 8 truncated"):
        run_fit(cfg, tmp_path)
    assert tq_actors_alive() == [], "TransferQueue actors leaked"
    assert [a for a in ray.util.list_named_actors(all_namespaces=True) if "screl" in str(a)] == []
    run_dir = next((tmp_path / "run").rglob("events.jsonl")).parent
    assert [e for _, line in read_events(run_dir) if (e := parse_event(line)).name == "train_step"] == []
