"""Per-request deadlines of a generation worker (``generation_timeout_s``, ``rollout_timeout_s``).

Deadlines run on a :class:`PausableClock`: it stands still while the worker's engine is paused for a refit, so
a request frozen by a weight update does not lose that time. A :class:`CallDeadlines` belongs to one rollout
call (one group's siblings on this worker): it knows the generate requests open in that call, which of them
passed ``generation_timeout_s``, and whether the call as a whole passed ``rollout_timeout_s``.

Request ids name their sibling: a workflow's request id is the attempt id, or starts with ``attempt + ":"``
(a multi-turn workflow's ``attempt:turn``), so a timed-out request is pinned on the sibling it belongs to.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Deadlines:
    """The worker's deadlines, from ``data.init_args.generation`` (None: no deadline)."""

    generation_timeout_s: float | None = None
    rollout_timeout_s: float | None = None

    @property
    def any(self) -> bool:
        return self.generation_timeout_s is not None or self.rollout_timeout_s is not None

    @property
    def poll_s(self) -> float:
        """How often a call checks its deadlines: a tenth of the shortest, within [0.02 s, 0.5 s]."""
        shortest = min(t for t in (self.generation_timeout_s, self.rollout_timeout_s) if t is not None)
        return min(0.5, max(0.02, shortest / 10))


class PausableClock:
    """Monotonic seconds that stand still between :meth:`pause` and :meth:`resume` (nested pauses count once)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._paused_at: float | None = None
        self._depth = 0
        self._paused_total = 0.0

    def now(self) -> float:
        with self._lock:
            t = self._paused_at if self._paused_at is not None else self._clock()
            return t - self._paused_total

    def pause(self) -> None:
        with self._lock:
            if self._depth == 0:
                self._paused_at = self._clock()
            self._depth += 1

    def resume(self) -> None:
        with self._lock:
            if self._depth == 0:
                raise RuntimeError("PausableClock.resume() without a pause()")
            self._depth -= 1
            if self._depth == 0 and self._paused_at is not None:
                self._paused_total += self._clock() - self._paused_at
                self._paused_at = None


@dataclass
class CallDeadlines:
    """The deadlines of one rollout call (see the module docstring)."""

    limits: Deadlines
    clock: PausableClock
    started: float = 0.0
    open: dict[str, float] = field(default_factory=dict)
    """Request id -> when it started (clock time), for the requests generating now."""
    timed_out: set[str] = field(default_factory=set)
    """Request ids aborted for passing ``generation_timeout_s``."""
    expired_at: float | None = None
    """When the call passed ``rollout_timeout_s`` (None: not yet)."""

    def __post_init__(self) -> None:
        self.started = self.clock.now()

    def opened(self, request_ids: Iterable[str]) -> None:
        now = self.clock.now()
        self.open.update((rid, now) for rid in request_ids)

    def closed(self, request_ids: Iterable[str]) -> None:
        for rid in request_ids:
            self.open.pop(rid, None)

    def due(self) -> list[str]:
        """Open request ids to abort now (past their own deadline, or every one once the call expired); each is
        reported once."""
        now = self.clock.now()
        rollout_s, generation_s = self.limits.rollout_timeout_s, self.limits.generation_timeout_s
        if self.expired_at is None and rollout_s is not None and now - self.started > rollout_s:
            self.expired_at = now
        if self.expired_at is not None:
            due = [rid for rid in self.open if rid not in self.timed_out]
        elif generation_s is not None:
            due = [rid for rid, t in self.open.items() if now - t > generation_s and rid not in self.timed_out]
        else:
            due = []
        self.timed_out.update(due)
        return due

    def reason(self, attempt: str) -> str | None:
        """Why ``attempt`` timed out (the knob that fired), or None if it did not."""
        if self.expired_at is not None:
            return f"rollout_timeout_s={self.limits.rollout_timeout_s:g} passed"
        if any(rid == attempt or rid.startswith(attempt + ":") for rid in self.timed_out):
            return f"generation_timeout_s={self.limits.generation_timeout_s:g} passed"
        return None
