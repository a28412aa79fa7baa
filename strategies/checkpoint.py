"""Sharded checkpoints with Megatron's ``dist_checkpointing``, to local paths or fsspec URLs.

A checkpoint is a directory (Lightning's ``.ckpt`` path names it). Each rank writes its own shards;
rank 0 writes everything that is not sharded (``common.pt``: Lightning's loops, callbacks, epoch,
optimizer hyperparameters). Because shards are keyed by their place in the full tensor, a checkpoint
saved at one tensor-parallel size loads at another.

URLs that are not local (``s3://``, ...) go through a local staging directory: ranks save there,
then the first rank of each node uploads what its node wrote; loading downloads first. The staging
directory is derived from the URL, so all ranks of a node agree on it without talking.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import fsspec
import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.dist_checkpointing.optimizer import (
    get_param_id_to_sharded_param_map,
    make_sharded_optimizer_tensor,
)
from torch.optim import Optimizer

__all__ = [
    "SHARDED_KEYS",
    "load_checkpoint",
    "optimizer_sharded_state",
    "optimizer_template",
    "save_checkpoint",
    "split_local_path",
]

SHARDED_KEYS = "screl_sharded_state_keys"
"""Key, inside a saved optimizer state, recording which per-parameter states were saved sharded."""

Barrier = Callable[[], None]


def split_local_path(path: str | os.PathLike[str]) -> str | None:
    """The local filesystem path of ``path`` (a plain path or a ``file://`` URL), or ``None`` for a remote URL."""
    fs, local = fsspec.core.url_to_fs(str(path))
    protocols = (fs.protocol,) if isinstance(fs.protocol, str) else tuple(fs.protocol)
    return local if "file" in protocols else None


def _staging_dir(url: str, staging_root: str | None) -> str:
    digest = hashlib.sha1(url.encode()).hexdigest()[:16]
    return os.path.join(staging_root or tempfile.gettempdir(), f"screl-ckpt-{digest}")


def _fresh_dir(path: str, leader: bool, barrier: Barrier) -> None:
    if leader:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.makedirs(path)
    barrier()


def _local_files(root: str) -> Iterator[str]:
    for dirpath, _, files in os.walk(root):
        for f in files:
            yield os.path.relpath(os.path.join(dirpath, f), root)


@contextmanager
def _write_location(
    path: str, staging_root: str | None, node_leader: bool, global_leader: bool, barrier: Barrier
) -> Iterator[str]:
    """A fresh local directory to save into; uploaded to ``path`` afterwards when that is remote."""
    local = split_local_path(path)
    if local is not None:
        _fresh_dir(local, global_leader, barrier)
        yield local
        return
    fs, remote = fsspec.core.url_to_fs(path)
    if global_leader and fs.exists(remote):
        fs.rm(remote, recursive=True)
    stage = _staging_dir(path, staging_root)
    _fresh_dir(stage, node_leader, barrier)
    try:
        yield stage
        barrier()
        if node_leader:
            fs.makedirs(remote, exist_ok=True)
            for rel in _local_files(stage):
                fs.put_file(os.path.join(stage, rel), f"{remote.rstrip('/')}/{rel}")
        barrier()
    finally:
        if node_leader:
            shutil.rmtree(stage, ignore_errors=True)


@contextmanager
def _read_location(path: str, staging_root: str | None, node_leader: bool, barrier: Barrier) -> Iterator[str]:
    """A local directory holding the checkpoint at ``path``, downloaded first when remote."""
    local = split_local_path(path)
    if local is not None:
        yield local
        return
    fs, remote = fsspec.core.url_to_fs(path)
    stage = _staging_dir(path, staging_root)
    try:
        if node_leader:
            if os.path.exists(stage):
                shutil.rmtree(stage)
            root = remote.rstrip("/")
            for file in fs.find(root):
                rel = file[len(root) :].lstrip("/")
                os.makedirs(os.path.dirname(os.path.join(stage, rel)), exist_ok=True)
                fs.get_file(file, os.path.join(stage, rel))
        barrier()
        yield stage
        barrier()
    finally:
        if node_leader:
            shutil.rmtree(stage, ignore_errors=True)


def save_checkpoint(
    checkpoint: dict[str, Any],
    path: str,
    staging_root: str | None = None,
    node_leader: bool | None = None,
    barrier: Barrier | None = None,
) -> None:
    """Save a (partly) sharded state dict to ``path`` on every rank; an existing checkpoint there is replaced.

    ``node_leader``: whether this rank uploads/cleans its node's staging directory (default: global
    rank 0, right for one node). ``barrier``: a barrier over all ranks (default: ``dist.barrier``).
    """
    barrier = barrier or dist.barrier
    rank0 = dist.get_rank() == 0
    node_leader = rank0 if node_leader is None else node_leader
    with _write_location(str(path), staging_root, node_leader, rank0, barrier) as target:
        dist_checkpointing.save(checkpoint, target)


def load_checkpoint(
    template: Callable[[Mapping[str, Any]], dict[str, Any]],
    path: str,
    staging_root: str | None = None,
    node_leader: bool | None = None,
    barrier: Barrier | None = None,
) -> dict[str, Any]:
    """Load the checkpoint at ``path``: its common part, with the shards that ``template`` asks for.

    ``template(common)`` gets the common (unsharded) part and returns the sharded state dict to fill in.
    Returns the common part merged with the loaded tensors, at this rank's sharding.
    """
    barrier = barrier or dist.barrier
    node_leader = dist.get_rank() == 0 if node_leader is None else node_leader
    with _read_location(str(path), staging_root, node_leader, barrier) as source:
        if not os.path.isdir(source):
            raise FileNotFoundError(f"No sharded checkpoint directory at {path!r}.")
        common = dist_checkpointing.load_common_state_dict(source)
        loaded = dist_checkpointing.load(template(common), source)
    return loaded


def _param_shape(sharded: ShardedTensor | ShardedTensorFactory) -> tuple[int, ...]:
    return tuple(sharded.data.shape)


def optimizer_sharded_state(
    optimizer: Optimizer, model_sharded_state: Mapping[str, Any], prefix: str
) -> dict[str, Any]:
    """A torch optimizer's state dict with every parameter-shaped state sharded like its parameter.

    Scalar states (Adam's ``step``) and the states of parameters outside ``model_sharded_state`` stay
    common (saved once, by rank 0).
    """
    state_dict = optimizer.state_dict()
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = get_param_id_to_sharded_param_map(dict(model_sharded_state), params)
    state: dict[int, dict[str, Any]] = {}
    sharded_keys: dict[int, list[str]] = {}
    for pid, pstate in state_dict["state"].items():
        entry: dict[str, Any] = {}
        target = by_id.get(pid)
        for key, value in pstate.items():
            if target is not None and torch.is_tensor(value) and tuple(value.shape) == _param_shape(target):
                entry[key] = make_sharded_optimizer_tensor(target, value, prefix=f"{prefix}.state.{key}")
                sharded_keys.setdefault(pid, []).append(key)
            else:
                entry[key] = value
        state[pid] = entry
    return {"state": state, "param_groups": state_dict["param_groups"], SHARDED_KEYS: sharded_keys}


def optimizer_template(
    optimizer: Optimizer, model_sharded_state: Mapping[str, Any], saved: Mapping[str, Any], prefix: str
) -> dict[str, Any]:
    """The sharded state dict to load ``optimizer``'s state into, from the common part of a saved one.

    Works on an optimizer without state yet: the sharded entries are allocated like their parameters.
    """
    params = [p for group in optimizer.param_groups for p in group["params"]]
    by_id = get_param_id_to_sharded_param_map(dict(model_sharded_state), params)
    state: dict[int, dict[str, Any]] = {}
    for pid, keys in saved.get(SHARDED_KEYS, {}).items():
        if pid not in by_id:
            raise KeyError(
                f"Optimizer state for parameter {pid} was saved sharded but the model has no such shard."
            )
        state[pid] = {
            key: make_sharded_optimizer_tensor(
                by_id[pid], torch.zeros_like(params[pid]), prefix=f"{prefix}.state.{key}"
            )
            for key in keys
        }
    return {"state": state}


def optimizer_state_for_torch(saved: Mapping[str, Any]) -> dict[str, Any]:
    """A loaded optimizer state (common part merged with shards) as ``Optimizer.load_state_dict`` wants it."""
    return {"state": dict(saved["state"]), "param_groups": saved["param_groups"]}
