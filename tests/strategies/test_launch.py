"""``screl fit`` with ``trainer.devices: 2``: Lightning starts the second rank itself, and nothing listens beyond
loopback while it runs (the ranks rendezvous through a file, Ray binds 127.0.0.1)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml
from screl.strategies.launch import INIT_FILE_ENV

from screl.dataplane.cluster import listening_addresses

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = ("127.0.0.1", "::1", "::ffff:127.0.0.1")


def _config(tmp_path: Path) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_megatron_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=2, default_root_dir=str(tmp_path / "root"), enable_progress_bar=False)
    cfg["grpo"].update(max_num_steps=2, num_prompts_per_step=4)
    cfg["async_rl"].update(min_groups_for_streaming_train=4, max_inflight_prompts=8, max_buffered_rollouts=8)
    cfg["data"]["init_args"]["generation"].update(max_new_tokens=8, min_new_tokens=8)
    cfg["data"]["init_args"]["run_dir"] = str(tmp_path / "run")
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.slow
def test_screl_fit_starts_two_ranks_on_loopback(tmp_path: Path) -> None:
    log = tmp_path / "fit.log"
    env = {k: v for k, v in os.environ.items() if k not in (INIT_FILE_ENV, "LOCAL_RANK", "MASTER_PORT")}
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "screl.cli", "fit", "--config", str(_config(tmp_path))],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    wide, ranks = [], 1
    try:
        while proc.poll() is None:
            tree = {proc.pid} | {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
            wide += [a for a in listening_addresses(tree) if a[1] not in LOOPBACK]
            ranks = max(ranks, sum(1 for p in tree if _is_rank(p)))
            time.sleep(0.5)
    finally:
        if proc.poll() is None:
            proc.kill()
    text = log.read_text()
    assert proc.wait(timeout=600) == 0, text[-3000:]
    assert not wide, f"listening beyond loopback: {sorted(set(wide))}"
    assert ranks == 2, "Lightning did not start the second rank"
    assert (tmp_path / "run" / "events.jsonl").read_text().count('"event":"train_step"') == 2


def _is_rank(pid: int) -> bool:
    try:
        cmd = psutil.Process(pid).cmdline()
    except psutil.Error:
        return False
    return "screl.cli" in cmd and "fit" in cmd
