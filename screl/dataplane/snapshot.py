"""TransferQueue snapshots with no shared disk: each node's share goes to (and comes from) the bundle URL itself.

TransferQueue's checkpoint has every actor write its own part on its own node: the TQ controller its state, each
storage unit its rows, and the client process ``metadata.json`` and the units' index. TQ assumes one filesystem
under all of them (its docs ask for NFS). screl does not: around TQ's save and load, a task pinned to each other
node that hosts a TQ actor

- before a save, creates the staging directory there (TQ's client creates it on its own node only);
- after the save, uploads what TQ wrote there (still under ``<dir>.tmp``: TQ renames it on the client's node only)
  straight to the bundle's fsspec URL, local or ``s3://``, and removes it; the writer then adopts those files;
- before a load, downloads the bundle's ``data_plane/`` there, each file checked against the manifest's SHA-256,
  and removes it after the load.

On a node that shares the client's filesystem the save finds nothing left to upload and the load finds the files
already in place, so one machine, a shared filesystem and separate disks all give the same bundle.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
import transfer_queue as tq
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from screl.dataplane.errors import DataPlaneError
from screl.dataplane.tq_client import (
    CONTROLLER_NAME,
    STORAGE_UNIT_PREFIX,
    TorchThreads,
    bounded_wait,
    in_daemon_thread,
)

_CHUNK = 1 << 20


def _units_subdir() -> str:
    """The subdirectory TQ's storage manager saves its units into (TQ creates it on the client's node only)."""
    from transfer_queue.storage.managers import simple_storage_manager

    return str(simple_storage_manager._SU_SUBDIR)


@dataclass(frozen=True)
class RemoteTree:
    """A directory at an fsspec URL: where nodes upload their shares (``digests`` empty) or the published
    ``data_plane/`` they download (``digests``: relative path -> SHA-256, from the manifest)."""

    url: str
    storage_options: Mapping[str, Any] = field(default_factory=dict)
    digests: Mapping[str, str] = field(default_factory=dict)


def tq_nodes() -> dict[str, list[str]]:
    """``node_id -> [TQ actor names]`` for every live TransferQueue actor (its controller and storage units)."""
    from ray._private.state import actors  # GCS's actor table: the public state API needs the dashboard

    found: dict[str, list[str]] = {}
    for info in actors().values():
        name = info.get("Name") or ""
        if info.get("State") != "ALIVE" or not (name == CONTROLLER_NAME or name.startswith(STORAGE_UNIT_PREFIX)):
            continue
        node = (info.get("Address") or {}).get("NodeID")
        if node:
            found.setdefault(str(node), []).append(name)
    return found


def other_tq_nodes() -> dict[str, list[str]]:
    """:func:`tq_nodes` less this process's node."""
    here = ray.get_runtime_context().get_node_id()
    return {n: names for n, names in tq_nodes().items() if n != here}


def _pinned(fn: Any, node_id: str) -> Any:
    return fn.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))


@ray.remote(num_cpus=0, max_retries=0)
def _make_dirs(path: str) -> None:
    os.makedirs(path, exist_ok=True)


@ray.remote(num_cpus=0, max_retries=0)
def _upload_and_remove(local_dir: str, tree: RemoteTree) -> list[str]:
    """Every file under ``local_dir`` (on this node) to ``tree.url/<relative path>``; returns the relative paths."""
    import fsspec

    if not os.path.isdir(local_dir):
        return []
    fs, base = fsspec.core.url_to_fs(tree.url, **dict(tree.storage_options))
    sent = []
    for dirpath, _, filenames in os.walk(local_dir):
        for name in sorted(filenames):
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, local_dir).replace(os.sep, "/")
            fs.makedirs(os.path.dirname(f"{base}/{rel}"), exist_ok=True)
            fs.put_file(path, f"{base}/{rel}")
            sent.append(rel)
    shutil.rmtree(local_dir, ignore_errors=True)
    return sorted(sent)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@ray.remote(num_cpus=0, max_retries=0)
