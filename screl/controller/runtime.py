"""``RolloutRuntime``: the trainer-side handle on everything the rollout side runs.

It starts (or joins) Ray on loopback, the TransferQueue data plane, the generation workers and the
``RolloutController`` actor, and gives the DataModule plain-Python calls with timeouts. It is the one
place outside the actors that talks to Ray.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import ray
import torch

from screl.config import GenerationConfig, RunConfig
from screl.controller.controller import RolloutController
from screl.controller.resources import check_cluster_fits, engine_options, worker_resources
from screl.dataplane import DataPlane, start_local_ray, stop_ray_if_started
from screl.dataplane.cluster import adopted_prestart_s, warm_worker_zygote
from screl.dataplane.tq_client import in_daemon_thread
from screl.envs import Task
from screl.models import PolicySpec
from screl.placement import DeviceMap
from screl.placement_env import ENV_DEVICE_MAP, joined_cluster_problem, local_ray_gpu_ids
from screl.rollout.colocated import ColocatedHost, ColocatedSlot
from screl.rollout.deadlines import Deadlines
from screl.rollout.engines.buckets import iter_buckets
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.engines.registry import engine_capabilities, resolve_backend
from screl.rollout.rows import ROW_FIELDS
from screl.rollout.worker import GenerationWorker, spawn_workers
from screl.rollout.workflows.reward_transform import reward_transform

log = logging.getLogger(__name__)
startup = logging.getLogger("screl.startup")
"""One line per component as the rollout side starts, with its time (``screl fit`` shows them on stderr)."""


WeightSource = Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]


def put_buckets(tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> list[Any]:
    """Object-store refs of the weights, one per bucket of about ``bucket_bytes``."""
    return [ray.put(bucket) for bucket in iter_buckets(tensors, bucket_bytes)]


def spawn_controller(
    run: RunConfig,
    task: Task,
    generation: GenerationConfig,
    workers: list[Any],
    run_dir: str,
    seed: int = 0,
    config_dict: dict[str, Any] | None = None,
    val_prompt_ids: list[int] | None = None,
) -> Any:
    """Start the ``RolloutController`` actor (CPU, asyncio) and return its handle; hand it the data plane with
    ``set_data_plane`` (TransferQueue starts while it boots)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    actor = ray.remote(RolloutController).options(  # type: ignore[attr-defined]
        num_cpus=0, max_concurrency=1000, scheduling_strategy=here  # the run's state lives beside its driver
    )
    whole = engine_capabilities(generation.backend).whole_call_batches
    return actor.remote(run, task, generation, workers, run_dir, seed, config_dict, val_prompt_ids, whole)


def check_joined_cluster(g: GenerationConfig, environ: Mapping[str, str] | None = None) -> None:
    """On a cluster screl joined (``ray.address``): fail before any actor starts when the trainer's node offers Ray
    more GPUs than the device map (``screl fit`` leaves it in ``SCREL_DEVICE_MAP``) gives generation there, so a
    worker could land on a trainer's GPU. A local cluster needs no check: it is started with the inference GPUs
    only (:func:`screl.dataplane.start_local_ray`, ``gpu_ids``)."""
    text = (os.environ if environ is None else environ).get(ENV_DEVICE_MAP)
    if not text:
        return
    why = joined_cluster_problem(DeviceMap.from_json(text), ray.nodes(), ray.get_runtime_context().get_node_id(),
                                 worker_resources(g).custom)
    if why is not None:
        raise RuntimeError(why)


def sampling_params(g: GenerationConfig) -> SamplingParams:
    """The sampling settings every request of the run shares (each request adds its own seed)."""
    return SamplingParams(max_new_tokens=g.max_new_tokens, min_new_tokens=g.min_new_tokens,
                          temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)


def start_host(controller: Any, policy: PolicySpec, g: GenerationConfig, run: RunConfig, seed: int,
               model: Any, autocast: torch.dtype | None, dataplane: Any, worker_kwargs: dict[str, Any],
               timeout_s: float, link: Any = None) -> ColocatedHost:
    """The colocated engine: a worker in this process whose engine decodes with ``model`` (the trainer's module,
    in the trainer's threads), served to the controller through its mailbox. ``backend: megatron``: the Megatron
    engine on the trainer's ``GPTModel`` shard, the other tensor-parallel ranks following through ``link``."""
    options = engine_options(g, run, seed)
    engine_cls: Any = resolve_backend(g.backend)  # the rules let only a colocatable engine here
    engine = engine_cls.on_trainer_module(policy, options, model=model, autocast=autocast, link=link)
    worker = GenerationWorker(policy, options=dataclasses.replace(options, num_threads=None), engine=engine,
                              **worker_kwargs)
    return ColocatedHost(controller, 0, worker, dataplane, stand_down_timeout_s=timeout_s)


