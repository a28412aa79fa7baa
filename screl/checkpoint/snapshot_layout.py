"""The names and records of rollout snapshots: what :mod:`screl.checkpoint.snapshots` writes and selects.

Here: the anchor and directory names (``<anchor>/rollout_snapshots/snapshot_<seq>/`` and its ``tmp_``/``trash_``
siblings), the manifest header (:class:`SnapshotManifest`, validated on construction and on parse, so an
invalid header is never written or selected), and the records a reader gets (:class:`SnapshotInfo`,
:class:`SnapshotScan`). Nothing here touches storage.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from screl.checkpoint.layout import PublishedDir

__all__ = [
    "ANCHOR_RE",
    "BOOTSTRAP_ANCHOR",
    "SNAPSHOTS_DIR",
    "SNAPSHOT_KIND",
    "SNAPSHOT_RE",
    "SNAPSHOT_SCHEMA_VERSION",
    "SUPPORTED_SNAPSHOT_SCHEMAS",
    "TMP_SNAPSHOT_RE",
    "TRASH_SNAPSHOT_RE",
    "MissingAnchorError",
    "SnapshotInfo",
    "SnapshotManifest",
    "SnapshotScan",
    "seq_of",
    "snapshots_rel",
    "trainer_anchor",
]

BOOTSTRAP_ANCHOR = "bootstrap"
SNAPSHOTS_DIR = "rollout_snapshots"
SNAPSHOT_SCHEMA_VERSION = 1
SNAPSHOT_KIND = "screl.rollout_snapshot"
SUPPORTED_SNAPSHOT_SCHEMAS = frozenset({1})

SNAPSHOT_RE = re.compile(r"^snapshot_(\d{6,})$")
TMP_SNAPSHOT_RE = re.compile(r"^tmp_snapshot_(\d{6,})$")
TRASH_SNAPSHOT_RE = re.compile(r"^trash_snapshot_(\d{6,})(?:_[0-9a-f]+)?$")
ANCHOR_RE = re.compile(r"^step_(\d+)$")


class MissingAnchorError(FileNotFoundError):
    """The anchor a snapshot needs is not durable yet (skip reason ``missing_trainer_anchor``)."""


def trainer_anchor(step: int) -> str:
    """The anchor name of trainer bundle ``step``."""
    return f"step_{step}"


def _int_field(data: Mapping[str, Any], key: str, minimum: int) -> int:
    value = data.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"snapshot manifest field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"snapshot manifest field {key!r} must be >= {minimum}, got {value}")
    return value


@dataclass(frozen=True)
class SnapshotManifest:
    """The lineage and cursor fields of a rollout snapshot (validated on construction)."""

    base_train_step: int
    """The trainer step of the anchor (0 for bootstrap)."""
    trainer_version: int
    """The trainer weight version when the snapshot was cut."""
    sampler_dispatch_index: int
    """The sampler dispatch position (-1: nothing dispatched yet)."""
    mutation_version: int
    """The data-plane mutation counter captured under the barrier."""
    rolled_back_train_group_count: int = 0
    """Groups claimed by the open train step, re-offered in the persisted copy."""
    current_epoch: int = 0
    bootstrap_fingerprint: str | None = None
    """The bootstrap anchor's fingerprint; None under a trainer anchor."""
    schema_version: int = SNAPSHOT_SCHEMA_VERSION

    def __post_init__(self) -> None:
        _validate_header(asdict(self))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SnapshotManifest:
        """Parse and validate (ValueError names the bad field); unknown keys are ignored."""
        return cls(**_validate_header(data))


def _validate_header(data: Mapping[str, Any]) -> dict[str, Any]:
    schema = data.get("schema_version")
    if isinstance(schema, bool) or schema not in SUPPORTED_SNAPSHOT_SCHEMAS:
        raise ValueError(
            f"snapshot schema_version {schema!r} is not supported"
            f" (supported: {sorted(SUPPORTED_SNAPSHOT_SCHEMAS)})"
        )
    fingerprint = data.get("bootstrap_fingerprint")
    if fingerprint is not None and not (isinstance(fingerprint, str) and fingerprint):
        raise ValueError(
            "snapshot manifest field 'bootstrap_fingerprint' must be a non-empty string or null,"
            f" got {fingerprint!r}"
        )
    return {
        "base_train_step": _int_field(data, "base_train_step", 0),
        "trainer_version": _int_field(data, "trainer_version", 0),
        "sampler_dispatch_index": _int_field(data, "sampler_dispatch_index", -1),
        "mutation_version": _int_field(data, "mutation_version", 0),
        "rolled_back_train_group_count": _int_field(data, "rolled_back_train_group_count", 0),
        "current_epoch": _int_field(data, "current_epoch", 0),
        "bootstrap_fingerprint": fingerprint,
        "schema_version": schema,
    }


@dataclass(frozen=True)
class SnapshotInfo(PublishedDir):
    """A published rollout snapshot; read its parts with ``store.read_bytes(info, name)`` etc."""

    anchor: str
    seq: int
    header: SnapshotManifest


@dataclass(frozen=True)
class SnapshotScan:
    """Every published snapshot under an anchor, judged against the expected lineage."""

    good: tuple[SnapshotInfo, ...]
    """Compatible snapshots, newest first."""
    skipped: tuple[tuple[str, str], ...]
    """``(directory name, reason)`` for corrupt or incompatible snapshots, newest first."""
    ignored: tuple[str, ...]
    """Temporary, trash and (object stores only) interrupted-publish directories."""
    where: str = ""
    """URL of the ``rollout_snapshots`` directory, for messages."""

    def choose(self) -> SnapshotInfo | None:
        """The newest good snapshot; ValueError listing the reasons when none is good but some were
        skipped; None when there were no candidates."""
        if self.good:
            return self.good[0]
        if self.skipped:
            reasons = "\n".join(f"  {name}: {reason}" for name, reason in self.skipped)
            raise ValueError(
                f"no compatible rollout snapshot under {self.where}; skipped:\n{reasons}\n"
                "Remove the stale snapshot directories listed above if they are not needed, or choose a new"
                " checkpointing.checkpoint_dir. Nothing was modified."
            )
        return None


def snapshots_rel(anchor: str) -> str:
    """The ``rollout_snapshots`` directory of ``anchor``, relative to the checkpoint root."""
    return f"{anchor}/{SNAPSHOTS_DIR}"


def seq_of(name: str) -> int | None:
    """The sequence number in a published, temporary or trash snapshot directory's name; None for other names."""
    for pattern in (SNAPSHOT_RE, TMP_SNAPSHOT_RE, TRASH_SNAPSHOT_RE):
        m = pattern.match(name)
        if m is not None:
            return int(m.group(1))
    return None

