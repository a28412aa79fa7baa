"""Distillation teachers (screl.rollout.teachers): scoring, routing by task_source, the worker's hook that writes
``teacher_logprobs`` into every row before it is put, and a failed teacher as a data failure. Real Ray actors for
the teachers, the real torch engine in an in-process generation worker, an in-memory data plane."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from _ray_session import session_ray

from screl.config_distill import DistillationConfig, Teacher
from screl.data.core_types import Dispatch
from screl.envs import CountLetter, TaskMixture
from screl.models import TinyCausalLM
from screl.models.logprobs import full_token_logprobs
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.rows import ROW_SCHEMA
from screl.rollout.teachers import (
    DISTILL_SCHEMA,
    DISTILL_TOP_K_SCHEMA,
    TeacherRouter,
    check_teachers_fit,
    completion_logprobs,
    completion_top_k,
    score_sequences,
    spawn_teachers,
)
from screl.rollout.worker import GenerationWorker

SEQS = [([5, 6, 7, 8, 9, 10], 2), ([11, 12, 13, 14], 3), ([7, 7, 7, 7, 7, 7, 7, 7], 5)]


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[None]:
    with session_ray(num_cpus=6, namespace="screl-tests"):
        yield


def _spawn_ready(cfg: DistillationConfig, namespace_prefix: str) -> dict[str, list[Any]]:
    """The teachers, each replica's model built (its ``ping`` answered) before the test's first call, as the
    runtime waits for them at start-up: ``score_timeout_s`` bounds a scoring call, not a process's boot (on a
    loaded machine four boots outlast the tests' 30 s)."""
    actors = spawn_teachers(cfg, temperature=1.0, namespace_prefix=namespace_prefix)
    ray.get([a.ping.remote() for replicas in actors.values() for a in replicas], timeout=600)
    return actors


def _config(**kw: Any) -> DistillationConfig:
    teachers = [Teacher("count", TinyCausalLM(seed=1)), Teacher("add", TinyCausalLM(seed=2))]
    return DistillationConfig(teachers=teachers, teacher_map={"add": "add"}, default_teacher="count",
                              num_cpus_per_teacher=0.5, max_teacher_restarts=0, **kw)


@pytest.mark.parity
def test_completion_logprobs_are_the_models_next_token_logprobs_of_the_completion() -> None:
    model = TinyCausalLM(seed=1).build_model().eval()
    got = completion_logprobs(model, SEQS)
    for (ids, p), lp in zip(SEQS, got, strict=True):
        t = torch.tensor([ids])
        with torch.no_grad():
            want = full_token_logprobs(model, t, torch.ones_like(t), 1.0)[0, p - 1:]
        assert len(lp) == len(ids) - p
        torch.testing.assert_close(torch.tensor(lp), want, rtol=0, atol=2e-6)  # padded batch vs alone: fp32 round-off
    hot = completion_logprobs(model, SEQS[:1], temperature=0.5)[0]
    assert hot != got[0], "the temperature scales the teacher's logits"


@pytest.mark.parity
@pytest.mark.parametrize("top_k", [0, 5])
def test_chunked_and_batched_scoring_equals_the_full_logits(top_k: int) -> None:
    """The teachers score through the trainer's chunked path (chunks of 2 positions here) and in forwards of a
    bounded size (8 padded tokens: one sequence each, longest first): the same logprobs and top-k as one forward
    through full logits, in the given order."""
    model = TinyCausalLM(seed=1).build_model().eval()
    full = score_sequences(model, SEQS, 0.7, top_k=top_k, chunk_tokens=0)
    for chunk, batch in ((None, None), (2, None), (2, 8)):
        got = score_sequences(model, SEQS, 0.7, top_k=top_k, chunk_tokens=chunk, batch_tokens=batch)
        for x, y in zip(got, full, strict=True):
            xs, ys = (x, y) if top_k else ((x,), (y,))
            torch.testing.assert_close(torch.tensor(xs[0]), torch.tensor(ys[0]), rtol=0, atol=2e-6)
            if top_k:
                assert torch.equal(xs[1], ys[1]) and xs[1].dtype == torch.int32 and xs[1].shape == (len(xs[0]), 5)
                torch.testing.assert_close(xs[2], ys[2], rtol=0, atol=2e-6)


