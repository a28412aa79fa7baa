"""The CPU thread budget: torch intra-op threads for the trainer process and each generation worker.

On CPU, generation and training compete for the same cores. When they take turns (sync: lookahead 0,
whole steps, no streaming) each phase may use every core, because the other one is idle meanwhile.
When they overlap (any lookahead, staleness window or streamed chunks), the cores are split between
them, so neither phase's thread team is descheduled by the other (an OpenMP team stalls at every
barrier while one of its threads waits for a core).

``generation.num_threads`` and ``data.init_args.train_num_threads`` set the two sides explicitly;
``None`` (the default) picks them with :func:`thread_plan`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from screl.config import GenerationConfig, RunConfig


def available_cores() -> int:
    """Cores this process may run on (its CPU affinity, else the machine's count), capped by ``OMP_NUM_THREADS``
    when it is set: the automatic plan then never gives a process more threads than the user allowed (CI's
    single-thread parity pass relies on it)."""
    try:
        cores = max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        cores = max(1, os.cpu_count() or 1)
    cap = os.environ.get("OMP_NUM_THREADS", "").strip()
    return min(cores, int(cap)) if cap.isdigit() and int(cap) > 0 else cores


@dataclass(frozen=True)
class ThreadPlan:
    """Torch threads per generation worker and for the trainer, and why."""

    generation: int
    train: int
    overlapping: bool
    cores: int
    colocated: bool = False

    def describe(self) -> str:
        if self.colocated:
            return (f"{self.train} in the trainer's process, which generates and trains in turns ({self.cores} cores; "
                    "colocated)")
        mode = "generation overlaps training: cores split" if self.overlapping else "phases take turns: all cores each"
        return f"{self.generation} per generation worker, {self.train} for training ({self.cores} cores; {mode})"


def phases_overlap(run: RunConfig) -> bool:
    """Whether generation runs while the trainer computes: the sampler says so (a lookahead/staleness
    window; a custom sampler by default), or a step is streamed as several chunks."""
    return run.sampler_rules.overlaps_training() or run.min_groups < run.groups_per_step


def thread_plan(
    generation: GenerationConfig, run: RunConfig, train_num_threads: int | None = None, cores: int | None = None
) -> ThreadPlan:
    """Resolve the thread budget: explicit values win; ``None`` means automatic.

    Automatic, on ``cores`` CPU cores with ``W`` CPU generation workers:
    - phases take turns: each worker ``max(1, cores // W)``, the trainer ``cores``;
    - phases overlap: generation gets half the cores (``max(1, cores // 2)``, split over the workers),
      the trainer the rest (at least 1).
    Workers on a GPU (``generation.device: cuda``) get 1 thread and leave the CPU cores to the trainer.
    """
    cores = available_cores() if cores is None else cores
    colocated = generation.colocated.enabled  # one process: its generation and training never overlap
    overlapping = phases_overlap(run) and not colocated
    on_cpu = generation.device == "cpu"
    workers = max(1, generation.num_workers)
    if not on_cpu:
        gen_total = 0
    elif overlapping:
        gen_total = max(1, cores // 2)
    else:
        gen_total = cores
    gen = generation.num_threads if generation.num_threads is not None else max(1, gen_total // workers)
    if train_num_threads is not None:
        train = train_num_threads
    elif overlapping and on_cpu:
        train = max(1, cores - gen_total)
    else:
        train = cores
    if colocated:  # the engine runs on the trainer's threads
        gen = train
    return ThreadPlan(generation=gen, train=train, overlapping=overlapping, cores=cores, colocated=colocated)
