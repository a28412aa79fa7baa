"""Fault injection: SIGKILL `screl fit` at seeded points in a row (every kind of point), resume each time, and
check nothing was lost or trained twice (the kill chain itself is in kill_chain.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from screl.checkpoint.store import CheckpointStore

from .conftest import recovery_config, with_snapshots
from .kill_chain import IN_ORDER, final_outcome, kill_chain

pytestmark = pytest.mark.slow


KINDS = ["generation", "mid_step", "checkpoint_write", "snapshot_write"]


@pytest.mark.parametrize("seed", [0])
def test_kill9_at_seeded_points_of_every_kind_loses_no_group(seed: int, tmp_path: Path) -> None:
    """Four kills in a row, each kind of point once, in a seeded order. With the other kill chains
    (tests/recovery/test_kill_resume_algos.py: 3 + 1 + 1; distillation, VLM: 1 each) the slow tier kills 11 runs at seeded points."""
    rng = random.Random(seed)
    ck_root = tmp_path / "bundles"
    steps = 30  # long enough that every incarnation reaches its kill point
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER))
    run_dir = tmp_path / "run"
    points = list(KINDS)
    rng.shuffle(points)
    kills = kill_chain(config, points, run_dir, ck_root, rng)
    assert sorted(set(kills)) == sorted(KINDS), f"not every kind of kill landed before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)
    store = CheckpointStore(str(ck_root))
    latest = store.latest()
    assert latest is not None and latest.step == steps
    # interrupted saves left temporary directories behind; none was ever selected, and retention swept them
    assert [p.name for p in ck_root.iterdir() if p.name.startswith("tmp_step_")] == []
