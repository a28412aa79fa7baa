"""``StallWatchdog``: the controller's check that the rollout side still makes progress while the trainer waits
(pure bookkeeping; the controller pings the workers itself).

With ``async_rl.watchdog.stall_timeout_s`` set, a trainer that waits for a chunk while no group has been
committed for that long gets an error that says what is stuck: the rollout calls older than the timeout (on
which workers), the workers that do not answer a ping, and the buffer's counts. Without it the trainer waits up
to ``data.init_args.step_timeout_s`` per chunk.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


class RolloutStalledError(RuntimeError):
    """No rollout group was committed for ``async_rl.watchdog.stall_timeout_s`` while the trainer waited."""


@dataclass
class WatchdogConfig:
    """The stall watchdog (``async_rl.watchdog``)."""

    stall_timeout_s: float | None = None
    """Fail the run when no rollout group is committed for this long while the trainer waits for a chunk,
    naming the stuck calls and the dead workers (None: off; the trainer waits ``step_timeout_s`` per chunk)."""
    health_check_interval_s: float | None = 5.0
    """Ping every generation worker this often, between requests: one dead for good (Ray will not restart it,
    ``generation.max_worker_restarts``) gets no more work, its rollouts are retried on the others, and with none
    left the run fails naming them (None: off; a dead worker is found when a call to it fails)."""


class StallWatchdog:
    """Tracks commits and the open rollout calls; :meth:`check` raises once the stall outlasts the timeout."""

    def __init__(self, stall_timeout_s: float | None, clock: Any = time.monotonic) -> None:
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self.last_commit = clock()
        self._calls: dict[int, tuple[int, float]] = {}  # call id -> (worker index, start)
        self._ids = itertools.count()

    def committed(self) -> None:
        self.last_commit = self.clock()

    def call_started(self, worker_index: int) -> int:
        token = next(self._ids)
        self._calls[token] = (worker_index, self.clock())
        return token

    def call_ended(self, token: int) -> None:
        self._calls.pop(token, None)

    def stalled_for(self, waiting_since: float) -> float | None:
        """Seconds without a commit while the trainer waited, once past the timeout (None: not stalled)."""
        if self.stall_timeout_s is None:
            return None
        idle = self.clock() - max(self.last_commit, waiting_since)
        return idle if idle > self.stall_timeout_s else None

    def old_calls(self) -> list[tuple[int, float]]:
        """(worker index, age) of the rollout calls open for longer than the timeout, oldest first."""
        now, limit = self.clock(), self.stall_timeout_s or 0.0
        return sorted(((w, now - t0) for w, t0 in self._calls.values() if now - t0 > limit), key=lambda x: -x[1])

    def error(self, idle: float, step: int, counts: dict[str, int], dead: Sequence[int]) -> RolloutStalledError:
        calls = ", ".join(f"worker {w} ({age:.0f} s)" for w, age in self.old_calls()) or "none"
        return RolloutStalledError(
            f"the rollout side is stalled: no group committed for {idle:.0f} s while the trainer waited for step "
            f"{step} (async_rl.watchdog.stall_timeout_s = {self.stall_timeout_s:g}). Buffer: {counts['ready']} "
            f"ready, {counts['inflight']} in flight. Rollout calls open longer than the timeout: {calls}. Workers "
            f"that do not answer a ping: {list(dead) or 'none'}. A hung engine or a lost generation fleet: see the "
            "workers' logs (screl fit --verbose), or raise the timeout if generation is just slow."
        )