def _download(tree: RemoteTree, local_dir: str) -> bool:
    """``tree`` into ``local_dir`` on this node, each file checked against its digest; False when the files are
    already there (a filesystem shared with the client)."""
    import fsspec

    if all(os.path.isfile(os.path.join(local_dir, rel)) and _sha256(os.path.join(local_dir, rel)) == sha
           for rel, sha in tree.digests.items()):
        return False
    fs, base = fsspec.core.url_to_fs(tree.url, **dict(tree.storage_options))
    for rel, sha in sorted(tree.digests.items()):
        dest = os.path.join(local_dir, *rel.split("/"))
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fs.get_file(f"{base}/{rel}", dest)
        if _sha256(dest) != sha:
            raise DataPlaneError(f"{tree.url}/{rel}: its SHA-256 differs from the bundle manifest's")
    return True


@ray.remote(num_cpus=0, max_retries=0)
def _remove(local_dir: str) -> None:
    shutil.rmtree(local_dir, ignore_errors=True)


def _all(refs: list[Any], timeout_s: float, what: str) -> list[Any]:
    try:
        return list(ray.get(refs, timeout=timeout_s))
    except ray.exceptions.GetTimeoutError:
        raise DataPlaneError(
            f"{what} on the TransferQueue nodes took over {timeout_s:.0f} s (data_plane.timeout_s)"
        ) from None


def prepare_save(staging_dir: str, nodes: Mapping[str, list[str]], timeout_s: float) -> None:
    """Create TQ's staging directory (``<dir>.tmp`` and its units' subdirectory) on ``nodes`` before its save
    writes there."""
    units = os.path.join(f"{staging_dir}.tmp", _units_subdir())
    _all([_pinned(_make_dirs, n).remote(units) for n in nodes], timeout_s, "creating the staging dir")


def upload_shares(staging_dir: str, nodes: Mapping[str, list[str]], tree: RemoteTree,
                  timeout_s: float) -> list[str]:
    """After TQ's save: each of ``nodes`` uploads what TQ left in ``<dir>.tmp`` there; the relative paths sent."""
    sent = _all([_pinned(_upload_and_remove, n).remote(f"{staging_dir}.tmp", tree) for n in nodes], timeout_s,
                f"uploading the snapshot's shares to {tree.url}")
    paths = [rel for share in sent for rel in share]
    if len(set(paths)) != len(paths):
        raise DataPlaneError(f"two TransferQueue nodes wrote the same snapshot file: {sorted(paths)}")
    return sorted(paths)


def download_shares(local_dir: str, nodes: Mapping[str, list[str]], tree: RemoteTree,
                    timeout_s: float) -> list[str]:
    """Before TQ's load: the published snapshot into ``local_dir`` on each of ``nodes``; the nodes that needed it."""
    got = _all([_pinned(_download, n).remote(tree, local_dir) for n in nodes], timeout_s,
               f"downloading {tree.url}")
    return [n for n, fetched in zip(nodes, got, strict=True) if fetched]


def remove_on(local_dir: str, nodes: list[str], timeout_s: float) -> None:
    _all([_pinned(_remove, n).remote(local_dir) for n in nodes], timeout_s, "removing the snapshot copy")


def save_tq(path: Path, metadata: dict[str, Any], timeout_s: float, remote: RemoteTree | None) -> None:
    """TQ's save into ``path``, the other nodes' shares uploaded to ``remote``."""
    others = other_tq_nodes()
    if others and remote is None:
        raise DataPlaneError(
            f"TransferQueue actors run on other nodes ({sorted(others)}), whose parts of the snapshot cannot be "
            f"written to {path}: give a bundle URL to upload them to."
        )
    if others:
        prepare_save(str(path), others, timeout_s)
    with TorchThreads():
        bounded_wait(in_daemon_thread(lambda: tq.save_checkpoint(path, metadata=metadata)), timeout_s,
                     f"TransferQueue save to {path}")
    if others:
        assert remote is not None
        upload_shares(str(path), others, remote, timeout_s)


def load_tq(path: Path, timeout_s: float, remote: RemoteTree | None) -> None:
    """TQ's load of ``path``, each other node given its checked copy of ``remote`` first (removed after)."""
    copied = [] if remote is None else download_shares(str(path), other_tq_nodes(), remote, timeout_s)
    try:
        with TorchThreads():
            bounded_wait(in_daemon_thread(lambda: tq.load_checkpoint(path)), timeout_s,
                         f"TransferQueue load of {path}")
    finally:
        if copied:
            remove_on(str(path), copied, timeout_s)
