"""The single controller (a Ray actor) and the helpers that start it."""

from __future__ import annotations

import os
from typing import Any

from screl.config import GenerationConfig, RunConfig
from screl.controller.controller import ROW_FIELDS, RolloutController, RolloutFailure
from screl.envs import Task
from screl.models import PolicySpec


def spawn_controller(
    run: RunConfig,
    task: Task,
    policy: PolicySpec,
    generation: GenerationConfig,
    workers: list[Any],
    dataplane: Any,
    run_dir: str,
    seed: int = 0,
) -> Any:
    """Start the ``RolloutController`` actor (CPU, asyncio) and return its handle."""
    import ray

    actor = ray.remote(RolloutController).options(  # type: ignore[attr-defined]
        num_cpus=0, max_concurrency=1000, name=f"screl-controller-{os.getpid()}"
    )
    return actor.remote(run, task, policy, generation, workers, dataplane, run_dir, seed)


__all__ = ["ROW_FIELDS", "RolloutController", "RolloutFailure", "spawn_controller"]
