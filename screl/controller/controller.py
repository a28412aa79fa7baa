"""The ``RolloutController``: the single controller, a CPU Ray actor on asyncio, a thin shell around
:class:`screl.data.core.RolloutCore`, which decides every transition; this actor runs each transition's effects
through its ports (the workers' rollout calls and aborts, data-plane clears, the event log, the clock). The trainer
talks to it with metadata only (``next_chunk``, ``complete_step``, ``capture`` / ``restore``); rows never pass
through it. Invariant (the data-plane barrier): ``capture`` holds it while TransferQueue saves and clears wait for
it, so every row the captured state counts is in the snapshot.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import logging
import os
import time
from collections.abc import Coroutine
from typing import IO, Any

from screl.config import GenerationConfig, RunConfig
from screl.controller.dispatch import groups_land_together, plan_calls
from screl.controller.refits import Refits
from screl.controller.settings import core_settings, recovery_policy
from screl.controller.validation import ValidationRunner
from screl.controller.watchdog import HEALTH_CHECK, dead_for_good, health_checks, unreachable_workers
from screl.data import create_sampler
from screl.data.core import RolloutCore
from screl.data.core_types import (
    STALE,
    Burst,
    ControllerState,
    Dispatch,
    Effects,
    RolloutFailure,
    SiblingReport,
)
from screl.data.events import CommitEvent, Event, EventLogWriter, RestoreEvent, open_event_log
from screl.data.watchdog import StallWatchdog
from screl.dataplane.snapshot import RemoteTree
from screl.envs import Task
from screl.rewards.stats import RewardStats, RowRewardParts
from screl.rollout.colocated import Mailbox, with_mailboxes
from screl.rollout.rows import ROW_FIELDS

log = logging.getLogger(__name__)

STATS_TIMEOUT_S = 10.0
"""How long :meth:`RolloutController.stats` waits for a worker's count (a hung worker's is left out)."""

PUMP = "the rollout pump failed"
SNAPSHOTS = "the periodic rollout snapshots stopped the run"
"""What leads the trainer's error when the rollout pump (or one of its calls), or the snapshot pump, stops the run
(the health check's is ``HEALTH_CHECK``)."""

__all__ = ["ROW_FIELDS", "RolloutController", "RolloutFailure", "core_settings"]


class RolloutController(Refits):
    """The single controller. Build it with :func:`screl.controller.spawn_controller`."""

    def __init__(
        self, run: RunConfig, task: Task, generation: GenerationConfig, workers: list[Any], run_dir: str,
        seed: int = 0, config_dict: dict[str, Any] | None = None,
        val_prompt_ids: list[int] | None = None, whole_call_batches: bool = False,
    ) -> None:
        import uuid

        self.run = run
        self.config_dict = config_dict or {}
        self.generation = generation
        self.workers = with_mailboxes(workers)  # a colocated engine's slot becomes its mailbox
        self.dp: Any = None  # set_data_plane, once TransferQueue is up
        self.server: Any = None  # watch_server: the policy server's actor, when the run exposes one
        settings = core_settings(run, task, len(workers), seed, id_prefix=f"{uuid.uuid4().hex[:8]}-")
        self.core = RolloutCore(settings, create_sampler(run.async_rl.sampler, groups_per_step=settings.groups_per_step),
                                recovery_policy(run))
        self.latest_weights: list[Any] | None = None
        self.external_refit = False
        self.reward_stats = RewardStats()  # each reward function's figures until the next step (refits)
        self.row_rewards = RowRewardParts()  # each row's values, until its chunk goes to the trainer
        self.pump_error: BaseException | None = None  # the first failure that stops the run (set by fail())
        self.pump_error_by = PUMP
        self.shutting_down = False
        self.snapshots: Any = None
        self._calls: set[asyncio.Task[None]] = set()
        self._burst_ids = itertools.count()
        # the engine's capability, resolved by the driver: the controller never imports an engine
        self._merge_groups = groups_land_together(generation, whole_call_batches)
        self._changed: asyncio.Event | None = None
        self._barrier: asyncio.Lock | None = None
        self._pump: asyncio.Task[None] | None = None
        self._snapshot_task: asyncio.Task[None] | None = None
        self._health: asyncio.Task[None] | None = None
        os.makedirs(run_dir, exist_ok=True)
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self._log_had_history = os.path.exists(self.events_path) and os.path.getsize(self.events_path) > 0
        self._restored_from: int | None = None
        self._events: IO[str] | None = None
        if run.async_rl.event_log:  # a torn last line (a killed writer) is cut first, and the cut is reported
            self._events, torn_note = open_event_log(self.events_path)
            if torn_note is not None:
                log.warning("screl: %s", torn_note)
        self._writer = EventLogWriter(self._events, clock=time.time) if self._events is not None else None
        self.validation: ValidationRunner | None = None
        if val_prompt_ids:
            self.validation = ValidationRunner(run.algo, val_prompt_ids, generation.max_new_tokens, seed, self.workers,
                                               self.ensure_fresh, self.emit)
        self._val_redo: list[int] = []
        self.watchdog = StallWatchdog(run.async_rl.watchdog.stall_timeout_s)

    # ------------------------------------------------------------------ views the snapshot pump reads
    @property
    def train_steps(self) -> int:
        return self.core.train_steps

    @property
    def mutation_version(self) -> int:
        return self.core.mutation_version

    # ------------------------------------------------------------------ ports
    @property
    def barrier(self) -> asyncio.Lock:
        if self._barrier is None:
            self._barrier = asyncio.Lock()
        return self._barrier

    def emit(self, event: Event) -> None:
        if isinstance(event, CommitEvent):
            self.watchdog.committed()
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

    async def _execute(self, eff: Effects) -> None:
        """Run a transition's effects: log, clear (behind the barrier), abort where the attempts run, dispatch."""
        for event in eff.events:
            self.emit(event)
        if eff.error is not None:
            self.fail(eff.error, PUMP)
        for worker, attempts in eff.abort.items():
            self.workers[worker].abort.remote(attempts)
        # one call per group (its siblings share a decode, groups land independently), or per worker and step where
        # they land together anyway; each worker's calls of this transition form a burst
        for call in plan_calls(eff.dispatch, self._merge_groups, self.generation.max_batch_size, self._burst_ids):
            self._spawn(self._rollout_call(call.worker, call.dispatches, call.delay_s, call.burst))
        if eff.clear:  # off the caller's path (a refit does not wait for it); behind the barrier all the same
            self._spawn(self._clear(list(eff.clear)))
        if eff:
            self.notify()

    def _spawn(self, work: Coroutine[Any, Any, None]) -> None:
        """Run ``work`` as a task of this actor: cancelled at shutdown, its failure stops the pump."""
        task = asyncio.get_running_loop().create_task(work)
        self._calls.add(task)
        task.add_done_callback(self._on_call_done)

    async def _clear(self, keys: list[str]) -> None:
        async with self.barrier:
            await self.dp.aclear(keys)  # missing keys are ignored

    def _on_call_done(self, task: asyncio.Task[None]) -> None:
        self._calls.discard(task)
        self._on_task_done(task)

    async def ensure_fresh(self, worker: Any) -> None:
        """A restarted worker comes back with its initial weights, no data plane and no policy server: push them
        first."""
        version, attached = await worker.status.remote()
        if self.external_refit and version != self.core.gen_version:
            raise RuntimeError(
                f"a generation worker restarted (it serves version {version}, the run {self.core.gen_version}) and "
                "cannot rejoin the NCCL weight group of data.init_args.generation.backend_args.weight_transfer: "
                "nccl; resume the run from its checkpoint, or drop weight_transfer to refit through the object store"
            )
        if not attached:
            await worker.set_data_plane.remote(self.dp)
            if self.server is not None:  # the policy server too: the agents' workflow lost it with the process
                url = await self.server.url.remote()
                await worker.attach_server.remote(self.server, url, self.generation.http_server.api_key)
        if self.latest_weights is not None and version != self.core.gen_version:
            await worker.update_weights.remote(self.latest_weights, self.core.gen_version)

    async def _rollout_call(self, index: int, dispatches: list[Dispatch], delay_s: float,
                            burst: Burst | None = None) -> None:
        """One rollout call on one worker; its reports (or its failure) go back into the core. A worker that
        answers ``STALE`` (restarted by Ray: initial weights, no data plane) is refreshed and called again."""
        import ray

        if delay_s > 0:
            await asyncio.sleep(delay_s)
            dispatches = [d for d in dispatches if d.attempt in self.core.attempts]  # aborted while backing off
            if not dispatches:
                return
        worker = self.workers[index]
        try:
            token = self.watchdog.call_started(index)
            try:
                reports: list[SiblingReport] | str = await worker.rollout.remote(dispatches, self.core.gen_version,
                                                                                  burst)
                if reports == STALE:
                    await self.ensure_fresh(worker)
                    reports = await worker.rollout.remote(dispatches)
            finally:
                self.watchdog.call_ended(token)
        except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError) as err:
            if self.generation.max_worker_restarts >= 0 and isinstance(err, ray.exceptions.ActorDiedError):
                why = await dead_for_good(worker, 2.0)  # Ray may not bring it back: stop sending it work first
                if why is not None:
                    await self._execute(self.core.worker_lost(index, why))
            await self._execute(self.core.call_failed([d.attempt for d in dispatches], type(err).__name__))
            return
        assert not isinstance(reports, str), "a refreshed worker answered STALE"
        for rep in reports:
            self.reward_stats.add(rep.reward_parts)
            self.row_rewards.add(rep.attempt, rep.reward_parts)
            await self._execute(self.core.report(rep, time.perf_counter()))

    # ------------------------------------------------------------------ lifecycle
    def watch_server(self, server: Any) -> None:
        """The OpenAI-compatible policy server's actor: the health checks fail the run when it dies."""
        self.server = server

    def set_data_plane(self, dataplane: Any) -> None:
        """The data plane of the run (handed over once TransferQueue has started, which it does while this
        actor boots)."""
        self.dp = dataplane

    async def start(self, weights: list[Any] | None = None) -> dict[str, Any]:
        """Start the rollout pump (``weights``: the workers' current weights, re-pushed after a worker restart)."""
        self.latest_weights = weights
        if self._restored_from is None and self._log_had_history:
            # a fresh start after an earlier incarnation (killed before any checkpoint): nothing carries over
            self.emit(RestoreEvent(step=0, group_ids=(), extra={"fresh": True}))
        self._changed = asyncio.Event()
        await self._execute(self.core.resume(time.perf_counter()))
        self._pump = asyncio.get_running_loop().create_task(self._rollout_pump())
        self._pump.add_done_callback(self._on_task_done)
        if self.run.async_rl.watchdog.health_check_interval_s is not None:
            self._health = asyncio.get_running_loop().create_task(health_checks(self))
            self._health.add_done_callback(functools.partial(self._on_task_done, by=HEALTH_CHECK))
        self._start_validation()
        rc, ck = self.run.rollout_checkpointing, self.run.checkpointing
        if rc.snapshot_attempt_interval_s is not None and ck.enabled and ck.checkpoint_dir:
            from screl.controller.snapshots import SnapshotPump

            self.snapshots = SnapshotPump(self, ck, rc, self.config_dict)
            self._snapshot_task = asyncio.get_running_loop().create_task(self.snapshots.run())
            self._snapshot_task.add_done_callback(functools.partial(self._on_task_done, by=SNAPSHOTS))
        return {"max_steps": self.core.max_steps, "events_path": self.events_path,
                "train_steps": self.core.train_steps}

    def _start_validation(self) -> None:
        """At start: redo the validations a resumed checkpoint had pending (with the weights it restored), or
        validate the initial weights (``val_at_start``)."""
        runner, version = self.validation, self.core.trainer_version
        if runner is None:
            return
        for v in self._val_redo:
            if v == version:
                runner.start(v)
            else:
                log.warning("screl: the checkpoint had validation of version %d pending, but resumes version %d: "
                            "those weights are gone, the validation is not redone", v, version)
        if not self._val_redo and self._restored_from is None and runner.due(version):
            runner.start(version)

    def _on_task_done(self, task: asyncio.Task[None], by: str = PUMP) -> None:
        if task.cancelled():
            return
        err = task.exception()
        if err is not None:
            self.fail(err, by)
        self.notify()

    def fail(self, err: BaseException, by: str) -> None:
        """Stop the run with ``err`` (the first failure wins); ``by`` (``PUMP``, ``HEALTH_CHECK`` or ``SNAPSHOTS``)
        leads the trainer's error, so that it says which part of the rollout side stopped the run."""
        if self.pump_error is None:
            self.pump_error, self.pump_error_by = err, by

    async def _rollout_pump(self) -> None:
        # checks shutting_down as well as relying on cancel: before Python 3.12, asyncio.wait_for (in
        # _wait_changed) can swallow a cancellation that lands as the event is set, and the loop would go on
        while not self.core.finished and not self.shutting_down:
            await self._execute(self.core.pump(time.perf_counter()))
            if self.pump_error is not None:
                return
            await self._wait_changed(0.5)
        self.notify()

    async def shutdown(self) -> None:
        """A clean end: stop the pumps, abort what is generating and evict what is ready (reason ``shutdown``, so
        the log accounts for every group), close the log."""
        self.shutting_down = True
        if self.validation is not None:
            self.validation.cancel()
        tasks = [*self._calls, *(t for t in (self._pump, self._snapshot_task, self._health) if t is not None)]
        for t in tasks:
            t.cancel()
        self.notify()
        if tasks:
            _, stuck = await asyncio.wait(tasks, timeout=10.0)
            if stuck:  # the log is closed with every group accounted for all the same
                log.warning("screl: %d controller task(s) ignored cancellation at shutdown", len(stuck))
        eff = self.core.shutdown()
        for event in eff.events:
            self.emit(event)
        for worker, attempts in eff.abort.items():
            self.workers[worker].abort.remote(attempts)
        for box in self.workers:
            if isinstance(box, Mailbox):
                box.close("the controller shut down")
        if self._events is not None:
            self._events.close()
            self._events = None
            self._writer = None

    async def stats(self) -> dict[str, Any]:
        import ray

        core = self.core
        puts = await asyncio.gather(*(asyncio.wait_for(w.row_puts.remote(), STATS_TIMEOUT_S) for w in self.workers),
                                    return_exceptions=True)
        return {
            "trainer_version": core.trainer_version, "gen_version": core.gen_version,
            "train_steps": core.train_steps, "buffered": core.buffer.num_buffered, "ready": core.buffer.num_ready,
            "inflight": core.buffer.num_inflight, "ledger_balanced": core.ledger.accounting().balanced,
            "exhausted": core.finished,
            "snapshots": dict(self.snapshots.outcomes) if self.snapshots is not None else {},
            "row_puts": sum(p for p in puts if isinstance(p, int) and not isinstance(p, ray.exceptions.RayError)),
            **core.metrics,
        }

    # ------------------------------------------------------------------ train pump side
    async def next_chunk(self, timeout_s: float) -> dict[str, Any] | None:
        """The next training chunk of the open step (metadata only), or None when the run is done."""
        waiting_since = time.monotonic()
        deadline = waiting_since + timeout_s
        while True:
            if self.pump_error is not None:
                raise RuntimeError(f"{self.pump_error_by}: {self.pump_error!r}") from self.pump_error
            eff, plan = self.core.next_chunk()
            await self._execute(eff)
            if plan.kind == "done":
                return None
            if plan.kind == "chunk":
                b = self.core.buffer
                return {"group_ids": list(plan.group_ids), "keys": list(plan.keys),
                        "start_weight": list(plan.start_weight), "end_weight": list(plan.end_weight),
                        "trainer_version": plan.trainer_version, "step_groups": plan.step_groups,
                        "last_chunk": plan.last_chunk, "buffer_fill": b.num_buffered, "inflight": b.num_inflight,
                        "generation_s": self.core.metrics.get("generation_s", 0.0),
                        "filtered": self.core.metrics["filtered"], "replaced": self.core.metrics["replaced"],
                        "reward_parts": self.row_rewards.take(list(plan.keys))}
            idle = self.watchdog.stalled_for(waiting_since)
            if idle is not None:
                b = self.core.buffer
                raise self.watchdog.error(idle, self.core.trainer_version,
                                          {"ready": b.num_ready, "inflight": b.num_inflight},
                                          await unreachable_workers(self.workers))
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(
                    f"no trainable chunk for step {self.core.trainer_version} within {timeout_s:.0f} s (buffer: "
                    f"{self.core.buffer.num_ready} ready, {self.core.buffer.num_inflight} in flight; sampler "
                    f"{type(self.core.sampler).__name__}). Raise data.init_args.step_timeout_s if generation is "
                    "just slow."
                )
            await self._wait_changed(min(left, 0.5))

    # ------------------------------------------------------------------ a colocated engine's mailbox
    def _mailbox(self, index: int) -> Mailbox:
        box = self.workers[index]
        if not isinstance(box, Mailbox):
            raise TypeError(f"generation worker {index} is a Ray actor, not a colocated engine")
        return box

    async def colocated_take(self, index: int, timeout_s: float) -> list[Any]:
        """The calls queued for colocated engine ``index`` (its host polls this)."""
        return await self._mailbox(index).take(timeout_s)

    def colocated_done(self, index: int, call_id: int, ok: bool, value: Any) -> None:
        """A colocated engine's reply to one call."""
        self._mailbox(index).done(call_id, ok, value)

    async def snapshot_now(self) -> str:
        """One periodic-snapshot attempt now; ``completed`` or ``skipped:<reason>``."""
        if self.snapshots is None:
            raise RuntimeError("periodic rollout snapshots are off (rollout_checkpointing.snapshot_attempt_interval_s)")
        return await self.snapshots.attempt()  # type: ignore[no-any-return]

    # ------------------------------------------------------------------ checkpoints
    async def capture(self, data_plane_dir: str | None, open_step: str = "reject",
                      remote: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything needed to resume (the core's :class:`ControllerState` as a dict), captured as the data-plane
        barrier is taken; with ``data_plane_dir`` the native TransferQueue snapshot is written there (local path)
        while clears wait, and the shares of TQ actors on other nodes to ``remote`` (``url``: the staged
        ``data_plane/``, and its ``storage_options``), from those nodes. Generation and row writes keep running."""
        async with self.barrier:
            state, eff = self.core.capture(open_step)
            if self.validation is not None:
                state.validation = {"pending": self.validation.pending()}
            for event in eff.events:  # logged at capture (the checker's anchor), whether or not the publish succeeds
                self.emit(event)
            if data_plane_dir is not None:
                tree = RemoteTree(**remote) if remote is not None else None
                await asyncio.get_running_loop().run_in_executor(
                    None, lambda: self.dp.save(data_plane_dir, remote=tree)
                )
        return state.to_dict()

    async def restore(self, state: dict[str, Any], data_plane_dir: str | None,
                      data_plane_remote: dict[str, Any] | None = None) -> dict[str, Any]:
        """Load a captured state before ``start``: re-offer completed groups, plan the unfinished ones
        (``data_plane_remote``: the published snapshot, for TQ actors on other nodes to fetch)."""
        if self._pump is not None:
            raise RuntimeError("restore() must run before start()")
        loaded = ControllerState.from_dict(state)
        self._val_redo = [int(v) for v in loaded.validation.get("pending", [])]
        present: set[str] | None = None
        if data_plane_dir is not None and loaded.mode != "shadow":
            tree = RemoteTree(**data_plane_remote) if data_plane_remote is not None else None
            await asyncio.get_running_loop().run_in_executor(
                None, lambda: self.dp.load(data_plane_dir, remote=tree)
            )
            present = set(await self.dp.alist_keys())
        eff, summary = self.core.restore(loaded, present)
        for warning in summary.pop("warnings"):
            log.warning("screl: %s", warning)
        self._restored_from = self.core.train_steps
        for event in eff.events:
            self.emit(event)
        if eff.clear:
            await self.dp.aclear(eff.clear)
        return summary
