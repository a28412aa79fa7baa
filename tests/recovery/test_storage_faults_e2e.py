"""Storage faults end to end (issue 40, item 2): a real ``screl fit`` (subprocess, loopback Ray, TransferQueue) whose
bundle save hits a full disk, first in the model part of a bundle, then, in the resumed run, in the bundle's
TransferQueue snapshot (the data-plane part). ``tests/recovery/test_storage_faults.py`` covers each kind of part
and the object store on the store's own code; this is the trainer's side of it.

Each time, per docs/failures.md: the run stops with ``CheckpointSaveError`` naming the bundle, the cause and the
bundle it will resume from; nothing of the failed bundle is published and its staging directory is gone; the same
command resumes from the previous bundle (its ``restore`` event names that step) and, once the disk has room,
the lineage finishes with ``screl events check`` passing and every step trained once after its last restore.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from _fit_env import fit_env

from screl.checkpoint import CheckpointStore
from screl.data.events import parse_event, read_events

from .conftest import recovery_config
from .faulty_fs import ENV, FIT, PROTOCOL, FaultyFileSystem
from .kill_chain import IN_ORDER, final_outcome

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def fit(config: Path, log: Path, enospc_at: str | None) -> int:
    env = fit_env()
    env.pop(ENV, None)
    if enospc_at is not None:
        env[ENV] = enospc_at
    env["PYTHONPATH"] = f"{ROOT}{':' + env['PYTHONPATH'] if env.get('PYTHONPATH') else ''}"
    with log.open("ab") as out:
        return subprocess.run([sys.executable, "-c", FIT, "fit", "--config", str(config)], stdout=out,
                              stderr=subprocess.STDOUT, env=env, cwd=ROOT, timeout=600).returncode


def restores(run_dir: Path) -> list[int]:
    return [e.step for e in (parse_event(line) for _, line in read_events(run_dir)) if e.name == "restore"]


def test_a_full_disk_in_the_model_then_in_the_data_plane_snapshot_publishes_nothing_and_resumes(
    tmp_path: Path
) -> None:
    import fsspec

    fsspec.register_implementation(PROTOCOL, FaultyFileSystem, clobber=True)
    ck_root = tmp_path / "ckpt"
    config = recovery_config(tmp_path, f"{PROTOCOL}://{ck_root}", steps=STEPS, sampler=IN_ORDER)
    run_dir, log = tmp_path / "run", tmp_path / "fit.log"
    store = CheckpointStore(f"{PROTOCOL}://{ck_root}")
    said = 0

    def new_output() -> str:
        nonlocal said
        text = log.read_text(errors="replace")
        out, said = text[said:], len(text)
        return out

    # 1. the disk fills while bundle step_2's model part is written
    assert fit(config, log, f"{ck_root}/tmp_step_2_*/lightning.ckpt") != 0
    out = new_output()
    assert "CheckpointSaveError: checkpoint bundle step_2 could not be saved" in out, out[-3000:]
    assert "No space left on device" in out and "it resumes from step_1" in out, out[-3000:]
    scan = store.scan()
    assert [b.step for b in scan.complete] == [1] and scan.temporaries == (), scan

    # 2. the same command resumes from step_1; the disk fills in step_3's TransferQueue snapshot
    assert fit(config, log, f"{ck_root}/tmp_step_3_*/data_plane/*") != 0
    out = new_output()
    assert restores(run_dir) == [1], restores(run_dir)
    assert "CheckpointSaveError: checkpoint bundle step_3 could not be saved" in out, out[-3000:]
    assert "No space left on device" in out and "data_plane" in out and "it resumes from step_2" in out, out[-3000:]
    scan = store.scan()
    assert [b.step for b in scan.complete] == [1, 2] and scan.temporaries == (), scan

    # 3. room again: the same command resumes from step_2 and finishes
    assert fit(config, log, None) == 0, new_output()[-3000:]
    assert restores(run_dir) == [1, 2]
    assert [b.step for b in store.scan().complete] == [2, 3, 4]  # keep_top_k: 3
    final_outcome(run_dir, STEPS, IN_ORDER)
