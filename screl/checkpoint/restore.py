"""Which state a starting run restores from: a read-only decision over the checkpoint directory.

The rules (``rollout_checkpointing.restore_mode``):

* a complete trainer bundle ``step_<n>`` exists:
  * ``latest`` with snapshots enabled: the newest compatible rollout snapshot under ``step_<n>``
    (``base_train_step == n``, ``trainer_version`` == the bundle's, no bootstrap fingerprint); when there
    is none, the bundle itself;
  * ``trainer_checkpoint`` (or snapshots disabled): the bundle, ignoring newer snapshots;
* no trainer bundle, snapshots enabled, bootstrap state (``bootstrap/``) exists:
  * ``trainer_checkpoint``: ValueError; a bootstrap snapshot has no model or optimizer checkpoint and the
    existing namespace cannot start a fresh lineage (nothing is modified);
  * ``latest``: the bootstrap anchor is validated against the configuration's fingerprint (mismatch:
    :class:`~screl.checkpoint.fingerprint.FingerprintMismatchError`), then the newest compatible bootstrap
    snapshot (step 0, version 0, this fingerprint) is restored; with none, a fresh start in that lineage;
* otherwise a fresh start.

Selection never writes or deletes anything.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from screl.checkpoint.fingerprint import (
    BootstrapAnchor,
    bootstrap_fingerprint,
    validate_bootstrap_anchor,
    validate_excluded_paths,
)
from screl.checkpoint.layout import ATOMIC_TMP_PREFIX
from screl.checkpoint.snapshots import (
    BOOTSTRAP_ANCHOR,
    SnapshotInfo,
    scan_snapshots,
    trainer_anchor,
)
from screl.checkpoint.store import BundleInfo, CheckpointStore

__all__ = ["RestoreMode", "RestorePlan", "RestoreSource", "bundle_trainer_version", "select_restore"]

RestoreMode = Literal["latest", "trainer_checkpoint"]
RestoreSource = Literal["fresh", "trainer_checkpoint", "snapshot", "bootstrap_snapshot"]


@dataclass(frozen=True)
class RestorePlan:
    """What to restore. ``source``:

    * ``fresh``: nothing (``bootstrap`` is set when an existing, validated bootstrap lineage continues);
    * ``trainer_checkpoint``: everything from ``bundle``;
    * ``snapshot``: model/optimizer from ``bundle``, rollout state (data plane, replay index, ledger,
      reserve, dataloader, epoch and dispatch index) from ``snapshot``;
    * ``bootstrap_snapshot``: the initial model, rollout state from ``snapshot`` (under ``bootstrap/``).
    """

    source: RestoreSource
    bundle: BundleInfo | None = None
    snapshot: SnapshotInfo | None = None
    bootstrap: BootstrapAnchor | None = None
    fingerprint: str | None = None
    """The configuration's bootstrap fingerprint when no trainer bundle exists and snapshots are enabled."""
    trainer_version: int = 0
    notes: tuple[str, ...] = ()
    """What was skipped and why (incomplete bundles, corrupt snapshots, ignored state), for the log."""


def bundle_trainer_version(bundle: BundleInfo) -> int:
    """The trainer version recorded in the bundle's metadata (``trainer_version``), else its step."""
    version = bundle.metadata.get("trainer_version", bundle.step)
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise ValueError(
            f"{bundle.url}: metadata trainer_version must be a non-negative integer, got {version!r}"
        )
    return version


