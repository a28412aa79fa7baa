"""``RolloutCore``: the single controller's state machine, pure (no Ray, no asyncio, no clock).

It owns the prompt cursor, the :class:`~screl.data.buffer.ReplayBuffer`, the staleness sampler, the
:class:`~screl.data.ledger.RolloutLedger`, where every attempt runs and the run's counters. Each
transition is one method that mutates that state and returns :class:`~screl.data.core_types.Effects`
(events to log, data-plane keys to clear, attempts to abort on a given worker, attempts to dispatch)::

    pump()                 admit the next step's prompts, reserve groups while capacity allows -> dispatches
    report(SiblingReport)  a sibling sealed (its row is in the data plane), failed on data, or was aborted
    call_failed(attempts)  the worker running these attempts died: retry with backoff, or drop
    next_chunk()           evict, select and claim the open step's next chunk -> ChunkPlan
    complete_step()        retire the step, bump the trainer version, abort what can never train
    refit_done()           the workers serve the new version: reopen reservation
    capture() / restore()  ControllerState in and out of checkpoints
    shutdown()             every live group reaches an end state in the log

A row is keyed by its attempt id (``<group>_g<i>_a<n>``), so a late write of an abandoned attempt never
overwrites a live one: the core clears it when its report arrives. A row counts only once the core has
recorded the sibling sealed; one written but not recorded when a state is captured is regenerated with
the same seed after a restore (under a new attempt key, the orphan is cleared on restore).

Three collaborators hold parts of the transitions, each handed the core's fields it needs and calling nothing
back: :mod:`~screl.data.core_admission` (the dataloader cursor, the replacement spares, the sampler's gate),
:mod:`~screl.data.core_drops` (a dropped group's slot, once the core has ended its run) and
:mod:`~screl.data.core_state` (capture and restore).
"""

from __future__ import annotations

import collections
from typing import Any

import numpy as np

from screl.data import core_admission, core_drops, core_state
from screl.data.buffer import ReplayBuffer
from screl.data.core_types import (
    ChunkPlan,
    ControllerState,
    CoreSettings,
    Dispatch,
    Effects,
    GroupRun,
    SiblingReport,
    WorkersLostError,
    seed_for,
)
from screl.data.events import (
    AbortEvent,
    CommitEvent,
    DropEvent,
    EvictEvent,
    FailEvent,
    RefitEvent,
    ReserveEvent,
    SelectEvent,
    TrainStepEvent,
    WindowEvent,
)
from screl.data.ledger import RecoveryPolicy, RolloutLedger, SiblingState
from screl.data.prompt_table import PromptTable
from screl.data.reserve import ReplacementReserve
from screl.data.samplers import PromptGroupSampler


