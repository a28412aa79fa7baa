"""The ``RolloutController``: the single controller, a CPU Ray actor on asyncio.

It owns the prompt source (stateful cursor), the ``ReplayBuffer``, the staleness sampler and the
``RolloutLedger`` (pure values from ``screl.data``), drives the generation workers, writes rollout
rows to the data plane and appends every decision to ``events.jsonl``. The trainer talks to it with
metadata only: ``next_chunk`` hands out the group ids and data-plane keys of the next training
chunk; ``complete_step`` retires a finished step, bumps the trainer version and refits the workers.

Rollout pump, per dataloader batch of ``num_prompts_per_step`` prompts::

    sampler.admit(T) -> per prompt: capacity + in-flight permit -> wait for rollout permission
      -> buffer.reserve -> ledger.reserve -> generate (one request per sibling) -> rewards
      -> data plane put -> buffer.commit (completion order)

Failures: a worker that dies (infra) or a reward function that raises (data) retries only the
unfinished siblings within ``async_rl.rollout_failure`` budgets, with exponential backoff; a group
that exhausts them is dropped (if a drop budget allows) or fails the run, and the error surfaces in
the trainer at its next ``next_chunk``.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import os
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

from screl.config import GenerationConfig, RunConfig
from screl.data import ReplayBuffer, RolloutLedger, create_sampler
from screl.data.events import (
    AbortEvent,
    AdmitEvent,
    CommitEvent,
    DropEvent,
    Event,
    EventLogWriter,
    EvictEvent,
    FailEvent,
    RefitEvent,
    ReserveEvent,
    SelectEvent,
    TrainStepEvent,
)
from screl.data.ledger import RecoveryPolicy
from screl.data.samplers import call_admit
from screl.envs import PromptRecord, Task, decode_completion
from screl.models import PolicySpec
from screl.rollout.engine import GenerationRequest, GenerationResult, SamplingParams

log = logging.getLogger(__name__)

#: Fields of every rollout row in the data plane.
ROW_FIELDS = ("input_ids", "prompt_len", "generation_logprobs", "token_versions", "reward")


class RolloutFailure(RuntimeError):
    """A prompt group failed beyond its retry budget and the drop budget is spent."""


@dataclass
class _GroupRun:
    """Controller-side bookkeeping of one prompt group in flight."""

    group_id: str
    prompt: PromptRecord
    start_weight: int
    target_step: int | None
    epoch: int
    results: dict[int, GenerationResult] = field(default_factory=dict)
    attempts: dict[int, str] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    task: asyncio.Task[None] | None = None


def _seed_for(*parts: Any) -> int:
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


class RolloutController:
    """The single controller. Build it with :func:`screl.controller.spawn_controller`."""

    def __init__(
        self,
        run: RunConfig,
        task: Task,
        policy: PolicySpec,
        generation: GenerationConfig,
        workers: list[Any],
        dataplane: Any,
        run_dir: str,
        seed: int = 0,
    ) -> None:
        self.run = run
        self.algo = run.algo
        self.task = task
        self.generation = generation
        self.workers = workers
        self.dp = dataplane
        self.seed = seed
        self.tokenizer = policy.build_tokenizer()
        self.prompts = task.prompts()
        self.prompt_tokens = {
            p.prompt_id: list(self.tokenizer(p.text, add_special_tokens=False)["input_ids"]) for p in self.prompts
        }
        self.G = self.algo.num_generations_per_prompt
        self.P = self.algo.num_prompts_per_step
        self.sampler = create_sampler(run.async_rl.sampler, groups_per_step=self.P)
        self.buffer = ReplayBuffer(
            run.max_buffered_rollouts, run.max_inflight_prompts, id_prefix=f"{uuid.uuid4().hex[:8]}-"
        )
        rr = run.rollout_recovery
        self.ledger = RolloutLedger(
            RecoveryPolicy(
                default_granularity=rr.default_granularity,  # type: ignore[arg-type]
                task_source_granularity_overrides=dict(rr.task_source_granularity_overrides),  # type: ignore[arg-type]
                agent_granularity_overrides=dict(rr.agent_granularity_overrides),  # type: ignore[arg-type]
            )
        )
        self.failure = run.async_rl.rollout_failure
        self.batches_per_epoch = len(self.prompts) // self.P
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the task has {len(self.prompts)} prompts, fewer than num_prompts_per_step={self.P}: "
                "no full step can be formed"
            )
        limit = self.algo.max_num_epochs * self.batches_per_epoch
        self.max_steps = min(limit, self.algo.max_num_steps) if self.algo.max_num_steps else limit
        # versions and counters
        self.trainer_version = 0
        self.gen_version = 0
        self.train_steps = 0
        self.epoch = 0
        self.batch_index = 0
        self.admitted_batches = 0
        self.skipped_prompts = 0
        self.consecutive_drops = 0
        self.step_claims: list[str] = []
        self.step_dispatched = 0
        self.shortfall: dict[int, int] = {}
        self.latest_weights: list[Any] | None = None
        self.runs: dict[str, _GroupRun] = {}
        self.pending_admitted = 0  # admitted prompts not yet reserved
        self.exhausted = False
        self.pump_error: BaseException | None = None
        self.metrics: dict[str, float] = {"evicted": 0, "aborted": 0, "dropped": 0, "retried": 0}
        self._next_worker = 0
        self._changed: asyncio.Event | None = None
        self._permitted: asyncio.Event | None = None
        self._pump: asyncio.Task[None] | None = None
        self._shutting_down = False
        os.makedirs(run_dir, exist_ok=True)
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self._events: TextIO | None = (
            open(self.events_path, "a", encoding="utf-8") if run.async_rl.event_log else None  # noqa: SIM115
        )
        self._writer = EventLogWriter(self._events, clock=time.time) if self._events is not None else None

    # ------------------------------------------------------------------ events
    def _emit(self, event: Event) -> None:
        if self._writer is not None:
            self._writer.write(event)

    def _notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_changed(self, timeout: float) -> None:
        assert self._changed is not None
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    # ------------------------------------------------------------------ lifecycle
    async def start(self, weights: list[Any] | None = None) -> dict[str, Any]:
        """Start the rollout pump (``weights``: the workers' current weights, to re-push after a restart)."""
        self.latest_weights = weights
        self._changed = asyncio.Event()
        self._permitted = asyncio.Event()
        self._permitted.set()
        self._pump = asyncio.get_running_loop().create_task(self._rollout_pump())
        self._pump.add_done_callback(self._on_pump_done)
        return {"max_steps": self.max_steps, "events_path": self.events_path}

    def _on_pump_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            self.pump_error = err
        self._notify()

    async def shutdown(self) -> None:
        """Cancel the pump and every rollout in flight (they stay "in flight" in the log); close the log."""
        self._shutting_down = True
        for gr in list(self.runs.values()):
            if gr.task is not None:
                gr.task.cancel()
        if self._pump is not None:
            self._pump.cancel()
            try:
                await self._pump
            except BaseException:  # noqa: BLE001 - already recorded or cancelled
                pass
        if self._events is not None:
            self._events.close()
            self._events = None

    async def stats(self) -> dict[str, Any]:
        return {
            "trainer_version": self.trainer_version,
            "gen_version": self.gen_version,
            "train_steps": self.train_steps,
            "buffered": self.buffer.num_buffered,
            "ready": self.buffer.num_ready,
            "inflight": self.buffer.num_inflight,
            "ledger": vars(self.ledger.accounting()) if hasattr(self.ledger.accounting(), "__dict__") else {},
            "exhausted": self.exhausted,
            **self.metrics,
        }

    # ------------------------------------------------------------------ rollout pump
    def _epoch_order(self, epoch: int) -> list[PromptRecord]:
        order = list(self.prompts)
        random.Random(_seed_for(self.seed, "epoch", epoch)).shuffle(order)
        return order

    def _outstanding(self) -> int:
        return self.buffer.num_live + self.pending_admitted

    async def _rollout_pump(self) -> None:
        assert self._permitted is not None
        while self.epoch < self.algo.max_num_epochs:
            order = self._epoch_order(self.epoch)
            while self.batch_index < self.batches_per_epoch:
                while True:
                    adm = call_admit(self.sampler, self.trainer_version, outstanding_groups=self._outstanding())
                    if adm.allowed:
                        break
                    await self._wait_changed(0.5)
                batch = order[self.batch_index * self.P:(self.batch_index + 1) * self.P]
                self.batch_index += 1
                self.admitted_batches += 1
                self.pending_admitted += len(batch)
                self._emit(AdmitEvent(
                    trainer_version=self.trainer_version, step=self.sampler.dispatch_index,
                    target_step=adm.target_step,
                    extra={"epoch": self.epoch, "prompt_ids": [p.prompt_id for p in batch]},
                ))
                for prompt in batch:
                    while not self.buffer.can_reserve():
                        await self._wait_changed(0.5)
                    await self._permitted.wait()
                    self._reserve_and_launch(prompt, adm.target_step)
            self.epoch += 1
            self.batch_index = 0
        while self.runs:
            await self._wait_changed(0.5)
        self.exhausted = True
        self._notify()

    def _reserve_and_launch(self, prompt: PromptRecord, target_step: int | None) -> None:
        sw = self.gen_version
        group_id = self.buffer.reserve(prompt.prompt_id, sw, target_step)
        self.pending_admitted -= 1
        self.ledger.reserve(group_id, prompt.prompt_id, self.G, start_weight=sw, target_step=target_step)
        self._emit(ReserveEvent(group_id=group_id, prompt_id=prompt.prompt_id, start_weight=sw,
                                target_step=target_step, trainer_version=self.trainer_version))
        gr = _GroupRun(group_id, prompt, sw, target_step, self.epoch)
        self.runs[group_id] = gr
        gr.task = asyncio.get_running_loop().create_task(self._run_group(gr))
        gr.task.add_done_callback(self._on_pump_done)

    def _pick_worker(self) -> Any:
        w = self.workers[self._next_worker % len(self.workers)]
        self._next_worker += 1
        return w

    def _requests(self, gr: _GroupRun, siblings: list[int]) -> list[GenerationRequest]:
        g = self.generation
        reqs = []
        for s in siblings:
            attempt = self.ledger.dispatch(gr.group_id, s)
            gr.attempts[s] = attempt
            params = SamplingParams(
                max_new_tokens=g.max_new_tokens, min_new_tokens=g.min_new_tokens, temperature=g.temperature,
                top_p=g.top_p, top_k=g.top_k,
                seed=_seed_for(self.seed, gr.prompt.prompt_id, gr.epoch, s, attempt),
            )
            reqs.append(GenerationRequest(attempt, self.prompt_tokens[gr.prompt.prompt_id], params))
        return reqs

    async def _ensure_fresh(self, worker: Any) -> None:
        """A restarted worker comes back with its initial weights: push the latest ones first."""
        if self.latest_weights is None:
            return
        version = await worker.version.remote()
        if version != self.gen_version:
            await worker.update_weights.remote(self.latest_weights, self.gen_version)

    async def _run_group(self, gr: _GroupRun) -> None:
        import ray

        infra_failures = 0
        data_failures = 0
        try:
            while True:
                pending = self.ledger.pending_siblings(gr.group_id)
                if pending:
                    worker = self._pick_worker()
                    reqs = self._requests(gr, pending)
                    try:
                        await self._ensure_fresh(worker)
                        results = await worker.generate.remote(reqs)
                    except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                        infra_failures += 1
                        for s in pending:
                            self.ledger.fail(gr.group_id, s, gr.attempts[s])
                        for s in pending:
                            self._emit(FailEvent(group_id=gr.group_id, prompt_id=gr.prompt.prompt_id, sibling=s,
                                                 reason="infra", extra={"detail": type(err).__name__,
                                                                        "attempt": infra_failures}))
                        if infra_failures >= self.failure.max_infra_attempts:
                            self._drop_or_raise(gr, "infra_attempts_exhausted", err)
                            return
                        self.metrics["retried"] += 1
                        await asyncio.sleep(self._backoff(infra_failures))
                        continue
                    for s, res in zip(pending, results, strict=True):
                        if res.finish_reason == "abort":
                            raise asyncio.CancelledError
                        gr.results[s] = res
                        self.ledger.seal(gr.group_id, s, gr.attempts[s])
                try:
                    rewards = self._rewards(gr)
                except Exception as err:  # noqa: BLE001 - a reward function failed: a data failure
                    data_failures += 1
                    for s in range(self.G):
                        self._emit(FailEvent(group_id=gr.group_id, prompt_id=gr.prompt.prompt_id, sibling=s,
                                             reason="data", extra={"detail": repr(err)[:200],
                                                                   "attempt": data_failures}))
                    if data_failures >= self.failure.max_data_attempts:
                        self._drop_or_raise(gr, "data_attempts_exhausted", err)
                        return
                    for s in list(gr.results):
                        self.ledger.abandon(gr.group_id, s)
                    gr.results.clear()
                    continue
                await self._commit(gr, rewards)
                self.consecutive_drops = 0
                return
        except asyncio.CancelledError:
            if self._shutting_down:
                raise
            if gr.group_id in self.buffer and not self.buffer.get(gr.group_id).ready:
                self.buffer.fail(gr.group_id)
            if gr.group_id in self.ledger:
                self.ledger.drop(gr.group_id, "aborted_stale")
            self._emit(AbortEvent(group_id=gr.group_id, trainer_version=self.trainer_version,
                                  start_weight=gr.start_weight, reason="stale"))
            self.metrics["aborted"] += 1
        finally:
            self.runs.pop(gr.group_id, None)
            self._notify()

    def _backoff(self, k: int) -> float:
        return float(min(self.failure.backoff_base_s * 2 ** (k - 1), self.failure.max_backoff_s))

    def _drop_or_raise(self, gr: _GroupRun, reason: str, err: BaseException) -> None:
        self.consecutive_drops += 1
        budget_ok = (
            (reason.startswith("data") and self.skipped_prompts < self.failure.max_skipped_prompts)
            or (reason.startswith("infra") and self.consecutive_drops <= self.failure.max_consecutive_dropped_prompts)
        )
        self.buffer.fail(gr.group_id)
        self.ledger.drop(gr.group_id, reason)
        self._emit(DropEvent(reason=reason, group_id=gr.group_id, prompt_id=gr.prompt.prompt_id))
        self.metrics["dropped"] += 1
        if gr.target_step is not None:
            self.shortfall[gr.target_step] = self.shortfall.get(gr.target_step, 0) + 1
        if not budget_ok:
            raise RolloutFailure(
                f"prompt {gr.prompt.prompt_id} (group {gr.group_id}) failed: {reason} ({err!r}); the drop budget "
                "async_rl.rollout_failure.max_skipped_prompts / max_consecutive_dropped_prompts is spent"
            ) from err
        if reason.startswith("data"):
            self.skipped_prompts += 1
        floor = math.ceil(self.P * self.failure.min_step_batch_fraction)
        if gr.target_step is not None and self.P - self.shortfall[gr.target_step] < floor:
            raise RolloutFailure(
                f"step {gr.target_step} lost {self.shortfall[gr.target_step]} of {self.P} groups to drops, "
                f"below async_rl.rollout_failure.min_step_batch_fraction={self.failure.min_step_batch_fraction}"
            )

    def _rewards(self, gr: _GroupRun) -> list[float]:
        texts = [decode_completion(self.tokenizer, gr.results[s].token_ids) for s in range(self.G)]
        return [float(r) for r in self.task.rewards([gr.prompt] * self.G, texts)]

    async def _commit(self, gr: _GroupRun, rewards: list[float]) -> None:
        keys = [f"{gr.group_id}_g{s}" for s in range(self.G)]
        rows: dict[str, list[torch.Tensor]] = {f: [] for f in ROW_FIELDS}
        end_weight = gr.start_weight
        for s in range(self.G):
            res = gr.results[s]
            prompt = list(res.prompt_token_ids)
            rows["input_ids"].append(torch.tensor(prompt + list(res.token_ids), dtype=torch.int64))
            rows["prompt_len"].append(torch.tensor([len(prompt)], dtype=torch.int64))
            rows["generation_logprobs"].append(torch.tensor(res.logprobs, dtype=torch.float32))
            rows["token_versions"].append(torch.tensor(res.weight_versions, dtype=torch.int64))
            rows["reward"].append(torch.tensor([rewards[s]], dtype=torch.float32))
            end_weight = max(end_weight, res.end_version)
        await self.dp.aput(keys, rows)
        if gr.group_id not in self.buffer:  # cancelled while writing: leave nothing behind
            await self.dp.aclear(keys)
            return
        self.buffer.commit(gr.group_id, end_weight)
        self.ledger.finalize(gr.group_id)
        gen_s = time.perf_counter() - gr.started
        self.metrics["generation_s"] = gen_s
        self._emit(CommitEvent(
            group_id=gr.group_id, end_weight=end_weight, start_weight=gr.start_weight, prompt_id=gr.prompt.prompt_id,
            target_step=gr.target_step,
            extra={"reward_mean": sum(rewards) / len(rewards), "generation_s": round(gen_s, 4)},
        ))

    # ------------------------------------------------------------------ train pump side
    def _step_target(self) -> int:
        return self.P - self.shortfall.get(self.trainer_version, 0)

    async def next_chunk(self, timeout_s: float) -> dict[str, Any] | None:
        """The next training chunk of the open step (metadata only), or None when the run is done."""
        deadline = time.monotonic() + timeout_s
        T = self.trainer_version
        while True:
            if self.pump_error is not None:
                raise RuntimeError(f"the rollout pump failed: {self.pump_error!r}") from self.pump_error
            if self.train_steps >= self.max_steps and not self.step_claims:
                return None
            evicted = self.sampler.evict(self.buffer.live_slots(), T)
            if evicted:
                await self._evict(evicted)
            target = self._step_target()
            remaining = target - self.step_dispatched
            if remaining <= 0 and not self.step_claims:
                raise RuntimeError(f"step {T} lost all {self.P} of its prompt groups to drops: nothing to train")
            if remaining <= 0 and self.step_claims:
                # drops shrank the step below what is already claimed: close it with an empty chunk
                return {"group_ids": [], "keys": [], "start_weight": [], "end_weight": [], "trainer_version": T,
                        "step_groups": target, "last_chunk": True, "buffer_fill": self.buffer.num_buffered,
                        "inflight": self.buffer.num_inflight, "generation_s": 0.0}
            min_groups = min(self.run.min_groups, remaining)
            ids = self.sampler.select(self.buffer.live_slots(), T, min_groups, remaining)
            if ids:
                return self._claim_chunk(ids, target)
            if self.exhausted and not self.runs:
                if self.step_dispatched == 0:
                    return None
                raise RuntimeError(
                    f"rollout exhausted before a complete training step was assembled: step {T} has "
                    f"{self.step_dispatched} of {target} groups and nothing more can be generated"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no trainable chunk for step {T} within {timeout_s:.0f} s (buffer: "
                    f"{self.buffer.num_ready} ready, {self.buffer.num_inflight} in flight; sampler "
                    f"{type(self.sampler).__name__}). Raise data.init_args.step_timeout_s if generation is just slow."
                )
            await self._wait_changed(min(left, 0.5))

    async def _evict(self, group_ids: list[str]) -> None:
        slots = self.buffer.remove(group_ids)
        self.ledger.evict(group_ids)
        keys = [f"{g}_g{s}" for g in group_ids for s in range(self.G)]
        await self.dp.aclear(keys)
        for slot in slots:
            self._emit(EvictEvent(group_id=slot.group_id, trainer_version=self.trainer_version,
                                  start_weight=slot.start_weight, target_step=slot.target_step, reason="out_of_window"))
        self.metrics["evicted"] += len(slots)
        self._notify()

    def _claim_chunk(self, ids: list[str], target: int) -> dict[str, Any]:
        slots = self.buffer.claim_for_training(ids)
        self.ledger.claim(ids)
        self.step_claims.extend(ids)
        self.step_dispatched += len(ids)
        self._emit(SelectEvent(trainer_version=self.trainer_version, group_ids=tuple(ids)))
        return {
            "group_ids": list(ids),
            "keys": [f"{g}_g{s}" for g in ids for s in range(self.G)],
            "start_weight": [s.start_weight for s in slots for _ in range(self.G)],
            "end_weight": [s.end_weight for s in slots for _ in range(self.G)],
            "trainer_version": self.trainer_version,
            "step_groups": target,
            "last_chunk": self.step_dispatched >= target,
            "buffer_fill": self.buffer.num_buffered,
            "inflight": self.buffer.num_inflight,
            "generation_s": self.metrics.get("generation_s", 0.0),
        }

    async def _refit_workers(self, weights: list[Any]) -> None:
        """Push ``weights`` to every live worker; a dead or restarting one is refreshed before its next request."""
        import ray

        results = await asyncio.gather(
            *(w.update_weights.remote(weights, self.trainer_version) for w in self.workers), return_exceptions=True
        )
        for worker_index, res in enumerate(results):
            if isinstance(res, (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError)):
                self.metrics["refit_skipped"] = self.metrics.get("refit_skipped", 0) + 1
                log.warning("screl: worker %d missed the refit to version %d (%s); it is refreshed before its "
                            "next request", worker_index, self.trainer_version, type(res).__name__)
            elif isinstance(res, BaseException):
                raise res

    async def complete_step(self, weights: list[Any] | None) -> dict[str, Any]:
        """The open step's optimizer update is done: retire it, bump the version, refit the workers."""
        assert self._permitted is not None
        ids = list(self.step_claims)
        step = self.trainer_version
        self.buffer.release_training_claims(ids)
        self.ledger.apply(ids)
        self.ledger.retire(ids)
        await self.dp.aclear([f"{g}_g{s}" for g in ids for s in range(self.G)])
        self._emit(TrainStepEvent(step=step, group_ids=tuple(ids), trainer_version=step))
        self.step_claims = []
        self.step_dispatched = 0
        self.shortfall = {k: v for k, v in self.shortfall.items() if k > step}
        self.train_steps += 1
        # refit: close the gate, bump the version, abort what the sampler says can never train
        self._permitted.clear()
        self.trainer_version = step + 1
        aborted = 0
        for gr in list(self.runs.values()):
            if gr.task is not None and self.sampler.should_abort_inflight(gr.start_weight, self.trainer_version):
                gr.task.cancel()
                for w in self.workers:
                    w.abort.remote(list(gr.attempts.values()))
                aborted += 1
        t0 = time.perf_counter()
        if weights is not None:
            self.latest_weights = weights
            await self._refit_workers(weights)
        self.gen_version = self.trainer_version
        self._emit(RefitEvent(trainer_version=self.trainer_version,
                              extra={"aborted": aborted, "refit_s": round(time.perf_counter() - t0, 4)}))
        self._permitted.set()
        self._notify()
        return {"trainer_version": self.trainer_version, "aborted": aborted}
