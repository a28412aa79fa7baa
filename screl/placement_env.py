"""How ``screl fit`` applies the device map on a node: the node's GPU ids, the trainer's ``CUDA_VISIBLE_DEVICES``,
the ids a local Ray cluster may hand to generation, and the check of a joined cluster's GPUs (docs/generation.md,
"Placement: which GPU runs what"). Invariant: the trainer's GPUs never enter Ray's pool."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from typing import Any

from screl.placement import GEN, DeviceMap, device_map

ENV_NODE_GPUS = "SCREL_NODE_GPUS"
"""The node's visible GPU ids as ``screl fit`` first found them (before it narrowed ``CUDA_VISIBLE_DEVICES``)."""
ENV_INFERENCE_GPUS = "SCREL_INFERENCE_GPUS"
"""Comma-separated GPU ids a local Ray cluster may hand to generation workers (set by ``screl fit``)."""
ENV_DEVICE_MAP = "SCREL_DEVICE_MAP"
"""The device map as JSON, for the rollout side's checks on a joined cluster."""

def parse_visible(value: str | None) -> list[str] | None:
    """The ids in a ``CUDA_VISIBLE_DEVICES`` value (None when unset)."""
    if value is None:
        return None
    return [v.strip() for v in value.split(",") if v.strip()]


def node_gpu_ids(environ: Mapping[str, str]) -> list[str]:
    """The GPUs this node offers screl: what ``screl fit`` first found (``SCREL_NODE_GPUS``, kept for the ranks it
    launches), else ``CUDA_VISIBLE_DEVICES``, else ``nvidia-smi -L`` (no CUDA initialised here), else none."""
    for var in (ENV_NODE_GPUS, "CUDA_VISIBLE_DEVICES"):
        ids = parse_visible(environ.get(var))
        if ids is not None:
            return ids
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run([smi, "-L"], capture_output=True, text=True, timeout=30, check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [str(i) for i, line in enumerate(ln for ln in out.splitlines() if ln.startswith("GPU "))]


def node_rank(environ: Mapping[str, str]) -> int:
    for var in ("NODE_RANK", "GROUP_RANK", "SLURM_NODEID"):
        if environ.get(var, "").isdigit():
            return int(environ[var])
    return 0


def apply_trainer_devices(cfg: Mapping[str, Any], environ: MutableMapping[str, str] | None = None) -> DeviceMap:
    """Compute the device map for this node and narrow the trainer's ``CUDA_VISIBLE_DEVICES`` to its GPUs.

    Call it in the ``screl fit`` process before the Trainer exists (CUDA reads the variable once, when it
    initialises). It also leaves, for the rollout side, the inference ids a local Ray cluster may use
    (``SCREL_INFERENCE_GPUS``) and the map (``SCREL_DEVICE_MAP``). Idempotent: ranks Lightning launches (and a
    second run in the same process) recompute it from ``SCREL_NODE_GPUS``. Returns the map; its ``problems`` are
    for the caller to raise (nothing is set then).
    """
    env = os.environ if environ is None else environ
    visible = node_gpu_ids(env)
    dmap = device_map(cfg, node_gpus=len(visible))
    if dmap.problems:
        return dmap
    env[ENV_NODE_GPUS] = ",".join(visible)
    node = node_rank(env)
    if dmap.trainer_on_gpu and not dmap.colocated:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(dmap.trainer_ids(node, visible))
    env[ENV_INFERENCE_GPUS] = ",".join(dmap.inference_ids(node, visible)) if dmap.inference_on_gpu else ""
    env[ENV_DEVICE_MAP] = dmap.to_json()
    return dmap


def local_ray_gpu_ids(environ: Mapping[str, str] | None = None) -> list[str] | None:
    """The GPU ids a local Ray cluster gets (``SCREL_INFERENCE_GPUS``), or None when ``screl fit`` set none."""
    return parse_visible((os.environ if environ is None else environ).get(ENV_INFERENCE_GPUS))


def joined_cluster_problem(dmap: DeviceMap, nodes: list[Mapping[str, Any]], driver_node_id: str,
                           worker_resources: Mapping[str, float]) -> str | None:
    """Why a joined Ray cluster could put a generation worker on a trainer's GPU, or None.

    ``nodes`` as ``ray.nodes()`` lists them. The trainer's node (the driver's) must not offer Ray more GPUs than the
    map gives generation there, unless the workers need a custom resource that node does not offer.
    """
    if not dmap.trainer_on_gpu or dmap.colocated:
        return None
    here = next((n for n in nodes if n.get("NodeID") == driver_node_id and n.get("Alive", True)), None)
    if here is None:
        return None
    offered = here.get("Resources") or {}
    if any(name not in offered for name in worker_resources):
        return None  # the workers cannot land on the trainer's node at all
    gpus = float(offered.get("GPU", 0))
    node0 = dmap.node(0)
    planned = len(node0.inference) if node0 else 0
    if gpus <= planned:
        return None
    trainer = ",".join(map(str, node0.trainer)) if node0 else ""
    ids = ",".join(map(str, node0.inference)) if node0 else ""
    ids = ids or '""'
    return (f"the Ray node of the trainer ({driver_node_id[:12]}) offers {gpus:g} GPU(s) but the device map gives "
            f"generation {planned} there (the trainer has GPU {trainer}): a worker could land on a trainer's GPU. "
            f"Start that node's raylet with CUDA_VISIBLE_DEVICES={ids} ray start --num-gpus {planned}, or "
            f"put generation on nodes of its own ({GEN}.resources: {{rollout_node: 1}})")
