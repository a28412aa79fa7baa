"""``GenerationWorker``: a Ray actor that drives one generation engine and writes its own rows.

The controller sends ``rollout(dispatches)``, metadata only (attempt id, prompt id, seed, priority). The worker
tokenizes each prompt once, runs its workflow on it (default: generate, reward, build the row), puts each sealed row
into the data plane under its attempt id (concurrent calls' writes coalesced into one put) and reports metadata back
(reward, lengths, finish reason, version). Invariant: rows never pass through the controller.

One decode thread gathers whatever is queued (up to ``max_batch_size`` rows) into one ``engine.generate`` call, so
concurrent groups share forward passes (:mod:`screl.rollout.decode_queue`); an engine that batches continuously
itself (``continuous_batching``, e.g. vLLM) gets each group at once through ``submit``. Weight updates run beside it
(:mod:`screl.rollout.worker_refit`), each token labelled with its version. Deadlines (:mod:`screl.rollout.deadlines`,
watched by :mod:`screl.rollout.rollout_call`) abort what runs past them as ``timeout``, their clock stopped while a
refit pauses the engine; under the drain gate (``in_flight_weight_updates: false``) a refit first waits for the
requests in flight. ``injected_latency_s``, a testing aid, delays each group's reply by a uniform random amount.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import random
from typing import Any

import ray
import torch

from screl.config_generation import DEFAULT_WORKFLOW
from screl.data.core_types import STALE, Burst, Dispatch, SiblingReport
from screl.envs import Task, decode_completion
from screl.models import PolicySpec
from screl.models.vision_inputs import VisionInputs
from screl.rollout.batching import RowSink
from screl.rollout.deadlines import CallDeadlines, Deadlines, PausableClock
from screl.rollout.decode_queue import DecodeQueue
from screl.rollout.engines.protocol import (
    EngineOptions,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    SamplingParams,
    declared_capabilities,
)
from screl.rollout.engines.registry import build_engine
from screl.rollout.resources import WorkerResources
from screl.rollout.rollout_call import (
    CALL,
    CallState,
    deadline_generate,
    mark_timeouts,
    shape_reward,
    teacher_score,
    watch_deadlines,
)
from screl.rollout.rows import ROUTING_SCHEMA, ROW_SCHEMA, VISION_SCHEMA, RowSchema
from screl.rollout.worker_refit import refit
from screl.rollout.workflows.reward_transform import RewardTransform
from screl.rollout.workflows.workflow import RolloutItem, RolloutOutcome, RolloutWorkflow, load_workflow


class GenerationWorker:
    """One engine in its own process. Create with :func:`spawn_workers` (or, colocated with the trainer, in the
    trainer's process with an ``engine`` on the trainer's module: :class:`screl.rollout.colocated.ColocatedHost`)."""

    def __init__(
        self,
        policy: PolicySpec,
        backend: str = "torch",
        options: EngineOptions | None = None,
        *,
        injected_latency_s: float = 0.0,
        batch_window_s: float = 0.01,
        task: Task | None = None,
        sampling: SamplingParams | None = None,
        workflow: str = DEFAULT_WORKFLOW,
        workflow_args: dict[str, Any] | None = None,
        row_window_s: float = 0.005,
        reward_transform: RewardTransform | None = None,
        val_task: Task | None = None,
        deadlines: Deadlines | None = None,
        in_flight_weight_updates: bool = True,
        engine: Any = None,
        teachers: Any = None,
    ) -> None:
        options = options or EngineOptions()
        if engine is None and options.num_threads is not None:
            torch.set_num_threads(options.num_threads)
        self.engine: Any = engine if engine is not None else build_engine(backend, policy, options)
        self.decoding = DecodeQueue(lambda requests: self.engine.generate(requests), options.max_batch_size or 64,
                                    batch_window_s)  # the engine looked up at each batch (a test may swap it)
        self.injected_latency_s = injected_latency_s
        self._rng = random.Random((options.seed or 0) + 7919)
        self.task, self.val_task = task, val_task
        self.sampling = sampling or SamplingParams()
        self.workflow: RolloutWorkflow | None = None
        self._policy = policy
        if task is not None or val_task is not None:
            self._tokenizer = policy.build_tokenizer()
        schema = _row_schema(policy, options)
        if task is not None:
            self.workflow = load_workflow(workflow)(task=task, tokenizer=self._tokenizer, schema=schema,
                                                    **(workflow_args or {}))
        self._prompt_tokens: dict[int, tuple[int, ...]] = {}
        self._prompt_images: dict[int, VisionInputs | None] = {}  # a vision-language policy's processed images
        self._call_states: dict[int, CallState] = {}  # the rollout calls running now
        self.rows = RowSink(row_window_s, busy=self._calls_working)
        self.teachers = teachers  # distillation: a screl.rollout.teachers.TeacherRouter; rows gain teacher_logprobs
        self.rows.schema = schema if teachers is None else teachers.schema
        self.reward_transform = reward_transform
        self.deadlines, self.clock = deadlines or Deadlines(), PausableClock()
        self.in_flight_weight_updates = in_flight_weight_updates
        self.capabilities = declared_capabilities(self.engine)
        self.continuous = self.capabilities.continuous_batching

    @property
    def max_batch_size(self) -> int:
        """Rows one decode takes at most (``EngineOptions.max_batch_size``, default 64)."""
        return self.decoding.max_batch_size

    @max_batch_size.setter
    def max_batch_size(self, rows: int) -> None:
        self.decoding.max_batch_size = rows

    @property
    def batch_window_s(self) -> float:
        """How long a decode waits for more groups when no burst marks them."""
        return self.decoding.batch_window_s

    @batch_window_s.setter
    def batch_window_s(self, seconds: float) -> None:
        self.decoding.batch_window_s = seconds

    # -- rollouts -------------------------------------------------------------------------------------
    def set_data_plane(self, dataplane: Any) -> None:
        """The data plane this worker writes its rows to (attached once it has started)."""
        self.rows.dataplane = dataplane

    def _tokens(self, prompt_id: int) -> tuple[int, ...]:
        tokens = self._prompt_tokens.get(prompt_id)
        if tokens is None:
            assert self.task is not None
            record = self.task.prompt(prompt_id)
            if self._policy.is_vlm:  # the images are drawn or loaded here, on the worker (never on the controller)
                ids, self._prompt_images[prompt_id] = self._policy.prompt_inputs(  # type: ignore[attr-defined]
                    self._tokenizer, record.text, self.task.images(record))
            else:
                ids = self._policy.prompt_token_ids(self._tokenizer, record.text)
            tokens = self._prompt_tokens[prompt_id] = tuple(ids)
        return tokens

    async def rollout(self, dispatches: list[Dispatch], expect_version: int | None = None,
                      burst: Burst | None = None) -> list[SiblingReport] | str:
        """Run the workflow on these siblings, write their rows, report metadata (one report per dispatch).

        ``expect_version``: the version the run serves; a worker behind it (restarted by Ray with its initial
        weights) or without a data plane returns :data:`STALE` at once, and the controller refreshes it and calls
        again (one round trip instead of a status call before every rollout). ``burst``: the calls sent with this
        one (the decode loop gathers them, then starts)."""
        if self.workflow is None or self.task is None:
            raise RuntimeError("this worker was started without a task: it can generate but not roll out")
        if expect_version is not None and (self.engine.version < expect_version or self.rows.dataplane is None):
            return STALE
        state = CallState(burst)
        CALL.set(state)
        self._call_states[id(state)] = state
        try:
            return await self._rollout(dispatches)
        finally:
            del self._call_states[id(state)]
            self.rows.poke()

    def _calls_working(self) -> int:
        """Rollout calls neither waiting on the engine nor on the row sink: they may write a row soon."""
        return sum(1 for c in self._call_states.values() if c.generating == 0) - self.rows.writers

    async def _rollout(self, dispatches: list[Dispatch]) -> list[SiblingReport]:
        assert self.task is not None
        items = [RolloutItem(d.attempt, self.task.prompt(d.prompt_id), self._tokens(d.prompt_id),
                             dataclasses.replace(self.sampling, seed=d.seed), d.priority,
                             self._prompt_images.get(d.prompt_id)) for d in dispatches]
        call = CallDeadlines(self.deadlines, self.clock) if self.deadlines.any else None
        try:
            outcomes = await self._run_workflow(items, call)
        except asyncio.CancelledError:  # aborted while queued
            outcomes = [RolloutOutcome(d.attempt, "abort", finish_reason="abort") for d in dispatches]
        if call is not None:
            mark_timeouts(call, outcomes)
        sealed = [o for o in outcomes if o.status == "sealed" and o.row is not None]
        if self.reward_transform is not None:
            for o in sealed:
                shape_reward(self.reward_transform, o)
        if self.teachers is not None and sealed:  # distillation: the teachers score before the row is written
            sealed = await teacher_score(self.teachers, items, sealed)
        if sealed:
            await self.rows.put([o.attempt for o in sealed], [o.row for o in sealed if o.row is not None])
        return [SiblingReport(o.attempt, o.status, o.reward, o.end_version, o.response_len,  # type: ignore[arg-type]
                              o.finish_reason, o.detail, o.reward_parts if o.status == "sealed" else None)
                for o in outcomes]

    async def _run_workflow(self, items: list[RolloutItem], call: CallDeadlines | None) -> list[RolloutOutcome]:
        """The workflow on ``items``; with deadlines, what runs past them is aborted (and a workflow still running
        a second after its rollout deadline, e.g. in a hung reward, is cancelled)."""
        assert self.workflow is not None
        if call is None:
            return await self.workflow.run(items, self.generate)
        run = asyncio.ensure_future(self.workflow.run(items, deadline_generate(call, self.generate, self.engine)))
        return await watch_deadlines(run, items, call, self.abort, self.deadlines.poll_s, self.clock)

    # -- validation ---------------------------------------------------------------------------------
    async def validate(self, version: int, samples: list[tuple[int, int, int]],
                       sampling: SamplingParams) -> list[dict[str, Any]]:
        """Generate and score held-out samples ``(prompt_id, sample, seed)`` with the weights of ``version``, at
        priority ``version`` (beside that step's rollouts). No row is written: validation never reaches the data
        plane. Each result names the weight versions its tokens came from (the controller checks the pin)."""
        if self.val_task is None:
            raise RuntimeError("this worker was started without held-out prompts (val_task): it cannot validate")
        if self.engine.version != version:
            raise RuntimeError(f"asked to validate version {version} but the worker serves {self.engine.version}")
        task, tok = self.val_task, self._tokenizer
        records = [task.prompt(pid) for pid, _, _ in samples]
        prompts = [self._val_prompt(task, r) for r in records]
        requests = [GenerationRequest(f"val-{version}-{pid}-{k}", ids, dataclasses.replace(sampling, seed=seed),
                                      version, vision)
                    for (ids, vision), (pid, k, seed) in zip(prompts, samples, strict=True)]
        results = await self.generate(requests)
        completions = [decode_completion(tok, r.token_ids) for r in results]
        rewards = await asyncio.get_running_loop().run_in_executor(None, task.rewards, records, completions)
        return [{"prompt_id": pid, "sample": k, "reward": float(reward), "response_len": len(res.token_ids),
                 "finish_reason": res.finish_reason, "versions": sorted(set(res.weight_versions))}
                for (pid, k, _), res, reward in zip(samples, results, rewards, strict=True)]

    def _val_prompt(self, task: Any, record: Any) -> tuple[list[int], VisionInputs | None]:
        """A held-out prompt's token ids and, for a vision-language policy, its images (as rollouts see them)."""
        if self._policy.is_vlm:
            ids, vision = self._policy.prompt_inputs(self._tokenizer, record.text, task.images(record))  # type: ignore[attr-defined]
            return ids, vision
        return self._policy.prompt_token_ids(self._tokenizer, record.text), None

    # -- requests -----------------------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate one group's requests (batched with whatever else is queued)."""
        if self.continuous:
            results: list[GenerationResult] = await asyncio.wrap_future(self.engine.submit(requests))  # type: ignore[attr-defined]
            return results
        call = CALL.get()
        burst = None
        if call is not None and not call.first_generate_done and call.burst is not None:
            burst = (call.burst.id, call.burst.size)
        future = self.decoding.put(requests, asyncio.get_running_loop(), burst)
        if call is not None:
            call.first_generate_done = True
            call.generating += 1
        try:
            results = await future
        finally:
            if call is not None:
                call.generating -= 1
                self.rows.poke()
        if self.injected_latency_s > 0:
            await asyncio.sleep(self._rng.uniform(0.0, self.injected_latency_s))
        return results

    async def partial_tokens(self, request_ids: list[str]) -> dict[str, list[int]] | None:
        """Each in-flight request's tokens so far (those still queued are left out); None when the engine cannot
        tell (its capabilities do not declare ``streams_tokens``)."""
        if not self.capabilities.streams_tokens:
            return None
        tokens: dict[str, list[int]] = self.engine.partial_tokens(request_ids)
        return tokens

    async def abort(self, request_ids: list[str]) -> None:
        """Finish these requests early: running ones return partial tokens (finish_reason ``abort``),
        queued ones are dropped before they start (their callers see a cancellation)."""
        self.decoding.drop(set(request_ids))
        self.engine.abort(request_ids)
        forward = getattr(self.workflow, "abort", None)  # a workflow whose requests are not the sibling's own
        if forward is not None:
            await forward(request_ids)

    # -- weights --------------------------------------------------------------------------------------
    async def update_weights(self, weights: list[Any], version: int) -> int:
        """Load the weights, given as buckets (state-dict pieces, or ObjectRefs to them), through the backend as
        ``version``; returns the version.

        An engine that streams buckets (``streams_weight_buckets``: the torch and vLLM engines) gets them one at a
        time: each ObjectRef is fetched only when the engine asks for the next bucket, and released once loaded,
        so the worker never holds more than one bucket (no merged state dict). Any other backend gets one merged
        state dict (the ``GenerationEngine`` protocol's)."""
        await refit(self.engine, weights, version, self.clock, streams=self.capabilities.streams_weight_buckets,
                    drain=not self.in_flight_weight_updates)  # the drain gate: in-flight requests finish first
        return version

    # -- vLLM's NCCL weight transfer (screl.rollout.engines.vllm_transfer): the trainer drives these --
    async def attach_server(self, server: Any, url: str, api_key: str | None) -> None:
        """The policy server, for a workflow that runs agents against it (``AgentWorkflow``)."""
        attach = getattr(self.workflow, "attach_server", None)
        if attach is not None:
            attach(server, url, api_key)

    async def tensor_parallel_size(self) -> int:
        return int(getattr(self.engine, "tensor_parallel_size", 1))

    async def weight_transfer(self, method: str, payload: Any = None) -> None:
        transfer = getattr(self.engine, "weight_transfer", None)
        if transfer is None:
            raise RuntimeError(f"the {type(self.engine).__name__} backend has no native weight transfer")
        await asyncio.get_running_loop().run_in_executor(None, transfer, method, payload)

    async def pause_for_transfer(self) -> None:
        """Hold generation for a transfer (``wait`` under the drain gate, else ``keep``); deadlines stand still."""
        self.clock.pause()
        mode: PauseMode = "keep" if self.in_flight_weight_updates else "wait"
        await asyncio.get_running_loop().run_in_executor(None, self.engine.pause, mode)

    async def resume_after_transfer(self, version: int) -> None:
        try:
            self.engine.set_version(version)
            self.engine.resume()
        finally:
            self.clock.resume()

    async def set_version(self, version: int) -> int:
        """Relabel the loaded weights as ``version`` (the policy did not change: PPO critic warmup)."""
        self.engine.set_version(version)
        return version

    async def version(self) -> int:
        return self.engine.version

    async def status(self) -> tuple[int, bool]:
        """(weight version, whether a data plane is attached): a restarted worker has neither refit nor plane."""
        return self.engine.version, self.rows.dataplane is not None

    async def num_threads(self) -> int:
        """Torch intra-op threads of this worker process."""
        return torch.get_num_threads()

    async def assigned_resources(self) -> dict[str, float]:
        """What Ray reserved for this worker (``num_cpus_per_worker``, ``num_gpus_per_worker``)."""
        return dict(ray.get_runtime_context().get_assigned_resources())

    async def pid(self) -> int:
        return os.getpid()

    async def node_id(self) -> str:
        """The Ray node this worker runs on (the controller's node-loss check reads it)."""
        return str(ray.get_runtime_context().get_node_id())

    async def ping(self) -> bool:
        return True

    async def row_puts(self) -> int:
        return self.rows.puts


def _row_schema(policy: PolicySpec, options: EngineOptions) -> RowSchema:
    """The schema of the rows a worker writes (before distillation adds the teachers' fields)."""
    if policy.is_vlm:
        return VISION_SCHEMA  # a vision-language policy: rows carry the prompt's processed images
    return ROUTING_SCHEMA if options.record_routing else ROW_SCHEMA  # routing replay: rows carry the routing


def spawn_workers(
    num_workers: int,
    policy: PolicySpec,
    *,
    resources: WorkerResources | None = None,
    namespace_prefix: str = "screl",
    options: EngineOptions | None = None,
    max_restarts: int = -1,
    **kwargs: Any,
) -> list[Any]:
    """Start ``num_workers`` generation actors (restarted by Ray up to ``max_restarts`` times if their process
    dies, -1: always); worker ``i`` seeds its engine with ``options.seed + i``."""
    remote_cls = ray.remote(GenerationWorker)
    options = options or EngineOptions()
    base_seed = options.seed or 0
    return [
        remote_cls.options(  # type: ignore[attr-defined]
            **(resources or WorkerResources()).actor_options(),
            max_restarts=max_restarts,
            max_task_retries=0,
            max_concurrency=64,
            name=f"{namespace_prefix}-generation-{i}-{os.getpid()}",
        ).remote(policy, options=dataclasses.replace(options, seed=base_seed + i), **kwargs)
        for i in range(num_workers)
    ]
