"""The ``RolloutController``: the single controller, a CPU Ray actor on asyncio.

It owns the prompt source (a stateful cursor), the ``ReplayBuffer``, the staleness sampler and the
``RolloutLedger`` (pure values from ``screl.data``), drives the generation workers, writes rollout
rows to the data plane and appends every decision to ``events.jsonl``. The trainer talks to it with
metadata only: ``next_chunk`` hands out the group ids and data-plane keys of the next training
chunk; ``complete_step`` retires a finished step, bumps the trainer version and refits the workers;
``capture`` / ``restore`` move its state in and out of checkpoints.

Rollout pump, per dataloader batch of ``num_prompts_per_step`` prompts::

    sampler.admit(T) -> queue the batch -> per prompt: capacity + in-flight permit
      -> wait for rollout permission -> buffer.reserve -> ledger.reserve -> GroupRunner.run

Data-plane barrier: row writes, commits, clears and evictions hold ``barrier`` briefly; ``capture``
holds it while TransferQueue saves, so the native snapshot and the replay index describe the same
groups. Generation itself never waits on it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import os
import random
import time
import uuid
from typing import Any, TextIO

from screl.config import GenerationConfig, RunConfig
from screl.controller.groups import (
    ROW_FIELDS,
    GroupRun,
    GroupRunner,
    RolloutFailure,
    RowWriter,
    row_key,
    seed_for,
)
from screl.data import ReplayBuffer, RolloutLedger, create_sampler
from screl.data.events import (
    AdmitEvent,
    CheckpointEvent,
    Event,
    EventLogWriter,
    EvictEvent,
    RefitEvent,
    ReserveEvent,
    RestoreEvent,
    SelectEvent,
    SnapshotEvent,
    TrainStepEvent,
)
from screl.data.ledger import GroupState, RecoveryPolicy
from screl.data.samplers import call_admit
from screl.envs import PromptRecord, Task
from screl.models import PolicySpec

log = logging.getLogger(__name__)

STATE_SCHEMA = 1

__all__ = ["ROW_FIELDS", "RolloutController", "RolloutFailure", "replay_digest"]


def replay_digest(groups: list[dict[str, Any]]) -> str:
    """SHA-256 over the canonical JSON of the replay index's groups."""
    return hashlib.sha256(json.dumps(groups, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
        config_dict: dict[str, Any] | None = None,
    ) -> None:
        self.run = run
        self.config_dict = config_dict or {}
        self.algo = run.algo
        self.task = task
        self.generation = generation
        self.workers = workers
        self.dp = dataplane
        self.seed = seed
        self.tokenizer = policy.build_tokenizer()
        self.prompts = task.prompts()
        self.prompt_by_id = {p.prompt_id: p for p in self.prompts}
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
        self.recovery_policy = RecoveryPolicy(
            default_granularity=rr.default_granularity,  # type: ignore[arg-type]
            task_source_granularity_overrides=dict(rr.task_source_granularity_overrides),  # type: ignore[arg-type]
            agent_granularity_overrides=dict(rr.agent_granularity_overrides),  # type: ignore[arg-type]
        )
        self.ledger = RolloutLedger(self.recovery_policy)
        self.failure = run.async_rl.rollout_failure
        self.batches_per_epoch = len(self.prompts) // self.P
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"the task has {len(self.prompts)} prompts, fewer than num_prompts_per_step={self.P}: "
                "no full step can be formed"
            )
        limit = self.algo.max_num_epochs * self.batches_per_epoch
        self.max_steps = min(limit, self.algo.max_num_steps) if self.algo.max_num_steps else limit
        # versions, cursor and counters (all in the checkpoint state)
        self.trainer_version = 0
        self.gen_version = 0
        self.train_steps = 0
        self.epoch = 0
        self.batch_index = 0
        self.admitted: collections.deque[tuple[int, int | None, int]] = collections.deque()  # prompt, stamp, epoch
        self.skipped_prompts = 0
        self.consecutive_drops = 0
        self.shortfall: dict[int, int] = {}
        self.mutation_version = 0
        # the open step and the groups in flight (not persisted: a checkpoint is taken between steps)
        self.step_claims: list[str] = []
        self.step_dispatched = 0
        self.runs: dict[str, GroupRun] = {}
        self.latest_weights: list[Any] | None = None
        self.exhausted = False
        self.pump_error: BaseException | None = None
        self.metrics: dict[str, float] = {"evicted": 0, "aborted": 0, "dropped": 0, "retried": 0}
        self.shutting_down = False
        self.runner = GroupRunner(self)
        self.row_writer = RowWriter(self)
        self._restored: list[GroupRun] = []
        self._next_worker = 0
        self._changed: asyncio.Event | None = None
        self._permitted: asyncio.Event | None = None
        self._barrier: asyncio.Lock | None = None
        self._pump: asyncio.Task[None] | None = None
        self.snapshots: Any = None
        self._snapshot_task: asyncio.Task[None] | None = None
        os.makedirs(run_dir, exist_ok=True)
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self._log_had_history = os.path.exists(self.events_path) and os.path.getsize(self.events_path) > 0
        self._restored_from: int | None = None
        self._events: TextIO | None = (
            open(self.events_path, "a", encoding="utf-8") if run.async_rl.event_log else None  # noqa: SIM115
        )
        self._writer = EventLogWriter(self._events, clock=time.time) if self._events is not None else None

    # ------------------------------------------------------------------ plumbing
    @property
    def barrier(self) -> asyncio.Lock:
        if self._barrier is None:
            self._barrier = asyncio.Lock()
        return self._barrier

    def emit(self, event: Event) -> None:
        if self._writer is not None:
            self._writer.write(event)

    def notify(self) -> None:
        if self._changed is not None:
            self._changed.set()

    async def _wait_changed(self, timeout: float) -> None:
        assert self._changed is not None
        self._changed.clear()
        try:
            await asyncio.wait_for(self._changed.wait(), timeout)
        except asyncio.TimeoutError:
            pass

    def pick_worker(self) -> Any:
        w = self.workers[self._next_worker % len(self.workers)]
        self._next_worker += 1
        return w

    async def ensure_fresh(self, worker: Any) -> None:
        """A restarted worker comes back with its initial weights: push the latest ones first."""
        if self.latest_weights is None:
            return
        version = await worker.version.remote()
        if version != self.gen_version:
            await worker.update_weights.remote(self.latest_weights, self.gen_version)

    # ------------------------------------------------------------------ lifecycle
    async def start(self, weights: list[Any] | None = None) -> dict[str, Any]:
        """Start the rollout pump (``weights``: the workers' current weights, re-pushed after a worker restart)."""
        self.latest_weights = weights
        if self._restored_from is None and self._log_had_history:
            # a fresh start after an earlier incarnation (killed before any checkpoint): nothing carries over
            self.emit(RestoreEvent(step=0, group_ids=(), extra={"fresh": True}))
        self._changed = asyncio.Event()
        self._permitted = asyncio.Event()
        self._permitted.set()
        for gr in self._restored:  # groups a restart found unfinished: keep sealed siblings, redo the rest
            self._launch(gr)
        self._restored = []
        self._pump = asyncio.get_running_loop().create_task(self._rollout_pump())
        self._pump.add_done_callback(self._on_task_done)
        rc, ck = self.run.rollout_checkpointing, self.run.checkpointing
        if rc.snapshot_attempt_interval_s is not None and ck.enabled and ck.checkpoint_dir:
            from screl.controller.snapshots import SnapshotPump

            self.snapshots = SnapshotPump(self, ck, rc, self.config_dict)
            self._snapshot_task = asyncio.get_running_loop().create_task(self.snapshots.run())
            self._snapshot_task.add_done_callback(self._on_task_done)
        return {"max_steps": self.max_steps, "events_path": self.events_path, "train_steps": self.train_steps}

    def _on_task_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled():
            return
        err = task.exception()
        if err is not None and self.pump_error is None:
            self.pump_error = err
        self.notify()

    async def shutdown(self) -> None:
        """Cancel the pump and every rollout in flight (they stay "in flight" in the log); close the log."""
        self.shutting_down = True
        tasks = [gr.task for gr in self.runs.values() if gr.task is not None]
        if self._pump is not None:
            tasks.append(self._pump)
        if self._snapshot_task is not None:
            tasks.append(self._snapshot_task)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self._events is not None:
            self._events.close()
            self._events = None
            self._writer = None

    async def stats(self) -> dict[str, Any]:
        acc = self.ledger.accounting()
        return {
            "trainer_version": self.trainer_version,
            "gen_version": self.gen_version,
            "train_steps": self.train_steps,
            "buffered": self.buffer.num_buffered,
            "ready": self.buffer.num_ready,
            "inflight": self.buffer.num_inflight,
            "ledger_balanced": acc.balanced,
            "exhausted": self.exhausted,
            "snapshots": dict(self.snapshots.outcomes) if self.snapshots is not None else {},
            "row_puts": self.row_writer.puts,
            **self.metrics,
        }

    # ------------------------------------------------------------------ rollout pump
    def _epoch_order(self, epoch: int) -> list[PromptRecord]:
        order = list(self.prompts)
        random.Random(seed_for(self.seed, "epoch", epoch)).shuffle(order)
        return order

    def _outstanding(self) -> int:
        return self.buffer.num_live + len(self.admitted)

    async def _rollout_pump(self) -> None:
        assert self._permitted is not None
        while True:
            while self.admitted:
                while not self.buffer.can_reserve():
                    await self._wait_changed(0.5)
                await self._permitted.wait()
                prompt_id, stamp, epoch = self.admitted.popleft()
                self._reserve_and_launch(self.prompt_by_id[prompt_id], stamp, epoch)
            if self.batch_index >= self.batches_per_epoch:
                self.epoch += 1
                self.batch_index = 0
            if self.epoch >= self.algo.max_num_epochs:
                break
            adm = call_admit(self.sampler, self.trainer_version, outstanding_groups=self._outstanding())
            if not adm.allowed:
                await self._wait_changed(0.5)
                continue
            order = self._epoch_order(self.epoch)
            batch = order[self.batch_index * self.P:(self.batch_index + 1) * self.P]
            self.batch_index += 1
            self.admitted.extend((p.prompt_id, adm.target_step, self.epoch) for p in batch)
            self.emit(AdmitEvent(
                trainer_version=self.trainer_version, step=self.sampler.dispatch_index, target_step=adm.target_step,
                extra={"epoch": self.epoch, "prompt_ids": [p.prompt_id for p in batch]},
            ))
        while self.runs:
            await self._wait_changed(0.5)
        self.exhausted = True
        self.notify()

    def _reserve_and_launch(self, prompt: PromptRecord, target_step: int | None, epoch: int) -> None:
        sw = self.gen_version
        group_id = self.buffer.reserve(prompt.prompt_id, sw, target_step)
        self.ledger.reserve(group_id, prompt.prompt_id, self.G, start_weight=sw, target_step=target_step)
        self.emit(ReserveEvent(group_id=group_id, prompt_id=prompt.prompt_id, start_weight=sw,
                               target_step=target_step, trainer_version=self.trainer_version))
        self._launch(GroupRun(group_id, prompt, sw, target_step, epoch))

    def _launch(self, gr: GroupRun) -> None:
        self.runs[gr.group_id] = gr
        gr.task = asyncio.get_running_loop().create_task(self.runner.run(gr))
        gr.task.add_done_callback(self._on_task_done)

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
            if remaining <= 0:  # drops shrank the step below what is already claimed: close it empty
                return self._chunk_meta([], [], target)
            ids = self.sampler.select(self.buffer.live_slots(), T, min(self.run.min_groups, remaining), remaining)
            if ids:
                slots = self.buffer.claim_for_training(ids)
                self.ledger.claim(ids)
                self.step_claims.extend(ids)
                self.step_dispatched += len(ids)
                self.emit(SelectEvent(trainer_version=T, group_ids=tuple(ids)))
                return self._chunk_meta(ids, slots, target)
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
                    f"no trainable chunk for step {T} within {timeout_s:.0f} s (buffer: {self.buffer.num_ready} "
                    f"ready, {self.buffer.num_inflight} in flight; sampler {type(self.sampler).__name__}). Raise "
                    "data.init_args.step_timeout_s if generation is just slow."
                )
            await self._wait_changed(min(left, 0.5))

    def _chunk_meta(self, ids: list[str], slots: list[Any], target: int) -> dict[str, Any]:
        return {
            "group_ids": list(ids),
            "keys": [row_key(g, s) for g in ids for s in range(self.G)],
            "start_weight": [s.start_weight for s in slots for _ in range(self.G)],
            "end_weight": [s.end_weight for s in slots for _ in range(self.G)],
            "trainer_version": self.trainer_version,
            "step_groups": target,
            "last_chunk": self.step_dispatched >= target,
            "buffer_fill": self.buffer.num_buffered,
            "inflight": self.buffer.num_inflight,
            "generation_s": self.metrics.get("generation_s", 0.0),
        }

    async def _evict(self, group_ids: list[str]) -> None:
        async with self.barrier:
            slots = self.buffer.remove(group_ids)
            self.ledger.evict(group_ids)
            await self.dp.aclear([row_key(g, s) for g in group_ids for s in range(self.G)])
            self.mutation_version += 1
        for slot in slots:
            self.emit(EvictEvent(group_id=slot.group_id, trainer_version=self.trainer_version,
                                 start_weight=slot.start_weight, target_step=slot.target_step, reason="out_of_window"))
        self.metrics["evicted"] += len(slots)
        self.notify()

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
        async with self.barrier:
            self.buffer.release_training_claims(ids)
            self.ledger.apply(ids)
            self.ledger.retire(ids)
            await self.dp.aclear([row_key(g, s) for g in ids for s in range(self.G)])
            self.mutation_version += 1
            self.step_claims = []
            self.step_dispatched = 0
            self.train_steps += 1  # with the clear, under the barrier: a snapshot never sees one without the other
        self.emit(TrainStepEvent(step=step, group_ids=tuple(ids), trainer_version=step))
        self.shortfall = {k: v for k, v in self.shortfall.items() if k > step}
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
        self.emit(RefitEvent(trainer_version=self.trainer_version,
                             extra={"aborted": aborted, "refit_s": round(time.perf_counter() - t0, 4)}))
        self._permitted.set()
        self.notify()
        return {"trainer_version": self.trainer_version, "aborted": aborted}

    async def snapshot_now(self) -> str:
        """One periodic-snapshot attempt now; ``completed`` or ``skipped:<reason>``."""
        if self.snapshots is None:
            raise RuntimeError("periodic rollout snapshots are off (rollout_checkpointing.snapshot_attempt_interval_s)")
        return await self.snapshots.attempt()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ checkpoints
    def _replay_index(self, with_claims: bool = False) -> list[dict[str, Any]]:
        """The completed groups a restore re-offers: the ready ones, and with ``with_claims`` (a snapshot taken
        mid-step, whose open step is rolled back) also the groups that step claimed, which are ready again
        after the restore and whose rows the data plane must hold."""
        claimed = self.buffer.claimed_slots() if with_claims else []
        return [
            {"group_id": s.group_id, "prompt_id": s.prompt_id, "start_weight": s.start_weight,
             "end_weight": s.end_weight, "target_step": s.target_step}
            for s in [*claimed, *self.buffer.live_slots()] if s.ready
        ]

    async def capture(self, data_plane_dir: str | None, open_step: str = "reject") -> dict[str, Any]:
        """Everything needed to resume, captured under the data-plane barrier at a step boundary.

        With ``data_plane_dir`` the native TransferQueue snapshot is written there (local path) while
        commits and clears wait; generation keeps running. Returns the replay index (with its digest),
        the ownership ledger, the sampler's dispatch position, the prompt cursor and the counters.
        """
        if self.step_claims and open_step != "rollback":
            raise RuntimeError("a trainer checkpoint is captured between steps: the open step still holds claims")
        async with self.barrier:
            if data_plane_dir is not None:
                loop = asyncio.get_running_loop()
                await loop.run_in_executor(None, self.dp.save, data_plane_dir)
            replay = self._replay_index(with_claims=open_step == "rollback")
            in_flight = {g: gr.info() for g, gr in self.runs.items()}
            state = {
                "schema_version": STATE_SCHEMA,
                "train_steps": self.train_steps,
                "trainer_version": self.trainer_version,
                "epoch": self.epoch,
                "batch_index": self.batch_index,
                "admitted": [list(a) for a in self.admitted],
                "sampler_name": type(self.sampler).__name__,
                "sampler": self.sampler.state_dict(),
                "dispatch_index": self.sampler.dispatch_index,
                "buffer": self.buffer.state_dict(),
                "replay_index": {"groups": replay, "digest": replay_digest(replay), "group_size": self.G},
                "ledger": self.ledger.to_dict(open_step="rollback" if open_step == "rollback" else "reject"),
                "rolled_back_groups": len(self.step_claims),
                "in_flight": in_flight,
                "shortfall": {str(k): v for k, v in self.shortfall.items()},
                "skipped_prompts": self.skipped_prompts,
                "mutation_version": self.mutation_version,
                "replacement_reserve": [],
                "mode": "authoritative" if getattr(self.sampler, "supports_buffer_checkpoint", False) is True
                else "shadow",
            }
            # logged when the state is captured (the checker's anchor), whether or not the publish succeeds
            kind = SnapshotEvent if open_step == "rollback" else CheckpointEvent
            self.emit(kind(step=self.train_steps, mutation_version=self.mutation_version,
                           extra={"groups": len(replay), "in_flight": len(in_flight),
                                  "rolled_back": len(self.step_claims)}))
        return state

    async def restore(self, state: dict[str, Any], data_plane_dir: str | None) -> dict[str, Any]:
        """Load a captured state before ``start``: re-offer completed groups, plan the unfinished ones."""
        if self._pump is not None:
            raise RuntimeError("restore() must run before start()")
        if state.get("schema_version") != STATE_SCHEMA:
            raise ValueError(f"controller state schema {state.get('schema_version')!r} is not {STATE_SCHEMA}")
        replay = state["replay_index"]
        if replay_digest(replay["groups"]) != replay["digest"]:
            raise ValueError("the replay index does not match its digest: the checkpoint is corrupt")
        if replay["group_size"] != self.G:
            raise ValueError(f"the checkpoint has groups of {replay['group_size']} rows, the config {self.G}: "
                             "num_generations_per_prompt cannot change on resume")
        if state.get("mode") == "shadow":
            log.warning("screl: the checkpoint's sampler does not support buffer checkpoints "
                        "(supports_buffer_checkpoint): completed buffered groups are not restored")
            state = {**state, "replay_index": {"groups": [], "digest": replay_digest([]), "group_size": self.G},
                     "in_flight": {}, "ledger": RolloutLedger(self.recovery_policy).to_dict(),
                     "buffer": ReplayBuffer().state_dict()}
            data_plane_dir = None
        if data_plane_dir is not None:
            loop = asyncio.get_running_loop()
            await loop.run_in_executor(None, self.dp.load, data_plane_dir)
        # the data plane must hold every row of every completed group and of every sealed sibling
        expected = {row_key(g["group_id"], s) for g in replay["groups"] for s in range(self.G)}
        expected |= {row_key(g, s) for g, info in state["in_flight"].items() for s in info["sealed"]}
        present = set(await self.dp.alist_keys()) if data_plane_dir is not None else set()
        missing = sorted(expected - present)
        if missing:
            raise ValueError(f"the TransferQueue snapshot lacks {len(missing)} rows the trainer checkpoint expects "
                             f"(e.g. {missing[:3]}): refusing to resume from an inconsistent bundle")
        self.buffer.load_state_dict(state["buffer"])
        self.buffer.rollback_training_claims()
        self.ledger = RolloutLedger.from_dict(state["ledger"], self.recovery_policy)
        plan = self.ledger.recover()  # abandons attempts that were in flight: {group: siblings to redo}
        if state["sampler_name"] == type(self.sampler).__name__:
            self.sampler.load_state_dict(state["sampler"])
        else:
            self.sampler.set_dispatch_index(state["train_steps"])
        self.train_steps = self.trainer_version = self.gen_version = int(state["train_steps"])
        self.epoch, self.batch_index = int(state["epoch"]), int(state["batch_index"])
        self.admitted = collections.deque((int(p), s, int(e)) for p, s, e in state["admitted"])
        self.shortfall = {int(k): v for k, v in state["shortfall"].items()}
        self.skipped_prompts = int(state["skipped_prompts"])
        self.mutation_version = int(state["mutation_version"])
        ready = [g["group_id"] for g in replay["groups"]]
        self._restored_from = self.train_steps
        self.emit(RestoreEvent(step=self.train_steps, group_ids=tuple(ready), mutation_version=self.mutation_version))
        for gid in self.ledger.group_ids(GroupState.GENERATING):
            rec = self.ledger.group(gid)
            info = state["in_flight"].get(gid, {"epoch": self.epoch, "end_weight": rec.start_weight,
                                                "resamples": {}, "sealed": []})
            gr = GroupRun(gid, self.prompt_by_id[rec.prompt_id], rec.start_weight, rec.target_step,
                          int(info["epoch"]), end_weight=int(info["end_weight"]),
                          sealed={s for s in info["sealed"] if s not in plan.get(gid, [])},
                          resamples={int(k): int(v) for k, v in info["resamples"].items()})
            self.buffer.reserve(rec.prompt_id, rec.start_weight, rec.target_step, group_id=gid)
            self.emit(ReserveEvent(group_id=gid, prompt_id=rec.prompt_id, start_weight=rec.start_weight,
                                   target_step=rec.target_step, trainer_version=self.trainer_version))
            self._restored.append(gr)
        return {"ready_groups": len(ready), "redispatched_groups": len(self._restored),
                "redispatched_siblings": sum(len(v) for v in plan.values())}
