"""Bundles publish atomically on a local directory and on S3; failed or killed saves never become latest."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from _ckpt_helpers import failing_open, put

from screl.checkpoint import CheckpointStore, IncompleteError

REPO = Path(__file__).resolve().parents[2]


def _save(store: CheckpointStore, step: int, payload: bytes = b"weights", **metadata: Any) -> None:
    with store.begin(step) as w:
        w.write_bytes("policy/weights.bin", payload + str(step).encode())
        w.write_bytes("training_info.json", json.dumps({"step": step}).encode())
        w.commit({"trainer_version": step, **metadata})


def test_round_trip_every_part_kind(store: CheckpointStore, tmp_path: Path) -> None:
    local_file = tmp_path / "model.ckpt"
    local_file.write_bytes(os.urandom(3000))
    snap = tmp_path / "tq_snapshot"
    (snap / "units" / "0").mkdir(parents=True)
    (snap / "units" / "0" / "data.bin").write_bytes(b"rows" * 100)
    (snap / "controller.json").write_text("{}")
    (snap / "empty").mkdir()

    assert store.latest() is None
    with store.begin(3) as w:
        w.write_file("lightning.ckpt", local_file)
        w.write_dir("data_plane", snap)
        w.write_torch("rollout_recovery.pt", {"groups": [1, 2], "t": torch.arange(4)})
        w.write_bytes("empty.bin", b"")
        info = w.commit({"trainer_version": 3, "consumed_samples": 12})

    assert info.step == 3 and info.metadata == {"trainer_version": 3, "consumed_samples": 12}
    latest = store.latest()
    assert latest is not None and latest.step == 3
    assert set(latest.parts) == {
        "lightning.ckpt",
        "data_plane/units/0/data.bin",
        "data_plane/controller.json",
        "rollout_recovery.pt",
        "empty.bin",
    }
    part = latest.parts["lightning.ckpt"]
    assert part.size == 3000 and part.sha256 == hashlib.sha256(local_file.read_bytes()).hexdigest()
    assert store.read_bytes(3, "lightning.ckpt") == local_file.read_bytes()
    assert store.read_bytes(latest, "empty.bin") == b""
    ledger = store.read_torch(3, "rollout_recovery.pt")
    assert ledger["groups"] == [1, 2] and torch.equal(ledger["t"], torch.arange(4))

    out = tmp_path / "restored"
    names = store.download_dir(3, "data_plane", out)
    assert sorted(names) == ["data_plane/controller.json", "data_plane/units/0/data.bin"]
    assert (out / "units" / "0" / "data.bin").read_bytes() == b"rows" * 100
    assert (out / "empty").is_dir()
    store.download_file(3, "lightning.ckpt", tmp_path / "again.ckpt")
    assert (tmp_path / "again.ckpt").read_bytes() == local_file.read_bytes()
    assert not any(name.startswith("tmp_") for name in store.children())


def test_latest_is_the_newest_complete_bundle(store: CheckpointStore) -> None:
    for step in (2, 10, 4):
        _save(store, step)
    assert [b.step for b in store.list_bundles()] == [2, 4, 10]
    latest = store.latest()
    assert latest is not None and latest.step == 10
    assert store.read_bytes(4, "policy/weights.bin") == b"weights4"


def test_a_complete_bundle_is_never_overwritten(store: CheckpointStore) -> None:
    _save(store, 1)
    with pytest.raises(FileExistsError, match="already a complete bundle"):
        store.begin(1)


@pytest.mark.parametrize(
    "name", ["", "/abs", "a//b", "../up", "a/./b", "manifest.json", "rollout_snapshots/x"]
)
def test_part_names_are_checked(store: CheckpointStore, name: str) -> None:
    with store.begin(1) as w, pytest.raises(ValueError, match="part name"):
        w.write_bytes(name, b"x")


def test_exception_inside_an_fsspec_write_leaves_nothing_selectable(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(store, 1)
    monkeypatch.setattr(store.fs, "open", failing_open(store, "policy/optimizer.bin", limit=100))
    with pytest.raises(OSError, match="injected failure"), store.begin(2) as w:
        w.write_bytes("policy/weights.bin", b"w" * 1000)
        w.write_bytes("policy/optimizer.bin", b"o" * 1000)
        w.commit({"trainer_version": 2})
    monkeypatch.undo()

    latest = store.latest()
    assert latest is not None and latest.step == 1
    assert store.read_bytes(1, "policy/weights.bin") == b"weights1"
    assert store.scan().temporaries == ()  # the context manager aborted the tmp dir
    _save(store, 2)  # the same step saves cleanly afterwards
    assert store.latest() is not None and store.latest().step == 2  # type: ignore[union-attr]


def test_a_broken_writer_refuses_to_commit_and_its_leftovers_are_never_selected(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(store, 1)
    writer = store.begin(2)
    monkeypatch.setattr(store.fs, "open", failing_open(store, "big.bin", limit=10))
    with pytest.raises(OSError, match="injected failure"):
        writer.write_bytes("big.bin", b"x" * 100)
    monkeypatch.undo()
    with pytest.raises(RuntimeError, match="refusing to publish"):
        writer.commit({})
    # a process that died here would leave its tmp dir behind: simulate that leftover
    leftover = store.begin(2)
    leftover.write_bytes("policy/weights.bin", b"partial")
    found = store.scan()
    assert found.latest is not None and found.latest.step == 1
    assert len(found.temporaries) == 1 and found.temporaries[0].startswith("tmp_step_2_")


def test_a_failed_publish_never_becomes_latest(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _save(store, 1)
    monkeypatch.setattr(store.fs, "open", failing_open(store, "manifest.json", limit=5))
    with pytest.raises(OSError, match="injected failure"):
        _save(store, 2)
    monkeypatch.undo()
    found = store.scan()
    assert found.latest is not None and found.latest.step == 1
    assert found.temporaries == ()
    assert store.read_bytes(1, "training_info.json") == b'{"step": 1}'


def test_incomplete_and_corrupt_bundles_are_skipped_with_reasons(store: CheckpointStore) -> None:
    _save(store, 1)
    _save(store, 2)
    _save(store, 3)
    put(store, "step_3/policy/weights.bin", b"truncated")  # wrong size
    store.fs.rm(store.path("step_2/training_info.json"))  # a missing part
    put(store, "step_4/policy/weights.bin", b"no manifest")  # an interrupted copy
    put(store, "step_5/manifest.json", b"{not json")

    found = store.scan()
    assert found.latest is not None and found.latest.step == 1
    reasons = dict(found.skipped)
    assert "has 9 bytes, the manifest says" in reasons["step_3"]
    assert "'training_info.json' is missing" in reasons["step_2"]
    assert "no manifest.json" in reasons["step_4"]
    assert "unreadable manifest.json" in reasons["step_5"]
    with pytest.raises(IncompleteError, match="is missing"):
        store.open(2)


def test_reads_verify_the_checksum(store: CheckpointStore) -> None:
    _save(store, 1)
    put(store, "step_1/policy/weights.bin", b"WEIGHTS1")  # same size, other bytes
    with pytest.raises(ValueError, match="is corrupt"):
        store.read_bytes(1, "policy/weights.bin")
    with pytest.raises(FileNotFoundError, match="has no part 'nope'"):
        store.read_bytes(1, "nope")


@pytest.mark.parametrize(("higher", "kept"), [(True, [2, 4, 6]), (False, [1, 6])])
def test_retain_by_metric_keeps_the_best_k_and_the_newest(store: CheckpointStore, higher: bool,
                                                          kept: list[int]) -> None:
    """checkpointing.metric_name: the best K by the value each manifest records, plus the newest bundle (resume
    needs it) whatever its value; a bundle without the value (5), or with another metric's (3), ranks last."""
    values: dict[int, Any] = {1: 0.1, 2: 0.9, 3: ("train:loss", 0.01), 4: 0.8, 5: None, 6: 0.3}
    for step, value in values.items():
        if value is None:
            _save(store, step)
        else:
            name, v = value if isinstance(value, tuple) else ("train:reward", value)
            _save(store, step, metric={"name": name, "key": name.split(":")[1], "value": v})
    removed = store.retain(keep_top_k=2, metric_name="train:reward", higher_is_better=higher)
    assert [b.step for b in store.scan().complete] == kept
    assert sorted(removed) == sorted(f"step_{s}" for s in values if s not in kept)


