"""The save side of the checkpoint store: staged writers that publish a directory with its manifest.

:class:`StagedWriter` writes every part under a temporary directory, then publishes it under its final name:
a fsync'd rename on a POSIX filesystem, a server-side copy with ``manifest.json`` written last on an object
store. :class:`BundleWriter` is the trainer bundle's (``CheckpointStore.begin``); the rollout snapshots'
writer builds on :class:`StagedWriter` too. :mod:`screl.checkpoint.store` re-exports both.

The writers see the store through :class:`PublishTarget`, the few calls they make on it, so that this module
never imports the store that imports it.
"""

from __future__ import annotations

import hashlib
import io
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping
from types import TracebackType
from typing import Any, Protocol

from screl.checkpoint.layout import (
    BUNDLE_KIND,
    BUNDLE_SCHEMA_VERSION,
    CHUNK_BYTES,
    MANIFEST_NAME,
    RESERVED_TOP_LEVEL,
    BundleInfo,
    IncompleteError,
    PartInfo,
    canonical_json,
    check_part_name,
)

__all__ = ["BundleWriter", "PublishTarget", "PublishedReadBackError", "StagedWriter", "fsync_path", "fsync_tree"]


class PublishTarget(Protocol):
    """What a writer uses of :class:`screl.checkpoint.store.CheckpointStore`: its filesystem and paths, and the
    calls that publish, withdraw and read back a directory."""

    fs: Any
    atomic_rename: bool

    def path(self, relpath: str = "") -> str: ...

    def url(self, relpath: str = "") -> str: ...

    def exists(self, relpath: str) -> bool: ...

    def files(self, relpath: str) -> dict[str, int]: ...

    def remove_tree(self, relpath: str) -> None: ...

    def remove_published(self, relpath: str, trash_relpath: str) -> None: ...

    def load_published(self, relpath: str) -> tuple[dict[str, Any], dict[str, PartInfo], tuple[str, ...]]: ...

    def open(self, step: int) -> BundleInfo: ...


class PublishedReadBackError(RuntimeError):
    """The bundle was published (its manifest is in place: a resume can use it), but reading it back failed."""


def fsync_path(path: str) -> None:
    """Flush a local file or directory (its entries) to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str) -> None:
    """:func:`fsync_path` every file and directory under ``root``, bottom-up."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for name in filenames:
            fsync_path(os.path.join(dirpath, name))
        fsync_path(dirpath)


def _iter_file(path: str | os.PathLike[str]) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


class StagedWriter:
    """Writes parts under a temporary directory and publishes them under the final name with a manifest.

    Use as a context manager: leaving the block with an exception (or without :meth:`commit`) aborts, and
    after any failed write the writer refuses to commit.
    """

    def __init__(self, store: PublishTarget, tmp_relpath: str, final_relpath: str) -> None:
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
            name, (bytes(view[i : i + CHUNK_BYTES]) for i in range(0, max(len(view), 1), CHUNK_BYTES))
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

    def staged_url(self, name: str) -> str:
        """Where other processes write part ``name`` themselves (a file, or a directory of files), each its own
        share, before :meth:`adopt` records it: nothing passes through this process."""
        check_part_name(name)
        self._check_writable(name)
        return self.store.url(f"{self.tmp_relpath}/{name}")

    def adopt(self, name: str, *, new_only: bool = False) -> list[PartInfo]:
        """Record what other processes wrote at :meth:`staged_url` as part ``name`` (a file) or parts
        ``name/<relative path>`` (a directory), reading each back for its size and SHA-256. ``new_only``: a
        directory this process wrote into too; the parts it recorded already are left as they are (and there
        may be nothing new)."""
        base = self.store.path(f"{self.tmp_relpath}/{name}")
        self.store.fs.invalidate_cache()
        if not self.store.fs.exists(base):
            if new_only:
                return []
            raise FileNotFoundError(f"nothing was written to part {name!r} ({self.store.url(self.tmp_relpath)})")
        files = [base] if self.store.fs.isfile(base) else sorted(self.store.fs.find(base))
        adopted = []
        for path in files:
            part = name if path == base else f"{name}/{path[len(base):].lstrip('/')}"
            if new_only and part in self.parts:
                continue
            self._check_writable(part)
            digest, size = hashlib.sha256(), 0
            with self.store.fs.open(path, "rb") as f:
                while chunk := f.read(CHUNK_BYTES):
                    digest.update(chunk)
                    size += len(chunk)
            self.parts[part] = PartInfo(part, size, digest.hexdigest())
            adopted.append(self.parts[part])
        return adopted

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
            data = canonical_json(manifest)
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
        fsync_tree(tmp)
        os.rename(tmp, final)
        fsync_path(final.rsplit("/", 1)[0])

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

    def __init__(self, store: PublishTarget, step: int, tmp_relpath: str) -> None:
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
        try:
            return self.store.open(self.step)
        except Exception as err:  # the store failed after the publish: say the bundle is there
            raise PublishedReadBackError(f"{self.store.url(self.final_relpath)} was published, but reading it back "
                                         f"failed: {type(err).__name__}: {err}") from err
