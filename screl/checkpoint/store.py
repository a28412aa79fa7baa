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

The names and manifest format live in :mod:`screl.checkpoint.layout`, the writers in
:mod:`screl.checkpoint.writer`, the file operations under the root in :mod:`screl.checkpoint.root`; this module
re-exports the public names of the first two, so ``from screl.checkpoint.store import ...`` keeps working for
every name it had.
"""

from __future__ import annotations

import hashlib
import io
import logging
import math
import os
import uuid
from collections.abc import Iterable
from typing import Any

from screl.checkpoint.layout import (
    BUNDLE_KIND,
    BUNDLE_SCHEMA_VERSION,
    CHUNK_BYTES,
    MANIFEST_NAME,
    RESERVED_TOP_LEVEL,
    STEP_RE,
    TMP_STEP_RE,
    TRASH_STEP_RE,
    BundleInfo,
    BundleScan,
    CorruptPartError,
    IncompleteError,
    PartInfo,
    PublishedDir,
    check_part_name,
    lookup_part,
    parse_parts,
)
from screl.checkpoint.root import CheckpointRoot
from screl.checkpoint.writer import BundleWriter, StagedWriter

log = logging.getLogger(__name__)

__all__ = [
    "BUNDLE_KIND",
    "BUNDLE_SCHEMA_VERSION",
    "MANIFEST_NAME",
    "RESERVED_TOP_LEVEL",
    "BundleInfo",
    "BundleScan",
    "BundleWriter",
    "CheckpointStore",
    "CorruptPartError",
    "IncompleteError",
    "PartInfo",
    "PublishedDir",
    "StagedWriter",
    "check_part_name",
    "parse_parts",
]


def safe_torch_load(raw: bytes, what: str) -> Any:
    """``torch.load(weights_only=True)`` of ``raw``; anything beyond tensors and plain containers (a pickled
    callable or class, as a tampered bundle could carry) is a ValueError naming ``what``, and nothing runs."""
    import pickle

    import torch

    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        lines = [ln.strip() for ln in str(err).splitlines() if "WeightsUnpickler error" in ln or "Unsupported" in ln]
        why = lines[0].removeprefix("WeightsUnpickler error:").strip() if lines else type(err).__name__
        raise ValueError(
            f"{what} holds more than tensors and plain containers ({why}); screl loads checkpoints with "
            "weights_only=True so that a bundle cannot run code. Resume only from bundles screl wrote."
        ) from None


class _Discard:
    """A sink for :meth:`CheckpointStore.verify`: the bytes are hashed, not kept."""

    def write(self, data: bytes) -> int:
        return len(data)


class CheckpointStore(CheckpointRoot):
    """Bundles ``step_<n>/`` under one fsspec root (local path, ``file://``, ``s3://bucket/prefix``).

    Args:
        root_url: the checkpoint directory (``checkpointing.checkpoint_dir``).
        storage_options: passed to fsspec (for S3: ``key``, ``secret``,
            ``client_kwargs={"endpoint_url": ...}``).
    """

    def __repr__(self) -> str:
        return f"CheckpointStore({self.root_url!r})"

    # -- bundles ---------------------------------------------------------------------------------------
    def begin(self, step: int) -> BundleWriter:
        """Start writing bundle ``step_<step>/`` (FileExistsError when a complete one is already there)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"bundle step must be a non-negative integer, got {step!r}")
        self._refuse_complete(step)
        tmp = f"tmp_step_{step}_{uuid.uuid4().hex}"
        return BundleWriter(self, step, tmp)

    def _refuse_complete(self, step: int) -> None:
        """A complete ``step_<step>`` is never overwritten, unless a part fails its SHA-256: a resume refused it
        (and fell back to an older bundle), so the run is saving that step again; the corrupt one goes."""
        try:
            info = self.open(step)
        except IncompleteError:
            return
        try:
            self.verify(info)
        except CorruptPartError as err:
            log.warning("screl checkpoint: replacing %s, which a resume refused: %s", info.url, err)
            self.remove_published(info.relpath, f"trash_step_{step}_{uuid.uuid4().hex}")
            return
        raise FileExistsError(f"{self.url(f'step_{step}')} is already a complete bundle")

    def scan(self) -> BundleScan:
        """Classify every ``step_*``/``tmp_step_*``/``trash_step_*`` directory under the root (read-only)."""
        complete: list[BundleInfo] = []
        skipped: list[tuple[str, str]] = []
        temporaries: list[str] = []
        for name in self.children():
            if TMP_STEP_RE.match(name) or TRASH_STEP_RE.match(name):
                temporaries.append(name)
                continue
            m = STEP_RE.match(name)
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
        part = lookup_part(published, name)
        buf = io.BytesIO()
        self._copy_out(published, part, buf)
        return buf.getvalue()

    def read_torch(self, target: int | PublishedDir, name: str) -> Any:
        """``torch.load`` of part ``name`` with ``weights_only=True``: tensors and plain containers only, so a bundle
        copied from elsewhere cannot run code on load (ValueError naming the part otherwise)."""
        published = self._resolve(target)
        return safe_torch_load(self.read_bytes(published, name), f"{name} of {published.url}")

    def download_file(
        self, target: int | PublishedDir, name: str, local_path: str | os.PathLike[str]
    ) -> None:
        """Copy part ``name`` to ``local_path``, SHA-256 verified."""
        published = self._resolve(target)
        part = lookup_part(published, name)
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

    def verify(self, target: int | PublishedDir, skip: Iterable[str] = ()) -> int:
        """Read every part of a bundle or published directory (less ``skip``) and check its size and SHA-256
        against the manifest (:class:`CorruptPartError` names the first that fails). Returns the parts read."""
        published = self._resolve(target)
        skipped = set(skip)
        names = [n for n in sorted(published.parts) if n not in skipped]
        for name in names:
            self._copy_out(published, published.parts[name], _Discard())
        return len(names)

    def _copy_out(self, published: PublishedDir, part: PartInfo, out: Any) -> None:
        digest = hashlib.sha256()
        size = 0
        try:
            f = self.fs.open(self.path(f"{published.relpath}/{part.name}"), "rb")
        except FileNotFoundError as err:
            raise CorruptPartError(f"{published.url}: part {part.name!r} is missing (the manifest lists it)",
                                   published.relpath, part.name, "missing") from err
        with f:
            while chunk := f.read(CHUNK_BYTES):
                digest.update(chunk)
                out.write(chunk)
                size += len(chunk)
        if size != part.size or digest.hexdigest() != part.sha256:
            check = "size" if size != part.size else "sha256"
            raise CorruptPartError(
                f"{published.url}: part {part.name!r} is corrupt: it failed its {check} check ({size} bytes,"
                f" sha256 {digest.hexdigest()[:12]}…; the manifest says {part.size} bytes, sha256"
                f" {part.sha256[:12]}…)", published.relpath, part.name, check)

    def retain(self, keep_top_k: int, metric_name: str | None = None, higher_is_better: bool = True) -> list[str]:
        """Keep ``keep_top_k`` complete bundles, delete the others and leftovers: the newest ones, or with
        ``metric_name`` the best by the value each bundle's metadata records for it (``metadata["metric"]``), plus
        the newest bundle, which resume needs; a bundle without the value ranks last.

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
        if metric_name is None:
            drop = list(found.complete[:-keep_top_k])
        else:
            def rank(bundle: BundleInfo) -> tuple[int, float, int]:
                recorded = bundle.metadata.get("metric")
                value = recorded.get("value") if isinstance(recorded, dict) and recorded.get("name") == metric_name \
                    else None
                if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
                    return (1, 0.0, -bundle.step)  # no value: after every bundle that has one, newest first
                return (0, -value if higher_is_better else value, -bundle.step)

            best = {b.relpath for b in sorted(found.complete, key=rank)[:keep_top_k]} | {latest.relpath}
            drop = [b for b in found.complete if b.relpath not in best]
        removed: list[str] = []
        for bundle in drop:
            self.remove_published(bundle.relpath, f"trash_step_{bundle.step}_{uuid.uuid4().hex}")
            removed.append(bundle.relpath)
        for name in found.temporaries:
            m = TMP_STEP_RE.match(name) or TRASH_STEP_RE.match(name)
            if m is not None and int(m.group(1)) <= latest.step:
                self.remove_tree(name)
                removed.append(name)
        for name, _reason in found.skipped:
            m = STEP_RE.match(name)
            if m is not None and int(m.group(1)) < latest.step:
                self.remove_published(name, f"trash_step_{m.group(1)}_{uuid.uuid4().hex}")
                removed.append(name)
        return removed