def test_retain_keeps_top_k_and_sweeps_old_leftovers(store: CheckpointStore) -> None:
    for step in (1, 2, 3, 4):
        _save(store, step)
    put(store, "tmp_step_2_0123abcd/x", b"x")  # leftovers of dead saves
    put(store, "trash_step_1_0123abcd/x", b"x")
    put(store, "step_0/orphan.bin", b"no manifest")
    newer_tmp = store.begin(9)  # a save that may still be in progress
    newer_tmp.write_bytes("x", b"x")

    removed = store.retain(keep_top_k=2)
    assert sorted(removed) == sorted(
        ["step_1", "step_2", "step_0", "tmp_step_2_0123abcd", "trash_step_1_0123abcd"]
    )
    found = store.scan()
    assert [b.step for b in found.complete] == [3, 4]
    assert found.temporaries == (newer_tmp.tmp_relpath,)
    assert store.retain(keep_top_k=1) == ["step_3"]
    assert [b.step for b in store.list_bundles()] == [4]
    with pytest.raises(ValueError, match="keep_top_k"):
        store.retain(0)


_CHILD = textwrap.dedent(
    """
    import json, os, signal, sys
    from screl.checkpoint import CheckpointStore

    url, options, kill_point = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    store = CheckpointStore(url, options)
    writer = store.begin(2)
    writer.write_bytes("policy/weights.bin", b"w" * 1000)
    if kill_point == "mid_part_write":
        real_open = store.fs.open
        def dying_open(path, mode="rb", *args, **kwargs):
            f = real_open(path, mode, *args, **kwargs)
            if "w" in mode:
                f.write(b"half")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            return f
        store.fs.open = dying_open
        writer.write_bytes("policy/optimizer.bin", b"o" * 1000)
    else:  # before the manifest: after the local fsync, or after the S3 copy of every part
        writer._write_manifest = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        writer.commit({"trainer_version": 2})
    """
)


