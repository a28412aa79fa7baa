"""Colocated generation (``generation.colocated.enabled: true``): the engine lives in the trainer's process and
decodes with the trainer's own module; no worker process, no second copy of the weights, and a refit is a version
bump (docs/generation.md, "Topologies: disaggregated and colocated").

The controller reaches the engine as it reaches any worker, through a handle whose methods have a ``.remote(...)``:
here a :class:`Mailbox` in the controller's process that queues each call. The trainer's :class:`ColocatedHost`
takes the calls (``RolloutController.colocated_take``, a long poll), runs them on a
:class:`~screl.rollout.worker.GenerationWorker` of its own and posts each result back (``colocated_done``).
Invariant: the rollout state machine, events, ledger and checkpoints are the same code in both topologies.

The train pump decides when the engine runs: it generates until the step's batch is complete, then **stands down**
for the whole train step (:meth:`ColocatedHost.stand_down`: decoding parked, KV caches freed, the deadline clock
stopped); the wake after the step's refit re-prefills the parked requests under the new weights.
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray

log = logging.getLogger(__name__)

Call = tuple[int, str, tuple[Any, ...], dict[str, Any]]
"""One queued call: (call id, the worker method's name, its positional and keyword arguments)."""


@dataclass(frozen=True)
class ColocatedSlot:
    """Stands in for a worker handle in the list the controller is built with; the controller replaces it by a
    :class:`Mailbox` in its own process."""

    index: int


class _Method:
    def __init__(self, box: Mailbox, name: str) -> None:
        self._box, self._name = box, name

    def remote(self, *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        return self._box.call(self._name, args, kwargs)


class Mailbox:
    """The controller's handle on a colocated engine: ``box.rollout.remote(...)`` queues the call and returns a
    future the host's reply resolves (an exception the host raised is raised to the awaiting caller)."""

    def __init__(self, index: int) -> None:
        self.index = index
        self._queue: list[Call] = []
        self._futures: dict[int, asyncio.Future[Any]] = {}
        self._ids = itertools.count()
        self._arrived: asyncio.Event | None = None
        self._closed: str | None = None

    def __getattr__(self, name: str) -> _Method:
        if name.startswith("_"):
            raise AttributeError(name)
        return _Method(self, name)

    def _event(self) -> asyncio.Event:
        if self._arrived is None:
            self._arrived = asyncio.Event()
        return self._arrived

    def call(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> asyncio.Future[Any]:
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        future.add_done_callback(_retrieve)  # a fire-and-forget call (abort) that fails logs nothing
        if self._closed is not None:
            future.set_exception(RuntimeError(self._closed))
            return future
        call_id = next(self._ids)
        self._futures[call_id] = future
        self._queue.append((call_id, name, args, kwargs))
        self._event().set()
        return future

    async def take(self, timeout_s: float) -> list[Call]:
        """The calls queued since the last take, waiting up to ``timeout_s`` for one (a long poll)."""
        if not self._queue:
            try:
                await asyncio.wait_for(self._event().wait(), timeout_s)
            except asyncio.TimeoutError:
                return []
        calls, self._queue = self._queue, []
        self._event().clear()
        return calls

    def done(self, call_id: int, ok: bool, value: Any) -> None:
        future = self._futures.pop(call_id, None)
        if future is None or future.done():
            return
        if ok:
            future.set_result(value)
        else:
            future.set_exception(value if isinstance(value, BaseException) else RuntimeError(str(value)))

    def close(self, why: str) -> None:
        """Fail every call waiting on the host, and every later one, with ``why``."""
        self._closed = why
        for future in self._futures.values():
            if not future.done():
                future.set_exception(RuntimeError(why))
        self._futures.clear()
        self._queue.clear()


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


def with_mailboxes(workers: list[Any]) -> list[Any]:
    """The controller's worker list with each :class:`ColocatedSlot` replaced by a :class:`Mailbox`."""
    return [Mailbox(w.index) if isinstance(w, ColocatedSlot) else w for w in workers]


class _SyncPuts:
    """The worker's row sink writes through the trainer's own data-plane client (its calls run on
    TransferQueue's client loop), not from the host's event loop."""

    def __init__(self, dataplane: Any) -> None:
        self.dataplane = dataplane

    async def aput(self, keys: list[str], rows: Mapping[str, Any]) -> None:
        await asyncio.get_running_loop().run_in_executor(None, lambda: self.dataplane.put(keys, rows))


class ColocatedHost:
    """Runs a :class:`~screl.rollout.worker.GenerationWorker` in the trainer's process for the controller.

    Args:
        controller: The ``RolloutController`` actor handle.
        index: The worker index the controller knows this engine by.
        worker: The worker, built with ``engine=`` the engine its class's ``on_trainer_module`` builds on the trainer's
            module (an engine that declares ``colocated``).
        dataplane: The trainer's data-plane client; the worker's rows go through it.
        stand_down_timeout_s: Longest wait for a decode step to finish at a stand-down.
    """

    POLL_S = 1.0

    def __init__(self, controller: Any, index: int, worker: Any, dataplane: Any,
                 stand_down_timeout_s: float = 600.0) -> None:
        self.controller, self.index, self.worker = controller, index, worker
        self.worker.set_data_plane(_SyncPuts(dataplane))
        self.turns = EngineTurns(worker, stand_down_timeout_s)
        self._stop = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="screl-colocated-loop", daemon=True)
        self._loop_thread.start()
        self._poller = threading.Thread(target=self._poll, name="screl-colocated-poll", daemon=True)
        self._poller.start()

    # -- the controller's calls ------------------------------------------------------------------------
    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                calls = ray.get(self.controller.colocated_take.remote(self.index, self.POLL_S),
                                timeout=self.POLL_S + 60)
            except Exception as err:  # noqa: BLE001 - the controller is gone (shutdown) or hung: stop serving
                if not self._stop.is_set():
                    log.warning("screl: the colocated engine stops taking rollout calls: %r", err)
                return
            for call in calls:
                self._start(call)

    def _start(self, call: Call) -> None:
        call_id, name, args, kwargs = call
        future = asyncio.run_coroutine_threadsafe(self._invoke(name, args, kwargs), self._loop)
        future.add_done_callback(lambda f: self._reply(call_id, f))

    async def _invoke(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        if name == "set_data_plane":  # the controller's refresh of a restarted worker: the host never restarts
            return None
        result = getattr(self.worker, name)(*args, **kwargs)
        return await result if inspect.isawaitable(result) else result

    def _reply(self, call_id: int, future: Any) -> None:
        try:
            ok, value = True, future.result()
        except BaseException as err:  # noqa: BLE001 - handed to the caller in the controller
            ok, value = False, RuntimeError(f"{type(err).__name__}: {err}")
        if self._stop.is_set():
            return
        try:
            self.controller.colocated_done.remote(self.index, call_id, ok, value)
        except Exception as err:  # noqa: BLE001 - the controller is gone
            log.debug("screl: a colocated reply was not delivered: %r", err)

    # -- the train pump's turns ---------------------------------------------------------------------------
    def stand_down(self) -> float:
        """See :meth:`EngineTurns.stand_down`."""
        return self.turns.stand_down()

    def wake(self) -> None:
        """See :meth:`EngineTurns.wake`."""
        self.turns.wake()

    def close(self) -> None:
        """Stop taking calls and stop the event loop (the engine's parked requests are dropped with it)."""
        self._stop.set()
        self.turns.wake()
        self._poller.join(timeout=self.POLL_S + 5)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._loop_thread.join(timeout=5)


class EngineTurns:
    """The colocated engine's turns with the trainer: it stands down for each train step and wakes after it.

    Args:
        worker: The :class:`~screl.rollout.worker.GenerationWorker` whose engine (on the trainer's module) and
            deadline clock take turns with the trainer.
        timeout_s: Longest wait for the engine to park at a stand-down.
    """

    def __init__(self, worker: Any, timeout_s: float = 600.0) -> None:
        self.worker = worker
        self.timeout_s = timeout_s
        self.stood_down_s = 0.0  # total time stood down
        self.stand_downs = 0
        self._down_since: float | None = None

    @property
    def engine(self) -> Any:
        return self.worker.engine

    def stand_down(self) -> float:
        """Park decoding, free the KV caches and stop the deadline clock for the train step; returns the seconds
        it took (one decode step at most; under the drain gate, ``in_flight_weight_updates: false``, the requests
        in flight finish first, on a running clock)."""
        if self._down_since is not None:
            return 0.0
        t0 = time.perf_counter()
        drain = not self.worker.in_flight_weight_updates  # the drain gate: what is in flight finishes first
        if not drain:
            self.worker.clock.pause()
        self.engine.stand_down(self.timeout_s, drain=drain)
        twin = getattr(getattr(self.engine, "model", None), "screl_decode_copy", None)
        if twin is not None:  # the engine's copy of the weights in its dtype (torch_model.DecodeCopy): cast at the wake
            twin.free()
        if drain:
            self.worker.clock.pause()
        self._down_since = time.perf_counter()
        self.stand_downs += 1
        return self._down_since - t0

    def wake(self) -> None:
        """Resume decoding (parked requests re-prefill under the current weights) and the deadline clock."""
        if self._down_since is None:
            return
        self.stood_down_s += time.perf_counter() - self._down_since
        self._down_since = None
        self.engine.wake()
        self.worker.clock.resume()

    @property
    def stood_down(self) -> bool:
        return self._down_since is not None
