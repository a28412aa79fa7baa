"""The controller's calls on every live worker (a refit, or a relabel when the policy did not change) are
bounded: a worker that hangs fails the refit naming it and the knob, a dead or restarting one is skipped and
refreshed later, one dead for good is not called. The workers are stand-ins with Ray's calling shape
(``handle.method.remote(...)`` returns an awaitable) whose replies are real coroutines."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace
from typing import Any

import pytest
import ray

from screl.controller.controller import RolloutController


class _Method:
    def __init__(self, worker: _Worker, name: str) -> None:
        self.worker, self.name = worker, name

    def remote(self, *args: Any) -> Any:
        return self.worker.reply(self.name, args)


class _Worker:
    def __init__(self, behaviour: str) -> None:
        self.behaviour, self.calls = behaviour, []

    def __getattr__(self, name: str) -> _Method:
        return _Method(self, name)

    async def reply(self, name: str, args: tuple[Any, ...]) -> None:
        self.calls.append((name, args))
        if self.behaviour == "hangs":
            await asyncio.sleep(3600)
        if self.behaviour == "restarting":
            raise ray.exceptions.ActorUnavailableError("restarting", b"\0" * 16)


def _controller(*behaviours: str, dead: frozenset[int] = frozenset()) -> Any:
    workers = [_Worker(b) for b in behaviours]
    fake = SimpleNamespace(workers=workers, core=SimpleNamespace(dead=set(dead), metrics={}))
    fake._on_live_workers = RolloutController._on_live_workers.__get__(fake)
    return fake, workers


@pytest.mark.parametrize(("method", "call", "args"), [("_refit_workers", "update_weights", ([["w"]], 3)),
                                                       ("_relabel_workers", "set_version", (3,))])
def test_a_hung_worker_fails_the_call_naming_it_and_the_knob(method: str, call: str, args: tuple[Any, ...]) -> None:
    fake, workers = _controller("ok", "hangs")
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"generation worker\(s\) \[1\] did not .* version 3 within 0 s "
                                           r"\(data.init_args.step_timeout_s\)"):
        asyncio.run(getattr(RolloutController, method)(fake, *args, timeout_s=0.2))
    assert time.monotonic() - t0 < 2.0
    assert workers[0].calls == workers[1].calls == [(call, args)]


def test_a_restarting_worker_is_skipped_and_counted_and_a_dead_one_is_not_called() -> None:
    fake, workers = _controller("ok", "restarting", "ok", dead=frozenset({2}))
    asyncio.run(RolloutController._relabel_workers(fake, 5, timeout_s=5.0))
    assert workers[0].calls == [("set_version", (5,))]
    assert workers[1].calls == [("set_version", (5,))]
    assert workers[2].calls == []
    assert fake.core.metrics == {"refit_skipped": 1}