def test_placement_keys_are_checked() -> None:
    problems = {key: why for key, _, why, _ in _config(teacher_device="cuda").problems()}
    assert "num_gpus_per_teacher" in next(k for k in problems if "num_gpus" in k)
    assert "needs a GPU share" in problems["model.init_args.distillation.num_gpus_per_teacher"]
    problems = {key: why for key, _, why, _ in _config(num_gpus_per_teacher=1.0).problems()}
    assert "never use" in problems["model.init_args.distillation.num_gpus_per_teacher"]
    keys = {key for key, *_ in _config(teacher_device="tpu", teacher_replicas=0, teacher_batch_tokens=0,
                                         teacher_chunk_tokens=-1).problems()}
    assert {f"model.init_args.distillation.{k}" for k in ("teacher_device", "teacher_replicas",
                                                           "teacher_batch_tokens", "teacher_chunk_tokens")} <= keys
    cfg = _config(teacher_device="cuda", num_gpus_per_teacher=1.0, teacher_replicas=2)
    with pytest.raises(RuntimeError, match=r"2 teacher\(s\) x 2 replica\(s\) x 1 GPU do not fit beside .*\(0.5 GPU\)"):
        check_teachers_fit(cfg, {"CPU": 1.0, "GPU": 0.5}, {"CPU": 16.0, "GPU": 4.0})
    check_teachers_fit(cfg, {"CPU": 1.0, "GPU": 0.0}, {"CPU": 16.0, "GPU": 4.0})


@pytest.mark.usefixtures("ray_cluster")
def test_a_teachers_rows_are_split_among_its_replicas() -> None:
    cfg = _config(score_timeout_s=30.0, teacher_replicas=2)
    actors = _spawn_ready(cfg, "screl-test-replicas")
    try:
        assert [len(r) for r in actors.values()] == [2, 2]
        rows = [("count", *s) for s in (*SEQS, SEQS[0])]
        got = asyncio.run(TeacherRouter(actors, cfg).score(rows))
        want = completion_logprobs(TinyCausalLM(seed=1).build_model().eval(), [s for _, *s in rows])
        for lp, ref in zip(got, want, strict=True):
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), rtol=0, atol=2e-6)
        assert ray.get([a.num_calls.remote() for a in actors["count"]]) == [1, 1]  # two rows each
        assert ray.get([a.num_calls.remote() for a in actors["add"]]) == [0, 0]
    finally:
        for replicas in actors.values():
            for a in replicas:
                ray.kill(a, no_restart=True)


def test_schema_adds_teacher_logprobs_aligned_like_generation_logprobs() -> None:
    assert DISTILL_SCHEMA.names == (*ROW_SCHEMA.names, "teacher_logprobs")
    row = {name: torch.tensor([0.0]) for name in ROW_SCHEMA.names}
    row.update(input_ids=torch.tensor([3, 4, 5, 6]), prompt_len=torch.tensor([2]), loss_mask=torch.ones(2),
               generation_logprobs=torch.tensor([-1.0, -2.0]), token_versions=torch.tensor([0, 0]),
               finish_reason=torch.tensor([1]), teacher_logprobs=torch.tensor([-0.5, -0.25]))
    data = DISTILL_SCHEMA.merge([row])
    out = DISTILL_SCHEMA.collate({"keys": ["k"], "trainer_version": 0, "start_weight": [0]}, data, 0)
    assert torch.equal(out["teacher_logprobs"], torch.tensor([[0.0, -0.5, -0.25]]))
    assert torch.equal(out["generation_logprobs"], torch.tensor([[0.0, -1.0, -2.0]]))
    with pytest.raises(ValueError, match=r"a row has fields"):
        ROW_SCHEMA.merge([row])


