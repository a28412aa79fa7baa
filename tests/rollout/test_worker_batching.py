"""The generation worker's batch choice: the most urgent priority first, in arrival order, bounded rows."""

from __future__ import annotations

import asyncio

from screl.rollout.batching import Pending, take_batch
from screl.rollout.engines.protocol import GenerationRequest


def group(name: str, rows: int, priority: int) -> Pending:
    loop = asyncio.new_event_loop()
    reqs = [GenerationRequest(f"{name}-{i}", [2, 3], priority=priority) for i in range(rows)]
    item = Pending(reqs, loop.create_future(), loop)
    loop.close()
    return item


def names(items: list[Pending]) -> list[str]:
    return [item.requests[0].request_id.split("-")[0] for item in items]


def test_most_urgent_step_decodes_alone_even_when_both_fit() -> None:
    queue = [group("s1a", 4, 1), group("s0a", 4, 0), group("s1b", 4, 1), group("s0b", 4, 0)]
    batch, rest = take_batch(queue, max_rows=64)
    assert names(batch) == ["s0a", "s0b"] and names(rest) == ["s1a", "s1b"]
    batch, rest = take_batch(rest, max_rows=64)
    assert names(batch) == ["s1a", "s1b"] and rest == []


def test_rows_bound_keeps_arrival_order() -> None:
    queue = [group("a", 4, 0), group("b", 8, 0), group("c", 2, 0), group("d", 2, 1)]
    batch, rest = take_batch(queue, max_rows=10)
    assert names(batch) == ["a"]  # b does not fit, and c must not overtake it
    assert names(rest) == ["b", "c", "d"]
    batch, rest = take_batch(rest, max_rows=10)
    assert names(batch) == ["b", "c"] and names(rest) == ["d"]


def test_an_oversized_group_still_runs_and_equal_priorities_batch_together() -> None:
    batch, rest = take_batch([group("big", 80, 0), group("x", 4, 0)], max_rows=64)
    assert names(batch) == ["big"] and names(rest) == ["x"]
    batch, rest = take_batch([group("a", 4, 3), group("b", 4, 3)], max_rows=64)
    assert names(batch) == ["a", "b"] and rest == []
    assert take_batch([], max_rows=8) == ([], [])
