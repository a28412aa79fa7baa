"""The stall watchdog's bookkeeping, on a hand-driven clock."""

from __future__ import annotations

import pytest

from screl.data.watchdog import RolloutStalledError, StallWatchdog


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_a_stall_is_the_time_without_a_commit_while_the_trainer_waits() -> None:
    clock = Clock()
    dog = StallWatchdog(10.0, clock=clock)
    clock.t = 130.0  # 30 s since the last commit, but the trainer only started waiting at 125
    assert dog.stalled_for(waiting_since=125.0) is None
    clock.t = 136.0
    assert dog.stalled_for(waiting_since=125.0) == pytest.approx(11.0)
    dog.committed()  # a commit resets it
    clock.t = 140.0
    assert dog.stalled_for(waiting_since=125.0) is None
    assert StallWatchdog(None, clock=clock).stalled_for(0.0) is None  # off


def test_the_error_names_the_old_calls_the_dead_workers_and_the_knob() -> None:
    clock = Clock()
    dog = StallWatchdog(10.0, clock=clock)
    old = dog.call_started(1)
    clock.t = 105.0
    dog.call_started(0)  # 5 s younger: under the timeout when checked
    done = dog.call_started(2)
    dog.call_ended(done)
    clock.t = 112.0
    assert dog.old_calls() == [(1, pytest.approx(12.0))]
    err = dog.error(12.0, step=7, counts={"ready": 2, "inflight": 5}, dead=[3])
    assert isinstance(err, RolloutStalledError) and isinstance(err, RuntimeError)
    msg = str(err)
    assert "no group committed for 12 s while the trainer waited for step 7" in msg
    assert "async_rl.watchdog.stall_timeout_s = 10" in msg
    assert "2 ready, 5 in flight" in msg
    assert "Rollout calls open longer than the timeout: worker 1 (12 s)." in msg
    assert "do not answer a ping: [3]" in msg
    dog.call_ended(old)
    assert "timeout: none" in str(dog.error(12.0, 7, {"ready": 0, "inflight": 0}, []))
