"""One prompt group's rollout: generate its siblings, seal each as it lands, commit the group.

Each sibling is sealed on arrival: its reward is computed and its row written to the data plane under
its final key ``<group_id>_g<i>`` (the token-capture staging), so a restart keeps sealed siblings and
regenerates only unfinished ones (``rollout_recovery.default_granularity: sibling``). The group is
committed to the replay buffer once every sibling is sealed.

Failures: a worker that dies (infra) or a reward function that raises (data) fails only the
siblings involved; they are retried within ``async_rl.rollout_failure`` budgets with exponential
backoff; a group that exhausts them is dropped (if a drop budget allows) or fails the run.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from screl.data.events import AbortEvent, CommitEvent, DropEvent, FailEvent
from screl.envs import PromptRecord, decode_completion
from screl.rollout.engine import GenerationRequest, GenerationResult, SamplingParams

if TYPE_CHECKING:
    from screl.controller.controller import RolloutController

#: Fields of every rollout row in the data plane.
ROW_FIELDS = ("input_ids", "prompt_len", "generation_logprobs", "token_versions", "reward")


class RolloutFailure(RuntimeError):
    """A prompt group failed beyond its retry budget and the drop budget is spent."""


def seed_for(*parts: Any) -> int:
    """A 32-bit seed from any parts (stable across processes and runs)."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little")


def row_key(group_id: str, sibling: int) -> str:
    return f"{group_id}_g{sibling}"


@dataclass
class GroupRun:
    """Controller-side bookkeeping of one prompt group in flight."""

    group_id: str
    prompt: PromptRecord
    start_weight: int
    target_step: int | None
    epoch: int
    end_weight: int = 0
    sealed: set[int] = field(default_factory=set)
    resamples: dict[int, int] = field(default_factory=dict)  # sibling -> data failures (changes its seed)
    attempts: dict[int, str] = field(default_factory=dict)
    rewards: dict[int, float] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)
    task: asyncio.Task[None] | None = None

    def info(self) -> dict[str, Any]:
        """What a checkpoint keeps of a group in flight (the ledger keeps the rest)."""
        return {"epoch": self.epoch, "end_weight": self.end_weight, "resamples": dict(self.resamples),
                "sealed": sorted(self.sealed)}


