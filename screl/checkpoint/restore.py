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
* otherwise a fresh start, unless a published bundle was skipped or refused (a part truncated, missing or failing
  its SHA-256, an unreadable manifest, an unknown schema): then :class:`NoUsableBundleError` names each one and the
  check it failed, and nothing starts. A ``step_<n>`` without ``manifest.json`` was never published (an
  interrupted object-store publish) and does not count.

``refused`` (relative path -> reason) takes bundles and snapshots out of the choice: a resume that found a corrupt
part while reading the chosen one (:class:`~screl.checkpoint.layout.CorruptPartError`) selects again without it.

Selection never writes or deletes anything.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from screl.checkpoint.fingerprint import (
    BootstrapAnchor,
    bootstrap_fingerprint,
    validate_bootstrap_anchor,
    validate_excluded_paths,
)
from screl.checkpoint.layout import ATOMIC_TMP_PREFIX, MANIFEST_NAME
from screl.checkpoint.snapshots import (
    BOOTSTRAP_ANCHOR,
    SnapshotInfo,
    scan_snapshots,
    trainer_anchor,
)
from screl.checkpoint.store import BundleInfo, BundleScan, CheckpointStore

__all__ = ["NoUsableBundleError", "RestoreMode", "RestorePlan", "RestoreSource", "bundle_trainer_version",
           "select_restore"]

RestoreMode = Literal["latest", "trainer_checkpoint"]
RestoreSource = Literal["fresh", "trainer_checkpoint", "snapshot", "bootstrap_snapshot"]


class NoUsableBundleError(ValueError):
    """Published bundles exist but none passes its checks: a resume stops instead of starting afresh over them."""


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
    refused: Mapping[str, str] | None = None,
) -> RestorePlan:
    """Decide what a starting run restores (read-only); see the module docstring for the rules."""
    if restore_mode not in ("latest", "trainer_checkpoint"):
        raise ValueError(f"restore_mode must be 'latest' or 'trainer_checkpoint', got {restore_mode!r}")
    extras = validate_excluded_paths(extra_excluded_paths)
    store = root if isinstance(root, CheckpointStore) else CheckpointStore(root, storage_options)
    refused = dict(refused or {})
    found = store.scan()
    notes = [f"skipped bundle {name}: {reason}" for name, reason in found.skipped]
    notes += [f"refused {relpath}: {reason}" for relpath, reason in refused.items()]
    usable = [b for b in found.complete if b.relpath not in refused]
    if usable:
        return _from_bundle(store, usable[-1], restore_mode, snapshots_enabled, notes, refused)
    _refuse_unusable(store, found, refused)
    return _without_bundle(store, restore_mode, snapshots_enabled, config, extras, notes, refused)


def _refuse_unusable(store: CheckpointStore, found: BundleScan, refused: Mapping[str, str]) -> None:
    """NoUsableBundleError when a published bundle exists but every one was skipped or refused."""
    bad = [(name, reason) for name, reason in found.skipped if store.exists(f"{name}/{MANIFEST_NAME}")]
    bad += [(b.relpath, refused[b.relpath]) for b in found.complete if b.relpath in refused]
    if bad:
        listed = "\n".join(f"  {name}: {reason}" for name, reason in sorted(bad))
        raise NoUsableBundleError(
            f"no usable checkpoint bundle in {store.url()}: every published bundle failed a check, and screl does"
            f" not start afresh over them:\n{listed}\nRestore those files from a copy, or move the directories"
            " away (or choose a new checkpointing.checkpoint_dir) to start from scratch. Nothing was modified."
        )


def _without_bundle(
    store: CheckpointStore,
    restore_mode: RestoreMode,
    snapshots_enabled: bool,
    config: Mapping[str, Any],
    extras: tuple[str, ...],
    notes: list[str],
    refused: Mapping[str, str],
) -> RestorePlan:
    """No trainer bundle: a fresh start, or the bootstrap lineage's newest compatible snapshot."""
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
    snapshot = _resolve(store, BOOTSTRAP_ANCHOR, 0, 0, fingerprint, notes, refused)
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
    refused: Mapping[str, str],
) -> RestorePlan:
    version = bundle_trainer_version(bundle)
    if restore_mode == "trainer_checkpoint" or not snapshots_enabled:
        return RestorePlan("trainer_checkpoint", bundle=bundle, trainer_version=version, notes=tuple(notes))
    anchor = trainer_anchor(bundle.step)
    snapshot = _resolve(store, anchor, bundle.step, version, None, notes, refused)
    if snapshot is None:
        return RestorePlan("trainer_checkpoint", bundle=bundle, trainer_version=version, notes=tuple(notes))
    return RestorePlan(
        "snapshot", bundle=bundle, snapshot=snapshot, trainer_version=version, notes=tuple(notes)
    )


def _resolve(
    store: CheckpointStore, anchor: str, step: int, version: int, fingerprint: str | None, notes: list[str],
    refused: Mapping[str, str],
) -> SnapshotInfo | None:
    """``resolve_latest_snapshot`` less the ``refused`` snapshots, noting the newer ones skipped on the way."""
    found = scan_snapshots(store, anchor, step, version, fingerprint)
    if refused:
        found = dataclasses.replace(found, good=tuple(s for s in found.good if s.relpath not in refused))
        if not found.good and not found.skipped:
            return None  # every candidate was refused by the resume: the anchor itself (or a fresh lineage)
    chosen = found.choose()
    notes += [
        f"skipped snapshot {anchor}/{name}: {reason}"
        for name, reason in found.skipped
        if chosen is None or int(name.rsplit("_", 1)[1]) > chosen.seq
    ]
    return chosen
