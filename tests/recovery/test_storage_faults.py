"""Storage faults (issue 40, item 2), on the real store and resume-selection code: an object store (a real
``moto_server``) stopped in the middle of a bundle's upload, a disk that fills up (an fsspec local filesystem that
raises ENOSPC after N bytes), every published bundle file truncated or bit-flipped in turn, and a torn last line of
``events.jsonl`` left by a writer killed mid-write.

Each fault: the save fails and publishes nothing, a resume uses the previous bundle, a corrupt bundle is refused
naming the file and the check it failed (and never loaded), and the event checker and the resumed writer handle the
torn line and say so. The times to detect are printed (``-s``) and recorded in docs/failures.md.
"""

from __future__ import annotations

import errno
import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
import pytest
import torch
from fsspec.implementations.local import LocalFileSystem

from screl.checkpoint import CheckpointStore, NoUsableBundleError
from screl.checkpoint.resume import CONTROLLER_STATE, LIGHTNING_CKPT, fetch_resume, write_controller_parts
from screl.data.event_check import check_events
from screl.data.events import CommitEvent, open_event_log

from .moto_store import BUCKET, Moto

REPO = Path(__file__).resolve().parents[2]


# -- a bundle with every kind of part -------------------------------------------------------------------------
def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _state(step: int) -> dict[str, Any]:
    """A controller state shaped like the runtime's capture (what ``write_controller_parts`` splits up)."""
    return {"train_steps": step, "trainer_version": step, "cursor": step * 4,
            "replay_index": {"groups": [f"g{step}-{i}" for i in range(3)], "digest": f"d{step}"},
            "ledger": {"g": [step]}, "in_flight": [], "admitted": [step], "replacement_reserve": [(step, 0)]}


