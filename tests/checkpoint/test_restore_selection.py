"""Restore selection follows the spec's rules on both backends and never modifies the checkpoint dir."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from _ckpt_helpers import put, tree

from screl.checkpoint import (
    BOOTSTRAP_ANCHOR,
    CheckpointStore,
    FingerprintMismatchError,
    SnapshotManifest,
    begin_snapshot,
    bootstrap_fingerprint,
    select_restore,
    write_bootstrap_anchor,
)

CONFIG: dict[str, Any] = {
    "model": {"init_args": {"policy": "tiny", "learning_rate": 0.1}},
    "grpo": {"num_generations_per_prompt": 4},
    "checkpointing": {"checkpoint_dir": "a"},
}


@pytest.fixture
def unchanged(store: CheckpointStore) -> Iterator[None]:
    """Every test here also checks that selection left the tree exactly as it was."""
    yield
    before = tree(store)
    for mode in ("latest", "trainer_checkpoint"):
        for enabled in (True, False):
            try:
                select_restore(store, mode, enabled, CONFIG)  # type: ignore[arg-type]
            except ValueError:
                pass
    assert tree(store) == before


def _bundle(store: CheckpointStore, step: int, version: int | None = None) -> None:
    with store.begin(step) as w:
        w.write_bytes("lightning.ckpt", b"model")
        w.commit({"trainer_version": step if version is None else version})


def _snapshot(store: CheckpointStore, anchor: str, step: int, version: int, fp: str | None = None) -> int:
    with begin_snapshot(store, anchor) as w:
        w.write_bytes("data_plane/storage.bin", b"rows")
        header = SnapshotManifest(
            step, version, sampler_dispatch_index=5, mutation_version=2, bootstrap_fingerprint=fp
        )
        return w.commit(header).seq


def _bootstrap(store: CheckpointStore, snapshots: int = 1) -> str:
    fp = write_bootstrap_anchor(store, CONFIG).fingerprint
    for _ in range(snapshots):
        _snapshot(store, BOOTSTRAP_ANCHOR, 0, 0, fp)
    return fp


def test_nothing_means_a_fresh_start(store: CheckpointStore, unchanged: None) -> None:
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.source == "fresh" and plan.bundle is None and plan.snapshot is None
    assert plan.fingerprint == bootstrap_fingerprint(CONFIG)
    assert select_restore(store, "trainer_checkpoint", True, CONFIG).source == "fresh"
    assert store.children() == []


def test_latest_takes_the_newest_compatible_snapshot_of_the_latest_bundle(
    store: CheckpointStore, unchanged: None
) -> None:
    _bundle(store, 2)
    _snapshot(store, "step_2", 2, 2)
    _bundle(store, 4)
    _snapshot(store, "step_4", 4, 4)
    newest = _snapshot(store, "step_4", 4, 4)
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.source == "snapshot" and plan.bundle is not None and plan.bundle.step == 4
    assert plan.snapshot is not None and plan.snapshot.seq == newest and plan.trainer_version == 4
    assert plan.snapshot.header.sampler_dispatch_index == 5


def test_latest_without_snapshots_uses_the_bundle(store: CheckpointStore, unchanged: None) -> None:
    _bundle(store, 2)
    _snapshot(store, "step_2", 2, 2)
    _bundle(store, 3, version=7)
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.source == "trainer_checkpoint" and plan.bundle is not None and plan.bundle.step == 3
    assert plan.trainer_version == 7


def test_trainer_checkpoint_ignores_newer_snapshots(store: CheckpointStore, unchanged: None) -> None:
    _bundle(store, 2)
    _snapshot(store, "step_2", 2, 2)
    plan = select_restore(store, "trainer_checkpoint", True, CONFIG)
    assert plan.source == "trainer_checkpoint" and plan.snapshot is None and plan.bundle is not None
    disabled = select_restore(store, "latest", False, CONFIG)
    assert disabled.source == "trainer_checkpoint" and disabled.snapshot is None
    assert len(store.children("step_2/rollout_snapshots")) == 1


def test_a_bundle_wins_over_bootstrap_state(store: CheckpointStore, unchanged: None) -> None:
    _bootstrap(store)
    _bundle(store, 1)
    plan = select_restore(store, "latest", True, {**CONFIG, "grpo": {"num_generations_per_prompt": 99}})
    assert plan.source == "trainer_checkpoint" and plan.bundle is not None and plan.bundle.step == 1


def test_corrupt_newest_snapshot_falls_back_and_is_noted(store: CheckpointStore, unchanged: None) -> None:
    _bundle(store, 2)
    older = _snapshot(store, "step_2", 2, 2)
    newest = _snapshot(store, "step_2", 2, 2)
    put(store, f"step_2/rollout_snapshots/snapshot_{newest:06d}/manifest.json", b"{broken")
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.snapshot is not None and plan.snapshot.seq == older
    assert any(f"snapshot_{newest:06d}" in note for note in plan.notes)


def test_incompatible_snapshots_under_the_latest_bundle_are_an_error(
    store: CheckpointStore, unchanged: None
) -> None:
    _bundle(store, 2, version=2)
    _snapshot(store, "step_2", 2, 3)  # written by a trainer at another version
    with pytest.raises(ValueError, match="lineage mismatch"):
        select_restore(store, "latest", True, CONFIG)


def test_bootstrap_only_state_with_trainer_checkpoint_fails_without_modifying_it(
    store: CheckpointStore, unchanged: None
) -> None:
    _bootstrap(store, snapshots=2)
    before = tree(store)
    with pytest.raises(
        ValueError,
        match=r"cannot start a fresh bootstrap lineage(.|\n)*restore_mode='latest'"
        r"(.|\n)*new checkpointing.checkpoint_dir(.|\n)*was not modified",
    ):
        select_restore(store, "trainer_checkpoint", True, CONFIG)
    assert tree(store) == before


def test_bootstrap_only_state_with_latest_recovers_the_newest_bootstrap_snapshot(
    store: CheckpointStore, unchanged: None
) -> None:
    fp = _bootstrap(store, snapshots=2)
    operational = {
        **CONFIG,
        "model": {"init_args": {"policy": "tiny", "learning_rate": 0.5}},
        "checkpointing": {"checkpoint_dir": "b"},
    }
    plan = select_restore(store, "latest", True, operational)
    assert plan.source == "bootstrap_snapshot" and plan.bundle is None
    assert (
        plan.snapshot is not None
        and plan.snapshot.seq == 2
        and plan.snapshot.header.bootstrap_fingerprint == fp
    )
    assert plan.bootstrap is not None and plan.bootstrap.fingerprint == fp == plan.fingerprint


def test_bootstrap_anchor_without_snapshots_continues_fresh_in_that_lineage(
    store: CheckpointStore, unchanged: None
) -> None:
    fp = _bootstrap(store, snapshots=0)
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.source == "fresh" and plan.bootstrap is not None and plan.bootstrap.fingerprint == fp


def test_changed_semantic_config_rejects_bootstrap_recovery(store: CheckpointStore, unchanged: None) -> None:
    _bootstrap(store)
    before = tree(store)
    with pytest.raises(FingerprintMismatchError, match="grpo.num_generations_per_prompt: 4 -> 8"):
        select_restore(store, "latest", True, {**CONFIG, "grpo": {"num_generations_per_prompt": 8}})
    assert tree(store) == before


def test_bootstrap_state_is_ignored_when_snapshots_are_disabled(
    store: CheckpointStore, unchanged: None
) -> None:
    _bootstrap(store)
    plan = select_restore(store, "trainer_checkpoint", False, CONFIG)
    assert plan.source == "fresh" and any("rollout snapshots are disabled" in n for n in plan.notes)


def test_bootstrap_snapshots_without_a_manifest_are_refused(store: CheckpointStore, unchanged: None) -> None:
    put(store, "bootstrap/rollout_snapshots/snapshot_000001/manifest.json", b"{}")
    with pytest.raises(ValueError, match="no manifest.json, so its configuration cannot be checked"):
        select_restore(store, "latest", True, CONFIG)


def test_a_killed_anchor_write_leaves_no_lineage_and_the_next_write_sweeps_it(
    store: CheckpointStore, unchanged: None
) -> None:
    # What SIGKILL between the staging write and the rename of bootstrap/manifest.json leaves (the CI flake).
    leftover = f"{BOOTSTRAP_ANCHOR}/.tmp_{'0f' * 16}_manifest.json"
    put(store, leftover, b'{"schema_version"')
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.source == "fresh" and plan.bootstrap is None and plan.fingerprint == bootstrap_fingerprint(CONFIG)
    assert select_restore(store, "trainer_checkpoint", True, CONFIG).source == "fresh"
    if store.atomic_rename:
        write_bootstrap_anchor(store, CONFIG)
        assert store.children(BOOTSTRAP_ANCHOR) == ["manifest.json"]
        assert select_restore(store, "latest", True, CONFIG).bootstrap is not None


def test_incomplete_bundles_are_not_trainer_checkpoints(store: CheckpointStore, unchanged: None) -> None:
    _bundle(store, 1)
    put(store, "step_5/lightning.ckpt", b"an interrupted object-store publish")
    put(store, "tmp_step_6_00ff/lightning.ckpt", b"a dead writer")
    plan = select_restore(store, "latest", True, CONFIG)
    assert plan.bundle is not None and plan.bundle.step == 1
    assert any("step_5" in note for note in plan.notes)


def test_arguments_are_checked(store: CheckpointStore) -> None:
    with pytest.raises(ValueError, match="restore_mode must be"):
        select_restore(store, "none", True, CONFIG)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty segment"):
        select_restore(store, "latest", True, CONFIG, ["a..b"])


def test_select_restore_accepts_a_url(backend: tuple[str, dict[str, Any]]) -> None:
    url, options = backend
    _bundle(CheckpointStore(url, options), 1)
    plan = select_restore(url, "latest", True, CONFIG, storage_options=options)
    assert plan.source == "trainer_checkpoint" and plan.bundle is not None and plan.bundle.step == 1
