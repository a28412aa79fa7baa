"""How a generation worker gathers a burst of rollout calls into one decode, flushes their rows, and refuses work
while stale (in-process, no Ray: the real torch engine on the tiny model, an in-memory data plane).

The windows here are long (60 s) on purpose: a call that waited one out would hang the test, so finishing at all
shows the worker did not wait; the batches the engine saw and the puts the plane got show what it gathered.
"""

from __future__ import annotations

import asyncio
from typing import Any

from screl.data.core_types import STALE, Burst, Dispatch
from screl.envs import CountLetter
from screl.models import TinyCausalLM
from screl.rollout.batching import Pending, RowSink, bursts_missing
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.worker import GenerationWorker

G = 2  # siblings per group


class CountingPlane:
    """An in-memory data plane that counts its puts."""

    def __init__(self) -> None:
        self.puts: list[list[str]] = []

    async def aput(self, keys: list[str], batch: Any) -> None:
        self.puts.append(list(keys))


def _worker(window_s: float, row_window_s: float = 60.0) -> tuple[GenerationWorker, list[int]]:
    w = GenerationWorker(TinyCausalLM(seed=0), task=CountLetter(), sampling=SamplingParams(max_new_tokens=3,
                         min_new_tokens=3), batch_window_s=window_s, row_window_s=row_window_s)
    w.set_data_plane(CountingPlane())
    batches: list[int] = []
    generate = w.engine.generate

    def counted(requests: Any) -> Any:
        batches.append(len(requests))
        return generate(requests)

    w.engine.generate = counted  # type: ignore[method-assign]
    return w, batches


def _group(name: str, prompt_id: int) -> list[Dispatch]:
    return [Dispatch(f"{name}_a{i}", name, i, prompt_id, 100 * prompt_id + i, 0, 0) for i in range(G)]


async def _calls(w: GenerationWorker, groups: list[list[Dispatch]], burst: Burst | None,
                 gap_s: float = 0.0) -> list[Any]:
    tasks = []
    for g in groups:
        tasks.append(asyncio.ensure_future(w.rollout(g, 0, burst)))
        await asyncio.sleep(gap_s)
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=30)


def test_a_burst_decodes_together_once_all_its_calls_arrived_and_its_rows_go_in_one_put() -> None:
    w, batches = _worker(window_s=60.0)
    groups = [_group(f"g{k}", k) for k in range(3)]
    reports = asyncio.run(_calls(w, groups, Burst(7, 3), gap_s=0.05))
    assert [[r.status for r in rep] for rep in reports] == [["sealed"] * G] * 3
    assert batches == [3 * G]  # one decode, started without waiting out the 60 s window
    plane = w.rows.dataplane
    assert len(plane.puts) == 1 and sorted(plane.puts[0]) == sorted(d.attempt for g in groups for d in g)


def test_a_call_sent_alone_as_a_burst_of_one_decodes_at_once() -> None:
    w, batches = _worker(window_s=60.0)
    [reports] = asyncio.run(_calls(w, [_group("g0", 0)], Burst(9, 1)))
    assert [r.status for r in reports] == ["sealed"] * G and batches == [G]


def test_a_burst_member_that_never_comes_holds_the_decode_only_until_four_windows() -> None:
    w, batches = _worker(window_s=0.05)
    reports = asyncio.run(_calls(w, [_group("g0", 0), _group("g1", 1)], Burst(1, 3)))  # the third never comes
    assert [len(rep) for rep in reports] == [G, G]
    assert batches == [2 * G]


def test_calls_outside_a_burst_keep_the_gathering_window() -> None:
    w, batches = _worker(window_s=0.5)
    asyncio.run(_calls(w, [_group("g0", 0), _group("g1", 1)], None, gap_s=0.05))
    assert batches == [2 * G]  # the second came within the window of the first


