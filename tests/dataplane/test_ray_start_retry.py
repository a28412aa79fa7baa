"""``start_local_ray`` starts the local cluster again when Ray's raylet misses its fixed 30 s registration (an
overloaded machine: seen on 2 cores under a loaded test run), a bounded number of times, and lets any other start-up
error through at once. Ray's start-up is replaced here by a stand-in that fails as Ray does: that failure cannot be
provoked on demand."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import ray

from screl.dataplane import cluster

TIMEOUT = ("The current node timed out during startup. This could happen because some of the raylet failed to "
           "startup or the GCS has become overloaded.")


class FlakyInit:
    """``ray.init`` that raises ``errors`` in turn, then succeeds; counts its calls and the shutdowns between."""

    def __init__(self, errors: list[Exception]) -> None:
        self.errors, self.calls, self.shutdowns = list(errors), 0, 0

    def init(self, **kwargs: Any) -> None:
        self.calls += 1
        assert kwargs["address"] == "local" and kwargs["include_dashboard"] is False
        if self.errors:
            raise self.errors.pop(0)

    def shutdown(self) -> None:
        self.shutdowns += 1


def _patch(monkeypatch: pytest.MonkeyPatch, flaky: FlakyInit) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", flaky.init)
    monkeypatch.setattr(ray, "shutdown", flaky.shutdown)


def test_a_raylet_registration_timeout_is_retried(monkeypatch: pytest.MonkeyPatch,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    flaky = FlakyInit([Exception(TIMEOUT), Exception(TIMEOUT)])
    _patch(monkeypatch, flaky)
    with caplog.at_level(logging.WARNING, logger="screl.dataplane.cluster"):
        assert cluster.start_local_ray(num_cpus=2) is True
    assert (flaky.calls, flaky.shutdowns) == (3, 2)
    assert [r.getMessage() for r in caplog.records] == [
        "screl: the local Ray cluster did not come up (The current node timed out during startup); starting it "
        f"again ({n} of 3): an overloaded machine" for n in (2, 3)]


def test_the_last_timeout_and_any_other_error_reach_the_caller(monkeypatch: pytest.MonkeyPatch) -> None:
    flaky = FlakyInit([Exception(TIMEOUT)] * cluster.START_ATTEMPTS)
    _patch(monkeypatch, flaky)
    with pytest.raises(Exception, match="timed out during startup"):
        cluster.start_local_ray(num_cpus=2)
    assert flaky.calls == cluster.START_ATTEMPTS
    other = FlakyInit([ValueError("num_cpus must be >= 0")])
    _patch(monkeypatch, other)
    with pytest.raises(ValueError, match="num_cpus must be >= 0"):
        cluster.start_local_ray(num_cpus=2)
    assert (other.calls, other.shutdowns) == (1, 0)
