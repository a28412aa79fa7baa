"""Checkpoint bundles over any fsspec URL, published atomically.

A *bundle* is the directory ``<root>/step_<n>/``: every part a trainer checkpoint needs (the Lightning
checkpoint, the native TransferQueue snapshot, the replay index, ``rollout_recovery.pt``,
``replacement_reserve.pt``, ...) plus a ``manifest.json`` listing each part with its size and SHA-256.

Publishing never exposes a half-written bundle:

* every part is first written under ``<root>/tmp_step_<n>_<uuid>/``;
* on a POSIX filesystem (a local disk or a shared filesystem mounted at the same path everywhere) the
  manifest is written into the temporary directory, the whole tree is fsync'd and then renamed to
  ``step_<n>/`` (and the parent fsync'd): the rename is the publish;
* on an object store (``s3://``, anything without an atomic rename) the parts are copied server-side to
  ``step_<n>/`` and ``manifest.json`` is written *last*, as one object: its appearance is the publish.
  A ``step_<n>/`` without a valid manifest (an interrupted copy) is never selectable.

Selection (:meth:`CheckpointStore.scan`, :meth:`CheckpointStore.latest`) is read-only and picks the newest
bundle whose manifest parses and whose listed parts are all present with the listed sizes; every skipped
directory is reported with its reason. Readers verify each part's SHA-256 as they read it.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

__all__ = [
    "BUNDLE_SCHEMA_VERSION",
    "MANIFEST_NAME",
    "BundleInfo",
    "BundleScan",
    "BundleWriter",
    "CheckpointStore",
    "IncompleteError",
    "PartInfo",
    "PublishedDir",
    "StagedWriter",
]

MANIFEST_NAME = "manifest.json"
BUNDLE_SCHEMA_VERSION = 1
BUNDLE_KIND = "screl.checkpoint_bundle"
#: Part names that a writer may not use: the manifest itself and the snapshot namespace of an anchor.
RESERVED_TOP_LEVEL = frozenset({MANIFEST_NAME, "rollout_snapshots"})

_CHUNK = 8 * 1024 * 1024
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_STEP_RE = re.compile(r"^tmp_step_(\d+)_[0-9a-f]+$")
_TRASH_STEP_RE = re.compile(r"^trash_step_(\d+)_[0-9a-f]+$")


class IncompleteError(FileNotFoundError):
    """A published directory is missing, has no valid manifest, or lacks a listed part."""


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


def _canonical_json(obj: Any) -> bytes:
    return json.dumps(obj, sort_keys=True, indent=1, allow_nan=False).encode()


class CheckpointStore:
    """Bundles ``step_<n>/`` under one fsspec root (local path, ``file://``, ``s3://bucket/prefix``).

    Args:
        root_url: the checkpoint directory (``checkpointing.checkpoint_dir``).
        storage_options: passed to fsspec (for S3: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``).
    """

    def __init__(self, root_url: str, storage_options: Mapping[str, Any] | None = None) -> None:
        self.root_url = str(root_url)
        self.storage_options = dict(storage_options or {})
        fs, path = fsspec.core.url_to_fs(self.root_url, **self.storage_options)
        self.fs: Any = fs
        self.root: str = path.rstrip("/") or path
        #: True where a directory rename is atomic (local and shared POSIX filesystems).
        self.atomic_rename: bool = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"CheckpointStore({self.root_url!r})"

    # -- low-level paths (shared by snapshots and the bootstrap anchor) --------------------------------
    def path(self, relpath: str = "") -> str:
        """The filesystem path of ``relpath`` (relative to the root)."""
        return f"{self.root}/{relpath}" if relpath else self.root

    def url(self, relpath: str = "") -> str:
        """The full URL of ``relpath``, for messages."""
        if self.atomic_rename:
            return self.path(relpath)
        return str(self.fs.unstrip_protocol(self.path(relpath)))

    def refresh(self, relpath: str = "") -> None:
        """Forget cached listings (object stores cache them; another process may have written)."""
        if self.atomic_rename:
            self.fs.invalidate_cache(self.path(relpath))
        else:
            self.fs.invalidate_cache()

    def children(self, relpath: str = "") -> list[str]:
        """Names of the entries directly under ``relpath`` (files and directories), sorted."""
        self.refresh(relpath)
        try:
            entries = self.fs.ls(self.path(relpath), detail=False)
        except (FileNotFoundError, NotADirectoryError):
            return []
        base = self.path(relpath).rstrip("/")
        names = []
        for entry in entries:
            entry = str(entry).rstrip("/")
            if entry == base:
                continue
            names.append(entry.rsplit("/", 1)[-1])
        return sorted(set(names))

    def files(self, relpath: str) -> dict[str, int]:
        """Every file under ``relpath`` (recursively) as ``relative name -> size``."""
        base = self.path(relpath).rstrip("/") + "/"
        self.refresh(relpath)
        try:
            found = self.fs.find(self.path(relpath), detail=True)
        except FileNotFoundError:
            return {}
        out: dict[str, int] = {}
        for name, info in found.items():
            name = str(name)
            if name.startswith(base) and info.get("type", "file") == "file":
                out[name[len(base) :]] = int(info.get("size") or 0)
        return out

    def exists(self, relpath: str) -> bool:
        self.refresh(relpath)
        return bool(self.fs.exists(self.path(relpath)))

    def read_json(self, relpath: str) -> Any:
        """Parse the JSON file at ``relpath`` (FileNotFoundError if absent, ValueError if invalid)."""
        with self.fs.open(self.path(relpath), "rb") as f:
            data = f.read()
        try:
            return json.loads(data)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"{self.url(relpath)} is not valid JSON: {exc}") from exc

    def write_json_atomic(self, relpath: str, obj: Any) -> None:
        """Write one small JSON file atomically: tmp + fsync + rename locally, a single PUT elsewhere."""
        data = _canonical_json(obj)
        target = self.path(relpath)
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self.atomic_rename:
            with self.fs.open(target, "wb") as f:
                f.write(data)
            return
        tmp = f"{parent}/.tmp_{uuid.uuid4().hex}_{target.rsplit('/', 1)[-1]}"
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            _fsync_path(tmp)
            os.replace(tmp, target)
            _fsync_path(parent)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def remove_tree(self, relpath: str) -> None:
        """Delete ``relpath`` and everything under it (no error when absent)."""
        if self.exists(relpath):
            self.fs.rm(self.path(relpath), recursive=True)

    def remove_published(self, relpath: str, trash_relpath: str) -> None:
        """Delete a published directory so that it leaves the live namespace first.

        Locally it is renamed to ``trash_relpath`` (atomic; a crash leaves a trash directory that is never
        selected) and then deleted. On an object store its ``manifest.json`` is deleted first (one object:
        the directory stops being selectable at once) and then the rest.
        """
        if self.atomic_rename:
            src, dst = self.path(relpath), self.path(trash_relpath)
            if not os.path.exists(src):
                return
            if os.path.exists(dst):
                self.fs.rm(dst, recursive=True)
            os.rename(src, dst)
            _fsync_path(dst.rsplit("/", 1)[0])
            self.fs.rm(dst, recursive=True)
            return
        manifest = f"{relpath}/{MANIFEST_NAME}"
        if self.exists(manifest):
            self.fs.rm(self.path(manifest))
        self.remove_tree(relpath)

    def load_published(self, relpath: str) -> tuple[dict[str, Any], dict[str, PartInfo], tuple[str, ...]]:
        """Manifest, parts and empty dirs of a published directory; IncompleteError says what is wrong."""
        try:
            manifest = self.read_json(f"{relpath}/{MANIFEST_NAME}")
        except FileNotFoundError as exc:
            raise IncompleteError(
                f"{self.url(relpath)}: no {MANIFEST_NAME} (unpublished or interrupted)"
            ) from exc
        except ValueError as exc:
            raise IncompleteError(f"{self.url(relpath)}: unreadable {MANIFEST_NAME}: {exc}") from exc
        if not isinstance(manifest, dict):
            raise IncompleteError(f"{self.url(relpath)}: {MANIFEST_NAME} is not a JSON object")
        try:
            parts, empty_dirs = parse_parts(manifest)
        except ValueError as exc:
            raise IncompleteError(f"{self.url(relpath)}: invalid {MANIFEST_NAME}: {exc}") from exc
        present = self.files(relpath)
        for part in parts.values():
            size = present.get(part.name)
            if size is None:
                raise IncompleteError(f"{self.url(relpath)}: part {part.name!r} is missing")
            if size != part.size:
                raise IncompleteError(
                    f"{self.url(relpath)}: part {part.name!r} has {size} bytes, the manifest says {part.size}"
                )
        return manifest, parts, empty_dirs

    # -- bundles ---------------------------------------------------------------------------------------
    def begin(self, step: int) -> BundleWriter:
        """Start writing bundle ``step_<step>/`` (FileExistsError when a complete one is already there)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bundle step must be a non-negative integer, got {step!r}")
        self._refuse_complete(step)
        tmp = f"tmp_step_{step}_{uuid.uuid4().hex}"
        return BundleWriter(self, step, tmp)

    def _refuse_complete(self, step: int) -> None:
        try:
            self.open(step)
        except IncompleteError:
            return
        raise FileExistsError(f"{self.url(f'step_{step}')} is already a complete bundle")

    def scan(self) -> BundleScan:
        """Classify every ``step_*``/``tmp_step_*``/``trash_step_*`` directory under the root (read-only)."""
        complete: list[BundleInfo] = []
        skipped: list[tuple[str, str]] = []
        temporaries: list[str] = []
        for name in self.children():
            if _TMP_STEP_RE.match(name) or _TRASH_STEP_RE.match(name):
                temporaries.append(name)
                continue
            m = _STEP_RE.match(name)
            if m is None:
                continue
            try:
                complete.append(self._bundle_info(int(m.group(1))))
            except IncompleteError as exc:
                skipped.append((name, str(exc)))
        complete.sort(key=lambda b: b.step)
        return BundleScan(tuple(complete), tuple(skipped), tuple(temporaries))

    def _bundle_info(self, step: int) -> BundleInfo:
        relpath = f"step_{step}"
        manifest, parts, empty_dirs = self.load_published(relpath)
        if manifest.get("kind") != BUNDLE_KIND:
            raise IncompleteError(
                f"{self.url(relpath)}: manifest kind {manifest.get('kind')!r} is not a bundle"
            )
        if manifest.get("schema_version") != BUNDLE_SCHEMA_VERSION:
            raise IncompleteError(
                f"{self.url(relpath)}: bundle schema_version {manifest.get('schema_version')!r}"
                " is not supported"
                f" (expected {BUNDLE_SCHEMA_VERSION})"
            )
        if manifest.get("step") != step or isinstance(manifest.get("step"), bool):
            raise IncompleteError(
                f"{self.url(relpath)}: manifest step {manifest.get('step')!r} does not match the directory"
            )
        return BundleInfo(
            relpath=relpath,
            url=self.url(relpath),
            parts=parts,
            empty_dirs=empty_dirs,
            metadata=dict(manifest.get("metadata", {})),
            manifest=manifest,
            step=step,
        )

    def latest(self) -> BundleInfo | None:
        """The newest complete bundle, or None (see :meth:`scan` for what was skipped and why)."""
        return self.scan().latest

    def list_bundles(self) -> list[BundleInfo]:
        """Complete bundles, oldest first."""
        return list(self.scan().complete)

    def open(self, step: int) -> BundleInfo:
        """Bundle ``step_<step>/`` if complete (IncompleteError, a FileNotFoundError, says why not)."""
        return self._bundle_info(step)

    def _resolve(self, target: int | PublishedDir) -> PublishedDir:
        return self.open(target) if isinstance(target, int) else target

    def read_bytes(self, target: int | PublishedDir, name: str) -> bytes:
        """Part ``name`` of a bundle (by step) or of a published directory, SHA-256 verified."""
        published = self._resolve(target)
        part = _lookup(published, name)
        buf = io.BytesIO()
        self._copy_out(published, part, buf)
        return buf.getvalue()

    def read_torch(self, target: int | PublishedDir, name: str, weights_only: bool = True) -> Any:
        """``torch.load`` of part ``name``."""
        import torch

        return torch.load(io.BytesIO(self.read_bytes(target, name)), weights_only=weights_only)

    def download_file(
        self, target: int | PublishedDir, name: str, local_path: str | os.PathLike[str]
    ) -> None:
        """Copy part ``name`` to ``local_path``, SHA-256 verified."""
        published = self._resolve(target)
        part = _lookup(published, name)
        os.makedirs(os.path.dirname(os.path.abspath(local_path)), exist_ok=True)
        with open(local_path, "wb") as out:
            self._copy_out(published, part, out)

    def download_dir(
        self, target: int | PublishedDir, name: str, local_dir: str | os.PathLike[str]
    ) -> list[str]:
        """Copy every part under ``name/`` into ``local_dir`` (empty directories recreated); returns names."""
        published = self._resolve(target)
        prefix = name.rstrip("/") + "/"
        names = sorted(p for p in published.parts if p.startswith(prefix))
        dirs = [d for d in published.empty_dirs if d == name.rstrip("/") or d.startswith(prefix)]
        if not names and not dirs:
            raise FileNotFoundError(f"{published.url} has no parts under {prefix!r}")
        os.makedirs(local_dir, exist_ok=True)
        for part_name in names:
            dest = os.path.join(local_dir, *part_name[len(prefix) :].split("/"))
            os.makedirs(os.path.dirname(dest), exist_ok=True)
            with open(dest, "wb") as out:
                self._copy_out(published, published.parts[part_name], out)
        for d in dirs:
            if d.startswith(prefix):
                os.makedirs(os.path.join(local_dir, *d[len(prefix) :].split("/")), exist_ok=True)
        return names

    def _copy_out(self, published: PublishedDir, part: PartInfo, out: Any) -> None:
        digest = hashlib.sha256()
        size = 0
        with self.fs.open(self.path(f"{published.relpath}/{part.name}"), "rb") as f:
            while chunk := f.read(_CHUNK):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != part.size or digest.hexdigest() != part.sha256:
            raise ValueError(
                f"{published.url}: part {part.name!r} is corrupt ({size} bytes,"
                f" sha256 {digest.hexdigest()[:12]}…;"
                f" the manifest says {part.size} bytes, sha256 {part.sha256[:12]}…)"
            )

    def retain(self, keep_top_k: int) -> list[str]:
        """Keep the newest ``keep_top_k`` complete bundles; delete older ones and leftovers.

        Leftovers are temporary/trash directories and incomplete ``step_<n>`` directories whose step is not
        newer than the newest complete bundle (newer ones may belong to a save in progress). The newest
        complete bundle is never deleted. Returns the deleted directory names.
        """
        if isinstance(keep_top_k, bool) or not isinstance(keep_top_k, int) or keep_top_k < 1:
            raise ValueError(f"keep_top_k must be an integer >= 1, got {keep_top_k!r}")
        found = self.scan()
        latest = found.latest
        if latest is None:
            return []
        removed: list[str] = []
        for bundle in found.complete[:-keep_top_k]:
            self.remove_published(bundle.relpath, f"trash_step_{bundle.step}_{uuid.uuid4().hex}")
            removed.append(bundle.relpath)
        for name in found.temporaries:
            m = _TMP_STEP_RE.match(name) or _TRASH_STEP_RE.match(name)
            if m is not None and int(m.group(1)) <= latest.step:
                self.remove_tree(name)
                removed.append(name)
        for name, _reason in found.skipped:
            m = _STEP_RE.match(name)
            if m is not None and int(m.group(1)) < latest.step:
                self.remove_published(name, f"trash_step_{m.group(1)}_{uuid.uuid4().hex}")
                removed.append(name)
        return removed


def _lookup(published: PublishedDir, name: str) -> PartInfo:
    part = published.parts.get(name)
    if part is None:
        known = ", ".join(sorted(published.parts)[:10])
        raise FileNotFoundError(f"{published.url} has no part {name!r} (parts: {known or 'none'})")
    return part


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: str) -> None:
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            _fsync_path(os.path.join(dirpath, name))
        _fsync_path(dirpath)