def test_a_stale_worker_answers_stale_before_doing_anything() -> None:
    w, batches = _worker(window_s=0.0)
    assert asyncio.run(w.rollout(_group("g0", 0), expect_version=1)) == STALE  # version 0 < the run's 1
    w.rows.dataplane = None
    assert asyncio.run(w.rollout(_group("g0", 0), expect_version=0)) == STALE  # no data plane (a fresh restart)
    assert batches == []
    w.set_data_plane(CountingPlane())
    w.engine.set_version(2)  # ahead: mid-refit, the new weights already loaded
    [a, b] = asyncio.run(w.rollout(_group("g0", 0), expect_version=1))
    assert a.status == b.status == "sealed" and batches == [G]


def test_the_row_sink_waits_for_a_busy_call_then_puts_both_rows_once() -> None:
    async def go() -> CountingPlane:
        busy = [1]
        sink = RowSink(window_s=60.0, busy=lambda: busy[0])
        sink.dataplane = plane = CountingPlane()
        first = asyncio.ensure_future(sink.put(["k1"], [_row()]))
        await asyncio.sleep(0.05)
        assert plane.puts == []  # a call that may still write is running: the sink waits for it
        busy[0] = 0
        await asyncio.wait_for(asyncio.gather(first, sink.put(["k2"], [_row()])), timeout=30)
        return plane

    assert asyncio.run(go()).puts == [["k1", "k2"]]


def test_bursts_missing_counts_each_bursts_absent_calls() -> None:
    loop = asyncio.new_event_loop()
    queue = [Pending([], loop.create_future(), loop, b) for b in [(1, 3), (1, 3), (2, 1), None]]
    loop.close()
    assert bursts_missing(queue, {1: 2, 2: 1}) == 1
    assert bursts_missing(queue, {1: 3, 2: 1}) == 0  # burst 1's third call came and was decoded already
    assert bursts_missing(queue[2:], {2: 1}) == 0


def _row() -> dict[str, Any]:
    from screl.rollout.engines.protocol import GenerationResult
    from screl.rollout.rows import ROW_SCHEMA

    res = GenerationResult("r", [2, 3], [4], [-0.5], "length", [0], 0, 0)
    return ROW_SCHEMA.build(res, 1.0, extra={"sample_mask": [1.0]})


def test_a_burst_larger_than_the_batch_decodes_batch_by_batch_without_waiting() -> None:
    w, batches = _worker(window_s=60.0)
    w.max_batch_size = G  # one group fills a batch: the other decodes next, its burst complete
    asyncio.run(_calls(w, [_group("g0", 0), _group("g1", 1)], Burst(3, 2), gap_s=0.05))
    assert batches == [G, G]


def test_a_continuous_engine_gets_each_group_as_it_comes_and_they_decode_in_one_run() -> None:
    """``decode: continuous`` declares continuous batching: the worker submits each group to the engine at once (no
    gathering window: 60 s here) and the groups join one run; each row's reward and tokens are the static path's."""
    from screl.rollout.engines.protocol import EngineOptions

    def worker(decode: str) -> GenerationWorker:
        w = GenerationWorker(TinyCausalLM(seed=0), options=EngineOptions(seed=0, args={
            "decode": decode, "max_rows": 4, "kv_cache_gb": 0.01}), task=CountLetter(),
            sampling=SamplingParams(max_new_tokens=8), batch_window_s=60.0, row_window_s=0.005)
        w.set_data_plane(CountingPlane())
        return w

    cont, static = worker("continuous"), worker("static")
    assert cont.continuous and not static.continuous
    groups = [_group(f"g{i}", i) for i in range(3)]
    ours = asyncio.run(_calls(cont, groups, None, gap_s=0.002))
    static.batch_window_s = 0.0
    ref = asyncio.run(_calls(static, groups, None))
    assert cont.engine.continuous.merged_calls >= 1  # a later group joined the run of an earlier one
    assert sum(len(keys) for keys in cont.rows.dataplane.puts) == 3 * G
    def seen(calls: list[Any]) -> list[tuple]:
        return [(r.attempt, r.status, r.reward, r.response_len, r.finish_reason) for call in calls for r in call]

    assert seen(ours) == seen(ref) and {r.status for call in ours for r in call} == {"sealed"}
