"""The checkpoint root on any fsspec filesystem, below the bundle logic of :mod:`screl.checkpoint.store`.

Paths and URLs under the root, fresh listings (object stores cache them), one small JSON file written
atomically, a published directory withdrawn (it leaves the live namespace before anything is deleted) and a
published directory's manifest read back with every listed part present at its listed size. Trainer bundles,
rollout snapshots and the bootstrap anchor all go through these calls.

Invariant: ``atomic_rename`` is True exactly on a local filesystem (a shared one mounted at the same path
included); the atomic JSON write and the withdrawal of a published directory take their rename path there, and
their one-object path (a single PUT; the manifest deleted first) elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from screl.checkpoint.layout import (
    ATOMIC_TMP_PREFIX,
    MANIFEST_NAME,
    IncompleteError,
    PartInfo,
    canonical_json,
    parse_parts,
)
from screl.checkpoint.writer import fsync_path

__all__ = ["CheckpointRoot"]


class CheckpointRoot:
    """One fsspec root (local path, ``file://``, ``s3://bucket/prefix``) and the file operations under it.

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
        data = canonical_json(obj)
        target = self.path(relpath)
        parent = target.rsplit("/", 1)[0]
        self.fs.makedirs(parent, exist_ok=True)
        if not self.atomic_rename:
            with self.fs.open(target, "wb") as f:
                f.write(data)
            return
        name = target.rsplit("/", 1)[-1]
        self._sweep_atomic_leftovers(parent, name)
        tmp = f"{parent}/{ATOMIC_TMP_PREFIX}{uuid.uuid4().hex}_{name}"
        try:
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            fsync_path(tmp)
            os.replace(tmp, target)
            fsync_path(parent)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    def _sweep_atomic_leftovers(self, parent: str, name: str) -> None:
        """Delete what a killed earlier write of ``parent/name`` left (one writer per checkpoint dir)."""
        leftover = re.compile(rf"^{re.escape(ATOMIC_TMP_PREFIX)}[0-9a-f]{{32}}_{re.escape(name)}$")
        for entry in os.listdir(parent):
            if leftover.match(entry):
                os.unlink(os.path.join(parent, entry))

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
            fsync_path(dst.rsplit("/", 1)[0])
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
                    " (size check: truncated or overwritten)"
                )
        return manifest, parts, empty_dirs
