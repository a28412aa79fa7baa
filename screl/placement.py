"""The device map: which GPUs of which node the trainer and the generation workers use (pure, no Ray).

``screl fit`` computes it before anything starts and ``screl check`` prints it (the plan's ``devices`` line).
Per node it names the trainer's GPUs (``trainer.devices`` on each of ``trainer.num_nodes`` nodes), the inference
GPUs (``colocated.resources``: ``gpus_per_node`` on ``num_nodes`` nodes, or ``num_gpus_per_worker`` x
``num_workers``) and the GPUs left over. GPUs are positions in the node's visible list: the trainer takes the first
ones, generation the last ones (the spec's rule). Inference GPUs sit on the trainer's nodes by default, on nodes of
their own when ``generation.resources`` names a custom Ray resource, and on the trainer's own GPU only when asked
explicitly (a fractional ``num_gpus_per_worker`` plus the engine's memory share). Invariant: no GPU is both the
trainer's and generation's unless that sharing was asked for. How ``screl fit`` enforces the map
(``CUDA_VISIBLE_DEVICES`` for the trainer, a local raylet's GPU pool, the joined-cluster check): docs/generation.md,
"Placement: which GPU runs what".
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

GEN = "data.init_args.generation"
RES = f"{GEN}.colocated.resources"
VLLM_DEFAULT_MEMORY_SHARE = 0.9
"""vLLM's own ``gpu_memory_utilization`` default: the share an engine takes unless told otherwise."""
DEFAULT_GPU_MEMORY_GB = 80.0
"""The device memory the budget line assumes when ``colocated.resources.gpu_memory_gb`` is not set."""

Issue = tuple[str, Any, str, str]
"""A problem: (dotted key, value, what is wrong, the fix), as ``screl.rules`` reports it."""


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


@dataclass(frozen=True)
class _Plan:
    """What the map is drawn from: the config's counts, clamped to usable values (each bad one is its rule's)."""

    trainer_on_gpu: bool
    t_nodes: int
    t_count: int | None
    colocated: bool
    workers: int
    i_nodes: int
    k: int
    g: float
    inference_on_gpu: bool
    node_gpus: int | None
    own_nodes: tuple[str, ...]


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
    node_gpus = _node_gpus(res, node_gpus, issues)
    mem_gb = _memory_gb(res, issues)
    plan = _plan(trainer, gen, res, node_gpus, issues)
    share = _number((gen.get("backend_args") or {}).get("gpu_memory_utilization"))
    if share is None and str(gen.get("device", "cpu")).startswith("cuda") and _claims_memory_share(gen):
        share = _screl_vllm_share()
    base = {"trainer_on_gpu": plan.trainer_on_gpu, "inference_on_gpu": plan.inference_on_gpu,
            "colocated": plan.colocated, "gpus_per_worker": plan.g, "memory_share": share, "gpu_memory_gb": mem_gb,
            "own_nodes_by": plan.own_nodes, "node_gpus_known": node_gpus is not None}
    if plan.colocated or not (plan.trainer_on_gpu or plan.inference_on_gpu):
        return DeviceMap(**base, problems=tuple(issues))  # type: ignore[arg-type]
    nodes = _nodes(plan, trainer, issues)
    issues.extend(_inference_pool_issues(plan))
    dmap = DeviceMap(nodes=tuple(nodes), **base)  # type: ignore[arg-type]
    if dmap.shared:
        issues.extend(_shared_gpu_issues(dmap, gen, cfg))
    return DeviceMap(nodes=tuple(nodes), **base, problems=tuple(issues))  # type: ignore[arg-type]


def _node_gpus(res: Mapping[str, Any], node_gpus: int | None, issues: list[Issue]) -> int | None:
    """The GPUs a node has: the caller's count, else ``colocated.resources.node_gpus`` when it is valid."""
    knob = res.get("node_gpus")
    if node_gpus is None and isinstance(knob, int) and not isinstance(knob, bool):
        if knob < 0:
            issues.append((f"{RES}.node_gpus", knob, "must be a count >= 0, or null (counted by screl fit)",
                           "set node_gpus: 8 (GPUs per node) or null"))
        else:
            node_gpus = knob
    return node_gpus


def _memory_gb(res: Mapping[str, Any], issues: list[Issue]) -> float | None:
    mem_gb = _number(res.get("gpu_memory_gb"))
    if res.get("gpu_memory_gb") is not None and (mem_gb is None or mem_gb <= 0):
        issues.append((f"{RES}.gpu_memory_gb", res.get("gpu_memory_gb"), "must be a number of GB > 0, or null",
                       "set gpu_memory_gb: 80 (an H100), or null to skip the memory check"))
        mem_gb = None
    return mem_gb