def select_restore(
    root: CheckpointStore | str,
    restore_mode: RestoreMode,
    snapshots_enabled: bool,
    config: Mapping[str, Any],
    extra_excluded_paths: Iterable[str] = (),
    storage_options: Mapping[str, Any] | None = None,
) -> RestorePlan:
    """Decide what a starting run restores (read-only); see the module docstring for the rules."""
    if restore_mode not in ("latest", "trainer_checkpoint"):
        raise ValueError(f"restore_mode must be 'latest' or 'trainer_checkpoint', got {restore_mode!r}")
    extras = validate_excluded_paths(extra_excluded_paths)
    store = root if isinstance(root, CheckpointStore) else CheckpointStore(root, storage_options)
    found = store.scan()
    notes = [f"skipped bundle {name}: {reason}" for name, reason in found.skipped]
    bundle = found.latest
    if bundle is not None:
        return _from_bundle(store, bundle, restore_mode, snapshots_enabled, notes)

    # A killed anchor write leaves only its staging file: no rollout state, and no lineage yet.
    bootstrap_exists = any(not n.startswith(ATOMIC_TMP_PREFIX) for n in store.children(BOOTSTRAP_ANCHOR))
    if not snapshots_enabled:
        if bootstrap_exists:
            notes.append(
                f"ignored bootstrap state in {store.url(BOOTSTRAP_ANCHOR)}: rollout snapshots are disabled"
            )
        return RestorePlan("fresh", notes=tuple(notes))
    fingerprint = bootstrap_fingerprint(config, extras)
    if not bootstrap_exists:
        return RestorePlan("fresh", fingerprint=fingerprint, notes=tuple(notes))
    if restore_mode == "trainer_checkpoint":
        raise ValueError(
            f"restore_mode='trainer_checkpoint' found bootstrap rollout state in"
            f" {store.url(BOOTSTRAP_ANCHOR)} but no trainer checkpoint: a bootstrap snapshot has no model or"
            " optimizer checkpoint, and"
            " screl cannot start a fresh bootstrap lineage in an existing bootstrap namespace. Use"
            " restore_mode='latest' to recover that state, or choose a new checkpointing.checkpoint_dir"
            " to start from scratch. Existing state was not modified."
        )
    anchor = validate_bootstrap_anchor(store, config, extras)
    if anchor is None:
        raise ValueError(
            f"{store.url(BOOTSTRAP_ANCHOR)} holds rollout state but no manifest.json, so its configuration"
            " cannot be checked. Choose a new checkpointing.checkpoint_dir (or remove that directory if its"
            " state is not needed). Existing state was not modified."
        )
    snapshot = _resolve(store, BOOTSTRAP_ANCHOR, 0, 0, fingerprint, notes)
    source: RestoreSource = "bootstrap_snapshot" if snapshot is not None else "fresh"
    return RestorePlan(
        source, snapshot=snapshot, bootstrap=anchor, fingerprint=fingerprint, notes=tuple(notes)
    )


def _from_bundle(
    store: CheckpointStore,
    bundle: BundleInfo,
    restore_mode: RestoreMode,
    snapshots_enabled: bool,
    notes: list[str],
) -> RestorePlan:
    version = bundle_trainer_version(bundle)
    if restore_mode == "trainer_checkpoint" or not snapshots_enabled:
        return RestorePlan("trainer_checkpoint", bundle=bundle, trainer_version=version, notes=tuple(notes))
    anchor = trainer_anchor(bundle.step)
    snapshot = _resolve(store, anchor, bundle.step, version, None, notes)
    if snapshot is None:
        return RestorePlan("trainer_checkpoint", bundle=bundle, trainer_version=version, notes=tuple(notes))
    return RestorePlan(
        "snapshot", bundle=bundle, snapshot=snapshot, trainer_version=version, notes=tuple(notes)
    )


def _resolve(
    store: CheckpointStore, anchor: str, step: int, version: int, fingerprint: str | None, notes: list[str]
) -> SnapshotInfo | None:
    """``resolve_latest_snapshot``, noting the newer snapshots that were skipped on the way."""
    found = scan_snapshots(store, anchor, step, version, fingerprint)
    chosen = found.choose()
    notes += [
        f"skipped snapshot {anchor}/{name}: {reason}"
        for name, reason in found.skipped
        if chosen is None or int(name.rsplit("_", 1)[1]) > chosen.seq
    ]
    return chosen
