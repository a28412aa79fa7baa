"""How a generation worker batches: which queued generate calls decode together (:func:`take_batch`, with the
bursts the controller marks, :func:`bursts_missing`) and how concurrent row writes coalesce into one data-plane
put (:class:`RowSink`). The worker (:mod:`screl.rollout.worker`) drives both."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from screl.rollout.engines.protocol import GenerationRequest, GenerationResult
from screl.rollout.rows import ROW_SCHEMA


@dataclass
class Pending:
    """A generate call waiting in the worker's queue for its decode batch."""

    requests: Sequence[GenerationRequest]
    future: asyncio.Future[list[GenerationResult]]
    loop: asyncio.AbstractEventLoop
    burst: tuple[int, int] | None = None
    """(burst id, calls in the burst) of the rollout call's first generate (:class:`screl.data.core_types.Burst`)."""


class RowSink:
    """Coalesces the worker's concurrent row writes into one data-plane put (a put costs a few ms whatever its
    size): the first write of a burst waits for company, then everything queued goes in one put. It waits at
    most ``window_s``, and not at all once ``busy()`` says no other rollout call could write soon (every other
    call is waiting on the engine or already here)."""

    def __init__(self, window_s: float = 0.005, busy: Callable[[], int] | None = None) -> None:
        self.window_s = window_s
        self.schema = ROW_SCHEMA  # the rows' fields (a distillation run's carry teacher_logprobs too)
        self.dataplane: Any = None
        self.puts = 0
        self.busy = busy
        self._queue: list[tuple[list[str], list[dict[str, torch.Tensor]], asyncio.Future[None]]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._changed: asyncio.Event | None = None
        self.writers = 0  # calls inside put(), queued or being written

    def poke(self) -> None:
        """A rollout call changed state: the flusher looks again whether to wait for it."""
        if self._changed is not None:
            self._changed.set()

    async def _gather(self) -> None:
        """Wait up to ``window_s`` for more writers, less when none could come."""
        if self.busy is None:
            await asyncio.sleep(self.window_s)
            return
        if self._changed is None:
            self._changed = asyncio.Event()
        deadline = time.monotonic() + self.window_s
        while self.busy() > 0:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._changed.clear()
            try:
                await asyncio.wait_for(self._changed.wait(), left)
            except asyncio.TimeoutError:
                return

    async def put(self, keys: list[str], rows: list[dict[str, torch.Tensor]]) -> None:
        if self.dataplane is None:
            raise RuntimeError("the worker has no data plane attached (set_data_plane)")
        loop = asyncio.get_running_loop()
        done: asyncio.Future[None] = loop.create_future()
        self._queue.append((keys, rows, done))
        self.writers += 1
        self.poke()
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        try:
            await asyncio.shield(done)
        finally:
            self.writers -= 1

    async def _flush(self) -> None:
        await self._gather()
        while self._queue:
            batch, self._queue = self._queue, []
            keys = [k for ks, _, _ in batch for k in ks]
            try:
                await self.dataplane.aput(keys, self.schema.merge([r for _, rows, _ in batch for r in rows]))
                self.puts += 1
            except BaseException as err:  # noqa: BLE001 - every writer of the batch hears about it
                for _, _, done in batch:
                    set_exception(done, err)
                if isinstance(err, asyncio.CancelledError):
                    raise
                continue
            for _, _, done in batch:
                set_result(done, None)


def bursts_missing(queue: list[Pending], arrived: Mapping[int, int]) -> int:
    """Calls not arrived yet of the bursts that have a call in ``queue`` (``arrived``: calls seen per burst id,
    those already decoded included)."""
    sizes = {item.burst[0]: item.burst[1] for item in queue if item.burst is not None}
    return sum(max(0, size - arrived.get(bid, 0)) for bid, size in sizes.items())


def take_batch(queue: list[Pending], max_rows: int) -> tuple[list[Pending], list[Pending]]:
    """Split ``queue`` into the next decode batch and the rest: the most urgent priority's groups in arrival
    order while they fit in ``max_rows`` (always at least one group); other priorities wait their turn."""
    priorities = [min((r.priority for r in item.requests), default=0) for item in queue]
    urgent = min(priorities, default=0)
    batch: list[Pending] = []
    rest: list[Pending] = []
    rows, full = 0, False
    for item, priority in zip(queue, priorities, strict=True):
        if priority == urgent and not full and (not batch or rows + len(item.requests) <= max_rows):
            batch.append(item)
            rows += len(item.requests)
        else:
            # an urgent group that did not fit ends the batch: later ones must not overtake it
            full = full or priority == urgent
            rest.append(item)
    return batch, rest


def set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def set_results(handed: list[tuple[asyncio.Future[Any], Any]]) -> None:
    for future, value in handed:
        set_result(future, value)


def set_exception(future: asyncio.Future[Any], err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)
