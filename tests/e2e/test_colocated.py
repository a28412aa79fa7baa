"""Colocated generation end to end (``configs/grpo_colocated_tiny.yaml``): the engine decodes with the trainer's
module in the trainer's process, stands down for each train step and wakes after the refit.

One run covers the topology's promises: the reward rises, validation during training works, the event audit
passes, no generation worker exists at any step (no named worker actor, no worker process under this cluster's
raylet), and a rollout deadline shorter than a (slowed) train step does not fire on the next step's requests in
flight across it. A sync run then matches the same run disaggregated, step for step."""

from __future__ import annotations

import copy
import time
from pathlib import Path
from typing import Any

import psutil
import pytest
import ray
import yaml
from lightning.pytorch import Callback

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

SLOW_STEPS = (2, 3, 4)
"""Train steps held for :data:`HOLD_S`, longer than the rollout deadline."""
HOLD_S = 2.5
ROLLOUT_TIMEOUT_S = 1.5


def _config(run_dir: Path, steps: int) -> dict[str, Any]:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_colocated_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(run_dir), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"]["max_num_steps"] = steps
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    return copy.deepcopy(cfg)


def _worker_processes() -> list[str]:
    """Command lines of generation-worker processes under this driver (its Ray cluster's raylet starts them, or its
    worker zygote forks them)."""
    out = []
    for p in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if "GenerationWorker" in cmd:
            out.append(cmd)
    return out


class Watch(Callback):
    """At every train step: no generation worker exists; on :data:`SLOW_STEPS` the step takes :data:`HOLD_S`."""

    def __init__(self) -> None:
        self.checked = 0

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        named = [a for a in ray.util.list_named_actors(all_namespaces=True) if "generation" in str(a)]
        assert named == [], named
        assert _worker_processes() == []
        self.checked += 1
        if trainer.global_step in SLOW_STEPS:
            time.sleep(HOLD_S)


def test_colocated_learns_validates_audits_and_freezes_deadlines(tmp_path: Path) -> None:
    steps = 12
    cfg = _config(tmp_path, steps)
    cfg["data"]["init_args"]["task"]["init_args"]["holdout"] = 8
    cfg["data"]["init_args"]["generation"]["rollout_timeout_s"] = ROLLOUT_TIMEOUT_S
    cfg["grpo"].update(val_period=4, validation={"num_samples": 2, "temperature": 1.0})
    watch = Watch()
    run_dir = run_fit(cfg, tmp_path, callbacks=[watch])
    assert watch.checked == steps
    rows = metrics(run_dir)
    reward = column(rows, "train/raw_reward")
    assert len(reward) == steps
    assert sum(reward[-3:]) / 3 > sum(reward[:3]) / 3 + 0.03, reward
    assert max(column(rows, "train/logprob_mismatch")) < 1e-5  # the engine decodes with the trainer's module
    # each step's generation phase, stood-down time left out (0 where the lookahead had the step's batch ready)
    busy = column(rows, "rollout/engine_busy_s")
    assert len(busy) == steps and min(busy) >= 0 and sum(busy) > 0 and max(busy) < HOLD_S, busy
    made = column(rows, "rollout/engine_tokens")  # the tokens its calls returned in that phase
    # every trained row's call returned before its step's stand-down: 8 groups of 4 x 16 tokens a step, at least
    assert len(made) == steps and sum(made) >= 8 * 4 * 16 * steps, made
    validated = [(r["step"], r["val/version"]) for r in rows if "val/version" in r]
    assert validated == [(4.0, 4.0), (8.0, 8.0), (12.0, 12.0)], validated
    events = [parse_event(line) for _, line in read_events(run_dir)]
    timeouts = [e for e in events if e.name == "fail" and e.reason == "timeout"]
    assert timeouts == [], timeouts  # the next step's requests sat out HOLD_S > rollout_timeout_s, frozen
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report


def test_a_sync_colocated_run_matches_the_disaggregated_run(tmp_path: Path) -> None:
    """Sync (no lookahead), the same seeds: the colocated engine (the trainer's module) and a worker (a copy
    refitted every step) sample the same tokens, so the steps' rewards and the event trace agree."""
    runs = {}
    for colocated in (True, False):
        cfg = _config(tmp_path / str(colocated), 4)
        cfg["async_rl"].update(sampler={"name": "in_order", "max_lookahead_versions": 0}, max_inflight_prompts=8,
                               max_buffered_rollouts=8)
        cfg["data"]["init_args"]["generation"]["colocated"]["enabled"] = colocated
        (tmp_path / str(colocated)).mkdir()
        run_dir = run_fit(cfg, tmp_path / str(colocated))
        trace = [(e.name, getattr(e, "prompt_id", None)) for e in
                 (parse_event(line) for _, line in read_events(run_dir)) if e.name in ("reserve", "train_step")]
        runs[colocated] = (column(metrics(run_dir), "train/raw_reward"), trace)
    assert runs[True][1] == runs[False][1]
    assert runs[True][0] == pytest.approx(runs[False][0], abs=1e-6)
