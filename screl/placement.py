"""The device map: which GPUs of which node the trainer and the generation workers use (pure, no Ray).

``screl fit`` computes it before anything starts and ``screl check`` prints it (the plan's ``devices`` line).
Per node it names the trainer's GPUs (``trainer.devices`` on each of ``trainer.num_nodes`` nodes), the inference
GPUs (``colocated.resources``: ``gpus_per_node`` on ``num_nodes`` nodes, or ``num_gpus_per_worker`` x
``num_workers``) and the GPUs left over. GPUs are positions in the node's visible list (``CUDA_VISIBLE_DEVICES``
or all of them): the trainer takes the first ones, generation the last ones, as the spec's rule says
(``gpus_per_node`` are the inference GPUs, the remainder goes to training).

Where the inference GPUs are:

* **On the trainer's nodes** by default: node ``i`` of the first ``colocated.resources.num_nodes`` nodes.
* **On nodes of their own** when ``generation.resources`` names a custom Ray resource (``rollout_node``): the
  nodes after the trainer's (docs/scaling.md, "Generation on its own nodes").
* **On the trainer's own GPU**, only when asked explicitly: a fractional ``num_gpus_per_worker`` (``0.4``) with
  ``gpus_per_node: 0`` and no GPU left over, plus the engine's memory share (vLLM's
  ``backend_args.gpu_memory_utilization``). The plan then prints the memory budget of that GPU.

How the map is enforced (``screl.cli`` and ``screl.controller.placement``):

* The trainer's processes get ``CUDA_VISIBLE_DEVICES`` naming only the trainer's GPUs, set in the ``screl fit``
  process before the Trainer (and so CUDA) starts; the ranks Lightning launches inherit it.
* A local Ray cluster (no ``ray.address``) is started with ``num_gpus`` = the inference GPUs and, for its raylet
  only, ``CUDA_VISIBLE_DEVICES`` naming those GPUs. Ray builds its GPU pool from that variable and maps the ids it
  hands out onto it, so a worker asking for a GPU can only get an inference GPU, and ``ray.get_gpu_ids()`` in the
  worker names the physical device. This was chosen over the alternatives because the trainer's GPUs never enter
  Ray's pool at all: a custom resource tells Ray *how many* a worker may take but not *which* ids, and a
  ``runtime_env`` ``CUDA_VISIBLE_DEVICES`` per actor is overwritten by Ray for actors that reserve GPUs.
* A joined cluster (``ray.address``) was started by someone else: ``screl fit`` checks what it offers and
  refuses to start when the trainer's node offers Ray more GPUs than the map gives generation there (the fix: start
  that node's raylet with ``CUDA_VISIBLE_DEVICES=<inference ids> ray start --num-gpus <count>``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any

GEN = "data.init_args.generation"
RES = f"{GEN}.colocated.resources"
VLLM_DEFAULT_MEMORY_SHARE = 0.9
"""vLLM's own ``gpu_memory_utilization`` default: the share an engine takes unless told otherwise."""
DEFAULT_GPU_MEMORY_GB = 80.0
"""The device memory the budget line assumes when ``colocated.resources.gpu_memory_gb`` is not set."""

ENV_NODE_GPUS = "SCREL_NODE_GPUS"
"""The node's visible GPU ids as ``screl fit`` first found them (before it narrowed ``CUDA_VISIBLE_DEVICES``)."""
ENV_INFERENCE_GPUS = "SCREL_INFERENCE_GPUS"
"""Comma-separated GPU ids a local Ray cluster may hand to generation workers (set by ``screl fit``)."""
ENV_DEVICE_MAP = "SCREL_DEVICE_MAP"
"""The device map as JSON, for the rollout side's checks on a joined cluster."""

Issue = tuple[str, Any, str, str]
"""A problem: (dotted key, value, what is wrong, the fix), as ``screl.validation`` reports it."""


@dataclass(frozen=True)
class NodeDevices:
    """One node's GPUs: positions in its visible list."""

    node: int
    gpus: int
    """GPUs on the node (the plan's own count when the node's is not known)."""
    trainer: tuple[int, ...] = ()
    inference: tuple[int, ...] = ()
    shared: bool = False
    """The inference GPUs are the trainer's (explicit fractional sharing)."""
    workers: int = 0
    """Generation workers planned on this node."""

    @property
    def left_over(self) -> tuple[int, ...]:
        used = set(self.trainer) | set(self.inference)
        return tuple(i for i in range(self.gpus) if i not in used)

    def describe(self) -> str:
        def ids(xs: tuple[int, ...]) -> str:
            return ",".join(map(str, xs)) if xs else "none"

        inference = ids(self.inference) + (" (shared with the trainer)" if self.shared else "")
        return (f"node {self.node}: trainer GPU {ids(self.trainer)}, inference GPU {inference} "
                f"({self.workers} worker(s)), left over {ids(self.left_over)}")