@pytest.mark.parametrize("kill_point", ["mid_part_write", "before_manifest"])
def test_kill_9_during_a_save_keeps_the_previous_bundle(
    backend: tuple[str, dict[str, Any]], kill_point: str
) -> None:
    url, options = backend
    store = CheckpointStore(url, options)
    _save(store, 1)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD, url, json.dumps(options), kill_point],
        env=env,
        capture_output=True,
        timeout=60,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]

    found = store.scan()
    assert found.latest is not None and found.latest.step == 1
    assert store.read_bytes(1, "policy/weights.bin") == b"weights1"
    leftovers = list(found.temporaries) + [name for name, _ in found.skipped]
    assert leftovers, "the killed save should leave a (never selectable) leftover"
    _save(store, 2)  # a later save of the same step publishes over the leftovers
    assert store.latest() is not None and store.latest().step == 2  # type: ignore[union-attr]
    store.retain(keep_top_k=2)
    assert store.scan().temporaries == () and store.scan().skipped == ()


def test_file_urls_and_empty_directories(tmp_path: Path) -> None:
    store = CheckpointStore(f"file://{tmp_path}/ck")
    assert store.atomic_rename
    (tmp_path / "empty_snapshot").mkdir()
    with store.begin(0) as w:
        w.write_dir("data_plane", tmp_path / "empty_snapshot")
        w.commit()
    assert store.latest() is not None and store.open(0).empty_dirs == ("data_plane",)
    assert store.download_dir(0, "data_plane", tmp_path / "out") == []
    assert (tmp_path / "out").is_dir()
    assert (tmp_path / "ck" / "step_0" / "manifest.json").is_file()


def test_a_directory_written_partly_here_and_partly_by_other_processes(store: CheckpointStore, tmp_path: Path) -> None:
    """The TransferQueue snapshot's shape: this process writes some files of ``data_plane/``, the nodes holding
    the rest upload them to the staged URL themselves, and ``adopt(new_only=True)`` records only theirs."""
    import fsspec

    here = tmp_path / "dp"
    (here / "storage_units").mkdir(parents=True)
    (here / "metadata.json").write_text("{}")
    (here / "storage_units" / "su_info.json").write_text("[]")
    rows = os.urandom(5000)
    with store.begin(4) as w:
        staged = w.staged_url("data_plane")
        w.write_dir("data_plane", here)
        with fsspec.open(f"{staged}/storage_units/su_0_x.pkl", "wb", **store.storage_options) as f:
            f.write(rows)  # another node's share
        adopted = w.adopt("data_plane", new_only=True)
        assert [p.name for p in adopted] == ["data_plane/storage_units/su_0_x.pkl"]
        assert w.adopt("data_plane", new_only=True) == []  # recorded now: nothing new
        assert w.adopt("nothing_here", new_only=True) == []
        with pytest.raises(FileNotFoundError, match="nothing was written to part 'nothing_here'"):
            w.adopt("nothing_here")
        w.commit({"trainer_version": 4})
    latest = store.latest()
    assert latest is not None
    assert sorted(latest.parts) == ["data_plane/metadata.json", "data_plane/storage_units/su_0_x.pkl",
                                    "data_plane/storage_units/su_info.json"]
    assert latest.parts["data_plane/storage_units/su_0_x.pkl"].sha256 == hashlib.sha256(rows).hexdigest()
    assert store.read_bytes(latest, "data_plane/storage_units/su_0_x.pkl") == rows
