"""The layout of published checkpoint directories and their manifest format.

A trainer bundle is ``<root>/step_<n>/``, written under ``tmp_step_<n>_<uuid>/`` and deleted through
``trash_step_<n>_<uuid>/``; every published directory (a bundle or a rollout snapshot) carries a
``manifest.json`` listing each part with its size and SHA-256. Here: those names, the records a reader gets
(:class:`PartInfo`, :class:`PublishedDir`, :class:`BundleInfo`, :class:`BundleScan`), the manifest's
validation and its canonical JSON encoding. :mod:`screl.checkpoint.store` re-exports the public names.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "BUNDLE_KIND",
    "BUNDLE_SCHEMA_VERSION",
    "ATOMIC_TMP_PREFIX",
    "CHUNK_BYTES",
    "MANIFEST_NAME",
    "RESERVED_TOP_LEVEL",
    "STEP_RE",
    "TMP_STEP_RE",
    "TRASH_STEP_RE",
    "BundleInfo",
    "BundleScan",
    "CorruptPartError",
    "IncompleteError",
    "PartInfo",
    "PublishedDir",
    "canonical_json",
    "check_part_name",
    "lookup_part",
    "parse_parts",
]

MANIFEST_NAME = "manifest.json"
BUNDLE_SCHEMA_VERSION = 1
BUNDLE_KIND = "screl.checkpoint_bundle"
#: Part names that a writer may not use: the manifest itself and the snapshot namespace of an anchor.
RESERVED_TOP_LEVEL = frozenset({MANIFEST_NAME, "rollout_snapshots"})

CHUNK_BYTES = 8 * 1024 * 1024
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
STEP_RE = re.compile(r"^step_(\d+)$")
TMP_STEP_RE = re.compile(r"^tmp_step_(\d+)_[0-9a-f]+$")
TRASH_STEP_RE = re.compile(r"^trash_step_(\d+)_[0-9a-f]+$")
#: A local atomic JSON write stages ``<dir>/.tmp_<uuid>_<name>`` and renames it; a SIGKILL between the two
#: leaves that file behind. It is never state: readers skip it, and the next write of that file sweeps it.
ATOMIC_TMP_PREFIX = ".tmp_"


class IncompleteError(FileNotFoundError):
    """A published directory is missing, has no valid manifest, or lacks a listed part."""


class CorruptPartError(ValueError):
    """A part of a published directory failed its size or SHA-256 check against the manifest as it was read.

    ``relpath`` is the published directory (``step_3``, ``step_3/rollout_snapshots/snapshot_000002``), ``part``
    the file within it, ``check`` ``"size"`` or ``"sha256"``: a resume refuses that directory and falls back.
    """

    def __init__(self, message: str, relpath: str, part: str, check: str) -> None:
        super().__init__(message)
        self.relpath, self.part, self.check = relpath, part, check


@dataclass(frozen=True)
class PartInfo:
    """One file of a published directory, as its manifest lists it."""

    name: str
    size: int
    sha256: str


@dataclass(frozen=True)
class PublishedDir:
    """A directory published with a manifest: a trainer bundle or a rollout snapshot."""

    relpath: str
    """Path relative to the store root (``step_3``, ``step_3/rollout_snapshots/snapshot_000002``)."""
    url: str
    """Full URL, for messages."""
    parts: Mapping[str, PartInfo]
    empty_dirs: tuple[str, ...]
    metadata: Mapping[str, Any]
    """The caller's metadata given at commit."""
    manifest: Mapping[str, Any]
    """The raw manifest."""


@dataclass(frozen=True)
class BundleInfo(PublishedDir):
    """A complete trainer checkpoint bundle ``step_<n>/``."""

    step: int


@dataclass(frozen=True)
class BundleScan:
    """What :meth:`CheckpointStore.scan` found under the root."""

    complete: tuple[BundleInfo, ...]
    """Complete bundles, oldest first."""
    skipped: tuple[tuple[str, str], ...]
    """``(directory name, reason)`` for every ``step_<n>`` that is not selectable."""
    temporaries: tuple[str, ...]
    """Leftover ``tmp_step_*`` / ``trash_step_*`` directories (never selectable)."""

    @property
    def latest(self) -> BundleInfo | None:
        return self.complete[-1] if self.complete else None


# -- manifest helpers ----------------------------------------------------------------------------------
def _check_int(manifest: Mapping[str, Any], key: str, minimum: int) -> int:
    value = manifest.get(key)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"manifest field {key!r} must be an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"manifest field {key!r} must be >= {minimum}, got {value}")
    return value


def parse_parts(manifest: Mapping[str, Any]) -> tuple[dict[str, PartInfo], tuple[str, ...]]:
    """The ``parts`` and ``empty_dirs`` of a manifest, validated (ValueError names the problem)."""
    raw = manifest.get("parts")
    if not isinstance(raw, list):
        raise ValueError("manifest field 'parts' must be a list")
    parts: dict[str, PartInfo] = {}
    for entry in raw:
        if not isinstance(entry, Mapping):
            raise ValueError(f"manifest part entry must be an object, got {entry!r}")
        name = entry.get("name")
        if not isinstance(name, str):
            raise ValueError(f"manifest part name must be a string, got {name!r}")
        check_part_name(name)
        size = _check_int(entry, "size", 0)
        digest = entry.get("sha256")
        if not isinstance(digest, str) or not _SHA256_RE.match(digest):
            raise ValueError(f"manifest part {name!r} has an invalid sha256 {digest!r}")
        if name in parts:
            raise ValueError(f"manifest lists part {name!r} twice")
        parts[name] = PartInfo(name, size, digest)
    dirs = manifest.get("empty_dirs", [])
    if not isinstance(dirs, list) or not all(isinstance(d, str) for d in dirs):
        raise ValueError("manifest field 'empty_dirs' must be a list of strings")
    metadata = manifest.get("metadata", {})
    if not isinstance(metadata, Mapping):
        raise ValueError("manifest field 'metadata' must be an object")
    return parts, tuple(dirs)


def check_part_name(name: str) -> None:
    """A part name is a relative POSIX path without empty, ``.`` or ``..`` segments."""
    segments = name.split("/")
    if not name or name.startswith("/") or "\\" in name or any(seg in ("", ".", "..") for seg in segments):
        raise ValueError(f"invalid part name {name!r}: expected a relative path like 'policy/weights.pt'")


def canonical_json(obj: Any) -> bytes:
    """``obj`` as the deterministic JSON bytes a manifest is written as (sorted keys, no NaN)."""
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode()


def lookup_part(published: PublishedDir, name: str) -> PartInfo:
    """Part ``name`` of ``published`` (FileNotFoundError naming some of the parts it has)."""
    part = published.parts.get(name)
    if part is None:
        known = ", ".join(sorted(published.parts)[:10])
        raise FileNotFoundError(f"{published.url} has no part {name!r} (parts: {known or 'none'})")
    return part