class RolloutRuntime:
    """Owns the rollout side of one run; every call waits at most ``timeout_s``."""

    def __init__(self, run: RunConfig, generation: GenerationConfig, timeout_s: float) -> None:
        self.run = run
        self.generation = generation
        self.timeout_s = timeout_s
        self.controller: Any = None
        self.workers: list[Any] = []
        self.server: Any = None
        self.server_url: str | None = None
        self.dataplane: DataPlane | None = None
        self._ray_started = False
        self.events_path: str | None = None
        self.refit_bucket_bytes = int(generation.refit_bucket_mb * 2**20)
        self.capabilities = engine_capabilities(generation.backend)
        self.broadcasts_weights = "nccl" in self.capabilities.weight_transfers and \
            generation.backend_args.get("weight_transfer") == "nccl"
        """The trainer broadcasts the policy module to the engines over NCCL instead of exporting buckets."""
        self._sender: Any = None
        self.colocated = generation.colocated.enabled
        """The engine decodes with the trainer's module in this process (:mod:`screl.rollout.colocated`)."""
        self.host: Any = None  # the colocated engine's ColocatedHost
        self._phase_at: dict[str, float] = {}  # its busy seconds and tokens at the last stand-down
        self.record_routing = False  # the engines record MoE routing for the trainer's replay (set before start)
        self.link: Any = None  # a colocated Megatron engine's DecodeLink to the other tensor-parallel ranks
        self.distillation: Any = None  # screl.Distill's DistillationConfig: teacher workers score every row
        self.teachers: dict[str, list[Any]] = {}  # their replicas' actors, by name
        self.row_fields: tuple[str, ...] = ROW_FIELDS

    def start(
        self, task: Task, policy: PolicySpec, run_dir: str, initial_weights: dict[str, torch.Tensor], seed: int,
        restore: tuple[dict[str, Any], str | None, dict[str, Any] | None] | None = None,
        config_dict: dict[str, Any] | None = None, val_task: Task | None = None,
        model: torch.nn.Module | None = None, autocast: torch.dtype | None = None, link: Any = None,
        distillation: Any = None,
    ) -> None:
        """Start everything; with ``restore`` = (controller state, local TransferQueue snapshot dir, the published
        snapshot for TQ actors on other nodes), the controller resumes from it before its pump starts. Colocated
        generation decodes with ``model`` (the trainer's module; its forward passes compute in ``autocast``; under
        tensor parallelism the other ranks follow each forward through ``link``)."""
        self.link = link
        self.distillation = distillation
        if self.colocated and model is None:
            raise ValueError("colocated generation needs the trainer's module (RolloutRuntime.start(model=...))")
        rc = self.run.ray
        t0 = time.perf_counter()
        self._ray_started = start_local_ray(num_cpus=rc.num_cpus, namespace=rc.namespace, address=rc.address,
                                            log_to_driver=os.environ.get("SCREL_VERBOSE") == "1",
                                            gpu_ids=local_ray_gpu_ids() if rc.address is None else None)
        warm_worker_zygote()  # the workers, the controller and TransferQueue are on their way
        early = adopted_prestart_s()
        if early is not None:
            startup.info("screl: Ray started at launch, beside the driver's start-up (up %.1f s before it was needed)",
                         early)
        else:
            startup.info("screl: Ray %s in %.1f s", "started" if self._ray_started else "joined",
                         time.perf_counter() - t0)
        try:
            weights = self._start_fleet(task, policy, run_dir, initial_weights, seed, config_dict, val_task,
                                        model, autocast)
            t2 = time.perf_counter()
            if restore is not None:
                summary = self._wait(self.controller.restore.remote(*restore), "restore the checkpoint", self.timeout_s)
                log.warning("screl: resumed the rollout side: %s", summary)
            info = self._wait(self.controller.start.remote(weights), "start the controller", self.timeout_s)
            self.events_path = info["events_path"]
            startup.info("screl: controller started in %.1f s; events -> %s", time.perf_counter() - t2, self.events_path)
        except BaseException:
            self.shutdown()
            raise

    def _start_fleet(
        self, task: Task, policy: PolicySpec, run_dir: str, initial_weights: dict[str, torch.Tensor], seed: int,
        config_dict: dict[str, Any] | None, val_task: Task | None, model: torch.nn.Module | None = None,
        autocast: torch.dtype | None = None,
    ) -> list[Any] | None:
        """Start TransferQueue, the workers (with ``initial_weights`` loaded) and the controller actor, all at
        once: TransferQueue (its controller, then its storage units, one after the other) starts in a thread
        while the workers and the controller boot. Returns the weights' object refs (None: colocated)."""
        g, dpc = self.generation, self.run.data_plane
        check_cluster_fits(g, ray.cluster_resources())
        if self.run.ray.address is not None:
            check_joined_cluster(g)
        t1 = time.perf_counter()
        dp_future = in_daemon_thread(
            lambda: DataPlane.start(num_storage_units=dpc.num_storage_units, partition_id=dpc.partition_id,
                                    storage_node_resource=dpc.storage_node_resource)
        )
        worker_kwargs = self._worker_kwargs(task, val_task)
        weights: list[Any] | None = None
        loaded: list[Any] = []
        try:
            if self.colocated:  # no worker process: the controller's mailbox, served by this process's host
                self.workers = [ColocatedSlot(0)]
            else:
                self.workers = spawn_workers(
                    g.num_workers, policy, resources=worker_resources(g),
                    options=engine_options(g, self.run, seed, self.record_routing),
                    max_restarts=g.max_worker_restarts, **worker_kwargs)
                weights = put_buckets(initial_weights.items(), self.refit_bucket_bytes)
                loaded = [w.update_weights.remote(weights, 0) for w in self.workers]
            self.controller = spawn_controller(
                self.run, task, g, self.workers, run_dir, seed, config_dict,
                [p.prompt_id for p in val_task.prompts()] if val_task is not None else None,
            )
        finally:  # a failed spawn still waits for TransferQueue, so shutdown() stops it
            self.dataplane = dp_future.result()
        startup.info("screl: TransferQueue started in %.1f s (%d storage unit(s))", time.perf_counter() - t1,
                     dpc.num_storage_units)
        actors = [self.controller] if self.colocated else [*self.workers, self.controller]
        attached = [a.set_data_plane.remote(self.dataplane) for a in actors]
        teachers_up = [a.ping.remote() for replicas in self.teachers.values() for a in replicas]  # built their models
        self._wait(loaded + attached + teachers_up, "load the initial weights into the workers", self.timeout_s)
        if self.colocated:
            self.host = start_host(self.controller, policy, g, self.run, seed, model, autocast,
                                   self.dataplane, worker_kwargs, self.timeout_s, link=self.link)
        if g.expose_http_server:
            self._start_server(policy, seed)
        self._say_ready(time.perf_counter() - t1)
        return weights

    def _worker_kwargs(self, task: Task, val_task: Task | None) -> dict[str, Any]:
        """What every generation worker (or the colocated host's worker) is built with besides its engine."""
        g = self.generation
        kwargs: dict[str, Any] = dict(
            backend=g.backend, injected_latency_s=g.injected_latency_s, batch_window_s=g.batch_window_s,
            task=task, sampling=sampling_params(g), workflow=g.workflow, workflow_args=dict(g.workflow_args),
            reward_transform=reward_transform(self.run.algo, g.max_new_tokens), val_task=val_task,
            deadlines=Deadlines(g.generation_timeout_s, g.rollout_timeout_s),
            in_flight_weight_updates=self.run.async_rl.in_flight_weight_updates,
        )
        if self.distillation is not None:
            kwargs["teachers"] = self._start_teachers()
        return kwargs

    def _say_ready(self, seconds: float) -> None:
        g = self.generation
        if self.colocated:
            startup.info("screl: the colocated %s engine (the trainer's module) and the controller ready in %.1f s",
                         g.backend, seconds)
        else:
            startup.info("screl: %d generation worker(s) and the controller ready in %.1f s (%s backend, weights "
                         "loaded)", len(self.workers), seconds, g.backend)

    def _start_teachers(self) -> Any:
        """Distillation: one scoring worker per teacher (started beside the fleet, ready before the workers roll
        out); the workers get a router to them and write ``teacher_logprobs`` into every row."""
        from screl.rollout.teachers import TeacherRouter, check_teachers_fit, distill_schema, spawn_teachers

        g, cfg = self.generation, self.distillation
        need = {"CPU": g.num_cpus_per_worker * g.num_workers, "GPU": (g.num_gpus_per_worker or 0.0) * g.num_workers}
        check_teachers_fit(cfg, need, ray.cluster_resources())
        t0 = time.perf_counter()
        self.teachers = spawn_teachers(cfg, g.temperature, self.run.ray.namespace)
        self.row_fields = distill_schema(cfg).names
        startup.info("screl: %d teacher worker(s) started in %.1f s (%s; %d replica(s) each on %s)",
                     sum(map(len, self.teachers.values())), time.perf_counter() - t0, ", ".join(self.teachers),
                     cfg.teacher_replicas, cfg.teacher_device)
        return TeacherRouter(dict(self.teachers), cfg)

    def _start_server(self, policy: PolicySpec, seed: int = 0) -> None:
        """The OpenAI-compatible policy server in front of the workers (``generation.expose_http_server``)."""
        from screl.rollout.server.server import PolicyServer

        g, hs = self.generation, self.generation.http_server
        self.server = ray.remote(PolicyServer).options(num_cpus=0, max_concurrency=1000).remote(
            self.workers, policy, host=hs.host, port=hs.port, api_key=hs.api_key, model_name=hs.model_name,
            max_tokens=g.max_new_tokens, temperature=g.temperature, tool_parser=hs.tool_parser, seed=seed,
            limits=hs)
        self.server_url = self._wait(self.server.start.remote(), "start the policy server", self.timeout_s)
        self._wait([w.attach_server.remote(self.server, self.server_url, hs.api_key) for w in self.workers]
                   + [self.controller.watch_server.remote(self.server)], "attach the policy server", self.timeout_s)
        startup.info("screl: OpenAI-compatible policy server at %s (model %r)", self.server_url, hs.model_name)

    def _wait(self, ref: Any, what: str, timeout_s: float | None = None) -> Any:
        """``ray.get(ref)`` within ``timeout_s`` (default: ``step_timeout_s`` + 60 s); a timeout says what the
        trainer was waiting for and names the knob."""
        limit = self.timeout_s + 60 if timeout_s is None else timeout_s
        try:
            return ray.get(ref, timeout=limit)
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"the rollout side did not {what} within {limit:.0f} s (data.init_args.step_timeout_s = "
                f"{self.timeout_s:g}): a hung controller or generation worker; see the workers' logs (screl fit "
                "--verbose), or raise step_timeout_s if it is just slow"
            ) from None

    def next_chunk(self) -> dict[str, Any] | None:
        """Metadata of the next training chunk, or None when the run is done."""
        return self._wait(self.controller.next_chunk.remote(self.timeout_s), "hand over the next chunk")  # type: ignore[no-any-return]

    def fetch(self, keys: list[str], fields: Sequence[str] | None = None) -> dict[str, list[torch.Tensor]]:
        """The rollout rows of ``keys`` from the data plane (``fields``: the trainer's row schema's; default the
        rows the workers write)."""
        assert self.dataplane is not None
        return self.dataplane.get(keys, list(fields or self.row_fields)) if keys else {}

    def stand_down(self) -> dict[str, float]:
        """Colocated: the step's batch is complete; after the running validation (its weights are about to
        change), the engine stands down for the train step. Returns its generation phase since the last stand-down
        for the step's metrics: ``engine_busy_s`` (the seconds it decoded) and ``engine_tokens`` (the tokens its
        calls returned), where the engine counts them."""
        self._wait(self.controller.validation_idle.remote(self.timeout_s), "finish the validation before the step",
                   self.timeout_s + 60)
        self.host.stand_down()
        engine, out = self.host.worker.engine, {}
        for key, attr in (("engine_busy_s", "busy_s"), ("engine_tokens", "tokens_out")):
            value = getattr(engine, attr, None)
            if value is not None:
                out[key], self._phase_at[key] = float(value) - self._phase_at.get(key, 0.0), float(value)
        return out

    def wake(self) -> None:
        """Colocated: generation resumes (idempotent)."""
        self.host.wake()

    def complete_step_in_place(self, changed: bool) -> dict[str, Any]:
        """Colocated: retire the step; the engine's weights are the trainer's, so the refit is the relabel
        (``changed``: the policy was updated, not a PPO critic warmup); then the engine wakes."""
        info = self._wait(self.controller.complete_step.remote(None, self.timeout_s, in_place=changed),
                          "relabel the colocated engine")
        if self.link is None:  # with followers the engine wakes when they serve it (the next fetch)
            self.host.wake()
        return info  # type: ignore[no-any-return]

    def release_followers(self) -> None:
        """Colocated Megatron under tensor parallelism: the engine stands down, then the other ranks leave their
        decode loop (they go on to the chunk's broadcast)."""
        if self.link is None or self.host is None:
            return
        self.host.stand_down()
        self.host.worker.engine.end_followers()

    def complete_step(self, weights: WeightSource | None) -> dict[str, Any]:
        """Retire the open step and refit the workers with ``weights`` (a state dict, or an iterable of buckets
        as ``iter_export_weights`` yields them): each bucket goes to the object store on its own. None: the
        policy did not change, the workers keep their weights."""
        if weights is not None and self.broadcasts_weights:
            return self._complete_step_by_broadcast(weights)  # type: ignore[arg-type]
        if weights is None:
            refs = None
        elif isinstance(weights, Mapping):
            refs = put_buckets(weights.items(), self.refit_bucket_bytes)
        else:
            refs = [ray.put(bucket) for bucket in weights]
        return self._wait(self.controller.complete_step.remote(refs, self.timeout_s), "refit the workers")  # type: ignore[no-any-return]

    def _complete_step_by_broadcast(self, module: torch.nn.Module) -> dict[str, Any]:
        """vLLM's NCCL transfer (``screl.rollout.engines.vllm_transfer``; unverified on a GPU here): the controller
        retires the step, the trainer broadcasts ``module``'s parameters to every engine, the controller resumes."""
        from screl.rollout.engines.vllm_transfer import NcclWeightSender

        if self._sender is None:
            self._wait(self.controller.use_external_refit.remote(), "switch to the NCCL refit")
            self._sender = NcclWeightSender(self.workers, module, timeout_s=self.timeout_s,
                                            bucket_bytes=self.refit_bucket_bytes)  # generation.refit_bucket_mb
        version = self._wait(self.controller.begin_refit.remote(self.timeout_s), "retire the step")
        t0 = time.perf_counter()
        self._sender.refit(int(version))
        return self._wait(self.controller.end_refit.remote(time.perf_counter() - t0), "resume after the refit")  # type: ignore[no-any-return]

    def finish_validation(self) -> list[dict[str, Any]]:
        """The end of training: the final validation (``val_at_end``) and every result not yet logged."""
        return self._wait(self.controller.finish_validation.remote(self.timeout_s), "finish the validation")  # type: ignore[no-any-return]

    def snapshot_now(self) -> str:
        """Attempt a periodic rollout snapshot right away (tests, and a save before a planned stop)."""
        return self._wait(self.controller.snapshot_now.remote(), "take a rollout snapshot", self.timeout_s)  # type: ignore[no-any-return]

    def capture(self, data_plane_dir: str | None, remote: dict[str, Any] | None = None) -> dict[str, Any]:
        """The controller's checkpoint state (and the native TransferQueue snapshot in ``data_plane_dir``, the
        shares held on other nodes uploaded to ``remote``: ``url`` and ``storage_options``)."""
        return self._wait(self.controller.capture.remote(data_plane_dir, remote=remote),  # type: ignore[no-any-return]
                          "capture its checkpoint state", self.timeout_s)

    def stats(self) -> dict[str, Any]:
        return ray.get(self.controller.stats.remote(), timeout=60)  # type: ignore[no-any-return]

    def worker_pids(self) -> list[int]:
        if self.colocated:
            return []
        return [int(p) for p in ray.get([w.pid.remote() for w in self.workers], timeout=60)]

    def shutdown(self) -> None:
        """Stop the controller, workers and data plane (and Ray, if started here). Idempotent."""
        if self.link is not None:  # the followers are gone or going: a decode woken by the close must not wait on them
            self.link.close()
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.controller is not None:
            try:
                ray.get(self.controller.shutdown.remote(), timeout=30)
            except Exception as err:  # noqa: BLE001 - keep tearing down
                log.warning("screl: controller shutdown failed: %r", err)
            ray.kill(self.controller, no_restart=True)
            self.controller = None
        if self.server is not None:
            ray.kill(self.server, no_restart=True)
            self.server = None
        for w in self.workers:
            if not isinstance(w, ColocatedSlot):
                ray.kill(w, no_restart=True)
        self.workers = []
        for teacher in (a for replicas in self.teachers.values() for a in replicas):
            ray.kill(teacher, no_restart=True)
        self.teachers = {}
        if self.dataplane is not None:
            try:
                self.dataplane.shutdown()
            except Exception as err:  # noqa: BLE001
                log.warning("screl: data plane shutdown failed: %r", err)
            self.dataplane = None
        stop_ray_if_started(self._ray_started)
        self._ray_started = False