@dataclass(frozen=True)
class DeviceMap:
    """Per node, the trainer's, the inference and the left-over GPUs; ``problems`` when the plan cannot run."""

    nodes: tuple[NodeDevices, ...] = ()
    trainer_on_gpu: bool = False
    inference_on_gpu: bool = False
    colocated: bool = False
    gpus_per_worker: float = 0.0
    memory_share: float | None = None
    """The engine's share of a GPU's memory (vLLM ``backend_args.gpu_memory_utilization``, else screl's default for
    vLLM on cuda; None: the backend allocates as it goes, or vLLM's own 0.9)."""
    gpu_memory_gb: float | None = None
    own_nodes_by: tuple[str, ...] = ()
    """Custom Ray resources that put generation on nodes of its own."""
    node_gpus_known: bool = False
    problems: tuple[Issue, ...] = field(default=(), compare=False)

    @property
    def shared(self) -> bool:
        return any(n.shared for n in self.nodes)

    def node(self, index: int) -> NodeDevices | None:
        return next((n for n in self.nodes if n.node == index), None)

    def trainer_ids(self, index: int, visible: list[str]) -> list[str]:
        n = self.node(index)
        return [visible[i] for i in n.trainer if i < len(visible)] if n else []

    def inference_ids(self, index: int, visible: list[str]) -> list[str]:
        n = self.node(index)
        return [visible[i] for i in n.inference if i < len(visible)] if n else []

    def workers_per_shared_gpu(self) -> int:
        return max(1, math.floor(1 / self.gpus_per_worker + 1e-9)) if 0 < self.gpus_per_worker < 1 else 1

    def budget(self) -> str | None:
        """The memory budget of a GPU the trainer shares with generation, or None when none is shared."""
        if not self.shared:
            return None
        n = next(n for n in self.nodes if n.shared)
        per_gpu = min(self.workers_per_shared_gpu(), max(1, n.workers))
        share = self.memory_share if self.memory_share is not None else VLLM_DEFAULT_MEMORY_SHARE
        engines = per_gpu * share
        gb = self.gpu_memory_gb or DEFAULT_GPU_MEMORY_GB
        assumed = "" if self.gpu_memory_gb else " (assumed; colocated.resources.gpu_memory_gb not set, not checked)"
        return (f"shared GPU: {per_gpu} worker(s) x {self.gpus_per_worker:g} GPU, memory {per_gpu} x {share:g} = "
                f"{engines:.2f} to the engines, {max(0.0, 1 - engines):.2f} = {gb * max(0.0, 1 - engines):.1f} GB "
                f"of {gb:g} GB{assumed} left to the trainer")

    def describe(self) -> str:
        if self.colocated:
            return "colocated: the engine runs in the trainer's processes, on the trainer's devices"
        if not (self.trainer_on_gpu or self.inference_on_gpu):
            return "no GPU (trainer and generation on CPU)"
        parts = [n.describe() for n in self.nodes]
        if self.own_nodes_by:
            parts.append("generation on nodes offering " + ", ".join(self.own_nodes_by))
        if not self.node_gpus_known:
            parts.append("node size = what the plan uses (colocated.resources.node_gpus not set; screl fit counts it)")
        budget = self.budget()
        if budget:
            parts.append(budget)
        return "; ".join(parts)

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "problems": []})

    @classmethod
    def from_json(cls, text: str) -> DeviceMap:
        raw = json.loads(text)
        nodes = tuple(NodeDevices(**{**n, "trainer": tuple(n["trainer"]), "inference": tuple(n["inference"])})
                      for n in raw.pop("nodes"))
        raw.pop("problems", None)
        return cls(nodes=nodes, **{**raw, "own_nodes_by": tuple(raw.get("own_nodes_by", ()))})


def _get(cfg: Any, dotted: str, default: Any = None) -> Any:
    node = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return default
        node = node[part]
    return node


