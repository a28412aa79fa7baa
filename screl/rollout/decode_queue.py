"""A generation worker's decode queue (:class:`screl.rollout.worker.GenerationWorker`): its generate calls wait here
and one decode thread gathers whatever is queued, up to ``max_batch_size`` rows, into one ``engine.generate``, so
concurrent groups share forward passes.

A step's groups arrive one by one as the pump reserves them: calls sent as a burst
(:class:`screl.data.core_types.Burst`) decode as soon as every call of the burst is queued; others wait until no new
group came for ``batch_window_s``.
Invariant: a batch never waits past 4 windows nor grows past ``max_batch_size`` rows, and its callers all resume in
the same iteration of their event loop. A batch the engine fails is decoded again call by call, so a call fails
only when it fails alone (one poisoned request never fails its batch's others). Which calls decode together is
:mod:`screl.rollout.batching`'s rule.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from screl.rollout.batching import Pending, bursts_missing, set_exception, set_results, take_batch
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult

__all__ = ["DecodeQueue"]

#: the engine's batch call: all the queued requests of one batch, flattened
Decode = Callable[[list[GenerationRequest]], list[GenerationResult]]


class DecodeQueue:
    """The queued generate calls and the daemon thread that decodes them with ``decode``, batch by batch."""

    def __init__(self, decode: Decode, max_batch_size: int, batch_window_s: float) -> None:
        self.decode = decode
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.queue: list[Pending] = []
        self.burst_arrivals: dict[int, int] = {}  # calls seen per burst id (insertion-ordered: oldest first)
        self.cv = threading.Condition()
        self.thread = threading.Thread(target=self._decode_loop, name="screl-decode", daemon=True)
        self.thread.start()

    def put(self, requests: Sequence[GenerationRequest], loop: asyncio.AbstractEventLoop,
            burst: tuple[int, int] | None) -> asyncio.Future[list[GenerationResult]]:
        """Queue one call's requests; its results arrive on the returned future, in ``loop``. ``burst``: (burst id,
        calls in it) of a rollout call's first generate, else None."""
        future: asyncio.Future[list[GenerationResult]] = loop.create_future()
        with self.cv:
            self.queue.append(Pending(requests, future, loop, burst))
            if burst is not None:
                self.burst_arrivals[burst[0]] = self.burst_arrivals.get(burst[0], 0) + 1
                while len(self.burst_arrivals) > 1024:  # forget the oldest bursts
                    del self.burst_arrivals[next(iter(self.burst_arrivals))]
            self.cv.notify()
        return future

    def drop(self, request_ids: set[str]) -> None:
        """Drop the queued calls holding any of ``request_ids`` before they start (their callers see a
        cancellation)."""
        with self.cv:
            dropped = [item for item in self.queue if request_ids & {r.request_id for r in item.requests}]
            self.queue = [item for item in self.queue if item not in dropped]
        for item in dropped:
            item.future.cancel()

    def queued_rows(self) -> int:
        return sum(len(item.requests) for item in self.queue)

    def _decode_loop(self) -> None:
        while True:
            self._decode(self._gather())

    def _gather(self) -> list[Pending]:
        """The next batch, once it is gathered (see the module's docstring)."""
        with self.cv:
            while not self.queue:
                self.cv.wait()
            deadline = time.monotonic() + 4 * self.batch_window_s
            while self.batch_window_s > 0 and self.queued_rows() < self.max_batch_size:
                missing = bursts_missing(self.queue, self.burst_arrivals)
                if missing == 0 and all(item.burst is not None for item in self.queue):
                    break
                seen = len(self.queue)
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self.cv.wait(timeout=min(left, self.batch_window_s))
                if len(self.queue) == seen and missing == 0:
                    break
            batch, self.queue = take_batch(self.queue, self.max_batch_size)
        return batch

    def _decode(self, batch: list[Pending]) -> None:
        flat = [r for item in batch for r in item.requests]
        try:
            results = self.decode(flat)
        except BaseException as err:  # noqa: BLE001 - handed to the waiting caller
            if len(batch) == 1:
                batch[0].loop.call_soon_threadsafe(set_exception, batch[0].future, err)
            else:  # one call's requests may have failed the batch (a prompt it cannot hold): each alone again
                for item in batch:
                    self._decode([item])
            return
        # one hand-over per event loop: the batch's callers all resume in the same loop iteration, so none
        # reaches the row sink while another still counts as generating (the sink would put it alone)
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[Any], Any]]] = {}
        at = 0
        for item in batch:
            part = results[at : at + len(item.requests)]
            at += len(item.requests)
            by_loop.setdefault(item.loop, []).append((item.future, part))
        for loop, handed in by_loop.items():
            loop.call_soon_threadsafe(set_results, handed)
