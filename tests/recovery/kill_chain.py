"""The kill chain: SIGKILL a fresh `screl fit` at seeded points in turn, then check nothing was lost."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import count_events, kill_tree, start_fit, wait_for

IN_ORDER = {"name": "in_order", "max_lookahead_versions": 1}


def tmp_bundle_exists(root: Path) -> bool:
    return root.is_dir() and any(p.name.startswith("tmp_step_") for p in root.iterdir())


def tmp_snapshot_exists(root: Path) -> bool:
    return root.is_dir() and any(True for _ in root.glob("*/rollout_snapshots/tmp_snapshot_*"))


def kill_at(point: str, proc: Any, run_dir: Path, ck_root: Path | None, rng: random.Random) -> bool:
    """Wait for the kill point, then SIGKILL the run; False when the run finished first."""
    reserves, selects = count_events(run_dir, "reserve"), count_events(run_dir, "select")
    if not wait_for(lambda: count_events(run_dir, "reserve") > reserves, 180, proc):
        return False
    if point == "generation":
        time.sleep(rng.uniform(0.0, 1.5))
    elif point == "mid_step":
        wait_for(lambda: count_events(run_dir, "select") > selects, 60, proc)
    elif point == "checkpoint_write" and ck_root is not None:
        wait_for(lambda: tmp_bundle_exists(ck_root), 60, proc, poll_s=0.002)
    elif point == "snapshot_write" and ck_root is not None:
        wait_for(lambda: tmp_snapshot_exists(ck_root), 60, proc, poll_s=0.002)
    if proc.poll() is not None:
        return False
    kill_tree(proc)
    return True


def final_outcome(run_dir: Path, steps: int, sampler: dict[str, Any]) -> None:
    report = check_events(run_dir, sampler)
    assert report.ok, report.format()
    events = [parse_event(line) for _, line in read_events(run_dir)]
    restores = [e for e in events if e.name == "restore"]
    assert restores, "no resume happened"
    # after each restore, the steps it resumed from are trained again; the surviving history covers 0..steps-1
    last_restore = max(i for i, e in enumerate(events) if e.name == "restore")
    resumed_at = events[last_restore].step
    after = [e.step for e in events[last_restore:] if e.name == "train_step"]
    assert after == list(range(resumed_at, steps))


def kill_chain(config: Path, points: list[str], run_dir: Path, ck_root: Path, rng: random.Random) -> list[str]:
    """SIGKILL a fresh `screl fit` at each point in turn, then let a last one finish; returns the kills that
    landed (a run that finishes before its point ends the chain)."""
    log = config.parent / "fit.log"
    kills = []
    for point in points:
        proc = start_fit(config, log)
        if not kill_at(point, proc, run_dir, ck_root, rng):
            assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
            break
        kills.append(point)
    final = start_fit(config, log)
    assert final.wait(timeout=900) == 0, log.read_text()[-3000:]
    return kills
