"""``RolloutRuntime``: the trainer-side handle on everything the rollout side runs.

It starts (or joins) Ray on loopback, the TransferQueue data plane, the generation workers and the
``RolloutController`` actor, and gives the DataModule plain-Python calls with timeouts. It is the one
place outside the actors that talks to Ray.
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from screl.config import GenerationConfig, RunConfig
from screl.controller.controller import RolloutController
from screl.dataplane import DataPlane, start_local_ray, stop_ray_if_started
from screl.envs import Task
from screl.models import PolicySpec
from screl.rollout.engine import SamplingParams
from screl.rollout.rows import ROW_FIELDS
from screl.rollout.worker import spawn_workers
from screl.threads import thread_plan

log = logging.getLogger(__name__)


def spawn_controller(
    run: RunConfig,
    task: Task,
    generation: GenerationConfig,
    workers: list[Any],
    dataplane: Any,
    run_dir: str,
    seed: int = 0,
    config_dict: dict[str, Any] | None = None,
) -> Any:
    """Start the ``RolloutController`` actor (CPU, asyncio) and return its handle."""
    actor = ray.remote(RolloutController).options(  # type: ignore[attr-defined]
        num_cpus=0, max_concurrency=1000
    )
    return actor.remote(run, task, generation, workers, dataplane, run_dir, seed, config_dict)


def sampling_params(g: GenerationConfig) -> SamplingParams:
    """The sampling settings every request of the run shares (each request adds its own seed)."""
    return SamplingParams(max_new_tokens=g.max_new_tokens, min_new_tokens=g.min_new_tokens,
                          temperature=g.temperature, top_p=g.top_p, top_k=g.top_k)


class RolloutRuntime:
    """Owns the rollout side of one run; every call waits at most ``timeout_s``."""

    def __init__(self, run: RunConfig, generation: GenerationConfig, timeout_s: float) -> None:
        self.run = run
        self.generation = generation
        self.timeout_s = timeout_s
        self.controller: Any = None
        self.workers: list[Any] = []
        self.dataplane: DataPlane | None = None
        self._ray_started = False
        self.events_path: str | None = None

    def start(
        self, task: Task, policy: PolicySpec, run_dir: str, initial_weights: dict[str, torch.Tensor], seed: int,
        restore: tuple[dict[str, Any], str | None] | None = None,
        config_dict: dict[str, Any] | None = None,
    ) -> None:
        """Start everything; with ``restore`` = (controller state, local TransferQueue snapshot dir), the
        controller resumes from it before its pump starts."""
        rc = self.run.ray
        self._ray_started = start_local_ray(num_cpus=rc.num_cpus, namespace=rc.namespace, address=rc.address)
        try:
            # start-up in parallel: the workers boot (and load the weights) while TransferQueue starts,
            # and the controller boots while the workers finish
            g = self.generation
            self.workers = spawn_workers(
                g.num_workers, policy, device=g.device, num_threads=thread_plan(g, self.run).generation,
                max_batch_size=g.max_batch_size,
                recompute_kv_cache_after_weight_updates=self.run.async_rl.recompute_kv_cache_after_weight_updates,
                injected_latency_s=g.injected_latency_s, seed=seed, backend=g.backend,
                batch_window_s=g.batch_window_s, task=task, sampling=sampling_params(g),
                workflow=g.workflow,
            )
            weights = [ray.put(initial_weights)]
            loaded = [w.update_weights.remote(weights, 0) for w in self.workers]
            self.dataplane = DataPlane.start(
                num_storage_units=self.run.data_plane.num_storage_units, partition_id=self.run.data_plane.partition_id
            )
            attached = [w.set_data_plane.remote(self.dataplane) for w in self.workers]
            self.controller = spawn_controller(
                self.run, task, g, self.workers, self.dataplane, run_dir, seed, config_dict
            )
            ray.get(loaded + attached, timeout=self.timeout_s)
            if restore is not None:
                summary = ray.get(self.controller.restore.remote(*restore), timeout=self.timeout_s)
                log.warning("screl: resumed the rollout side: %s", summary)
            info = ray.get(self.controller.start.remote(weights), timeout=self.timeout_s)
            self.events_path = info["events_path"]
            log.info("screl: controller started; events -> %s", self.events_path)
        except BaseException:
            self.shutdown()
            raise

    def next_chunk(self) -> dict[str, Any] | None:
        """Metadata of the next training chunk, or None when the run is done."""
        return ray.get(  # type: ignore[no-any-return]
            self.controller.next_chunk.remote(self.timeout_s), timeout=self.timeout_s + 60
        )

    def fetch(self, keys: list[str]) -> dict[str, list[torch.Tensor]]:
        """The rollout rows of ``keys`` from the data plane."""
        assert self.dataplane is not None
        return self.dataplane.get(keys, list(ROW_FIELDS)) if keys else {}

    def complete_step(self, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Retire the open step and refit the workers with ``weights``."""
        ref = [ray.put(weights)]
        return ray.get(self.controller.complete_step.remote(ref), timeout=self.timeout_s)  # type: ignore[no-any-return]

    def snapshot_now(self) -> str:
        """Attempt a periodic rollout snapshot right away (tests, and a save before a planned stop)."""
        return ray.get(self.controller.snapshot_now.remote(), timeout=self.timeout_s)  # type: ignore[no-any-return]

    def capture(self, data_plane_dir: str | None) -> dict[str, Any]:
        """The controller's checkpoint state (and the native TransferQueue snapshot in ``data_plane_dir``)."""
        return ray.get(self.controller.capture.remote(data_plane_dir), timeout=self.timeout_s)  # type: ignore[no-any-return]

    def stats(self) -> dict[str, Any]:
        return ray.get(self.controller.stats.remote(), timeout=60)  # type: ignore[no-any-return]

    def worker_pids(self) -> list[int]:
        return [int(p) for p in ray.get([w.pid.remote() for w in self.workers], timeout=60)]

    def shutdown(self) -> None:
        """Stop the controller, workers and data plane (and Ray, if started here). Idempotent."""
        if self.controller is not None:
            try:
                ray.get(self.controller.shutdown.remote(), timeout=30)
            except Exception as err:  # noqa: BLE001 - keep tearing down
                log.warning("screl: controller shutdown failed: %r", err)
            ray.kill(self.controller, no_restart=True)
            self.controller = None
        for w in self.workers:
            ray.kill(w, no_restart=True)
        self.workers = []
        if self.dataplane is not None:
            try:
                self.dataplane.shutdown()
            except Exception as err:  # noqa: BLE001
                log.warning("screl: data plane shutdown failed: %r", err)
            self.dataplane = None
        stop_ray_if_started(self._ray_started)
        self._ray_started = False
