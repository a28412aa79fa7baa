"""Per-request deadlines and the drain gate on a generation worker (in-process, no Ray).

The engine here is a fake at the true edge: it emits one token every ``token_s`` seconds, honours pause
(``keep`` parks between tokens, ``wait`` drains), abort (partial tokens) and a refit that takes ``refit_s``
with generation parked, so deadlines and refits can be timed against it.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import pytest
import torch

from screl.data.core_types import Dispatch
from screl.envs import CountLetter
from screl.models import TinyCausalLM
from screl.rollout.deadlines import CallDeadlines, Deadlines, PausableClock
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, PauseMode, SamplingParams
from screl.rollout.worker import GenerationWorker


class PacedEngine:
    """One token (id 5) every ``token_s``; a refit parks generation for ``refit_s``."""

    def __init__(self, token_s: float = 0.05, refit_s: float = 0.0) -> None:
        self.token_s, self.refit_s = token_s, refit_s
        self._version = 0
        self._cv = threading.Condition()
        self._aborted: set[str] = set()
        self._inflight: set[str] = set()
        self._mode: PauseMode | None = None
        self._active = 0

    @property
    def version(self) -> int:
        return self._version

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        return [self._one(r) for r in requests]

    def _one(self, req: GenerationRequest) -> GenerationResult:
        tokens: list[int] = []
        versions: list[int] = []
        with self._cv:
            self._cv.wait_for(lambda: self._mode is None)
            self._inflight.add(req.request_id)
            self._active += 1
        reason = "length"
        try:
            while len(tokens) < req.sampling.max_new_tokens:
                time.sleep(self.token_s)
                with self._cv:
                    if self._mode == "keep":
                        self._active -= 1
                        self._cv.notify_all()
                        self._cv.wait_for(lambda: self._mode != "keep")
                        self._active += 1
                    if req.request_id in self._aborted:
                        reason = "abort"
                        break
                    tokens.append(5)
                    versions.append(self._version)
        finally:
            with self._cv:
                self._active -= 1
                self._inflight.discard(req.request_id)
                self._aborted.discard(req.request_id)
                self._cv.notify_all()
        return GenerationResult(req.request_id, list(req.prompt_token_ids), tokens, [-1.0] * len(tokens),
                                reason, versions, versions[0] if versions else self._version, self._version)  # type: ignore[arg-type]

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._cv:
            self._aborted.update(set(request_ids) & self._inflight)

    def pause(self, mode: PauseMode = "keep") -> None:
        with self._cv:
            self._mode = mode
            self._cv.notify_all()
            self._cv.wait_for(lambda: self._active == 0)

    def resume(self) -> None:
        with self._cv:
            self._mode = None
            self._cv.notify_all()

    def update_weights(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        held = self._mode is not None
        if not held:
            self.pause("keep")
        time.sleep(self.refit_s)
        self._version = version
        if not held:
            self.resume()

    def set_version(self, version: int) -> None:
        self._version = version


class MemoryPlane:
    """Rows a worker wrote, by key (the data plane's ``aput``)."""

    def __init__(self) -> None:
        self.rows: dict[str, dict[str, torch.Tensor]] = {}

    async def aput(self, keys: list[str], batch: Any) -> None:
        for i, k in enumerate(keys):
            self.rows[k] = {name: batch[name][i] for name in batch.keys()}


def _worker(engine: PacedEngine, max_new_tokens: int, **kwargs: Any) -> GenerationWorker:
    w = GenerationWorker(TinyCausalLM(seed=0), task=CountLetter(),
                         sampling=_fixed(max_new_tokens),
                         batch_window_s=0.0, **kwargs)
    w.engine = engine  # type: ignore[assignment]
    w.set_data_plane(MemoryPlane())
    return w


def _fixed(n: int) -> SamplingParams:
    return SamplingParams(max_new_tokens=n, min_new_tokens=n)


def _dispatch(attempt: str) -> Dispatch:
    return Dispatch(attempt, "g0", 0, 0, 11, 0, 0)


# -- the clock and one call's deadlines -----------------------------------------------------------------------

def test_the_pausable_clock_stands_still_while_paused() -> None:
    now = [100.0]
    clock = PausableClock(lambda: now[0])
    assert clock.now() == 100.0
    now[0] = 103.0
    clock.pause()
    clock.pause()  # nested: one pause
    now[0] = 110.0
    assert clock.now() == 103.0
    clock.resume()
    assert clock.now() == 103.0  # still paused once
    clock.resume()
    now[0] = 111.0
    assert clock.now() == 104.0  # 7 s paused, excluded
    with pytest.raises(RuntimeError, match=r"resume\(\) without a pause\(\)"):
        clock.resume()


def test_call_deadlines_pin_a_generation_timeout_on_its_sibling_and_a_rollout_timeout_on_all() -> None:
    now = [0.0]
    clock = PausableClock(lambda: now[0])
    call = CallDeadlines(Deadlines(generation_timeout_s=2.0, rollout_timeout_s=5.0), clock)
    call.opened(["a0:t0", "a1"])
    now[0] = 1.0
    call.opened(["a2"])
    now[0] = 2.5
    assert call.due() == ["a0:t0", "a1"]  # a2 is 1.5 s old
    assert call.due() == []  # each is reported once
    assert call.reason("a0") == "generation_timeout_s=2 passed"
    assert call.reason("a1") == "generation_timeout_s=2 passed"
    assert call.reason("a2") is None and call.reason("a") is None  # "a" is no prefix of "a0:t0" plus ":"
    call.closed(["a0:t0", "a1"])
    clock.pause()
    now[0] = 50.0  # a refit: the rollout deadline does not move
    assert call.due() == []
    clock.resume()
    now[0] = 52.6  # 5.1 s of running time since the call started
    assert call.due() == ["a2"]
    assert call.reason("a2") == call.reason("a9") == "rollout_timeout_s=5 passed"


def test_the_poll_interval_follows_the_shortest_deadline() -> None:
    assert Deadlines(generation_timeout_s=1.0, rollout_timeout_s=30.0).poll_s == pytest.approx(0.1)
    assert Deadlines(rollout_timeout_s=0.05).poll_s == 0.02
    assert Deadlines(rollout_timeout_s=600).poll_s == 0.5
    assert not Deadlines().any


# -- a worker's deadlines ---------------------------------------------------------------------------------------

def test_a_hung_request_is_aborted_at_its_deadline_and_reported_as_timeout() -> None:
    w = _worker(PacedEngine(token_s=0.05), max_new_tokens=10_000, deadlines=Deadlines(generation_timeout_s=0.5))
    t0 = time.monotonic()
    [report] = asyncio.run(w.rollout([_dispatch("att-1")]))
    took = time.monotonic() - t0
    assert report.status == "timeout" and report.detail == "generation_timeout_s=0.5 passed"
    assert 0.5 <= took < 3.0, took
    assert w.rows.dataplane.rows == {}  # no row for a timed-out sibling


def test_a_reward_that_hangs_is_cut_off_by_the_rollout_deadline() -> None:
    class HangingReward(CountLetter):
        def rewards(self, prompts: Any, completions: Any) -> list[float]:
            time.sleep(6)
            return [0.0] * len(prompts)

    w = _worker(PacedEngine(token_s=0.01), max_new_tokens=3, deadlines=Deadlines(rollout_timeout_s=0.5))
    w.task = HangingReward()
    assert w.workflow is not None
    w.workflow.task = w.task  # type: ignore[attr-defined]
    loop = asyncio.new_event_loop()  # not asyncio.run: it would wait for the hung reward's thread at exit
    t0 = time.monotonic()
    [report] = loop.run_until_complete(w.rollout([_dispatch("att-2")]))
    took = time.monotonic() - t0
    loop.close()
    assert report.status == "timeout" and report.detail == "rollout_timeout_s=0.5 passed"
    assert took < 3.0, took  # one second of grace after the deadline, not the reward's 6 s


def test_time_paused_for_a_refit_does_not_count_toward_the_deadline() -> None:
    """8 tokens at 0.1 s (0.8 s of generation) with a 1.5 s refit in the middle: 2.3 s of wall time against a
    1.2 s deadline. The request finishes and seals; the same request without the refit pause excluded would not."""

    async def go(worker: GenerationWorker) -> Any:
        call = asyncio.ensure_future(worker.rollout([_dispatch("att-3")]))
        await asyncio.sleep(0.3)
        await worker.update_weights([{}], 1)
        return await call

    engine = PacedEngine(token_s=0.1, refit_s=1.5)
    w = _worker(engine, max_new_tokens=8, deadlines=Deadlines(generation_timeout_s=1.2))
    t0 = time.monotonic()
    [report] = asyncio.run(go(w))
    assert time.monotonic() - t0 > 2.0
    assert report.status == "sealed", report
    row = w.rows.dataplane.rows["att-3"]
    versions = row["token_versions"].tolist()
    assert versions[0] == 0 and versions[-1] == 1  # the refit landed mid-request


def test_the_drain_gate_lets_in_flight_requests_finish_under_the_old_weights() -> None:
    async def go(worker: GenerationWorker) -> tuple[list[Any], list[Any]]:
        first = asyncio.ensure_future(worker.generate([GenerationRequest("r1", [1, 2], _fixed(8))]))
        await asyncio.sleep(0.2)  # r1 is decoding
        refit = asyncio.ensure_future(worker.update_weights([{}], 1))
        await asyncio.sleep(0.1)  # the gate is draining r1; r2 arrives and waits for the new weights
        second = asyncio.ensure_future(worker.generate([GenerationRequest("r2", [1, 2], _fixed(4))]))
        await refit
        return await first, await second

    w = _worker(PacedEngine(token_s=0.1), max_new_tokens=8, in_flight_weight_updates=False)
    (r1,), (r2,) = asyncio.run(go(w))
    assert r1.weight_versions == [0] * 8 and r1.finish_reason == "length"
    assert r2.weight_versions == [1] * 4
    # without the gate, the same refit lands in the middle of r1
    w = _worker(PacedEngine(token_s=0.1), max_new_tokens=8)
    (r1,), _ = asyncio.run(go(w))
    assert r1.weight_versions[0] == 0 and r1.weight_versions[-1] == 1
