"""The kill chain on the multimodal config (``configs/grpo_vlm_tiny.yaml``): a run killed mid-step, with image rows
(pixel values and grids) in its data plane and rollout snapshots, resumes from its bundle, loses no group and trains
none twice; the resumed trainer recomputes its logprobs from the restored rows' own images (a row without them is
refused, so every trained step after the restore read them)."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest

from screl.checkpoint.store import CheckpointStore

from .conftest import recovery_config, with_snapshots
from .kill_chain import IN_ORDER, final_outcome, kill_chain

pytestmark = pytest.mark.slow


def test_kill9_a_vlm_run_loses_no_group_and_trains_nothing_twice(tmp_path: Path) -> None:
    rng = random.Random(5)
    ck_root = tmp_path / "bundles"
    steps = 4
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER,
                                            source="grpo_vlm_tiny.yaml"), snapshot_attempt_interval_s=0.2)
    run_dir = tmp_path / "run"
    kills = kill_chain(config, ["mid_step"], run_dir, ck_root, rng)
    assert kills == ["mid_step"], f"the kill did not land before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)
    mismatch = []
    for path in (tmp_path / "root").rglob("metrics.csv"):
        with path.open() as fh:
            mismatch += [float(r["train/logprob_mismatch"]) for r in csv.DictReader(fh)
                         if r.get("train/logprob_mismatch")]
    assert mismatch and max(mismatch) < 1e-4, mismatch  # the same images on both sides, before and after the kill
    latest = CheckpointStore(str(ck_root)).latest()
    assert latest is not None and latest.step == steps