def _count(value: Any, least: int, default: int) -> int:
    """``value`` when it is an int >= ``least`` (not a bool), else ``default``."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= least else default


def _plan(trainer: Mapping[str, Any], gen: Mapping[str, Any], res: Mapping[str, Any], node_gpus: int | None,
          issues: list[Issue]) -> _Plan:
    accel = str(trainer.get("accelerator") or "auto")
    if isinstance(trainer.get("accelerator"), Mapping):
        accel = str(trainer["accelerator"].get("class_path", "")).lower()
    trainer_on_gpu = accel in ("gpu", "cuda") or "cuda" in accel or (accel == "auto" and bool(node_gpus))
    t_count = _trainer_devices(trainer, issues) if trainer_on_gpu else 0
    colocated = bool(_get(gen, "colocated.enabled", False))
    on_cuda = str(gen.get("device", "cpu")).startswith("cuda")
    workers, i_nodes = _count(gen.get("num_workers", 1), 1, 1), _count(res.get("num_nodes", 1), 1, 1)
    k = _count(res.get("gpus_per_node", 0), 0, 0)
    g_raw = _number(gen.get("num_gpus_per_worker"))
    if g_raw is not None and g_raw < 0:
        g_raw = None  # its own rule reports it
    if colocated or not on_cuda:
        g = g_raw or 0.0
    else:
        g = g_raw if g_raw is not None else (i_nodes * k / workers if k else 1.0)
    own_nodes = tuple(sorted(gen.get("resources") or {})) if isinstance(gen.get("resources"), Mapping) else ()
    return _Plan(trainer_on_gpu, _count(trainer.get("num_nodes", 1), 1, 1), t_count, colocated, workers, i_nodes,
                 k, g, g > 0, node_gpus, own_nodes)


def _nodes(plan: _Plan, trainer: Mapping[str, Any], issues: list[Issue]) -> list[NodeDevices]:
    """Each node's GPUs: the trainer's first, generation's last (or shared, where a fractional share asks it)."""
    i_nodes, workers, separate = plan.i_nodes, plan.workers, bool(plan.own_nodes)
    per_node_workers = [workers // i_nodes + (1 if n < workers % i_nodes else 0) for n in range(i_nodes)]
    inf_gpus = [plan.k] * i_nodes if plan.k else [math.ceil(w * plan.g - 1e-9) for w in per_node_workers]
    nodes: list[NodeDevices] = []
    for n in range(plan.t_nodes + i_nodes if separate else max(plan.t_nodes, i_nodes)):
        inf_index = (n - plan.t_nodes) if separate else n
        has_inf = plan.inference_on_gpu and 0 <= inf_index < i_nodes and (separate or n < i_nodes)
        want_inf = inf_gpus[inf_index] if has_inf else 0
        w_here = per_node_workers[inf_index] if has_inf else 0
        t_here = plan.t_count if n < plan.t_nodes and plan.trainer_on_gpu else 0
        if t_here is None:  # "auto": the rest of the node
            t_here = max((plan.node_gpus - want_inf) if plan.node_gpus is not None else 1, 0)
        nodes.append(_node(plan, trainer, n, t_here, want_inf, w_here, issues))
    return nodes


def _node(plan: _Plan, trainer: Mapping[str, Any], n: int, t_here: int, want_inf: int, w_here: int,
          issues: list[Issue]) -> NodeDevices:
    size, g, k = plan.node_gpus, plan.g, plan.k
    if 0 < g < 1 and k == 0 and t_here > 0 and want_inf > 0 and (size is None or size < t_here + want_inf):
        size = size if size is not None else t_here  # the fractional share: generation on the trainer's GPUs
        trainer_pos = tuple(range(min(t_here, size)))
        inference_pos = tuple(range(max(0, min(t_here, size) - want_inf), min(t_here, size)))
        if want_inf > t_here:
            issues.append((f"{GEN}.num_gpus_per_worker", g, f"{w_here} worker(s) x {g:g} GPU share "
                           f"{want_inf} GPU(s) but the trainer has {t_here} on node {n} to share: the node is "
                           "oversubscribed", f"lower num_workers or num_gpus_per_worker to fit {t_here} GPU(s), "
                           f"or give generation GPUs of its own ({RES}.gpus_per_node)"))
        return NodeDevices(n, size, trainer_pos, inference_pos, shared=True, workers=w_here)
    size = size if size is not None else t_here + want_inf
    trainer_pos = tuple(range(t_here))
    inference_pos = tuple(range(max(0, size - want_inf), size)) if want_inf else ()
    issues.extend(_node_issues(plan, trainer, n, size, t_here, want_inf, set(trainer_pos) & set(inference_pos)))
    return NodeDevices(n, size, trainer_pos, inference_pos, workers=w_here)


def _node_issues(plan: _Plan, trainer: Mapping[str, Any], n: int, size: int, t_here: int, want_inf: int,
                 overlap: set[int]) -> list[Issue]:
    k, g = plan.k, plan.g
    if t_here > size:
        return [("trainer.devices", trainer.get("devices"), f"the trainer takes {t_here} GPU(s) per node but node {n} "
                 f"has {size}: the node is oversubscribed", f"set trainer.devices <= {size}, or correct {RES}.node_gpus")]
    if overlap:
        return [(f"{RES}.gpus_per_node" if k else f"{GEN}.num_gpus_per_worker", k or g,
                 f"node {n} has {size} GPU(s): the trainer's {t_here} (trainer.devices) and generation's "
                 f"{want_inf} overlap, so a worker would land on a trainer's device",
                 f"make trainer.devices + inference GPUs <= {size}: lower trainer.devices to "
                 f"{max(size - want_inf, 0)} or the inference GPUs; or share one GPU explicitly with a "
                 "fractional num_gpus_per_worker (e.g. 0.4) and gpus_per_node: 0 plus the engine's memory "
                 "share (backend_args.gpu_memory_utilization)")]
    if want_inf > size:
        return [(f"{RES}.gpus_per_node" if k else f"{GEN}.num_gpus_per_worker", k or g,
                 f"generation takes {want_inf} GPU(s) on node {n}, which has {size}: oversubscribed",
                 f"lower the inference GPUs to <= {size}, or correct {RES}.node_gpus")]
    return []


def _inference_pool_issues(plan: _Plan) -> list[Issue]:
    """The workers' GPUs against the pool ``colocated.resources`` gives generation."""
    workers, g, k, i_nodes = plan.workers, plan.g, plan.k, plan.i_nodes
    issues: list[Issue] = []
    if k and plan.inference_on_gpu and workers * g > i_nodes * k + 1e-9:
        issues.append((f"{GEN}.num_gpus_per_worker", g, f"{workers} worker(s) x {g:g} GPU = {workers * g:g} GPUs, but "
                       f"colocated.resources gives generation {i_nodes} x {k} = {i_nodes * k}: the inference "
                       "devices are oversubscribed (Ray would leave workers pending)",
                       f"set num_gpus_per_worker <= {i_nodes * k / workers:g}, fewer num_workers, or more "
                       "gpus_per_node"))
    if k and g > k + 1e-9:
        issues.append((f"{GEN}.num_gpus_per_worker", g, f"one worker takes {g:g} GPUs and a node has {k} for "
                       "generation: Ray cannot split a worker over nodes", f"set num_gpus_per_worker <= {k}"))
    return issues


def _claims_memory_share(gen: Mapping[str, Any]) -> bool:
    """Whether the configured engine preallocates a share of a GPU's memory (it declares so; an engine that does
    not resolve claims none here: the generation rules report it)."""
    from screl.rollout.engines.registry import engine_capabilities

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
        return issues + _kv_cache_issues(dmap, gen, cfg, per_gpu)
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


def _kv_cache_issues(dmap: DeviceMap, gen: Mapping[str, Any], cfg: Mapping[str, Any], per_gpu: int) -> list[Issue]:
    """An engine that holds a KV cache from its start (its capabilities' ``kv_cache_gib``: the torch engine's
    continuous path, ``backend_args.kv_cache_gb``): on a GPU the trainer shares (with ``gpu_memory_gb``), the
    engines' caches and the trainer's estimate must fit. Engines that allocate as they go: the fraction alone is
    their explicit share."""
    kv = _held_kv_cache_gib(gen)
    estimate = trainer_memory_bytes(cfg) if kv is not None and dmap.gpu_memory_gb is not None else None
    if kv is None or dmap.gpu_memory_gb is None or estimate is None:
        return []
    need, have = per_gpu * kv * 2**30 + estimate, dmap.gpu_memory_gb * 1e9
    if need <= have:
        return []
    room = (have - estimate) / per_gpu / 2**30
    return [(f"{GEN}.backend_args.kv_cache_gb", kv, f"{per_gpu} engine(s) x {kv:g} GiB of KV cache on the shared "
             f"{dmap.gpu_memory_gb:g} GB GPU and the trainer's estimated peak of {estimate / 1e9:.1f} GB need "
             f"{need / 1e9:.1f} GB", (f"lower kv_cache_gb to <= {room:.2f}" if room > 0 else
                                      "the trainer alone does not fit this GPU: lower "
                                      "model.init_args.micro_batch_tokens") + ", or give generation a GPU of its own")]


def _held_kv_cache_gib(gen: Mapping[str, Any]) -> float | None:
    """The GiB of KV cache the configured engine declares it holds from its start, or None."""
    from screl.rollout.engines.registry import engine_capabilities
    from screl.rules.context import rule_at

    try:
        path = engine_capabilities(str(gen.get("backend", "torch"))).kv_cache_gib
    except ValueError:
        return None
    value = rule_at(path)(dict(gen.get("backend_args") or {})) if path else None
    return None if value is None else float(value)


def trainer_memory_bytes(cfg: Mapping[str, Any]) -> int | None:
    """The trainer's estimated peak bytes per process (the plan's ``trainer memory`` line,
    :func:`screl.modules.memory_plan.config_estimate`), or None when the policy cannot tell its shape before
    loading."""
    from screl.modules.memory_plan import config_estimate

    estimate, _ = config_estimate(cfg)
    return None if estimate is None else estimate.peak
