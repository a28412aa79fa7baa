"""Periodic rollout snapshots, and the bootstrap fingerprint and restore modes (a kill and resume on S3, with bundles
ranked by a metric, is tests/recovery/test_storage_faults_e2e.py's object-store outage)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from _launch import launch

from screl.checkpoint.store import CheckpointStore
from screl.data.event_check import check_events
from screl.data.events import parse_event, read_events

from .conftest import count_events, kill_tree, recovery_config, start_fit, wait_for, with_snapshots

pytestmark = pytest.mark.slow

IN_ORDER = {"name": "in_order", "max_lookahead_versions": 1}


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()}


def _bootstrap_snapshots(ck_root: Path) -> list[Path]:
    base = ck_root / "bootstrap" / "rollout_snapshots"
    return sorted(base.glob("snapshot_*")) if base.is_dir() else []


def _crash_before_first_step(tmp_path: Path) -> tuple[Path, Path]:
    """A run that is killed after bootstrap snapshots were published and before its first trainer bundle."""
    ck_root = tmp_path / "bundles"
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=4, sampler=IN_ORDER))
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["generation"]["injected_latency_s"] = 4.0  # the first step takes a while
    config.write_text(yaml.safe_dump(cfg))
    proc = start_fit(config, tmp_path / "fit.log")
    assert wait_for(lambda: len(_bootstrap_snapshots(ck_root)) >= 1 and count_events(tmp_path / "run", "commit") >= 1,
                    240, proc), (tmp_path / "fit.log").read_text()[-3000:]
    assert not (ck_root / "step_1").exists()
    kill_tree(proc)
    return config, ck_root


def test_bootstrap_state_restore_modes_and_fingerprint(tmp_path: Path) -> None:
    config, ck_root = _crash_before_first_step(tmp_path)
    before = _tree(ck_root)
    log = tmp_path / "fit.log"

    # trainer_checkpoint with only bootstrap state: fails, names the fix, modifies nothing
    strict = tmp_path / "strict.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["rollout_checkpointing"]["restore_mode"] = "trainer_checkpoint"
    strict.write_text(yaml.safe_dump(cfg))
    proc = start_fit(strict, tmp_path / "strict.log")
    assert proc.wait(timeout=300) != 0
    out = (tmp_path / "strict.log").read_text()
    assert "cannot start a fresh bootstrap lineage" in out and "Existing state was not modified" in out
    assert _tree(ck_root) == before

    # a semantic change (temperature) rejects bootstrap recovery and names the key, read-only
    changed = tmp_path / "changed.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["generation"]["temperature"] = 0.7
    changed.write_text(yaml.safe_dump(cfg))
    proc = start_fit(changed, tmp_path / "changed.log")
    assert proc.wait(timeout=300) != 0
    out = (tmp_path / "changed.log").read_text()
    assert "data.init_args.generation.temperature: 1.0 -> 0.7" in out
    assert _tree(ck_root) == before

    # latest recovers the bootstrap snapshot (operational changes are fine) and the run completes
    ok = tmp_path / "ok.yaml"
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["generation"]["injected_latency_s"] = 0.2  # operational
    cfg["ray"] = {"num_cpus": 7}  # operational
    ok.write_text(yaml.safe_dump(cfg))
    proc = start_fit(ok, log)
    assert proc.wait(timeout=600) == 0, log.read_text()[-3000:]
    assert "resuming from" in log.read_text() and "bootstrap" in log.read_text()
    events = [parse_event(line) for _, line in read_events(tmp_path / "run")]
    restore = [e for e in events if e.name == "restore"]
    assert restore and restore[0].step == 0
    report = check_events(tmp_path / "run", IN_ORDER)
    assert report.ok, report.format()


_HOLD_AFTER_SNAPSHOT = """
import sys, time
from pathlib import Path
from lightning.pytorch import Callback
from screl.cli import ScrelCLI

