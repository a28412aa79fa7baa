"""What each generation worker asks of Ray and how it builds its engine, from the generation config; and the
check, before any actor starts, that the Ray cluster can hold the workers at all.

Used by the runtime (which spawns the workers), the controller's health checks (which know what a lost
node's workers needed) and ``screl fit``'s startup summary; it imports none of them.
"""

from __future__ import annotations

from screl.config import GenerationConfig, RunConfig
from screl.rollout.engines.protocol import EngineOptions
from screl.rollout.resources import WorkerResources
from screl.threads import thread_plan


def worker_resources(g: GenerationConfig) -> WorkerResources:
    """What Ray reserves per generation worker: ``num_cpus_per_worker``, and ``num_gpus_per_worker`` or else
    ``colocated.resources`` (num_nodes x gpus_per_node GPUs) split over the workers on a cuda device."""
    res = g.colocated.resources
    total_gpus = res.num_nodes * res.gpus_per_node
    if g.num_gpus_per_worker is not None:
        gpus = g.num_gpus_per_worker
    elif g.device.startswith("cuda") and not g.colocated.enabled:
        gpus = total_gpus / g.num_workers if total_gpus else 1.0
    else:
        gpus = 0.0
    return WorkerResources(num_cpus=g.num_cpus_per_worker, num_gpus=gpus, spread=res.num_nodes > 1,
                           custom=dict(g.resources))


def engine_options(g: GenerationConfig, run: RunConfig, seed: int, record_routing: bool = False) -> EngineOptions:
    """How each worker builds its engine (worker ``i`` adds ``i`` to the seed); ``record_routing``: the trainer
    replays the engines' MoE routing (``model.init_args.routing_replay``)."""
    return EngineOptions(device=g.device, num_threads=thread_plan(g, run).generation, max_batch_size=g.max_batch_size,
                         recompute_kv_cache_after_weight_updates=run.async_rl.recompute_kv_cache_after_weight_updates,
                         seed=seed, args=dict(g.backend_args), record_routing=record_routing)


def check_cluster_fits(g: GenerationConfig, cluster: dict[str, float]) -> None:
    """Fail before any actor starts when the cluster cannot hold the generation workers (Ray would otherwise
    leave them pending forever); the message names the knobs."""
    need = worker_resources(g)
    problems = []
    knobs = {"CPU": "num_cpus_per_worker; ray.num_cpus for a local cluster", "GPU": "num_gpus_per_worker"}
    for kind, per_worker in need.demand().items():
        total = per_worker * g.num_workers
        have = float(cluster.get(kind, 0.0))
        if total > have:
            knob = knobs.get(kind, f"resources.{kind}; start a node that offers it: ray start --resources")
            problems.append(f"{g.num_workers} worker(s) x {per_worker:g} {kind} = {total:g} {kind}, the Ray cluster "
                            f"has {have:g} (data.init_args.generation.{knob}; num_workers)")
    if problems:
        raise RuntimeError("the generation workers do not fit the Ray cluster: " + "; ".join(problems))