def _iter_file(path: str | os.PathLike[str]) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


class StagedWriter:
    """Writes parts under a temporary directory and publishes them under the final name with a manifest.

    Use as a context manager: leaving the block with an exception (or without :meth:`commit`) aborts, and
    after any failed write the writer refuses to commit.
    """

    def __init__(self, store: CheckpointStore, tmp_relpath: str, final_relpath: str) -> None:
        self.store = store
        self.tmp_relpath = tmp_relpath
        self.final_relpath = final_relpath
        self.parts: dict[str, PartInfo] = {}
        self.empty_dirs: list[str] = []
        self._state = "open"
        self._broken: str | None = None

    def __enter__(self) -> StagedWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._state == "open":
            self.abort()

    # -- writing ---------------------------------------------------------------------------------------
    def _check_writable(self, name: str) -> None:
        if self._state != "open":
            raise RuntimeError(f"writer for {self.final_relpath} is {self._state}")
        if self._broken is not None:
            raise RuntimeError(f"writer for {self.final_relpath} is broken: {self._broken}")
        check_part_name(name)
        if name.split("/", 1)[0] in RESERVED_TOP_LEVEL:
            raise ValueError(f"part name {name!r} is reserved")
        if name in self.parts:
            raise ValueError(f"part {name!r} was already written")
        clash = [p for p in self.parts if p.startswith(name + "/") or name.startswith(p + "/")]
        if clash:
            raise ValueError(
                f"part {name!r} clashes with part {clash[0]!r} (a file cannot also be a directory)"
            )

    def _write_chunks(self, name: str, chunks: Iterable[bytes]) -> PartInfo:
        self._check_writable(name)
        target = self.store.path(f"{self.tmp_relpath}/{name}")
        digest = hashlib.sha256()
        size = 0
        try:
            self.store.fs.makedirs(target.rsplit("/", 1)[0], exist_ok=True)
            with self.store.fs.open(target, "wb") as f:
                for chunk in chunks:
                    f.write(chunk)
                    digest.update(chunk)
                    size += len(chunk)
        except BaseException as exc:
            self._broken = f"writing part {name!r} failed: {exc!r}"
            raise
        part = PartInfo(name, size, digest.hexdigest())
        self.parts[name] = part
        return part

    def write_bytes(self, name: str, data: bytes) -> PartInfo:
        """Write part ``name`` from memory."""
        view = memoryview(data)
        return self._write_chunks(
            name, (bytes(view[i : i + _CHUNK]) for i in range(0, max(len(view), 1), _CHUNK))
        )

    def write_file(self, name: str, local_path: str | os.PathLike[str]) -> PartInfo:
        """Upload the local file ``local_path`` as part ``name``."""
        if not os.path.isfile(local_path):
            raise FileNotFoundError(f"no such local file: {local_path}")
        return self._write_chunks(name, _iter_file(local_path))

    def write_dir(self, name: str, local_dir: str | os.PathLike[str]) -> list[PartInfo]:
        """Upload every file under ``local_dir`` as parts ``name/<relative path>`` (empty dirs recorded)."""
        if not os.path.isdir(local_dir):
            raise FileNotFoundError(f"no such local directory: {local_dir}")
        check_part_name(name)
        if name.split("/", 1)[0] in RESERVED_TOP_LEVEL:
            raise ValueError(f"part name {name!r} is reserved")
        written: list[PartInfo] = []
        for dirpath, dirnames, filenames in os.walk(local_dir):
            dirnames.sort()
            rel = os.path.relpath(dirpath, local_dir)
            prefix = name if rel == "." else f"{name}/{rel.replace(os.sep, '/')}"
            if not dirnames and not filenames:
                self.empty_dirs.append(prefix)
            for fname in sorted(filenames):
                written.append(self.write_file(f"{prefix}/{fname}", os.path.join(dirpath, fname)))
        return written

    def write_torch(self, name: str, obj: Any) -> PartInfo:
        """``torch.save`` ``obj`` as part ``name``."""
        import torch

        buf = io.BytesIO()
        torch.save(obj, buf)
        return self.write_bytes(name, buf.getvalue())

    # -- publishing ------------------------------------------------------------------------------------
    def abort(self) -> None:
        """Discard the temporary directory (best effort; a leftover is never selectable)."""
        if self._state == "committed":
            raise RuntimeError(f"{self.final_relpath} is already committed")
        self._state = "aborted"
        try:
            self.store.remove_tree(self.tmp_relpath)
        except Exception:  # noqa: BLE001 - a leftover tmp dir is harmless and swept by retention
            pass

    def _manifest_body(self) -> dict[str, Any]:
        return {
            "parts": [
                {"name": p.name, "size": p.size, "sha256": p.sha256}
                for p in sorted(self.parts.values(), key=lambda p: p.name)
            ],
            "empty_dirs": sorted(self.empty_dirs),
            "created_unix": time.time(),
        }

    def _publish(self, manifest: dict[str, Any]) -> None:
        """Publish the staged parts with ``manifest`` (the manifest is the last thing to appear)."""
        if self._state != "open":
            raise RuntimeError(f"writer for {self.final_relpath} is {self._state}")
        if self._broken is not None:
            self.abort()
            raise RuntimeError(f"refusing to publish {self.final_relpath}: {self._broken}")
        try:
            data = _canonical_json(manifest)
            self._clear_incomplete_final()
            if self.store.atomic_rename:
                self._publish_rename(data)
            else:
                self._publish_copy(data)
        except BaseException:
            self.abort()
            raise
        self._state = "committed"

    def _clear_incomplete_final(self) -> None:
        """Remove a leftover final directory that was never published (else refuse to overwrite)."""
        if not self.store.exists(self.final_relpath):
            return
        try:
            self.store.load_published(self.final_relpath)
        except IncompleteError:
            leaf = self.final_relpath.rsplit("/", 1)
            trash = f"trash_{leaf[-1]}_{uuid.uuid4().hex}"
            self.store.remove_published(self.final_relpath, trash if len(leaf) == 1 else f"{leaf[0]}/{trash}")
            return
        raise FileExistsError(f"{self.store.url(self.final_relpath)} is already published")

    def _write_manifest(self, relpath: str, data: bytes) -> None:
        with self.store.fs.open(self.store.path(f"{relpath}/{MANIFEST_NAME}"), "wb") as f:
            f.write(data)

    def _publish_rename(self, data: bytes) -> None:
        tmp = self.store.path(self.tmp_relpath)
        final = self.store.path(self.final_relpath)
        os.makedirs(tmp, exist_ok=True)
        self._write_manifest(self.tmp_relpath, data)
        _fsync_tree(tmp)
        os.rename(tmp, final)
        _fsync_path(final.rsplit("/", 1)[0])

    def _publish_copy(self, data: bytes) -> None:
        fs = self.store.fs
        for name in sorted(self.parts):
            fs.copy(
                self.store.path(f"{self.tmp_relpath}/{name}"), self.store.path(f"{self.final_relpath}/{name}")
            )
        present = self.store.files(self.final_relpath)
        for part in self.parts.values():
            if present.get(part.name) != part.size:
                raise OSError(
                    f"copy of part {part.name!r} to {self.store.url(self.final_relpath)} is incomplete"
                )
        try:
            self._write_manifest(self.final_relpath, data)
        except BaseException:
            try:  # the PUT may have landed: withdraw it so a failed commit never becomes selectable
                fs.rm(self.store.path(f"{self.final_relpath}/{MANIFEST_NAME}"))
            except Exception:  # noqa: BLE001
                pass
            raise
        try:
            self.store.remove_tree(self.tmp_relpath)
        except Exception:  # noqa: BLE001 - swept later by retention
            pass


class BundleWriter(StagedWriter):
    """Writes one trainer checkpoint bundle; :meth:`commit` publishes it."""

    def __init__(self, store: CheckpointStore, step: int, tmp_relpath: str) -> None:
        super().__init__(store, tmp_relpath, f"step_{step}")
        self.step = step

    def __enter__(self) -> BundleWriter:
        return self

    def commit(self, metadata: Mapping[str, Any] | None = None) -> BundleInfo:
        """Publish the bundle; ``metadata`` (JSON) lands in the manifest (e.g. ``trainer_version``)."""
        manifest = {
            "schema_version": BUNDLE_SCHEMA_VERSION,
            "kind": BUNDLE_KIND,
            "step": self.step,
            **self._manifest_body(),
            "metadata": dict(metadata or {}),
        }
        self._publish(manifest)
        return self.store.open(self.step)