class RolloutCore:
    """The controller's logic; :class:`screl.controller.RolloutController` is its async shell."""

    def __init__(self, settings: CoreSettings, sampler: PromptGroupSampler, policy: RecoveryPolicy) -> None:
        self.settings = s = settings
        self.P, self.G = s.groups_per_step, s.generations_per_prompt
        self.sampler = sampler
        self.policy = policy
        self.buffer = ReplayBuffer(s.max_buffered_rollouts, s.max_inflight_prompts, id_prefix=s.id_prefix)
        self.ledger = RolloutLedger(policy)
        self.prompts = s.prompts if isinstance(s.prompts, PromptTable) else PromptTable(s.prompts)
        self._order: tuple[int, np.ndarray] | None = None  # (epoch, its order): shuffled once an epoch
        self.batches_per_epoch = len(self.prompts) // self.P
        if self.batches_per_epoch == 0:
            raise ValueError(f"the task has {len(self.prompts)} prompts, fewer than num_prompts_per_step={self.P}: "
                             "no full step can be formed")
        limit = s.max_num_epochs * self.batches_per_epoch
        self.max_steps = min(limit, s.max_num_steps) if s.max_num_steps else limit
        self.trainer_version = self.gen_version = self.train_steps = 0
        self.epoch = self.batch_index = 0
        # admitted, not yet reserved: (prompt, target step, epoch, replacements its slot has had)
        self.admitted: collections.deque[tuple[int, int | None, int, int]] = collections.deque()
        self.reserve = ReplacementReserve(s.reserve)
        self.skipped_prompts = self.consecutive_drops = self.mutation_version = 0
        self.shortfall: dict[int, int] = {}
        self.step_claims: list[str] = []
        self.step_dispatched = 0
        self.runs: dict[str, GroupRun] = {}
        self.group_keys: dict[str, list[str]] = {}  # committed group -> its row keys, by sibling
        self.attempts: dict[str, tuple[str, int, int]] = {}  # live attempt -> (group, sibling, worker)
        self.load = [0] * s.num_workers
        self.dead: set[int] = set()  # workers gone for good: nothing is dispatched to them
        self.refitting = False
        self.window: int | None = None  # the sampler's gate window, when it retunes (PPO critic warmup)
        self.admission_closed = False
        self.last_aborted = 0
        self.metrics: dict[str, float] = {"evicted": 0, "aborted": 0, "dropped": 0, "retried": 0, "filtered": 0,
                                          "replaced": 0}
        self._cursor = 0
        self._restored: list[GroupRun] = []

    # ------------------------------------------------------------------ views
    @property
    def finished(self) -> bool:
        """No prompt is left to admit and nothing is generating: rollout is exhausted."""
        return self.admission_closed and not self.admitted and not self.runs

    @property
    def outstanding(self) -> int:
        return self.buffer.num_live + len(self.admitted)

    def step_target(self) -> int:
        return self.P - self.shortfall.get(self.trainer_version, 0)

    def keys_of(self, group_ids: list[str]) -> list[str]:
        return [k for g in group_ids for k in self.group_keys[g]]

    # ------------------------------------------------------------------ rollout pump
    def pump(self, now: float = 0.0) -> Effects:
        """Admit and reserve as far as the sampler's gate, the buffer's bounds and the refit gate allow."""
        eff = Effects()
        self._retune(eff)
        while not self.refitting:
            if self.admitted:
                if not self.buffer.can_reserve():
                    break
                eff.extend(self._reserve_next(now))
            elif not core_admission.admit(self, eff):
                break
        return eff

    def _retune(self, eff: Effects) -> None:
        """Let the sampler retune its gate for the trainer's version; log a ``window`` event when it changes."""
        retune = getattr(self.sampler, "retune", None)
        window = retune(self.trainer_version, self.settings.policy_training_start_step) if retune else None
        if window is not None and window != self.window:
            self.window = window
            eff.events.append(WindowEvent(trainer_version=self.trainer_version, window=window))

    def epoch_order(self, epoch: int) -> list[int]:
        """The prompt ids of ``epoch`` in the order the dataloader serves them."""
        return self.epoch_slice(epoch, 0, len(self.prompts))

    def epoch_slice(self, epoch: int, start: int, stop: int) -> list[int]:
        """``epoch_order(epoch)[start:stop]``, the epoch's order shuffled once (not for every batch)."""
        if self._order is None or self._order[0] != epoch:
            self._order = (epoch, np.asarray(core_admission.epoch_order(self, epoch), dtype=np.int64))
        return list(self._order[1][start:stop].tolist())

    def _reserve_next(self, now: float) -> Effects:
        prompt_id, stamp, epoch, replacements = self.admitted.popleft()
        prompt, sw = self.prompts[prompt_id], self.gen_version
        gid = self.buffer.reserve(prompt_id, sw, stamp)
        self.ledger.reserve(gid, prompt_id, self.G, start_weight=sw, target_step=stamp,
                            task_source=prompt.task_source, agent=prompt.agent)
        run = self.runs[gid] = GroupRun(gid, prompt_id, sw, stamp, epoch, started=now, replacements=replacements)
        eff = Effects(events=[ReserveEvent(group_id=gid, prompt_id=prompt_id, start_weight=sw, target_step=stamp,
                                           trainer_version=self.trainer_version)])
        return eff.extend(self._dispatch(run))

    def _pick_worker(self) -> int:
        """The least loaded worker, ties broken round-robin (so one group's siblings share one decode)."""
        n = len(self.load)
        order = [w for w in ((self._cursor + i) % n for i in range(n)) if w not in self.dead] or list(range(n))
        worker = min(order, key=lambda w: self.load[w])
        self._cursor = (worker + 1) % n
        return worker

    def _dispatch(self, run: GroupRun, delay_s: float = 0.0) -> Effects:
        """One request per pending sibling, all on one worker. The seed depends on the prompt, epoch, sibling and
        data failures so far, not on the attempt: a sibling lost to a dead worker or a restart regenerates the
        same sample."""
        worker, eff = self._pick_worker(), Effects()
        for s in self.ledger.pending_siblings(run.group_id):
            attempt = self.ledger.dispatch(run.group_id, s)
            self.attempts[attempt] = (run.group_id, s, worker)
            self.load[worker] += 1
            seed = seed_for(self.settings.seed, run.prompt_id, run.epoch, s, run.resamples.get(s, 0))
            priority = run.target_step if run.target_step is not None else run.start_weight
            eff.dispatch.append(Dispatch(attempt, run.group_id, s, run.prompt_id, seed, priority, worker, delay_s))
        return eff

    def _untrack(self, attempt: str) -> tuple[str, int, int] | None:
        info = self.attempts.pop(attempt, None)
        if info is not None:
            self.load[info[2]] -= 1
        return info

    # ------------------------------------------------------------------ worker reports
    def report(self, rep: SiblingReport, now: float = 0.0) -> Effects:
        """One attempt's outcome. A report of an attempt that is no longer live (aborted, dropped, superseded) is
        ignored, and its row, if it wrote one, cleared. A ``timeout`` (past its deadline, aborted by the worker)
        counts as an infrastructure failure: retried within ``max_infra_attempts``."""
        if rep.status == "timeout":
            return self.call_failed([rep.attempt], rep.detail or "deadline passed", reason="timeout")
        info = self._untrack(rep.attempt)
        if info is None:
            return Effects(clear=[rep.attempt] if rep.status == "sealed" else [])
        gid, s, _ = info
        run = self.runs[gid]
        if rep.status == "sealed":
            self.ledger.seal(gid, s, rep.attempt)
            run.keys[s], run.rewards[s] = rep.attempt, rep.reward
            run.end_weight = max(run.end_weight, run.start_weight, rep.end_version)
            self.mutation_version += 1
            return self._commit(run, now) if len(run.keys) == self.G else Effects()
        if rep.status == "abort":  # stopped by the engine, not by us: regenerate it
            eff = self._settle(run, self.ledger.abandon(gid, s))
            return eff.extend(self._dispatch(run))
        run.data_failures += 1
        run.resamples[s] = run.resamples.get(s, 0) + 1
        eff = self._settle(run, self.ledger.fail(gid, s, rep.attempt))
        eff.events.insert(0, FailEvent(group_id=gid, prompt_id=run.prompt_id, sibling=s, reason="data",
                                       extra={"detail": rep.detail[:200], "attempt": run.data_failures}))
        if run.data_failures >= self.settings.failure.max_data_attempts:
            return eff.extend(self._drop(run, "data_attempts_exhausted", rep.detail))
        return eff.extend(self._dispatch(run))

    def call_failed(self, attempts: list[str], detail: str, reason: str = "infra") -> Effects:
        """The worker running ``attempts`` died (or was unreachable), or they passed their deadline (``reason``
        ``timeout``): one infra failure per group involved."""
        eff, by_group = Effects(), collections.defaultdict(list)
        for a in attempts:
            info = self._untrack(a)
            if info is not None:
                by_group[info[0]].append((info[1], a))
        for gid, sibs in by_group.items():
            run = self.runs[gid]
            run.infra_failures += 1
            for s, a in sibs:
                eff.events.append(FailEvent(group_id=gid, prompt_id=run.prompt_id, sibling=s, reason=reason,
                                            extra={"detail": detail[:200], "attempt": run.infra_failures}))
                if self.ledger.group(gid).siblings[s].state is SiblingState.DISPATCHED:  # not cascaded yet
                    eff.extend(self._settle(run, self.ledger.fail(gid, s, a)))
            if run.infra_failures >= self.settings.failure.max_infra_attempts:
                eff.extend(self._drop(run, "infra_attempts_exhausted", detail))
            else:
                self.metrics["retried"] += 1
                eff.extend(self._dispatch(run, self.settings.failure.backoff(run.infra_failures)))
        dead = set(attempts)
        eff.abort = {w: [a for a in ids if a not in dead] for w, ids in eff.abort.items()}
        eff.abort = {w: ids for w, ids in eff.abort.items() if ids}
        return eff

    def worker_lost(self, worker: int, detail: str, restartable: bool = True) -> Effects:
        """Worker ``worker`` is dead for good (found by a health check or a failed call): nothing more goes to it,
        its live attempts fail as infra failures and are retried on the others. With no worker left, the pump
        stops with :class:`WorkersLostError`. ``restartable``: more restarts would have brought it back (the
        message then names ``max_worker_restarts``); False when nothing could (its node is gone)."""
        if worker in self.dead:
            return Effects()
        self.dead.add(worker)
        eff = Effects()
        if len(self.dead) == len(self.load):
            why = (": Ray does not restart them past data.init_args.generation.max_worker_restarts" if restartable
                   else "; add capacity and resume the run from its last checkpoint")
            eff.error = WorkersLostError(
                f"every generation worker is dead for good (workers {sorted(self.dead)}; last: {detail}){why}")
            return eff
        mine = [a for a, (_, _, w) in self.attempts.items() if w == worker]
        return eff.extend(self.call_failed(mine, f"worker {worker} is dead: {detail}")) if mine else eff

    def _settle(self, run: GroupRun, cascaded: list[int]) -> Effects:
        """After a fail or abandon: abort the in-flight peers the ledger abandoned (``prompt_group``) and clear the
        rows of sealed siblings it discarded."""
        eff = Effects()
        for attempt, (gid, s, worker) in list(self.attempts.items()):
            if gid == run.group_id and s in cascaded:
                self._untrack(attempt)
                eff.abort_attempt(worker, attempt)
        record = self.ledger.group(run.group_id)
        for s in [s for s in run.keys if record.siblings[s].state is not SiblingState.SEALED]:
            eff.clear.append(run.keys.pop(s))
            run.rewards.pop(s, None)
        if eff.clear:
            self.mutation_version += 1
        return eff

    def _commit(self, run: GroupRun, now: float) -> Effects:
        rewards = [run.rewards[s] for s in range(self.G)]
        if self.settings.dynamic_sampling and max(rewards) == min(rewards):
            return core_drops.filter_group(self, run, rewards[0], self._end_run(run, "filtered"))
        end = max(run.end_weight, run.start_weight)
        self.buffer.commit(run.group_id, end)
        self.ledger.finalize(run.group_id)
        self.group_keys[run.group_id] = [run.keys[s] for s in range(self.G)]
        del self.runs[run.group_id]
        self.consecutive_drops = 0
        gen_s = max(0.0, now - run.started)
        self.metrics["generation_s"] = gen_s
        return Effects(events=[CommitEvent(
            group_id=run.group_id, end_weight=end, start_weight=run.start_weight, prompt_id=run.prompt_id,
            target_step=run.target_step,
            extra={"reward_mean": sum(rewards) / len(rewards), "generation_s": round(gen_s, 4)},
        )])

    def _end_run(self, run: GroupRun, reason: str) -> Effects:
        """Remove a generating group everywhere (buffer slot, ledger, live attempts, sealed rows)."""
        eff = Effects(clear=list(run.keys.values()))
        for attempt, (gid, _, worker) in list(self.attempts.items()):
            if gid == run.group_id:
                self._untrack(attempt)
                eff.abort_attempt(worker, attempt)
        self.buffer.fail(run.group_id)
        self.ledger.drop(run.group_id, reason)
        del self.runs[run.group_id]
        self.mutation_version += 1
        return eff

    def _drop(self, run: GroupRun, reason: str, detail: str) -> Effects:
        return core_drops.drop(self, run, reason, detail, self._end_run(run, reason))

    def _abort_run(self, run: GroupRun, reason: str) -> Effects:
        eff = self._end_run(run, "aborted_stale" if reason == "stale" else reason)
        eff.events.append(AbortEvent(group_id=run.group_id, trainer_version=self.trainer_version,
                                     start_weight=run.start_weight, reason=reason))
        self.metrics["aborted"] += 1
        return eff

    # ------------------------------------------------------------------ train pump side
    def next_chunk(self) -> tuple[Effects, ChunkPlan]:
        """Evict what the sampler says, then the open step's next chunk (``wait`` if none is trainable yet)."""
        T, eff = self.trainer_version, Effects()
        if self.train_steps >= self.max_steps and not self.step_claims:
            return eff, ChunkPlan("done")
        evicted = self.sampler.evict(self.buffer.live_slots(), T)
        if evicted:
            eff.extend(self._evict(evicted, "out_of_window"))
        target = self.step_target()
        remaining = target - self.step_dispatched
        if remaining <= 0 and not self.step_claims:
            raise RuntimeError(f"step {T} lost all {self.P} of its prompt groups to drops: nothing to train"
                               + core_drops.filter_hint(self))
        if remaining <= 0:  # drops shrank the step below what is already claimed: close it empty
            return eff, self._plan([], [], target)
        ids = self.sampler.select(self.buffer.live_slots(), T, min(self.settings.min_groups, remaining), remaining)
        if ids:
            slots = self.buffer.claim_for_training(ids)
            self.ledger.claim(ids)
            self.step_claims.extend(ids)
            self.step_dispatched += len(ids)
            eff.events.append(SelectEvent(trainer_version=T, group_ids=tuple(ids)))
            return eff, self._plan(ids, slots, target)
        if self.finished:
            if self.step_dispatched == 0:
                return eff, ChunkPlan("done")
            raise RuntimeError(
                f"rollout exhausted before a complete training step was assembled: step {T} has "
                f"{self.step_dispatched} of {target} groups and nothing more can be generated"
                + core_drops.filter_hint(self))
        return eff, ChunkPlan("wait")

    def _plan(self, ids: list[str], slots: list[Any], target: int) -> ChunkPlan:
        return ChunkPlan(
            "chunk", group_ids=tuple(ids), keys=tuple(self.keys_of(ids)),
            start_weight=tuple(s.start_weight for s in slots for _ in range(self.G)),
            end_weight=tuple(s.end_weight for s in slots for _ in range(self.G)),
            trainer_version=self.trainer_version, step_groups=target, last_chunk=self.step_dispatched >= target,
        )

    def _evict(self, group_ids: list[str], reason: str) -> Effects:
        slots = self.buffer.remove(group_ids)
        self.ledger.evict(group_ids)
        eff = Effects(clear=self.keys_of(group_ids))
        for g in group_ids:
            del self.group_keys[g]
        self.mutation_version += 1
        self.metrics["evicted"] += len(slots)
        eff.events += [EvictEvent(group_id=s.group_id, trainer_version=self.trainer_version,
                                  start_weight=s.start_weight, target_step=s.target_step, reason=reason)
                       for s in slots]
        return eff

    def complete_step(self) -> Effects:
        """The open step's optimizer update is done: retire it, bump the version, abort what can never train.
        Reservation stays closed until :meth:`refit_done`."""
        ids, step = list(self.step_claims), self.trainer_version
        self.buffer.release_training_claims(ids)
        self.ledger.apply(ids)
        self.ledger.retire(ids)
        eff = Effects(clear=self.keys_of(ids), events=[TrainStepEvent(step=step, group_ids=tuple(ids),
                                                                       trainer_version=step)])
        for g in ids:
            del self.group_keys[g]
        self.mutation_version += 1
        self.step_claims, self.step_dispatched = [], 0
        self.train_steps += 1
        self.shortfall = {k: v for k, v in self.shortfall.items() if k > step}
        self.refitting, self.trainer_version = True, step + 1
        stale = [r for r in self.runs.values() if self.sampler.should_abort_inflight(r.start_weight, step + 1)]
        for run in stale:
            eff.extend(self._abort_run(run, "stale"))
        self.last_aborted = len(stale)
        return eff

    def refit_done(self, refit_s: float = 0.0, refitted: bool = True) -> Effects:
        """The workers now serve ``trainer_version``: new reservations start from it. ``refitted=False``: the
        policy did not change this step (PPO critic warmup), the workers only relabel their version, and no
        ``refit`` event is logged."""
        self.gen_version, self.refitting = self.trainer_version, False
        if not refitted:
            return Effects()
        return Effects(events=[RefitEvent(trainer_version=self.trainer_version,
                                          extra={"aborted": self.last_aborted, "refit_s": round(refit_s, 4)})])

    def shutdown(self) -> Effects:
        """A clean end: every group still generating is aborted and every ready one evicted (reason
        ``shutdown``), so the event log accounts for every reserved group."""
        eff = Effects()
        for run in list(self.runs.values()):
            eff.extend(self._abort_run(run, "shutdown"))
        ready = [s.group_id for s in self.buffer.live_slots() if s.ready]
        if ready:
            eff.extend(self._evict(ready, "shutdown"))
        eff.events += [DropEvent(reason="shutdown", prompt_id=pid) for pid, *_ in self.admitted]
        eff.events += self.reserve.release()
        self.admitted.clear()
        self.admission_closed = True
        return eff

    # ------------------------------------------------------------------ checkpoints (in screl.data.core_state)
    def capture(self, open_step: str = "reject") -> tuple[ControllerState, Effects]:
        """The state a resume needs (``open_step="rollback"``: a mid-step snapshot, the open step's claims rolled
        back in the copy), and the ``checkpoint``/``snapshot`` event that anchors it in the log."""
        return core_state.capture(self, open_step)

    def restore(self, state: ControllerState, present_keys: set[str] | None) -> tuple[Effects, dict[str, Any]]:
        """Load ``state`` before the pump starts; ``present_keys``: the rows the restored data plane holds (None:
        no data plane was restored). Raises if a row the state counts on is missing; clears orphan rows."""
        eff, stats, self._restored = core_state.restore(self, state, present_keys)
        return eff, stats

    def resume(self, now: float = 0.0) -> Effects:
        """Dispatch the unfinished siblings of the groups a restore brought back (at start)."""
        eff = Effects()
        for run in self._restored:
            run.started = now
            eff.extend(self._dispatch(run))
        self._restored = []
        return eff