def _number(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _trainer_devices(trainer: Mapping[str, Any], issues: list[Issue]) -> int | None:
    """GPUs per trainer node from ``trainer.devices``: a count, or None = the rest of the node ("auto", -1)."""
    d = trainer.get("devices", "auto")
    if d in ("auto", -1, "-1", None):
        return None
    if isinstance(d, int) and not isinstance(d, bool) and d >= 0:
        return d
    if isinstance(d, str) and d.isdigit():
        return int(d)
    issues.append(("trainer.devices", d, "screl gives the trainer the node's first GPUs and names them in "
                   "CUDA_VISIBLE_DEVICES, so it takes a count, not a list of device ids",
                   "write trainer.devices: N (N GPUs per node), or auto for every GPU generation does not use"))
    return None


def device_map(cfg: Mapping[str, Any], node_gpus: int | None = None) -> DeviceMap:
    """The device map of a whole config (the parsed YAML with defaults), with every problem found.

    ``node_gpus``: GPUs each node has (``screl fit`` passes the node's own count); None: the config's
    ``colocated.resources.node_gpus``, else exactly what the plan uses.
    """
    issues: list[Issue] = []
    trainer = cfg.get("trainer") or {}
    gen = _get(cfg, "data.init_args.generation", None) or _get(cfg, "data.generation", {}) or {}
    res = gen.get("colocated", {}).get("resources", {}) if isinstance(gen.get("colocated"), Mapping) else {}
    res = res or {}
    knob_gpus = res.get("node_gpus")
    if node_gpus is None and isinstance(knob_gpus, int) and not isinstance(knob_gpus, bool):
        if knob_gpus < 0:
            issues.append((f"{RES}.node_gpus", knob_gpus, "must be a count >= 0, or null (counted by screl fit)",
                           "set node_gpus: 8 (GPUs per node) or null"))
        else:
            node_gpus = knob_gpus
    mem_gb = _number(res.get("gpu_memory_gb"))
    if res.get("gpu_memory_gb") is not None and (mem_gb is None or mem_gb <= 0):
        issues.append((f"{RES}.gpu_memory_gb", res.get("gpu_memory_gb"), "must be a number of GB > 0, or null",
                       "set gpu_memory_gb: 80 (an H100), or null to skip the memory check"))
        mem_gb = None
    accel = str(trainer.get("accelerator") or "auto")
    if isinstance(trainer.get("accelerator"), Mapping):
        accel = str(trainer["accelerator"].get("class_path", "")).lower()
    trainer_on_gpu = accel in ("gpu", "cuda") or "cuda" in accel or (accel == "auto" and bool(node_gpus))
    t_nodes = trainer.get("num_nodes", 1)
    t_nodes = t_nodes if isinstance(t_nodes, int) and t_nodes >= 1 else 1
    t_count = _trainer_devices(trainer, issues) if trainer_on_gpu else 0
    colocated = bool(_get(gen, "colocated.enabled", False))
    on_cuda = str(gen.get("device", "cpu")).startswith("cuda")
    workers = gen.get("num_workers", 1)
    workers = workers if isinstance(workers, int) and workers >= 1 else 1
    i_nodes = res.get("num_nodes", 1)
    i_nodes = i_nodes if isinstance(i_nodes, int) and i_nodes >= 1 else 1
    k = res.get("gpus_per_node", 0)
    k = k if isinstance(k, int) and not isinstance(k, bool) and k >= 0 else 0
    g_raw = _number(gen.get("num_gpus_per_worker"))
    if g_raw is not None and g_raw < 0:
        g_raw = None  # its own rule reports it
    share = _number((gen.get("backend_args") or {}).get("gpu_memory_utilization"))
    if share is None and on_cuda and _claims_memory_share(gen):
        share = _screl_vllm_share()
    if colocated or not on_cuda:
        g = g_raw or 0.0
        inference_on_gpu = g > 0
    else:
        g = g_raw if g_raw is not None else (i_nodes * k / workers if k else 1.0)
        inference_on_gpu = g > 0
    own_nodes = tuple(sorted(gen.get("resources") or {})) if isinstance(gen.get("resources"), Mapping) else ()
    base = {"trainer_on_gpu": trainer_on_gpu, "inference_on_gpu": inference_on_gpu, "colocated": colocated,
            "gpus_per_worker": g, "memory_share": share, "gpu_memory_gb": mem_gb, "own_nodes_by": own_nodes,
            "node_gpus_known": node_gpus is not None}
    if colocated or not (trainer_on_gpu or inference_on_gpu):
        return DeviceMap(**base, problems=tuple(issues))  # type: ignore[arg-type]

    # inference GPUs per inference node, and whether they are the trainer's own (explicit fractional sharing)
    per_node_workers = [workers // i_nodes + (1 if n < workers % i_nodes else 0) for n in range(i_nodes)]
    if k:
        inf_gpus = [k] * i_nodes
    else:
        inf_gpus = [math.ceil(w * g - 1e-9) for w in per_node_workers]
    separate = bool(own_nodes)
    nodes: list[NodeDevices] = []
    count = t_nodes + i_nodes if separate else max(t_nodes, i_nodes)
    for n in range(count):
        is_trainer = n < t_nodes and trainer_on_gpu
        inf_index = (n - t_nodes) if separate else n
        has_inf = inference_on_gpu and 0 <= inf_index < i_nodes and (separate or n < i_nodes)
        want_inf = inf_gpus[inf_index] if has_inf else 0
        w_here = per_node_workers[inf_index] if has_inf else 0
        t_here = t_count if is_trainer else 0
        size = node_gpus
        if t_here is None:  # "auto": the rest of the node
            rest = (size - want_inf) if size is not None else 1
            t_here = max(rest, 0)
        fractional_share = (0 < g < 1 and k == 0 and t_here > 0 and want_inf > 0
                            and (size is None or size < t_here + want_inf))
        if fractional_share:
            size = size if size is not None else t_here
            trainer_pos = tuple(range(min(t_here, size)))
            inference_pos = tuple(range(max(0, min(t_here, size) - want_inf), min(t_here, size)))
            nodes.append(NodeDevices(n, size, trainer_pos, inference_pos, shared=True, workers=w_here))
            if want_inf > t_here:
                issues.append((f"{GEN}.num_gpus_per_worker", g, f"{w_here} worker(s) x {g:g} GPU share "
                               f"{want_inf} GPU(s) but the trainer has {t_here} on node {n} to share: the node is "
                               "oversubscribed", f"lower num_workers or num_gpus_per_worker to fit {t_here} GPU(s), "
                               f"or give generation GPUs of its own ({RES}.gpus_per_node)"))
            continue
        size = size if size is not None else t_here + want_inf
        trainer_pos = tuple(range(t_here))
        inference_pos = tuple(range(max(0, size - want_inf), size)) if want_inf else ()
        nodes.append(NodeDevices(n, size, trainer_pos, inference_pos, workers=w_here))
        if t_here > size:
            issues.append(("trainer.devices", trainer.get("devices"), f"the trainer takes {t_here} GPU(s) per node "
                           f"but node {n} has {size}: the node is oversubscribed",
                           f"set trainer.devices <= {size}, or correct {RES}.node_gpus"))
        elif set(trainer_pos) & set(inference_pos):
            issues.append((f"{RES}.gpus_per_node" if k else f"{GEN}.num_gpus_per_worker", k or g,
                           f"node {n} has {size} GPU(s): the trainer's {t_here} (trainer.devices) and generation's "
                           f"{want_inf} overlap, so a worker would land on a trainer's device",
                           f"make trainer.devices + inference GPUs <= {size}: lower trainer.devices to "
                           f"{max(size - want_inf, 0)} or the inference GPUs; or share one GPU explicitly with a "
                           "fractional num_gpus_per_worker (e.g. 0.4) and gpus_per_node: 0 plus the engine's memory "
                           "share (backend_args.gpu_memory_utilization)"))
        elif want_inf > size:
            issues.append((f"{RES}.gpus_per_node" if k else f"{GEN}.num_gpus_per_worker", k or g,
                           f"generation takes {want_inf} GPU(s) on node {n}, which has {size}: oversubscribed",
                           f"lower the inference GPUs to <= {size}, or correct {RES}.node_gpus"))
    if k and inference_on_gpu and workers * g > i_nodes * k + 1e-9:
        issues.append((f"{GEN}.num_gpus_per_worker", g, f"{workers} worker(s) x {g:g} GPU = {workers * g:g} GPUs, but "
                       f"colocated.resources gives generation {i_nodes} x {k} = {i_nodes * k}: the inference "
                       "devices are oversubscribed (Ray would leave workers pending)",
                       f"set num_gpus_per_worker <= {i_nodes * k / workers:g}, fewer num_workers, or more "
                       "gpus_per_node"))
    if k and g > k + 1e-9:
        issues.append((f"{GEN}.num_gpus_per_worker", g, f"one worker takes {g:g} GPUs and a node has {k} for "
                       "generation: Ray cannot split a worker over nodes", f"set num_gpus_per_worker <= {k}"))
    dmap = DeviceMap(nodes=tuple(nodes), **base)  # type: ignore[arg-type]
    if dmap.shared:
        issues.extend(_shared_gpu_issues(dmap, gen, cfg))
    return DeviceMap(nodes=tuple(nodes), **base, problems=tuple(issues))  # type: ignore[arg-type]


def _claims_memory_share(gen: Mapping[str, Any]) -> bool:
    """Whether the configured engine preallocates a share of a GPU's memory (it declares so; an engine that does
    not resolve claims none here: the generation rules report it)."""
    from screl.rollout.backends import engine_capabilities

    try:
        return engine_capabilities(str(gen.get("backend", "torch"))).claims_gpu_memory_share
    except ValueError:
        return False


def _screl_vllm_share() -> float | None:
    """The memory share screl gives a vLLM engine on cuda unless ``backend_args`` sets one (None: vLLM's own)."""
    from screl import config_generation

    value = getattr(config_generation, "VLLM_GPU_MEMORY_UTILIZATION", None)
    return float(value) if isinstance(value, (int, float)) else None


def _shared_gpu_issues(dmap: DeviceMap, gen: Mapping[str, Any], cfg: Mapping[str, Any]) -> list[Issue]:
    """A GPU the trainer shares: the engines' memory shares, and (with ``gpu_memory_gb``) the trainer's estimate."""
    issues: list[Issue] = []
    claims = _claims_memory_share(gen)
    n = next(n for n in dmap.nodes if n.shared)
    per_gpu = min(dmap.workers_per_shared_gpu(), max(1, n.workers))
    key = f"{GEN}.backend_args.gpu_memory_utilization"
    share = dmap.memory_share
    if claims and share is None:
        issues.append((key, None, f"generation shares the trainer's GPU (num_gpus_per_worker {dmap.gpus_per_worker:g})"
                       f" and vLLM would take {VLLM_DEFAULT_MEMORY_SHARE} of its memory by default, leaving the "
                       "trainer almost none", "set backend_args.gpu_memory_utilization, e.g. 0.25, so that the "
                       "engines and the trainer both fit"))
        return issues
    if share is None:
        return issues  # the torch engine allocates as it goes: the fraction alone is the explicit share
    if share <= 0 or per_gpu * share >= 1:
        issues.append((key, share, f"{per_gpu} engine(s) on the shared GPU take {per_gpu} x {share:g} = "
                       f"{per_gpu * share:.2f} of its memory and leave the trainer nothing: the GPU is oversubscribed",
                       f"set gpu_memory_utilization < {1 / per_gpu:.2f} (less the trainer's share), or fewer workers "
                       "per GPU (num_gpus_per_worker)"))
        return issues
    if dmap.gpu_memory_gb is None:
        return issues
    estimate = trainer_memory_bytes(cfg)
    if estimate is None:
        return issues
    left = dmap.gpu_memory_gb * 1e9 * (1 - per_gpu * share)
    fits = (1 - estimate / (dmap.gpu_memory_gb * 1e9)) / per_gpu
    if left < estimate:
        issues.append((key, share, f"{per_gpu} engine(s) x {share:g} of a {dmap.gpu_memory_gb:g} GB GPU leave the "
                       f"trainer {left / 1e9:.1f} GB, less than its estimated peak of {estimate / 1e9:.1f} GB (the "
                       "plan's trainer memory line)", (f"lower gpu_memory_utilization to <= {fits:.2f}, " if fits > 0
                                                       else "the trainer alone does not fit this GPU: ") +
                       "lower model.init_args.micro_batch_tokens, or give generation a GPU of its own"))
    return issues


def trainer_memory_bytes(cfg: Mapping[str, Any]) -> int | None:
    """The trainer's estimated peak bytes per process (the plan's ``trainer memory`` line,
    :func:`screl.modules.memory_plan.config_estimate`), or None when the policy cannot tell its shape before
    loading."""
    from screl.modules.memory_plan import config_estimate

    estimate, _ = config_estimate(cfg)
    return None if estimate is None else estimate.peak


# -- the node's GPUs, and the trainer's CUDA_VISIBLE_DEVICES ---------------------------------------------------


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