@pytest.mark.usefixtures("ray_cluster")
def test_router_routes_by_task_source_and_a_dead_teacher_fails_its_rows_only() -> None:
    cfg = _config(score_timeout_s=30.0)
    actors = _spawn_ready(cfg, "screl-test")
    try:
        router = TeacherRouter(actors, cfg)
        rows = [("add", *SEQS[0]), (None, *SEQS[1]), ("count", *SEQS[2]), ("other", *SEQS[0])]
        got = asyncio.run(router.score(rows))
        count = completion_logprobs(TinyCausalLM(seed=1).build_model().eval(), [s for _, *s in rows])
        add = completion_logprobs(TinyCausalLM(seed=2).build_model().eval(), [s for _, *s in rows])
        want = [add[0], count[1], count[2], count[3]]
        assert [len(lp) for lp in got] == [len(lp) for lp in want]  # type: ignore[arg-type]
        for lp, ref in zip(got, want, strict=True):
            # two batch layouts, not one: each actor scores only its own rows ('add' row 0 alone at width 6,
            # 'count' 3 rows) in its own process and thread count, the reference all 4 rows padded to width 8;
            # fp32 round-off of logprobs ~ -4 (eps 1.19e-7 x 4 x a few ops): the bound of the padded-vs-alone check
            torch.testing.assert_close(torch.tensor(lp), torch.tensor(ref), rtol=0, atol=2e-6)
        assert ray.get(actors["add"][0].num_calls.remote()) == 1, "one call per teacher"
        ray.kill(actors["add"][0], no_restart=True)
        _until_dead(actors["add"][0])  # ray.kill returns before the process ends: a call meanwhile may still run
        again = asyncio.run(router.score(rows))
        assert isinstance(again[0], RuntimeError)
        assert "teacher 'add' failed" in str(again[0])
        assert again[1:] == got[1:]  # exact: the same 'count' actor scores the same 3-row batch again
    finally:
        for replicas in actors.values():
            for a in replicas:
                ray.kill(a, no_restart=True)


def _until_dead(actor: Any, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.num_calls.remote(), timeout=timeout_s)
        except ray.exceptions.RayActorError:
            return
        time.sleep(0.05)
    raise AssertionError(f"the killed actor still answered after {timeout_s} s")


