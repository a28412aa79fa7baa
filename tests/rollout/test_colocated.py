"""Colocated generation's parts: the controller's mailbox, and the engine's turns with the trainer on a real torch
engine decoding with a shared module (the trainer's, in a run: ``tests/e2e/test_colocated.py``).

The turns: a stand-down frees the parked batches' KV caches and stops the deadline clock; the wake re-prefills.
A request in flight across a stand-down keeps its time (its deadline is shorter than the stand-down and does not
fire), the same deadline on an engine that really stalls fires, and a request whose KV cache was freed mid-decode
yields the tokens it would have yielded without the stand-down."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest
import torch

from screl.data.core_types import Dispatch
from screl.envs import CountLetter
from screl.models import TinyCausalLM
from screl.rollout.colocated import ColocatedSlot, EngineTurns, Mailbox, with_mailboxes
from screl.rollout.deadlines import Deadlines
from screl.rollout.engines.protocol import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.worker import GenerationWorker

SPEC = TinyCausalLM(seed=0)


# -- the mailbox ----------------------------------------------------------------------------------------------

def test_the_mailbox_queues_calls_and_resolves_them_by_the_hosts_replies() -> None:
    async def scenario() -> None:
        [box] = with_mailboxes([ColocatedSlot(0)])
        assert isinstance(box, Mailbox)
        assert await box.take(0.01) == []  # nothing queued: the long poll times out empty
        rollout = box.rollout.remote(["d0"], 3, None)
        status = box.status.remote()
        calls = await box.take(1.0)
        assert [(name, args) for _, name, args, _ in calls] == [("rollout", (["d0"], 3, None)), ("status", ())]
        (rid, *_), (sid, *_) = calls
        box.done(sid, False, RuntimeError("engine failed"))
        box.done(rid, True, ["report"])
        assert await rollout == ["report"]
        with pytest.raises(RuntimeError, match="engine failed"):
            await status
        waiting = box.ping.remote()
        box.close("the controller shut down")
        with pytest.raises(RuntimeError, match="the controller shut down"):
            await waiting
        with pytest.raises(RuntimeError, match="the controller shut down"):
            await box.ping.remote()  # later calls fail at once
        assert await box.take(0.01) == []

    asyncio.run(scenario())


def test_a_long_poll_wakes_when_a_call_arrives() -> None:
    async def scenario() -> float:
        box = Mailbox(0)
        t0 = time.perf_counter()
        taking = asyncio.ensure_future(box.take(30.0))
        await asyncio.sleep(0.05)
        box.abort.remote(["a"])
        [(_, name, args, _)] = await asyncio.wait_for(taking, 5.0)
        assert (name, args) == ("abort", (["a"],))
        return time.perf_counter() - t0

    assert asyncio.run(scenario()) < 5.0


# -- the engine's turns ---------------------------------------------------------------------------------------

class MemoryPlane:
    """Rows the worker wrote, by key (the data plane's ``aput``)."""

    def __init__(self) -> None:
        self.rows: dict[str, Any] = {}

    async def aput(self, keys: list[str], batch: Any) -> None:
        self.rows.update(dict.fromkeys(keys, batch))


def _shared_engine(**kwargs: Any) -> TorchGenerationEngine:
    """A torch engine decoding with a module it did not build (a trainer's, in train mode with gradients)."""
    model = SPEC.build_model().train()
    return TorchGenerationEngine(SPEC, num_threads=None, seed=0, model=model, **kwargs)


def _worker(deadlines: Deadlines, max_new_tokens: int) -> GenerationWorker:
    w = GenerationWorker(SPEC, engine=_shared_engine(), task=CountLetter(), batch_window_s=0.0,
                         sampling=SamplingParams(max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens),
                         deadlines=deadlines)
    w.set_data_plane(MemoryPlane())
    return w


def _rollout_across(w: GenerationWorker, hold: Any, hold_s: float) -> Any:
    """Roll one sibling out while ``hold`` (a stand-down or a stall) lasts ``hold_s`` from the moment its request
    is queued; returns its report."""
    async def scenario() -> Any:
        call = asyncio.ensure_future(w.rollout([Dispatch("att-0", "g0", 0, 0, 11, 0, 0)]))
        while not w.engine.loop.in_flight:  # the request reached the engine
            await asyncio.sleep(0.001)
        release = await asyncio.get_running_loop().run_in_executor(None, hold)
        await asyncio.sleep(hold_s)
        release()
        [report] = await call
        return report

    return asyncio.run(scenario())


DEADLINES = Deadlines(generation_timeout_s=2.0, rollout_timeout_s=3.0)
"""Far above the 16 tokens' decode time (milliseconds), below the 5 s a train step holds the engine here."""


def test_a_deadline_shorter_than_the_stand_down_does_not_fire() -> None:
    w = _worker(DEADLINES, max_new_tokens=16)
    turns = EngineTurns(w, timeout_s=30)

    def stand_down() -> Any:
        turns.stand_down()
        assert w.engine.stood_down and w.engine.paused
        return turns.wake

    report = _rollout_across(w, stand_down, hold_s=5.0)
    assert report.status == "sealed", report
    assert report.response_len == 16
    assert turns.stand_downs == 1 and turns.stood_down_s >= 5.0
    assert not w.engine.stood_down and not w.engine.paused
    assert list(w.rows.dataplane.rows) == ["att-0"]


def test_the_same_deadline_fires_on_an_engine_that_really_stalls() -> None:
    w = _worker(DEADLINES, max_new_tokens=16)

    def stall() -> Any:
        w.engine.pause("keep", timeout=30)  # the engine stops, the clock does not: a hung engine
        return w.engine.resume

    report = _rollout_across(w, stall, hold_s=5.0)
    assert report.status == "timeout"
    assert report.detail in ("generation_timeout_s=2 passed", "rollout_timeout_s=3 passed")
    assert w.rows.dataplane.rows == {}


@pytest.mark.parity
def test_a_freed_kv_cache_is_refilled_at_the_wake_and_the_tokens_are_the_same() -> None:
    """Stand down in the middle of a long decode (the weights unchanged, the version label moved): the parked batch
    loses its cache, re-prefills at the wake, and samples the same tokens as an undisturbed run; the tokens after
    the wake carry the new version."""
    n = 300
    requests = [GenerationRequest(f"r{i}", [3 + i, 4, 5], SamplingParams(max_new_tokens=n, min_new_tokens=n,
                                                                        seed=100 + i)) for i in range(3)]
    reference = _shared_engine().generate(requests)
    engine = _shared_engine()
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(results=engine.generate(requests)))
    thread.start()
    deadline = time.monotonic() + 30
    while not engine.loop.in_flight and time.monotonic() < deadline:
        time.sleep(0.001)
    time.sleep(0.02)
    engine.stand_down(timeout=30)
    engine.set_version(1)  # the trainer's refit, in place
    engine.wake()
    thread.join(60)
    results = out["results"]
    for got, ref in zip(results, reference, strict=True):
        assert got.token_ids == ref.token_ids
        torch.testing.assert_close(torch.tensor(got.logprobs), torch.tensor(ref.logprobs), rtol=0, atol=1e-4)
    versions = results[0].weight_versions
    assert 0 < versions.count(1) < n, "the stand-down did not land mid-decode"
    assert versions == sorted(versions) and results[0].end_version == 1


def test_a_shared_module_keeps_its_mode_and_gradients() -> None:
    engine = _shared_engine()
    model = engine.model
    assert model.training and all(p.requires_grad for p in model.parameters())
    engine.generate([GenerationRequest("r", [3, 4], SamplingParams(max_new_tokens=4, seed=1))])
    assert model.training and all(p.requires_grad for p in model.parameters())
    assert all(p.grad is None for p in model.parameters())
