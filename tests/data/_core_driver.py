"""A deterministic driver around the real ``RolloutCore``: it plays the workers (every dispatched attempt is
outstanding until a test reports on it) and the data plane (a set of row keys), and applies every effect."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from screl.data import RecoveryPolicy, create_sampler
from screl.data.core import RolloutCore
from screl.data.core_types import (
    ControllerState,
    CorePrompt,
    CoreSettings,
    Dispatch,
    Effects,
    FailureBudget,
    RolloutFailure,
    SiblingReport,
)
from screl.data.events import Event
from screl.data.reserve import ReservePolicy

P, G = 3, 2


def make_core(block: dict[str, Any] | None = None, *, granularity: str = "sibling", workers: int = 2,
              prompts: int = 12, epochs: int = 4, failure: FailureBudget | None = None,
              cap: int | None = 2 * P + 2, inflight: int | None = P + 1, min_groups: int = 1,
              overrides: dict[str, dict[str, str]] | None = None,
              routing: dict[int, tuple[str | None, str | None]] | None = None, dynamic: bool = False,
              reserve: ReservePolicy | None = None, step_may_shrink: bool = True) -> RolloutCore:
    block = block or {"name": "in_order", "max_lookahead_versions": 1}
    routing = routing or {}
    settings = CoreSettings(
        prompts=tuple(CorePrompt(i, *routing.get(i, (None, None))) for i in range(prompts)), groups_per_step=P,
        generations_per_prompt=G, max_num_epochs=epochs, min_groups=min_groups, max_buffered_rollouts=cap,
        max_inflight_prompts=inflight, num_workers=workers, seed=7, failure=failure or FailureBudget(),
        dynamic_sampling=dynamic, reserve=reserve or ReservePolicy(), step_may_shrink=step_may_shrink,
    )
    policy = RecoveryPolicy(default_granularity=granularity, **(overrides or {}))  # type: ignore[arg-type]
    return RolloutCore(settings, create_sampler(block, groups_per_step=P), policy)


@dataclass
class Driver:
    core: RolloutCore
    block: dict[str, Any] = field(default_factory=lambda: {"name": "in_order", "max_lookahead_versions": 1})
    events: list[Event] = field(default_factory=list)
    rows: set[str] = field(default_factory=set)
    outstanding: list[Dispatch] = field(default_factory=list)
    aborted: list[tuple[int, str]] = field(default_factory=list)
    error: BaseException | None = None
    checkpoint: tuple[ControllerState, set[str]] | None = None
    reward_of: Callable[[Dispatch, int], float] | None = None
    """The reward a seal reports, from the attempt and the op's argument (None: always 1.0)."""

    def apply(self, eff: Effects) -> Effects:
        self.events += eff.events
        self.rows -= set(eff.clear)
        where = {d.attempt: d.worker for d in self.outstanding}
        for worker, ids in eff.abort.items():
            for a in ids:
                assert where.get(a) == worker, f"abort of {a} sent to worker {worker}, it runs on {where.get(a)}"
                self.aborted.append((worker, a))
        self.outstanding += eff.dispatch
        if eff.error is not None:
            self.error = eff.error
        return eff

    # ------------------------------------------------------------------ the workers' side
    def take(self, k: int) -> Dispatch | None:
        return self.outstanding.pop(k % len(self.outstanding)) if self.outstanding else None

    def seal(self, k: int = 0, reward: float | None = None) -> Effects | None:
        d = self.take(k)
        if d is None:
            return None
        if reward is None:
            reward = self.reward_of(d, k) if self.reward_of is not None else 1.0
        self.rows.add(d.attempt)  # the worker writes the row before it reports
        return self.apply(self.core.report(SiblingReport(d.attempt, "sealed", reward=reward,
                                                         end_version=self.core.gen_version)))

    def data_fail(self, k: int = 0) -> Effects | None:
        d = self.take(k)
        if d is None:
            return None
        return self.apply(self.core.report(SiblingReport(d.attempt, "data_error", detail="ValueError('bad')")))

    def infra_fail(self, k: int = 0) -> Effects | None:
        """The worker of one outstanding call dies: every attempt of that group on that worker fails."""
        d = self.take(k)
        if d is None:
            return None
        same = [o for o in self.outstanding if o.group_id == d.group_id and o.worker == d.worker]
        self.outstanding = [o for o in self.outstanding if o not in same]
        return self.apply(self.core.call_failed([d.attempt] + [o.attempt for o in same], "RayActorError"))

    def pump(self, _: int = 0) -> Effects:
        return self.apply(self.core.pump())

    def seal_all(self) -> None:
        while self.outstanding and self.error is None:
            self.seal(0)
            self.pump()

    # ------------------------------------------------------------------ the trainer's side
    def train(self, _: int = 0) -> bool:
        """One next_chunk; a step whose last chunk came is completed and refit. True if a step finished."""
        eff, plan = self.core.next_chunk()
        self.apply(eff)
        if plan.kind != "chunk":
            return False
        assert set(plan.keys) <= self.rows, f"chunk keys {set(plan.keys) - self.rows} have no row"
        assert len(plan.keys) == G * len(plan.group_ids)
        if plan.last_chunk:
            self.apply(self.core.complete_step())
            self.apply(self.core.refit_done())
            return True
        return False

    # ------------------------------------------------------------------ checkpoints
    def save(self, _: int = 0) -> None:
        if self.core.step_claims:
            return
        state, eff = self.core.capture()
        self.apply(eff)
        self.checkpoint = (copy.deepcopy(state), set(self.rows))

    def crash_and_resume(self, _: int = 0) -> None:
        """The process dies: in-flight attempts are gone; a fresh core restores the last checkpoint."""
        if self.checkpoint is None:
            return
        state, rows = self.checkpoint
        old = self.core
        core = RolloutCore(old.settings, create_sampler(self.block, groups_per_step=P), old.policy)
        self.core, self.rows, self.outstanding = core, set(rows), []
        eff, _summary = core.restore(copy.deepcopy(state), set(rows))
        self.apply(eff)
        self.apply(core.resume())

    def finish(self) -> None:
        """Deliver every outstanding report (stale ones clear their rows), close the open step, shut down."""
        while self.core.step_claims and self.error is None:
            if not self.train():
                self.apply(self.core.complete_step())
                self.apply(self.core.refit_done())
        self.apply(self.core.shutdown())
        while self.outstanding:
            self.seal(0)


__all__ = ["G", "P", "Driver", "RolloutFailure", "make_core"]