class RowWriter:
    """Coalesces concurrent row writes into one data-plane put (a put costs ~10 ms whatever its size).

    Writers await their rows' durability; the first write of a burst waits ``window_s`` for company,
    then everything queued goes out in one put under the data-plane barrier.
    """

    def __init__(self, ctl: RolloutController, window_s: float = 0.005) -> None:
        self.ctl = ctl
        self.window_s = window_s
        self._queue: list[tuple[list[str], dict[str, list[torch.Tensor]], asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.puts = 0

    async def put(self, keys: list[str], rows: dict[str, list[torch.Tensor]]) -> None:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queue.append((keys, rows, done))
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        await asyncio.shield(done)

    async def _flush(self) -> None:
        await asyncio.sleep(self.window_s)
        while self._queue:
            batch, self._queue = self._queue, []
            # a group aborted or dropped while its rows waited here must not leave rows behind
            live = [(ks, rows, done) for ks, rows, done in batch if ks[0].rsplit("_g", 1)[0] in self.ctl.runs]
            for ks, _, done in batch:
                if ks[0].rsplit("_g", 1)[0] not in self.ctl.runs and not done.done():
                    done.cancel()
            batch = live
            if not batch:
                continue
            keys = [k for ks, _, _ in batch for k in ks]
            merged = {f: [t for _, rows, _ in batch for t in rows[f]] for f in ROW_FIELDS}
            try:
                async with self.ctl.barrier:
                    await self.ctl.dp.aput(keys, merged)
                    self.ctl.mutation_version += 1
                self.puts += 1
            except BaseException as err:  # noqa: BLE001 - every writer of the batch hears about it
                for _, _, done in batch:
                    if not done.done():
                        done.set_exception(err)
                if isinstance(err, asyncio.CancelledError):
                    raise
                continue
            for _, _, done in batch:
                if not done.done():
                    done.set_result(None)


class GroupRunner:
    """Runs one group for a controller (a separate object so the controller file stays about the pumps)."""

    def __init__(self, ctl: RolloutController) -> None:
        self.ctl = ctl

    def requests(self, gr: GroupRun, siblings: list[int]) -> list[GenerationRequest]:
        """One request per sibling. The seed depends on the prompt, epoch, sibling and data failures so far,
        not on the attempt: a sibling lost to a dead worker or a restart regenerates the same sample."""
        ctl, g = self.ctl, self.ctl.generation
        reqs = []
        for s in siblings:
            attempt = ctl.ledger.dispatch(gr.group_id, s)
            gr.attempts[s] = attempt
            params = SamplingParams(
                max_new_tokens=g.max_new_tokens, min_new_tokens=g.min_new_tokens, temperature=g.temperature,
                top_p=g.top_p, top_k=g.top_k,
                seed=seed_for(ctl.seed, gr.prompt.prompt_id, gr.epoch, s, gr.resamples.get(s, 0)),
            )
            priority = gr.target_step if gr.target_step is not None else gr.start_weight
            reqs.append(GenerationRequest(attempt, ctl.prompt_tokens[gr.prompt.prompt_id], params, priority))
        return reqs

    async def run(self, gr: GroupRun) -> None:
        import ray

        ctl = self.ctl
        infra_failures = 0
        data_failures = 0
        try:
            while True:
                pending = ctl.ledger.pending_siblings(gr.group_id)
                if not pending:
                    break
                worker = ctl.pick_worker()
                reqs = self.requests(gr, pending)
                try:
                    await ctl.ensure_fresh(worker)
                    results = await worker.generate.remote(reqs)
                except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
                    infra_failures += 1
                    for s in pending:
                        ctl.ledger.fail(gr.group_id, s, gr.attempts[s])
                        ctl.emit(FailEvent(group_id=gr.group_id, prompt_id=gr.prompt.prompt_id, sibling=s,
                                           reason="infra", extra={"detail": type(err).__name__,
                                                                  "attempt": infra_failures}))
                    if infra_failures >= ctl.failure.max_infra_attempts:
                        await self.drop_or_raise(gr, "infra_attempts_exhausted", err)
                        return
                    ctl.metrics["retried"] += 1
                    await asyncio.sleep(self.backoff(infra_failures))
                    continue
                finished: list[tuple[int, GenerationResult, float]] = []
                for s, res in zip(pending, results, strict=True):
                    if res.finish_reason == "abort":
                        raise asyncio.CancelledError
                    try:
                        reward = float(ctl.task.reward(gr.prompt, decode_completion(ctl.tokenizer, res.token_ids)))
                    except Exception as err:  # noqa: BLE001 - a reward function failed: a data failure
                        data_failures += 1
                        gr.resamples[s] = gr.resamples.get(s, 0) + 1
                        ctl.ledger.fail(gr.group_id, s, gr.attempts[s])
                        ctl.emit(FailEvent(group_id=gr.group_id, prompt_id=gr.prompt.prompt_id, sibling=s,
                                           reason="data", extra={"detail": repr(err)[:200],
                                                                 "attempt": data_failures}))
                        if data_failures >= ctl.failure.max_data_attempts:
                            await self.drop_or_raise(gr, "data_attempts_exhausted", err)
                            return
                        continue
                    finished.append((s, res, reward))
                if finished:
                    await self.seal(gr, finished)
            await self.commit(gr)
            ctl.consecutive_drops = 0
        except asyncio.CancelledError:
            if ctl.shutting_down:
                raise
            await self.forget(gr)
            ctl.emit(AbortEvent(group_id=gr.group_id, trainer_version=ctl.trainer_version,
                                start_weight=gr.start_weight, reason="stale"))
            ctl.metrics["aborted"] += 1
        finally:
            ctl.runs.pop(gr.group_id, None)
            ctl.notify()

    async def seal(self, gr: GroupRun, finished: list[tuple[int, GenerationResult, float]]) -> None:
        """Write finished siblings' rows (coalesced with other groups' writes) and mark them sealed.

        A capture between the write and the seal sees the row but not the seal: after a restart that
        sibling is regenerated with the same seed and its row rewritten, so nothing is lost or doubled.
        """
        ctl = self.ctl
        rows: dict[str, list[torch.Tensor]] = {f: [] for f in ROW_FIELDS}
        for _, res, reward in finished:
            rows["input_ids"].append(torch.tensor(list(res.prompt_token_ids) + list(res.token_ids), dtype=torch.int64))
            rows["prompt_len"].append(torch.tensor([len(res.prompt_token_ids)], dtype=torch.int64))
            rows["generation_logprobs"].append(torch.tensor(res.logprobs, dtype=torch.float32))
            rows["token_versions"].append(torch.tensor(res.weight_versions, dtype=torch.int64))
            rows["reward"].append(torch.tensor([reward], dtype=torch.float32))
        await ctl.row_writer.put([row_key(gr.group_id, s) for s, _, _ in finished], rows)
        for s, res, reward in finished:
            ctl.ledger.seal(gr.group_id, s, gr.attempts[s])
            gr.sealed.add(s)
            gr.rewards[s] = reward
            gr.end_weight = max(gr.end_weight, gr.start_weight, res.end_version)

    async def commit(self, gr: GroupRun) -> None:
        ctl = self.ctl
        async with ctl.barrier:
            ctl.buffer.commit(gr.group_id, max(gr.end_weight, gr.start_weight))
            ctl.ledger.finalize(gr.group_id)
            ctl.mutation_version += 1
        gen_s = time.perf_counter() - gr.started
        ctl.metrics["generation_s"] = gen_s
        rewards = [gr.rewards[s] for s in sorted(gr.rewards)]
        ctl.emit(CommitEvent(
            group_id=gr.group_id, end_weight=max(gr.end_weight, gr.start_weight), start_weight=gr.start_weight,
            prompt_id=gr.prompt.prompt_id, target_step=gr.target_step,
            extra={"reward_mean": sum(rewards) / max(1, len(rewards)), "generation_s": round(gen_s, 4)},
        ))

    async def forget(self, gr: GroupRun) -> None:
        """Remove an unfinished group everywhere: buffer slot, ledger record, its sealed rows."""
        ctl = self.ctl
        async with ctl.barrier:
            if gr.group_id in ctl.buffer and not ctl.buffer.get(gr.group_id).ready:
                ctl.buffer.fail(gr.group_id)
            if gr.group_id in ctl.ledger:
                ctl.ledger.drop(gr.group_id, "aborted_stale")
            await ctl.dp.aclear([row_key(gr.group_id, s) for s in range(ctl.G)])  # missing keys are ignored
            ctl.mutation_version += 1

    def backoff(self, k: int) -> float:
        f = self.ctl.failure
        return float(min(f.backoff_base_s * 2 ** (k - 1), f.max_backoff_s))

    async def drop_or_raise(self, gr: GroupRun, reason: str, err: BaseException) -> None:
        ctl, f = self.ctl, self.ctl.failure
        ctl.consecutive_drops += 1
        budget_ok = (
            (reason.startswith("data") and ctl.skipped_prompts < f.max_skipped_prompts)
            or (reason.startswith("infra") and ctl.consecutive_drops <= f.max_consecutive_dropped_prompts)
        )
        async with ctl.barrier:
            ctl.buffer.fail(gr.group_id)
            ctl.ledger.drop(gr.group_id, reason)
            await ctl.dp.aclear([row_key(gr.group_id, s) for s in range(ctl.G)])
            ctl.mutation_version += 1
        ctl.emit(DropEvent(reason=reason, group_id=gr.group_id, prompt_id=gr.prompt.prompt_id))
        ctl.metrics["dropped"] += 1
        if gr.target_step is not None:
            ctl.shortfall[gr.target_step] = ctl.shortfall.get(gr.target_step, 0) + 1
        if not budget_ok:
            raise RolloutFailure(
                f"prompt {gr.prompt.prompt_id} (group {gr.group_id}) failed: {reason} ({err!r}); the drop budget "
                "async_rl.rollout_failure.max_skipped_prompts / max_consecutive_dropped_prompts is spent"
            ) from err
        if reason.startswith("data"):
            ctl.skipped_prompts += 1
        floor = math.ceil(ctl.P * f.min_step_batch_fraction)
        if gr.target_step is not None and ctl.P - ctl.shortfall[gr.target_step] < floor:
            raise RolloutFailure(
                f"step {gr.target_step} lost {ctl.shortfall[gr.target_step]} of {ctl.P} groups to drops, below "
                f"async_rl.rollout_failure.min_step_batch_fraction={f.min_step_batch_fraction}"
            )