class HoldAfterSnapshot(Callback):
    # before step 3 trains (bundle step_2 is the newest): wait for a snapshot under it, then hang until killed,
    # so no newer bundle can be published between that snapshot and the kill
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.global_step == 2:
            while not list(Path(sys.argv[2]).glob("step_2/rollout_snapshots/snapshot_*")):
                time.sleep(0.05)
            Path(sys.argv[3]).write_text("held")
            time.sleep(3600)

cli = ScrelCLI(args=["--config", sys.argv[1]], run=False)
cli.trainer.callbacks.append(HoldAfterSnapshot())
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
"""


def test_snapshot_under_trainer_anchor_carries_newer_rollouts(tmp_path: Path) -> None:
    ck_root = tmp_path / "bundles"
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=6, sampler=IN_ORDER),
                            snapshot_attempt_interval_s=0.2)
    driver, marker = tmp_path / "hold.py", tmp_path / "held"
    driver.write_text(_HOLD_AFTER_SNAPSHOT)
    proc = launch([str(driver), str(config), str(ck_root), str(marker)], tmp_path / "fit.log")
    assert wait_for(marker.exists, 300, proc), (tmp_path / "fit.log").read_text()[-3000:]
    kill_tree(proc)
    latest = CheckpointStore(str(ck_root)).latest()
    assert latest is not None and latest.step == 2, latest
    proc = start_fit(config, tmp_path / "fit.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "fit.log").read_text()[-3000:]
    assert "step_2/rollout_snapshots/snapshot_" in (tmp_path / "fit.log").read_text()  # resumed from the snapshot
    report = check_events(tmp_path / "run", IN_ORDER)
    assert report.ok, report.format()


_SNAPSHOT_MID_STEP = """
import sys, time
from pathlib import Path
from lightning.pytorch import Callback
from screl.cli import ScrelCLI

class SnapshotMidStep(Callback):
    # at the start of step 1 the step's groups are claimed: snapshot now, then hang until killed
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if pl_module.global_step == 1:
            outcome = trainer.datamodule.runtime.snapshot_now()
            Path(sys.argv[2]).write_text(outcome)
            time.sleep(3600)

cli = ScrelCLI(args=["--config", sys.argv[1]], run=False)
cli.trainer.callbacks.append(SnapshotMidStep())
cli.trainer.fit(cli.model, datamodule=cli.datamodule)
"""


def test_snapshot_taken_mid_step_restores_the_open_steps_groups(tmp_path: Path) -> None:
    """A snapshot captured while a step holds its claims rolls that step back: its groups come back as ready
    (in the replay index, checked against the data plane) and train exactly once after the resume."""
    import torch

    ck_root = tmp_path / "bundles"
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=4, sampler=IN_ORDER),
                            snapshot_attempt_interval_s=3600.0)  # only the snapshot the callback takes
    driver, marker = tmp_path / "driver.py", tmp_path / "snapshot_outcome"
    driver.write_text(_SNAPSHOT_MID_STEP)
    proc = launch([str(driver), str(config), str(marker)], tmp_path / "fit.log")
    assert wait_for(marker.exists, 300, proc), (tmp_path / "fit.log").read_text()[-3000:]
    kill_tree(proc)
    assert marker.read_text() == "completed"
    [snapshot] = sorted(ck_root.glob("step_1/rollout_snapshots/snapshot_*"))
    claimed = [e.group_ids for e in (parse_event(line) for _, line in read_events(tmp_path / "run"))
               if e.name == "select"][-1]
    replay = torch.load(snapshot / "replay_buffer_metadata.pt", weights_only=False)
    assert set(claimed) <= {g["group_id"] for g in replay["groups"]}  # the open step's groups, rolled back

    proc = start_fit(config, tmp_path / "fit.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "fit.log").read_text()[-3000:]
    assert "rollout_snapshots/snapshot_" in (tmp_path / "fit.log").read_text()
    events = [parse_event(line) for _, line in read_events(tmp_path / "run")]
    [restore] = [e for e in events if e.name == "restore"]
    assert set(claimed) <= set(restore.group_ids or ())
    report = check_events(tmp_path / "run", IN_ORDER)
    assert report.ok, report.format()