class RecordingPlane:
    """An in-memory data plane that keeps what was put."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    async def aput(self, keys: list[str], batch: dict[str, list[torch.Tensor]]) -> None:
        for i, key in enumerate(keys):
            self.rows[key] = {name: values[i] for name, values in batch.items()}


@pytest.mark.usefixtures("ray_cluster")
def test_worker_writes_teacher_logprobs_and_a_failed_teacher_call_is_a_data_failure() -> None:
    cfg = _config(score_timeout_s=30.0)
    actors = _spawn_ready(cfg, "screl-test")
    task = TaskMixture({"count": CountLetter(), "add": CountLetter(letter="b")})
    try:
        worker = GenerationWorker(TinyCausalLM(seed=0), task=task, teachers=TeacherRouter(actors, cfg),
                                  sampling=SamplingParams(max_new_tokens=4, min_new_tokens=4), row_window_s=0.0)
        plane = RecordingPlane()
        worker.set_data_plane(plane)
        count_pid, add_pid = task.prompts()[0].prompt_id, task.prompts()[1].prompt_id
        dispatches = [Dispatch(f"g{pid}_a0", f"g{pid}", 0, pid, 7, 0, 0) for pid in (count_pid, add_pid)]
        reports = asyncio.run(worker.rollout(dispatches))
        assert [r.status for r in reports] == ["sealed", "sealed"]
        assert sorted(plane.rows) == sorted(d.attempt for d in dispatches)
        models = {"count": TinyCausalLM(seed=1).build_model().eval(), "add": TinyCausalLM(seed=2).build_model().eval()}
        for d, source in zip(dispatches, ("count", "add"), strict=True):
            row = plane.rows[d.attempt]
            assert set(row) == set(DISTILL_SCHEMA.names)
            ids, p = row["input_ids"].tolist(), int(row["prompt_len"][0])
            assert row["teacher_logprobs"].shape == (len(ids) - p,) == (4,)
            want = completion_logprobs(models[source], [(ids, p)])[0]
            torch.testing.assert_close(row["teacher_logprobs"], torch.tensor(want), rtol=0, atol=2e-6)

        ray.kill(actors["add"][0], no_restart=True)
        plane.rows.clear()
        again = [Dispatch(f"g{pid}_a1", f"g{pid}", 0, pid, 8, 0, 0) for pid in (count_pid, add_pid)]
        reports = asyncio.run(worker.rollout(again))
        assert [r.status for r in reports] == ["sealed", "data_error"]
        assert "teacher 'add' failed" in reports[1].detail
        assert list(plane.rows) == [again[0].attempt], "no row is written without its teacher logprobs"
    finally:
        for replicas in actors.values():
            for a in replicas:
                ray.kill(a, no_restart=True)


@pytest.mark.usefixtures("ray_cluster")
def test_top_k_teachers_write_their_top_tokens_into_each_row() -> None:
    """``estimator: top_k``: the worker's rows carry the teacher's top-k ids and logprobs at each completion position
    (the teacher actor's forward), beside ``teacher_logprobs``; the rows collate to ``[rows, length - 1, k]``."""
    cfg = _config(score_timeout_s=30.0, estimator="top_k", top_k=5)
    actors = _spawn_ready(cfg, "screl-test-topk")
    task = TaskMixture({"count": CountLetter(), "add": CountLetter(letter="b")})
    try:
        router = TeacherRouter(actors, cfg)
        assert router.schema is DISTILL_TOP_K_SCHEMA
        worker = GenerationWorker(TinyCausalLM(seed=0), task=task, teachers=router,
                                  sampling=SamplingParams(max_new_tokens=4, min_new_tokens=4), row_window_s=0.0)
        plane = RecordingPlane()
        worker.set_data_plane(plane)
        pid = task.prompts()[1].prompt_id  # an "add" prompt: the seed-2 teacher
        reports = asyncio.run(worker.rollout([Dispatch(f"g{pid}_a0", f"g{pid}", 0, pid, 7, 0, 0)]))
        assert [r.status for r in reports] == ["sealed"]
        [row] = plane.rows.values()
        assert set(row) == set(DISTILL_TOP_K_SCHEMA.names)
        ids, p = row["input_ids"].tolist(), int(row["prompt_len"][0])
        [(lp, top_ids, top_lp)] = completion_top_k(TinyCausalLM(seed=2).build_model().eval(), [(ids, p)], 5)
        assert row["teacher_top_ids"].dtype == torch.int32 and row["teacher_top_ids"].shape == (4, 5)
        assert torch.equal(row["teacher_top_ids"], top_ids)
        torch.testing.assert_close(row["teacher_top_logprobs"], top_lp, rtol=0, atol=2e-6)
        torch.testing.assert_close(row["teacher_logprobs"], torch.tensor(lp), rtol=0, atol=2e-6)
        assert (row["teacher_top_logprobs"][:, 0] >= row["teacher_logprobs"] - 1e-6).all()  # the top-1 bounds it
        data = DISTILL_TOP_K_SCHEMA.merge([row])
        out = DISTILL_TOP_K_SCHEMA.collate({"keys": ["k"], "trainer_version": 0, "start_weight": [0]}, data, 0)
        assert out["teacher_top_ids"].shape == (1, len(ids) - 1, 5)
        assert torch.equal(out["teacher_top_ids"][0, p - 1:], top_ids)
    finally:
        for replicas in actors.values():
            for a in replicas:
                ray.kill(a, no_restart=True)
