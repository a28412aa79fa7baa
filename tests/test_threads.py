"""The CPU thread budget: sync runs give each phase every core, overlapping runs split them."""

from __future__ import annotations

from typing import Any

import pytest

from screl.config import GenerationConfig, RunConfig
from screl.threads import phases_overlap, thread_plan


def run(sampler: dict[str, Any], *, min_groups: int | None = None, prompts: int = 8) -> RunConfig:
    return RunConfig.from_dict({
        "grpo": {"num_prompts_per_step": prompts, "num_generations_per_prompt": 4},
        "async_rl": {"sampler": sampler, "min_groups_for_streaming_train": min_groups},
    })


SYNC = {"name": "in_order", "max_lookahead_versions": 0}
ASYNC = {"name": "in_order", "max_lookahead_versions": 1}


@pytest.mark.parametrize("cores", [1, 2, 3, 16])
def test_sync_gives_each_phase_every_core(cores: int) -> None:
    plan = thread_plan(GenerationConfig(), run(SYNC), cores=cores)
    assert (plan.generation, plan.train, plan.overlapping) == (cores, cores, False)


@pytest.mark.parametrize(("cores", "gen", "train"), [(1, 1, 1), (2, 1, 1), (3, 1, 2), (16, 8, 8)])
def test_async_splits_the_cores(cores: int, gen: int, train: int) -> None:
    plan = thread_plan(GenerationConfig(), run(ASYNC), cores=cores)
    assert (plan.generation, plan.train, plan.overlapping) == (gen, train, True)


@pytest.mark.parametrize(
    "sampler",
    [
        {"name": "windowed", "max_staleness_versions": 1},
        {"name": "weight_fifo", "max_staleness_versions": 1},
        {"name": "ready_first", "max_staleness_versions": 2},
        {"name": "custom", "target": "tests.sampler_plugins:DeclaresCheckpoint", "max_lookahead_versions": 1},
    ],
)
def test_every_window_overlaps(sampler: dict[str, Any]) -> None:
    assert phases_overlap(run(sampler))


def test_a_custom_sampler_answers_the_overlap_hint_itself() -> None:
    # an in_order subclass with lookahead 0 keeps the built-in's answer: phases take turns
    sync_subclass = {"name": "custom", "target": "tests.sampler_plugins:DeclaresCheckpoint",
                     "max_lookahead_versions": 0}
    assert not phases_overlap(run(sync_subclass))


def test_streamed_chunks_overlap_even_in_sync_mode() -> None:
    assert not phases_overlap(run(SYNC, min_groups=8))
    assert phases_overlap(run(SYNC, min_groups=4))
    assert thread_plan(GenerationConfig(), run(SYNC, min_groups=4), cores=4).generation == 2


def test_generation_cores_are_shared_by_the_workers() -> None:
    sync = thread_plan(GenerationConfig(num_workers=2), run(SYNC), cores=8)
    overlap = thread_plan(GenerationConfig(num_workers=2), run(ASYNC), cores=8)
    assert (sync.generation, sync.train) == (4, 8)
    assert (overlap.generation, overlap.train) == (2, 4)
    assert thread_plan(GenerationConfig(num_workers=4), run(ASYNC), cores=2).generation == 1


def test_explicit_values_win() -> None:
    plan = thread_plan(GenerationConfig(num_threads=3), run(SYNC), train_num_threads=5, cores=2)
    assert (plan.generation, plan.train) == (3, 5)


def test_gpu_workers_leave_the_cores_to_the_trainer() -> None:
    plan = thread_plan(GenerationConfig(device="cuda"), run(ASYNC), cores=8)
    assert (plan.generation, plan.train) == (1, 8)
    assert "8 for training" in plan.describe() and "cores split" in plan.describe()


@pytest.mark.parametrize(("env", "want"), [(None, 2), ("1", 1), ("8", 2), ("0", 2), ("two", 2)])
def test_omp_num_threads_caps_the_automatic_plan(monkeypatch: pytest.MonkeyPatch, env: str | None, want: int) -> None:
    import os

    from screl import threads

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert threads.available_cores() == want
    plan = thread_plan(GenerationConfig(), run(SYNC))
    assert (plan.generation, plan.train) == (want, want)
