"""The kill chain with teachers (``screl.Distill``): a run killed while a rollout snapshot is being written resumes,
every incarnation starts its teacher worker again, and every row trained (restored or new) carries its teacher
logprobs: a row is only ever written with them, so the restored data plane holds no row without them.

The run uses ``estimator: top_k`` (4), whose rows carry the most: the teacher's logprob of each token and its top-4
tokens with their logprobs at each position (a trailing dimension), through the data plane, its snapshot and the
restore. ``sampled`` rows hold a subset of those fields and go through the same code."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import pytest
import yaml

from screl.checkpoint.store import CheckpointStore

from .conftest import ROOT, recovery_config, with_snapshots
from .kill_chain import IN_ORDER, final_outcome, kill_chain

pytestmark = pytest.mark.slow


def test_kill9_a_distillation_run_loses_no_group_and_trains_no_row_without_teacher_logprobs(tmp_path: Path) -> None:
    rng = random.Random(3)
    ck_root = tmp_path / "bundles"
    steps = 8
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER,
                                            source="distill_tiny.yaml"), snapshot_attempt_interval_s=0.1)
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["init_args"]["distillation"].update(estimator="top_k", top_k=4)
    teacher = cfg["model"]["init_args"]["distillation"]["teachers"][0]["policy"]["init_args"]
    teacher.update(path=str(ROOT / teacher["path"]), tokenizer_path=str(ROOT / teacher["tokenizer_path"]))
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    kills = kill_chain(config, ["snapshot_write"], run_dir, ck_root, rng)
    assert kills == ["snapshot_write"], f"the kill did not land before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)
    log = (tmp_path / "fit.log").read_text()
    assert log.count("1 teacher worker(s) started") == 2, "every incarnation starts its teacher"
    # Distill refuses a chunk without teacher_logprobs; every step of every incarnation logged the teacher's mean
    # logprob of the student's tokens, a real (negative) one
    logged, mass = [], []
    for path in (tmp_path / "root").rglob("metrics.csv"):
        with path.open() as fh:
            rows = list(csv.DictReader(fh))
        logged += [float(r["train/teacher_logprob"]) for r in rows if r.get("train/teacher_logprob")]
        mass += [float(r["train/teacher_top_k_mass"]) for r in rows if r.get("train/teacher_top_k_mass")]
    assert len(logged) >= steps and all(v < 0 for v in logged), logged
    # every step also trained on the top-4 rows (restored ones included): the teacher's mass on its 4 tokens
    assert len(mass) == len(logged) and all(0.0 < m <= 1.0 + 1e-5 for m in mass), mass
    latest = CheckpointStore(str(ck_root)).latest()
    assert latest is not None and latest.step == steps
