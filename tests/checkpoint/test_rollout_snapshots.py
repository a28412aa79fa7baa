"""Periodic rollout snapshots: layout, manifest validation, retention and the read-only resolver."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from _ckpt_helpers import failing_open, put, tree

from screl.checkpoint import (
    BOOTSTRAP_ANCHOR,
    CheckpointStore,
    MissingAnchorError,
    SnapshotInfo,
    SnapshotManifest,
    begin_snapshot,
    list_snapshots,
    prune_bootstrap_snapshots,
    resolve_latest_snapshot,
    retain_snapshots,
    scan_snapshots,
    write_bootstrap_anchor,
)

CONFIG: dict[str, Any] = {
    "model": {"init_args": {"policy": "tiny"}},
    "grpo": {"num_generations_per_prompt": 4},
}


def _bundle(store: CheckpointStore, step: int) -> None:
    with store.begin(step) as w:
        w.write_bytes("lightning.ckpt", b"model")
        w.commit({"trainer_version": step})


def _header(step: int = 3, version: int = 3, **kw: Any) -> SnapshotManifest:
    return SnapshotManifest(
        base_train_step=step, trainer_version=version, sampler_dispatch_index=7, mutation_version=11, **kw
    )


def _snapshot(
    store: CheckpointStore,
    anchor: str = "step_3",
    header: SnapshotManifest | None = None,
    keep: int | None = None,
    payload: bytes = b"rows",
) -> SnapshotInfo:
    with begin_snapshot(store, anchor) as w:
        w.write_bytes("data_plane/storage.bin", payload)
        w.write_bytes("replay_buffer_metadata.pt", b"index")
        return w.commit(header or _header(), metadata={"note": "x"}, keep_latest_k=keep)


def test_layout_sequence_numbers_and_round_trip(store: CheckpointStore) -> None:
    _bundle(store, 3)
    first = _snapshot(store, payload=b"one")
    second = _snapshot(store, payload=b"two")
    assert (first.seq, second.seq) == (1, 2)
    assert second.relpath == "step_3/rollout_snapshots/snapshot_000002"
    assert store.children("step_3/rollout_snapshots") == ["snapshot_000001", "snapshot_000002"]
    assert store.read_bytes(second, "data_plane/storage.bin") == b"two"
    assert second.header == _header() and second.metadata == {"note": "x"}
    assert [s.seq for s in list_snapshots(store, "step_3")] == [1, 2]
    # the bundle itself is unaffected by its snapshots
    assert store.latest() is not None and set(store.open(3).parts) == {"lightning.ckpt"}


def test_sequence_continues_after_leftovers_and_sweeps_them(store: CheckpointStore) -> None:
    _bundle(store, 3)
    _snapshot(store)
    put(store, "step_3/rollout_snapshots/tmp_snapshot_000004/x", b"dead writer")
    put(store, "step_3/rollout_snapshots/trash_snapshot_000002/x", b"dead retention")
    with begin_snapshot(store, "step_3") as w:
        assert w.seq == 5
        assert store.children("step_3/rollout_snapshots") == ["snapshot_000001"]  # leftovers swept
        w.abort()


def test_a_snapshot_needs_a_durable_anchor(store: CheckpointStore) -> None:
    with pytest.raises(MissingAnchorError, match="not durable yet"):
        begin_snapshot(store, "step_3")
    put(store, "step_3/lightning.ckpt", b"no manifest yet")
    with pytest.raises(MissingAnchorError, match="not durable yet"):
        begin_snapshot(store, "step_3")
    with pytest.raises(MissingAnchorError, match="write the bootstrap anchor first"):
        begin_snapshot(store, BOOTSTRAP_ANCHOR)
    with pytest.raises(ValueError, match="invalid snapshot anchor"):
        begin_snapshot(store, "elsewhere")


def test_header_must_match_its_anchor(store: CheckpointStore) -> None:
    _bundle(store, 3)
    with pytest.raises(ValueError, match="does not match anchor step_3"):
        _snapshot(store, header=_header(step=2, version=2))
    with pytest.raises(ValueError, match="must have bootstrap_fingerprint=None"):
        _snapshot(store, header=_header(bootstrap_fingerprint="ab" * 32))
    anchor = write_bootstrap_anchor(store, CONFIG)
    with pytest.raises(ValueError, match="does not match the anchor's"):
        _snapshot(store, BOOTSTRAP_ANCHOR, _header(0, 0, bootstrap_fingerprint="ab" * 32))
    info = _snapshot(store, BOOTSTRAP_ANCHOR, _header(0, 0, bootstrap_fingerprint=anchor.fingerprint))
    assert info.relpath == "bootstrap/rollout_snapshots/snapshot_000001"
    assert [s.seq for s in list_snapshots(store, "step_3")] == []  # nothing half-published


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("sampler_dispatch_index", -2, "must be >= -1"),
        ("sampler_dispatch_index", True, "must be an integer"),
        ("mutation_version", False, "must be an integer"),
        ("rolled_back_train_group_count", -1, "must be >= 0"),
        ("trainer_version", 1.0, "must be an integer"),
        ("bootstrap_fingerprint", 5, "must be a non-empty string or null"),
        ("schema_version", 99, "is not supported"),
    ],
)
def test_manifest_fields_are_validated(field: str, value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SnapshotManifest.from_json({**_header().to_json(), field: value})
    assert (
        SnapshotManifest.from_json(
            {**_header().to_json(), "sampler_dispatch_index": -1}
        ).sampler_dispatch_index
        == -1
    )


def test_resolver_picks_the_newest_and_falls_back_past_a_corrupt_one(store: CheckpointStore) -> None:
    _bundle(store, 3)
    _snapshot(store)
    _snapshot(store)
    newest = _snapshot(store)
    put(store, f"{newest.relpath}/data_plane/storage.bin", b"truncated!!")  # wrong size: corrupt
    put(store, "step_3/rollout_snapshots/tmp_snapshot_000009/manifest.json", b"{}")  # never a candidate
    chosen = resolve_latest_snapshot(store, "step_3", 3, 3, None)
    assert chosen is not None and chosen.seq == 2
    found = scan_snapshots(store, "step_3", 3, 3, None)
    assert [name for name, _ in found.skipped] == ["snapshot_000003"]
    assert "manifest says" in found.skipped[0][1]
    assert "tmp_snapshot_000009" in found.ignored


def test_resolver_errors_name_lineage_and_fingerprint(store: CheckpointStore) -> None:
    _bundle(store, 3)
    _snapshot(store, header=_header(3, 4))
    with pytest.raises(
        ValueError,
        match=r"lineage mismatch.*trainer_version=4.*expected base_train_step=3, "
        r"trainer_version=3(.|\n)*new checkpointing.checkpoint_dir",
    ):
        resolve_latest_snapshot(store, "step_3", 3, 3, None)
    anchor = write_bootstrap_anchor(store, CONFIG)
    _snapshot(store, BOOTSTRAP_ANCHOR, _header(0, 0, bootstrap_fingerprint=anchor.fingerprint))
    with pytest.raises(ValueError, match="bootstrap fingerprint mismatch"):
        resolve_latest_snapshot(store, BOOTSTRAP_ANCHOR, 0, 0, "cd" * 32)
    assert resolve_latest_snapshot(store, "step_9", 9, 9, None) is None  # no candidates at all


def test_resolver_is_read_only(store: CheckpointStore) -> None:
    _bundle(store, 3)
    _snapshot(store)
    put(store, "step_3/rollout_snapshots/tmp_snapshot_000002/x", b"leftover")
    put(store, "step_3/rollout_snapshots/snapshot_000003/manifest.json", b"garbage")
    before = tree(store)
    assert resolve_latest_snapshot(store, "step_3", 3, 3, None) is not None
    scan_snapshots(store, "step_3", 3, 3, None)
    list_snapshots(store, "step_3")
    assert tree(store) == before


def test_keep_latest_k_retention(store: CheckpointStore) -> None:
    _bundle(store, 3)
    for _ in range(4):
        _snapshot(store, keep=2)
    assert store.children("step_3/rollout_snapshots") == ["snapshot_000003", "snapshot_000004"]
    assert retain_snapshots(store, "step_3", 1) == ["snapshot_000003"]
    with pytest.raises(ValueError, match="keep_latest_k"):
        retain_snapshots(store, "step_3", 0)


def test_failed_snapshot_write_is_never_selected(
    store: CheckpointStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    _bundle(store, 3)
    _snapshot(store)
    monkeypatch.setattr(store.fs, "open", failing_open(store, "storage.bin", limit=2))
    with pytest.raises(OSError, match="injected failure"):
        _snapshot(store)
    monkeypatch.undo()
    chosen = resolve_latest_snapshot(store, "step_3", 3, 3, None)
    assert chosen is not None and chosen.seq == 1


def test_interrupted_object_store_publish_is_ignored_not_fatal(store: CheckpointStore) -> None:
    """A ``snapshot_<seq>`` without manifest: a copy cut short on S3 (ignored), corrupt locally (a reason)."""
    _bundle(store, 3)
    good = _snapshot(store)
    put(store, "step_3/rollout_snapshots/snapshot_000002/data_plane/storage.bin", b"half-copied")
    found = scan_snapshots(store, "step_3", 3, 3, None)
    assert found.good[0].seq == good.seq
    if store.atomic_rename:
        assert [name for name, _ in found.skipped] == ["snapshot_000002"]
    else:
        assert "snapshot_000002" in found.ignored and found.skipped == ()
        store.remove_tree(good.relpath)  # only the interrupted publish is left: no candidate, not an error
        assert resolve_latest_snapshot(store, "step_3", 3, 3, None) is None


def test_bootstrap_snapshots_are_pruned_only_after_a_trainer_bundle(store: CheckpointStore) -> None:
    anchor = write_bootstrap_anchor(store, CONFIG)
    _snapshot(store, BOOTSTRAP_ANCHOR, _header(0, 0, bootstrap_fingerprint=anchor.fingerprint))
    assert prune_bootstrap_snapshots(store) == []
    _bundle(store, 1)
    assert prune_bootstrap_snapshots(store) == ["snapshot_000001"]
    assert store.children("bootstrap") == ["manifest.json"]


def test_snapshot_manifest_replace_revalidates() -> None:
    with pytest.raises(ValueError, match="must be >= 0"):
        replace(_header(), mutation_version=-1)


def test_local_publish_is_a_rename(tmp_path: Path) -> None:
    store = CheckpointStore(str(tmp_path / "ck"))
    _bundle(store, 3)
    with begin_snapshot(store, "step_3") as w:
        w.write_bytes("a", b"a")
        staged = tmp_path / "ck" / "step_3" / "rollout_snapshots" / "tmp_snapshot_000001"
        assert staged.is_dir()
        w.commit(_header())
    assert not staged.exists()
    assert (tmp_path / "ck" / "step_3" / "rollout_snapshots" / "snapshot_000001" / "manifest.json").is_file()
