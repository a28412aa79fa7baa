"""Fault-injection fixtures: `screl fit` as a real subprocess, killed with SIGKILL, resumed."""

from __future__ import annotations

import csv
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import yaml
from _launch import launch

ROOT = Path(__file__).resolve().parents[2]


def recovery_config(base: Path, checkpoint_dir: str, *, steps: int, sampler: dict[str, Any] | None = None,
                    storage_options: dict[str, Any] | None = None, source: str = "grpo_tiny.yaml") -> Path:
    """A small checkpointed run of ``configs/<source>``: 4 prompts x 2 generations, a bundle every step, one
    shared events log."""
    cfg = yaml.safe_load((ROOT / "configs" / source).read_text())
    algo = "ppo" if "ppo" in cfg else "grpo"
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(base / "root"), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["data"]["init_args"]["generation"].update(max_new_tokens=8, min_new_tokens=8, injected_latency_s=0.2)
    cfg["data"]["init_args"].update(step_timeout_s=120, run_dir=str(base / "run"))
    cfg[algo].update(num_prompts_per_step=4, num_generations_per_prompt=2, max_num_steps=steps)
    cfg["async_rl"].update(min_groups_for_streaming_train=4, max_inflight_prompts=8, max_buffered_rollouts=8)
    if algo == "ppo":  # the critic warmup looks further ahead: room for its window
        cfg["async_rl"].update(max_inflight_prompts=12, max_buffered_rollouts=12)
    if sampler is not None:
        cfg["async_rl"]["sampler"] = sampler
        if sampler.get("max_lookahead_versions", sampler.get("max_staleness_versions", 1)) == 0:
            cfg["model"]["init_args"]["loss_fn"]["init_args"] = {"use_importance_sampling_correction": False}
    cfg["checkpointing"] = {"enabled": True, "checkpoint_dir": checkpoint_dir, "save_period": 1, "keep_top_k": 3,
                            "storage_options": storage_options or {}}
    base.mkdir(parents=True, exist_ok=True)
    path = base / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def start_fit(config: Path, log: Path, env: dict[str, str] | None = None) -> Any:
    """`screl fit` in its own session (so a kill takes its Ray processes with it, as a node loss would), forked
    from the test zygote where it can be (``tests/_launch.py``): a ``Popen``-like handle."""
    return launch(["-m", "screl.cli", "fit", "--config", str(config)], log, env=env)


def kill_tree(proc: Any) -> None:
    """SIGKILL the trainer and everything it started (Ray, TransferQueue, workers)."""
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for child in children:
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=60)
    psutil.wait_procs(children, timeout=30)


def count_events(run_dir: Path, name: str) -> int:
    path = run_dir / "events.jsonl"
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if f'"event":"{name}"' in line)


def wait_for(pred: Any, timeout: float, proc: Any = None, poll_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        if proc is not None and proc.poll() is not None:
            return bool(pred())
        time.sleep(poll_s)
    return False


def with_snapshots(config: Path, **changes: Any) -> Path:
    cfg = yaml.safe_load(config.read_text())
    cfg["rollout_checkpointing"] = {"snapshot_attempt_interval_s": 0.5, "keep_latest_k": 2, **changes}
    cfg["token_capture"] = {"enabled": True}
    config.write_text(yaml.safe_dump(cfg))
    return config


PARITY_KEYS = ("train/loss", "reward", "train/grad_norm")


def per_step(root: Path) -> dict[int, tuple[float, ...]]:
    """step -> (loss, reward, grad norm) over every metrics.csv under root (later runs override earlier)."""
    out: dict[int, tuple[float, ...]] = {}
    for path in sorted(root.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime):
        with path.open() as fh:
            for row in csv.DictReader(fh):
                if all(row.get(k) for k in PARITY_KEYS):
                    out[int(row["step"])] = tuple(float(row[k]) for k in PARITY_KEYS)
    return out


@pytest.fixture
def moto(tmp_path: Path) -> Iterator[Any]:
    """A real ``moto_server`` (:class:`~tests.recovery.moto_store.Moto`) with the bucket, killed at the end."""
    import fsspec

    from .moto_store import BUCKET, Moto

    server = Moto(tmp_path)
    server.start()
    fsspec.filesystem("s3", **server.options).mkdir(BUCKET)
    try:
        yield server
    finally:
        if server.proc is not None and server.proc.poll() is None:
            server.proc.kill()
            server.proc.wait(timeout=10)