def save_bundle(store: CheckpointStore, step: int, model_bytes: int = 4096) -> None:
    """Bundle ``step_<step>``: the Lightning checkpoint (model and optimizer), the controller state and its sidecars
    (replay index, ledger, reserve) and a TransferQueue-shaped data plane, each part's bytes depending on ``step``."""
    gen = torch.Generator().manual_seed(step)
    weights = torch.randn(model_bytes // 4, generator=gen)
    ckpt = {"state_dict": {"w": weights}, "optimizer_states": [{"state": {0: {"exp_avg": weights * 0.1}}}],
            "global_step": step}
    with store.begin(step) as w:
        w.write_bytes(LIGHTNING_CKPT, _torch_bytes(ckpt))
        w.write_bytes("data_plane/metadata.json", json.dumps({"step": step}).encode())
        w.write_bytes("data_plane/storage_units/unit_0.pkl", pickle.dumps({"rows": list(range(step, step + 64))}))
        write_controller_parts(w, _state(step))
        w.commit({"trainer_version": step, "train_steps": step})


PARTS = [LIGHTNING_CKPT, CONTROLLER_STATE, "data_plane/metadata.json", "data_plane/storage_units/unit_0.pkl",
         "replay_buffer_metadata.pt", "rollout_recovery.pt", "replacement_reserve.pt"]


def assert_resumed_step(resume: Any, step: int) -> None:
    """The resume holds bundle ``step``'s state and nothing of another bundle."""
    assert resume is not None and resume.step == step
    assert resume.controller_state["train_steps"] == step
    ckpt = torch.load(resume.ckpt_path, weights_only=True)
    assert ckpt["global_step"] == step
    if resume.data_plane_dir is not None:
        assert json.loads(Path(resume.data_plane_dir, "metadata.json").read_text()) == {"step": step}


# -- an object store that goes away mid-save --------------------------------------------------------------------
class _StopAfter:
    """A writable file that stops the object store once ``limit`` bytes of this part went through (then goes on
    writing, as an uploader would)."""

    def __init__(self, inner: Any, limit: int, stop: Any) -> None:
        self.inner, self.limit, self.stop, self.written = inner, limit, stop, 0

    def write(self, data: bytes) -> int:
        self.written += len(data)
        if self.written >= self.limit and self.stop is not None:
            self.stop()
            self.stop = None
        return int(self.inner.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> _StopAfter:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)


@pytest.mark.parametrize("when", ["mid_part_upload", "mid_publish_copy"])
def test_an_object_store_stopped_mid_save_publishes_nothing_and_resume_uses_the_previous_bundle(
    moto: Moto, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    store = CheckpointStore(url, moto.options)
    save_bundle(store, 1)
    stopped: list[float] = []

    def stop() -> None:
        moto.kill()
        stopped.append(time.monotonic())

    if when == "mid_part_upload":  # 12 MiB of model: s3fs uploads it in parts; the store dies after the first
        real_open = store.fs.open
        monkeypatch.setattr(store.fs, "open", lambda path, mode="rb", *a, **k: _StopAfter(
            real_open(path, mode, *a, **k), 6 << 20, stop) if "w" in mode and LIGHTNING_CKPT in path
            else real_open(path, mode, *a, **k))
    else:  # every part is uploaded; the store dies during the server-side copy that publishes them
        real_copy = store.fs.copy

        def copy(src: str, dst: str, *a: Any, **k: Any) -> Any:
            out = real_copy(src, dst, *a, **k)
            if not stopped:
                stop()
            return out
        monkeypatch.setattr(store.fs, "copy", copy)
    with pytest.raises(Exception, match=rf"127\.0\.0\.1:{moto.port}") as failure:
        save_bundle(store, 2, model_bytes=12 << 20)
    detect_s = time.monotonic() - stopped[0]
    monkeypatch.undo()
    print(f"\nobject store stopped {when}: the save failed after {detect_s:.1f} s "
          f"({type(failure.value).__name__})")
    assert detect_s < 60

    moto.start(replay=True)  # the store comes back with what it held
    found = store.scan()
    assert [b.step for b in found.complete] == [1], "the failed save became selectable"
    assert_resumed_step(fetch_resume(url, str(tmp_path / "local"), config={}, storage_options=moto.options), 1)
    save_bundle(store, 2)  # the next save of that step publishes over whatever the failed one left
    assert [b.step for b in store.scan().complete] == [1, 2]
    store.retain(keep_top_k=2)
    assert store.scan().temporaries == ()


def test_an_object_store_stopped_right_after_the_publish_says_the_bundle_is_there(
    moto: Moto, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found end to end (tests/recovery/test_storage_faults_e2e.py): the store went away between the manifest's
    publish and the read-back that ends ``commit``; the save then said "nothing of it was published", while a resume
    used that very bundle. Now the error says it is there."""
    from screl.checkpoint.writer import BundleWriter, PublishedReadBackError

    url = f"s3://{BUCKET}/{uuid.uuid4().hex}/ckpt"
    store = CheckpointStore(url, moto.options)
    real_publish = BundleWriter._publish

    def publish_then_stop(self: BundleWriter, manifest: dict[str, Any]) -> None:
        real_publish(self, manifest)
        moto.kill()

    monkeypatch.setattr(BundleWriter, "_publish", publish_then_stop)
    with pytest.raises(PublishedReadBackError, match=r"step_1 was published, but reading it back failed"):
        save_bundle(store, 1)
    monkeypatch.undo()
    moto.start(replay=True)
    assert [b.step for b in store.scan().complete] == [1]


# -- a full disk --------------------------------------------------------------------------------------------------
class FullDiskFileSystem(LocalFileSystem):
    """The local filesystem of a disk with ``free`` bytes left: a write past them raises ENOSPC, as write(2) does
    (the bytes that fit are written first). ``free = None``: room for everything."""

    protocol = ("fulldisk",)
    root_marker = "/"
    free: int | None = None

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        return super()._strip_protocol(path[len("fulldisk://"):] if path.startswith("fulldisk://") else path)

    def _open(self, path: str, mode: str = "rb", **kwargs: Any) -> Any:
        f = super()._open(path, mode, **kwargs)
        return _Enospc(f) if "w" in mode or "a" in mode else f


class _Enospc:
    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, data: bytes) -> int:
        free = FullDiskFileSystem.free
        if free is not None and len(data) > free:
            self.inner.write(data[:free])
            FullDiskFileSystem.free = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self.inner, "path", "?"))
        if free is not None:
            FullDiskFileSystem.free = free - len(data)
        return int(self.inner.write(data))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def __enter__(self) -> _Enospc:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.inner.__exit__(*exc)


fsspec.register_implementation("fulldisk", FullDiskFileSystem, clobber=True)


@pytest.mark.parametrize("fills_in", [LIGHTNING_CKPT, "data_plane/storage_units/unit_0.pkl",
                                      "replay_buffer_metadata.pt", "manifest.json"])
def test_a_full_disk_mid_save_publishes_nothing_and_resume_uses_the_previous_bundle(
    tmp_path: Path, fills_in: str
) -> None:
    """The disk fills in the middle of each kind of part in turn (the parts are written in the order of PARTS, the
    manifest last), measured on a reference save of the same bundle."""
    FullDiskFileSystem.free = None
    reference = CheckpointStore(str(tmp_path / "reference"))
    save_bundle(reference, 2)
    parts = reference.open(2).parts
    sizes = [parts[name].size for name in PARTS] + [len(reference.fs.cat_file(reference.path("step_2/manifest.json")))]
    at = (PARTS + ["manifest.json"]).index(fills_in)
    free = sum(sizes[:at]) + sizes[at] // 2
    root = tmp_path / "ckpt"
    store = CheckpointStore(f"fulldisk://{root}")
    assert store.atomic_rename  # a local disk: published by rename
    save_bundle(store, 1)
    FullDiskFileSystem.free = free
    try:
        with pytest.raises(OSError, match="No space left on device") as failure:
            save_bundle(store, 2)
        assert failure.value.errno == errno.ENOSPC
    finally:
        FullDiskFileSystem.free = None
    found = store.scan()
    assert [b.step for b in found.complete] == [1] and found.skipped == ()
    assert found.temporaries == (), "the failed save's staging directory was left behind"
    assert_resumed_step(fetch_resume(str(root), str(tmp_path / "local"), config={}), 1)
    save_bundle(store, 2)  # space freed: the same step saves
    assert [b.step for b in store.scan().complete] == [1, 2]


@pytest.fixture(params=["local", "s3"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> CheckpointStore:
    """An empty checkpoint directory on a local disk and on the session's S3 endpoint (tests/conftest.py)."""
    if request.param == "local":
        return CheckpointStore(str(tmp_path / "ckpt"))
    options = request.getfixturevalue("s3_options")
    return CheckpointStore(f"s3://screl-ckpt-tests/{uuid.uuid4().hex}/ckpt", options)


# -- corruption of each published file ------------------------------------------------------------------------
def _damage(store: CheckpointStore, relpath: str, how: str) -> None:
    data = bytearray(store.fs.cat_file(store.path(relpath)))
    if how == "truncate":
        data = data[: len(data) // 2]
    else:
        data[len(data) // 2] ^= 0x01  # one bit, same size: only the SHA-256 can tell
    store.fs.pipe_file(store.path(relpath), bytes(data))


@pytest.mark.parametrize("how", ["truncate", "bitflip"])
@pytest.mark.parametrize("part", PARTS)
def test_a_corrupt_bundle_file_is_refused_naming_it_and_resume_falls_back(
    store: CheckpointStore, tmp_path: Path, caplog: pytest.LogCaptureFixture, part: str, how: str
) -> None:
    save_bundle(store, 1)
    save_bundle(store, 2)
    _damage(store, f"step_2/{part}", how)
    check = "size" if how == "truncate" else "sha256"
    caplog.set_level(logging.WARNING, logger="screl.checkpoint.resume")
    for rank, rollout_side in enumerate((True, False)):  # rank 0 and another training rank choose alike
        resume = fetch_resume(store.root_url, str(tmp_path / f"rank_{rank}"), config={},
                              storage_options=store.storage_options, rollout_side=rollout_side)
        assert resume is not None and resume.step == 1, f"rank {rank} resumed from the corrupt bundle"
        assert not (tmp_path / f"rank_{rank}" / "step_2").exists(), "a corrupt download was left behind"
    assert_resumed_step(fetch_resume(store.root_url, str(tmp_path / "again"), config={},
                                     storage_options=store.storage_options), 1)
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "step_2" in said and repr(part) in said and f"{check} check" in said, said

    store.remove_published("step_1", f"trash_step_1_{uuid.uuid4().hex}")  # no earlier bundle left: stop
    with pytest.raises(NoUsableBundleError, match=rf"step_2: .*part '{part}'.*{check} check"):
        fetch_resume(store.root_url, str(tmp_path / "none"), config={}, storage_options=store.storage_options)
    if how == "bitflip":  # the run that fell back saves step 2 again: the refused bundle makes way
        save_bundle(store, 2)
        assert_resumed_step(fetch_resume(store.root_url, str(tmp_path / "resaved"), config={},
                                         storage_options=store.storage_options), 2)


def test_a_good_complete_bundle_is_still_never_overwritten(store: CheckpointStore) -> None:
    save_bundle(store, 1)
    with pytest.raises(FileExistsError, match="already a complete bundle"):
        store.begin(1)


def test_a_corrupt_rollout_snapshot_falls_back_to_its_bundle(store: CheckpointStore, tmp_path: Path) -> None:
    from screl.checkpoint import SnapshotManifest, begin_snapshot

    save_bundle(store, 1)
    with begin_snapshot(store, "step_1") as w:
        write_controller_parts(w, {**_state(1), "train_steps": 99})
        w.write_bytes("data_plane/metadata.json", b'{"step": 99}')
        snap = w.commit(SnapshotManifest(1, 1, sampler_dispatch_index=3, mutation_version=1))
    kwargs: dict[str, Any] = {"config": {}, "snapshots_enabled": True, "storage_options": store.storage_options}
    resume = fetch_resume(store.root_url, str(tmp_path / "a"), **kwargs)
    assert resume is not None and resume.source == "snapshot" and resume.controller_state["train_steps"] == 99
    _damage(store, f"{snap.relpath}/rollout_recovery.pt", "bitflip")
    resume = fetch_resume(store.root_url, str(tmp_path / "b"), **kwargs)
    assert resume is not None and resume.source == "trainer_checkpoint"
    assert_resumed_step(resume, 1)


# -- a torn last line of events.jsonl ---------------------------------------------------------------------------
_WRITER = """
import os, signal, sys
from screl.data.events import CommitEvent, EventLogWriter, ReserveEvent
path = sys.argv[1]
with open(path, "a", encoding="utf-8") as fh:
    writer = EventLogWriter(fh)
    writer.write(ReserveEvent(group_id="a", prompt_id=0, start_weight=0, target_step=0))
    writer.write(CommitEvent(group_id="a", end_weight=0))
    writer.write(ReserveEvent(group_id="b", prompt_id=1, start_weight=0, target_step=0))
    line = CommitEvent(group_id="b", end_weight=0).to_json() + "\\n"
    fh.write(line[: len(line) // 2])  # the kernel has half of the next line when the kill lands
    fh.flush()
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_torn_last_event_line_is_reported_by_the_checker_and_cut_by_the_resumed_writer(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    log_path = run_dir / "events.jsonl"
    proc = subprocess.run([sys.executable, "-c", _WRITER, str(log_path)], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, timeout=60)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert not log_path.read_bytes().endswith(b"\n")

    cli = subprocess.run([sys.executable, "-m", "screl.cli", "events", "check", str(run_dir)], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "note: line 4 is torn" in cli.stdout and "OK: no violations" in cli.stdout
    assert "Traceback" not in cli.stderr

    stream, note = open_event_log(log_path)  # what a resumed controller does before appending
    assert note is not None and "torn last line" in note
    with stream:
        stream.write(CommitEvent(group_id="b", end_weight=1).to_json() + "\n")
    lines = log_path.read_text().splitlines()
    assert len(lines) == 4 and lines[-1] == CommitEvent(group_id="b", end_weight=1).to_json()
    report = check_events(log_path)
    assert report.ok and report.notes == [] and report.events == 4
    stream, note = open_event_log(log_path)  # a clean log is left as it is
    stream.close()
    assert note is None and len(log_path.read_text().splitlines()) == 4


def test_an_unparsable_line_in_the_middle_is_still_a_violation(tmp_path: Path) -> None:
    log_path = tmp_path / "events.jsonl"
    log_path.write_text('{"event":"commit","group_id":"a","end_weight":0}\n{"event":"ref\n'
                        '{"event":"commit","group_id":"b","end_weight":0}')
    report = check_events(log_path)
    assert ("parse", 2) in [(v.rule, v.line) for v in report.violations] and report.notes == []
