"""Periodic rollout snapshots under a trainer or bootstrap anchor.

Layout (``<anchor>`` is ``step_<n>`` or ``bootstrap`` under the checkpoint root)::

    <anchor>/rollout_snapshots/tmp_snapshot_000007/    # being written: never selected
    <anchor>/rollout_snapshots/snapshot_000006/        # published: manifest.json + parts
    <anchor>/rollout_snapshots/trash_snapshot_000004/  # being deleted by retention: never selected

The sequence number is six digits, one more than the largest in use. Publishing follows the store: a
fsync'd rename of ``tmp_snapshot_<seq>`` on a POSIX filesystem; on an object store (no rename) the parts
are copied server-side to ``snapshot_<seq>/`` and ``manifest.json`` is written last. So on an object store
a ``snapshot_<seq>/`` without a manifest is an interrupted publish: the resolver ignores it (it is not a
reason to refuse a restart) and the next snapshot's sweep deletes it; on a POSIX filesystem it cannot arise
from a crash and is reported as corrupt. Retention renames a snapshot to ``trash_snapshot_<seq>`` before
deleting it locally; on an object store it deletes ``manifest.json`` first, which withdraws the snapshot
in one request.

Selection (:func:`resolve_latest_snapshot`) is read-only. The names, the manifest header and the records live
in :mod:`screl.checkpoint.snapshot_layout`; this module re-exports the public ones.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from screl.checkpoint.snapshot_layout import (
    ANCHOR_RE,
    BOOTSTRAP_ANCHOR,
    SNAPSHOT_KIND,
    SNAPSHOT_RE,
    SNAPSHOT_SCHEMA_VERSION,
    SNAPSHOTS_DIR,
    TMP_SNAPSHOT_RE,
    TRASH_SNAPSHOT_RE,
    MissingAnchorError,
    SnapshotInfo,
    SnapshotManifest,
    SnapshotScan,
    seq_of,
    snapshots_rel,
    trainer_anchor,
)
from screl.checkpoint.store import (
    MANIFEST_NAME,
    CheckpointStore,
    IncompleteError,
    StagedWriter,
)

__all__ = [
    "BOOTSTRAP_ANCHOR",
    "SNAPSHOTS_DIR",
    "SNAPSHOT_SCHEMA_VERSION",
    "MissingAnchorError",
    "SnapshotInfo",
    "SnapshotManifest",
    "SnapshotScan",
    "SnapshotWriter",
    "begin_snapshot",
    "list_snapshots",
    "prune_bootstrap_snapshots",
    "resolve_latest_snapshot",
    "retain_snapshots",
    "scan_snapshots",
    "sweep_snapshot_leftovers",
    "trainer_anchor",
]


def _check_anchor(store: CheckpointStore, anchor: str) -> None:
    if anchor == BOOTSTRAP_ANCHOR:
        if not store.exists(f"{BOOTSTRAP_ANCHOR}/{MANIFEST_NAME}"):
            raise MissingAnchorError(
                f"{store.url(BOOTSTRAP_ANCHOR)} has no {MANIFEST_NAME}: write the bootstrap anchor first"
            )
        return
    m = ANCHOR_RE.match(anchor)
    if m is None:
        raise ValueError(f"invalid snapshot anchor {anchor!r}: expected 'bootstrap' or 'step_<n>'")
    try:
        store.open(int(m.group(1)))
    except IncompleteError as exc:
        raise MissingAnchorError(f"trainer anchor {anchor} is not durable yet: {exc}") from exc


class SnapshotWriter(StagedWriter):
    """Writes ``tmp_snapshot_<seq>/``; :meth:`commit` publishes ``snapshot_<seq>/``."""

    store: CheckpointStore  # the whole store: a snapshot reads its anchor and prunes its siblings

    def __init__(self, store: CheckpointStore, anchor: str, seq: int) -> None:
        base = snapshots_rel(anchor)
        super().__init__(store, f"{base}/tmp_snapshot_{seq:06d}", f"{base}/snapshot_{seq:06d}")
        self.anchor = anchor
        self.seq = seq

    def __enter__(self) -> SnapshotWriter:
        return self

    def commit(
        self,
        header: SnapshotManifest,
        metadata: Mapping[str, Any] | None = None,
        keep_latest_k: int | None = None,
    ) -> SnapshotInfo:
        """Publish the snapshot, then (optionally) keep only the newest ``keep_latest_k`` snapshots.

        The header must match the anchor: ``base_train_step`` is the anchor's step (0 for bootstrap), and
        ``bootstrap_fingerprint`` is the bootstrap anchor's fingerprint there and None under a trainer
        anchor (ValueError otherwise, before anything is published).
        """
        try:
            self._check_header(header)
        except BaseException:
            self.abort()
            raise
        manifest = {
            **header.to_json(),
            "kind": SNAPSHOT_KIND,
            "seq": self.seq,
            **self._manifest_body(),
            "metadata": dict(metadata or {}),
        }
        self._publish(manifest)
        if keep_latest_k is not None:
            retain_snapshots(self.store, self.anchor, keep_latest_k)
        return _load_snapshot(self.store, self.anchor, self.final_relpath.rsplit("/", 1)[-1])

    def _check_header(self, header: SnapshotManifest) -> None:
        if self.anchor == BOOTSTRAP_ANCHOR:
            anchor = self.store.read_json(f"{BOOTSTRAP_ANCHOR}/{MANIFEST_NAME}")
            expected = anchor.get("bootstrap_fingerprint") if isinstance(anchor, dict) else None
            if header.base_train_step != 0 or header.trainer_version != 0:
                raise ValueError(
                    "a bootstrap snapshot must have base_train_step=0 and trainer_version=0, got "
                    f"{header.base_train_step}/{header.trainer_version}"
                )
            if header.bootstrap_fingerprint is None or header.bootstrap_fingerprint != expected:
                raise ValueError(
                    f"bootstrap snapshot fingerprint {header.bootstrap_fingerprint!r}"
                    " does not match the anchor's"
                    f" {expected!r}"
                )
            return
        step = int(self.anchor.split("_", 1)[1])
        if header.base_train_step != step:
            raise ValueError(
                f"snapshot base_train_step {header.base_train_step} does not match anchor {self.anchor}"
            )
        if header.bootstrap_fingerprint is not None:
            raise ValueError("a snapshot under a trainer anchor must have bootstrap_fingerprint=None")


def sweep_snapshot_leftovers(store: CheckpointStore, anchor: str) -> list[str]:
    """Delete ``tmp_snapshot_*``/``trash_snapshot_*`` (and, on object stores, manifest-less snapshots).

    Only call it while holding the checkpoint-save lock (no snapshot is being written).
    """
    base = snapshots_rel(anchor)
    removed: list[str] = []
    for name in store.children(base):
        leftover = bool(TMP_SNAPSHOT_RE.match(name) or TRASH_SNAPSHOT_RE.match(name))
        if not leftover and SNAPSHOT_RE.match(name) and not store.atomic_rename:
            leftover = not store.exists(f"{base}/{name}/{MANIFEST_NAME}")
        if leftover:
            store.remove_tree(f"{base}/{name}")
            removed.append(name)
    return removed


def begin_snapshot(store: CheckpointStore, anchor: str, sweep: bool = True) -> SnapshotWriter:
    """Start ``tmp_snapshot_<seq>`` under ``anchor`` (MissingAnchorError when the anchor is not durable).

    ``sweep`` first deletes leftovers of interrupted snapshots under this anchor (see
    :func:`sweep_snapshot_leftovers`); the sequence number is one more than any seen (published, temporary
    or trash), so a number is never reused.
    """
    _check_anchor(store, anchor)
    seqs = [s for s in (seq_of(n) for n in store.children(snapshots_rel(anchor))) if s is not None]
    if sweep:
        sweep_snapshot_leftovers(store, anchor)
    return SnapshotWriter(store, anchor, max(seqs, default=0) + 1)


def _load_snapshot(store: CheckpointStore, anchor: str, name: str) -> SnapshotInfo:
    relpath = f"{snapshots_rel(anchor)}/{name}"
    manifest, parts, empty_dirs = store.load_published(relpath)
    if manifest.get("kind") != SNAPSHOT_KIND:
        raise IncompleteError(
            f"{store.url(relpath)}: manifest kind {manifest.get('kind')!r} is not a snapshot"
        )
    try:
        header = SnapshotManifest.from_json(manifest)
    except ValueError as exc:
        raise IncompleteError(f"{store.url(relpath)}: invalid manifest: {exc}") from exc
    return SnapshotInfo(
        relpath=relpath,
        url=store.url(relpath),
        parts=parts,
        empty_dirs=empty_dirs,
        metadata=dict(manifest.get("metadata", {})),
        manifest=manifest,
        anchor=anchor,
        seq=int(name.rsplit("_", 1)[1]),
        header=header,
    )


def _published_names(store: CheckpointStore, anchor: str) -> tuple[list[str], list[str]]:
    """(``snapshot_*`` names newest first, other names)."""
    published: list[str] = []
    other: list[str] = []
    for name in store.children(snapshots_rel(anchor)):
        (published if SNAPSHOT_RE.match(name) else other).append(name)
    published.sort(key=lambda n: int(n.rsplit("_", 1)[1]), reverse=True)
    return published, other


def scan_snapshots(
    store: CheckpointStore,
    anchor: str,
    expect_step: int | None = None,
    expect_version: int | None = None,
    expect_fingerprint: str | None = None,
    check_lineage: bool = True,
) -> SnapshotScan:
    """Judge every published snapshot under ``anchor`` (read-only); see :func:`resolve_latest_snapshot`."""
    published, other = _published_names(store, anchor)
    good: list[SnapshotInfo] = []
    skipped: list[tuple[str, str]] = []
    ignored = list(other)
    for name in published:
        relpath = f"{snapshots_rel(anchor)}/{name}"
        if not store.atomic_rename and not store.exists(f"{relpath}/{MANIFEST_NAME}"):
            ignored.append(name)  # an interrupted copy-then-manifest publish on an object store
            continue
        try:
            info = _load_snapshot(store, anchor, name)
        except IncompleteError as exc:
            skipped.append((name, str(exc)))
            continue
        reason = (
            _lineage_problem(info.header, expect_step, expect_version, expect_fingerprint)
            if check_lineage
            else None
        )
        if reason is not None:
            skipped.append((name, f"{info.url}: {reason}"))
            continue
        good.append(info)
    return SnapshotScan(tuple(good), tuple(skipped), tuple(ignored), store.url(snapshots_rel(anchor)))


def _lineage_problem(
    header: SnapshotManifest, step: int | None, version: int | None, fingerprint: str | None
) -> str | None:
    if (step is not None and header.base_train_step != step) or (
        version is not None and header.trainer_version != version
    ):
        return (
            f"lineage mismatch: snapshot has base_train_step={header.base_train_step},"
            f" trainer_version={header.trainer_version}; expected base_train_step={step},"
            f" trainer_version={version}"
        )
    if header.bootstrap_fingerprint != fingerprint:
        return (
            f"bootstrap fingerprint mismatch: snapshot has {header.bootstrap_fingerprint!r},"
            f" expected {fingerprint!r}"
        )
    return None


def resolve_latest_snapshot(
    store: CheckpointStore,
    anchor: str,
    expect_step: int,
    expect_version: int,
    expect_fingerprint: str | None,
) -> SnapshotInfo | None:
    """The newest compatible published snapshot under ``anchor`` (read-only).

    Newest first, a snapshot is skipped (with its reason) when its manifest is missing, unreadable or
    invalid, a listed part is missing or has the wrong size, its ``base_train_step``/``trainer_version``
    differ from ``expect_step``/``expect_version``, or its ``bootstrap_fingerprint`` differs from
    ``expect_fingerprint`` (None under a trainer anchor). The first good one is returned; when none is
    good but some were skipped, ValueError lists the reasons; with no candidates at all, None.
    """
    return scan_snapshots(store, anchor, expect_step, expect_version, expect_fingerprint).choose()


def list_snapshots(store: CheckpointStore, anchor: str) -> list[SnapshotInfo]:
    """Published, readable snapshots under ``anchor`` (any lineage), oldest first."""
    return list(reversed(scan_snapshots(store, anchor, check_lineage=False).good))


def retain_snapshots(store: CheckpointStore, anchor: str, keep_latest_k: int) -> list[str]:
    """Keep the newest ``keep_latest_k`` readable snapshots; delete every older published one.

    Each deleted snapshot first leaves the live namespace (renamed to ``trash_snapshot_<seq>`` locally,
    its manifest deleted first on an object store). Returns the deleted names.
    """
    if isinstance(keep_latest_k, bool) or not isinstance(keep_latest_k, int) or keep_latest_k < 1:
        raise ValueError(f"keep_latest_k must be an integer >= 1, got {keep_latest_k!r}")
    kept = list_snapshots(store, anchor)[-keep_latest_k:]
    if not kept:
        return []
    oldest_kept = kept[0].seq
    published, _ = _published_names(store, anchor)
    removed = []
    base = snapshots_rel(anchor)
    for name in published:
        seq = int(name.rsplit("_", 1)[1])
        if seq < oldest_kept:
            store.remove_published(f"{base}/{name}", f"{base}/trash_snapshot_{seq:06d}")
            removed.append(name)
    return removed


def prune_bootstrap_snapshots(store: CheckpointStore) -> list[str]:
    """Delete the bootstrap snapshots once a complete trainer bundle exists (else do nothing).

    The bootstrap manifest stays (it records the lineage's identity). Returns the deleted names.
    """
    if store.latest() is None:
        return []
    published, other = _published_names(store, BOOTSTRAP_ANCHOR)
    base = snapshots_rel(BOOTSTRAP_ANCHOR)
    removed = []
    for name in published:
        store.remove_published(f"{base}/{name}", f"{base}/trash_snapshot_{int(name.rsplit('_', 1)[1]):06d}")
        removed.append(name)
    for name in other:
        store.remove_tree(f"{base}/{name}")
        removed.append(name)
    if not store.children(base):
        store.remove_tree(base)
    return removed
