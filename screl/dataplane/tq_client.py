"""This process's TransferQueue client: connect, start and stop TQ, and the process-wide state behind them.

TQ keeps one client per process in module globals of ``transfer_queue.interface``; everything here
guards them with one lock, remembers which controller the client talks to (``connected_to``) and whether
this process started that TQ, and bounds every blocking call (``bounded_wait``): TQ's controller RPCs have
none; ``bounded_await`` is its twin on a running event loop. :class:`screl.dataplane.client.DataPlane` is the
only user.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

# Read once at import by TQ's client and storage units: pin their torch thread pool to one thread.
os.environ.setdefault("TQ_NUM_THREADS", "1")

import ray  # noqa: E402
import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import DictConfig  # noqa: E402
from transfer_queue import interface as _tqi  # noqa: E402

from screl.dataplane.errors import DataPlaneError, DataPlaneLostError, DataPlaneTimeoutError  # noqa: E402
from screl.dataplane.tq_host import hosts_storage, start_hosted  # noqa: E402

T = TypeVar("T")

CONTROLLER_NAME = "TransferQueueController"
CONTROLLER_NAMESPACE = "transfer_queue"
STORAGE_UNIT_PREFIX = "TransferQueueStorageUnit#"

_LOCK = threading.RLock()
_connected_to: str | None = None  # controller actor id the process's TQ client talks to
_started_here: str | None = None  # controller actor id of a TQ this process started and has not shut down
_expected: frozenset[str] = frozenset()  # the TQ actors ("namespace/name") alive when this process connected
LIVENESS_POLL_S = 1.0
"""How often a data-plane call that waits checks that the TQ actors it connected to are still alive (a call to a
dead storage unit or controller would otherwise wait out its whole timeout: TQ talks to them over ZMQ)."""


def find_controller() -> Any | None:
    try:
        return ray.get_actor(CONTROLLER_NAME, namespace=CONTROLLER_NAMESPACE)
    except ValueError:
        return None


def actor_id(handle: Any) -> str:
    return str(handle._actor_id.hex())


def drop_client() -> None:
    """Forget this process's TQ client without touching any actor (``tq.close()`` would kill them)."""
    global _connected_to, _expected
    client = _tqi._TQ_CLIENT
    _tqi._TQ_CLIENT = None
    _tqi._TQ_CONTROLLER = None
    _connected_to = None
    _expected = frozenset()
    if client is not None:
        try:
            client.close()
        except Exception:  # a client of a dead TQ may fail to close; it is garbage either way
            pass


def _tq_named_actors() -> list[tuple[str, str]]:
    """``(namespace, name)`` of every live TQ actor (controller and storage units) in the cluster."""
    return [
        (a["namespace"], a["name"])
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"] == CONTROLLER_NAME or a["name"].startswith(STORAGE_UNIT_PREFIX)
    ]


def tq_actors_alive() -> list[str]:
    """Names of the TransferQueue actors alive in this Ray cluster (empty after a clean shutdown)."""
    return sorted(f"{ns}/{name}" for ns, name in _tq_named_actors())


def describe_tq_actor(name: str, hosts_unit: bool = False) -> str:
    """``transfer_queue/TransferQueueController`` -> "the TransferQueue controller (...)" (``hosts_unit``: "... and
    the storage unit it holds"); a storage unit likewise."""
    short = name.split("/", 1)[-1]
    if short == CONTROLLER_NAME:
        return f"the TransferQueue controller{' with the storage unit it holds' if hosts_unit else ''} ({name})"
    if short.startswith(STORAGE_UNIT_PREFIX):
        return f"the TransferQueue storage unit {short[len(STORAGE_UNIT_PREFIX):]} ({name})"
    return name


def lost_tq_actors() -> list[str]:
    """The TQ actors this process connected to that are no longer alive (Ray does not restart them)."""
    if not _expected:
        return []
    try:
        alive = set(tq_actors_alive())
    except Exception:  # noqa: BLE001 - the GCS unreachable: not known to be lost
        return []
    return sorted(_expected - alive)


def lost_error(lost: list[str], what: str) -> DataPlaneLostError:
    hosted = not any(n.split("/", 1)[-1].startswith(STORAGE_UNIT_PREFIX) for n in _expected)  # one-process TQ
    return DataPlaneLostError(
        f"{what} failed: {', '.join(describe_tq_actor(n, hosted) for n in lost)} died (the rows it held are gone; "
        "Ray does not restart TransferQueue's actors). Run the same command again: it resumes from the last "
        "checkpoint bundle."
    )


def kill_tq_actors() -> None:
    for namespace, name in _tq_named_actors():
        try:
            ray.kill(ray.get_actor(name, namespace=namespace), no_restart=True)
        except ValueError:  # died meanwhile
            pass


def in_daemon_thread(fn: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Run a blocking call in a daemon thread (a hung TQ call must not block interpreter exit)."""
    fut: concurrent.futures.Future[T] = concurrent.futures.Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the waiter
            fut.set_exception(e)

    threading.Thread(target=run, name="screl-dataplane", daemon=True).start()
    return fut


def bounded_wait(fut: concurrent.futures.Future[T], timeout_s: float, what: str) -> T:
    """``fut``'s result within ``timeout_s``; a TQ actor that dies meanwhile fails the wait at once
    (:class:`DataPlaneLostError`, naming it) instead of at the timeout."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            return fut.result(timeout=max(0.0, min(left, LIVENESS_POLL_S)))
        except concurrent.futures.TimeoutError:
            if left <= LIVENESS_POLL_S:
                break
            lost = lost_tq_actors()
            if lost:
                fut.cancel()
                raise lost_error(lost, what) from None
    fut.cancel()
    raise DataPlaneTimeoutError(
        f"{what} did not finish within {timeout_s:g}s; is the TransferQueue controller/storage alive "
        f"(tq actors alive: {tq_actors_alive()})? Raise the timeout_s if the data is large."
    ) from None


async def bounded_await(aw: Awaitable[T], timeout_s: float, what: str) -> T:
    """``aw`` within ``timeout_s`` on the running loop (:func:`bounded_wait`'s async twin); a TQ actor that dies
    meanwhile fails it at once, naming the actor."""
    task = asyncio.ensure_future(aw)
    deadline = asyncio.get_running_loop().time() + timeout_s
    try:
        while True:
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            done, _ = await asyncio.wait({task}, timeout=min(left, LIVENESS_POLL_S))
            if done:
                return task.result()
            lost = await asyncio.get_running_loop().run_in_executor(None, lost_tq_actors)
            if lost:
                raise lost_error(lost, what) from None
    finally:
        if not task.done():
            task.cancel()
    raise DataPlaneTimeoutError(
        f"{what} did not finish within {timeout_s:g}s; is the TransferQueue controller/storage alive "
        f"(tq actors alive: {tq_actors_alive()})? Raise the timeout_s if the data is large."
    )


def connect(expected_controller: str | None, timeout_s: float) -> None:
    """Make this process's TQ client talk to the running controller (idempotent, thread-safe)."""
    global _connected_to, _expected
    with _LOCK:
        controller = find_controller()
        if controller is None:
            raise DataPlaneError(
                f"No TransferQueue controller ({CONTROLLER_NAMESPACE}/{CONTROLLER_NAME}) runs in this Ray "
                f"cluster: call DataPlane.start() in the driver first (and connect to the same Ray cluster)."
            )
        cid = actor_id(controller)
        if expected_controller is not None and cid != expected_controller:
            raise DataPlaneError(
                f"This data-plane handle refers to TransferQueue controller {expected_controller}, but "
                f"{cid} runs now (TransferQueue was restarted): get a fresh handle from the new DataPlane."
            )
        if _tqi._TQ_CLIENT is not None and _connected_to == cid:
            return
        drop_client()  # stale client of an earlier TQ (e.g. in a reused Ray worker)
        deadline = time.monotonic() + timeout_s
        while True:  # the controller stores its config at the end of start(); wait for it, bounded
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DataPlaneTimeoutError(
                    f"TransferQueue controller {cid} did not publish its config within {timeout_s:g}s."
                )
            try:
                conf = ray.get(controller.get_config.remote(), timeout=remaining)
            except ray.exceptions.GetTimeoutError:
                continue
            if conf is not None:
                break
            time.sleep(0.1)
        _tqi._TQ_CONTROLLER = controller
        tq.init()  # finds the controller above and builds this process's client from its config
        if _tqi._TQ_CLIENT is None:
            raise DataPlaneError(f"transfer_queue.init() did not create a client for controller {cid}.")
        _connected_to = cid
        _expected = frozenset(tq_actors_alive())


def connected_to() -> str | None:
    """The controller actor id this process's TQ client talks to (None: no client)."""
    return _connected_to


def is_connected(controller_actor_id: str) -> bool:
    """Whether this process has a TQ client and it talks to ``controller_actor_id``."""
    return _tqi._TQ_CLIENT is not None and _connected_to == controller_actor_id


def current_client() -> Any:
    """This process's TQ client (its ``_loop`` runs TQ's coroutines)."""
    return _tqi._TQ_CLIENT


def check_can_start(num_storage_units: int) -> None:
    """Refuse to start TQ without Ray, with a second controller, or with too few free CPUs."""
    if not ray.is_initialized():
        raise DataPlaneError("Ray is not initialised: call screl.dataplane.start_local_ray() first.")
    if num_storage_units < 1:
        raise ValueError(f"num_storage_units={num_storage_units} must be >= 1.")
    if find_controller() is not None:
        raise DataPlaneError(
            f"A TransferQueue controller ({CONTROLLER_NAMESPACE}/{CONTROLLER_NAME}) already runs in this "
            f"Ray cluster and TQ allows one per cluster: attach to it with DataPlane.attach(handle) or "
            f"shut it down first."
        )
    need, free = 1 + num_storage_units, ray.available_resources().get("CPU", 0.0)
    if free < need:
        raise DataPlaneError(
            f"TransferQueue needs {need} free logical CPUs (controller + {num_storage_units} storage "
            f"units, num_cpus=1 each) but Ray has {free:g}: start Ray with more num_cpus."
        )


def start_tq(conf: DictConfig, timeout_s: float, what: str) -> str:
    """Start TQ with ``conf`` from this process and connect to it; returns the controller's actor id. One storage
    unit placed anywhere (the default) lives inside the controller's actor (:mod:`screl.dataplane.tq_host`).

    On a failed or timed-out start every TQ actor is killed and the client dropped.
    """
    global _connected_to, _started_here, _expected
    with _LOCK:
        drop_client()
        _tqi._TQ_STORAGE = None  # storage handles of an earlier TQ started (and lost) by this process
        if hosts_storage(conf):  # one process: the unit inside the controller (tq_host.py)
            fut = in_daemon_thread(lambda: start_hosted(conf, CONTROLLER_NAME, CONTROLLER_NAMESPACE))
        else:
            fut = in_daemon_thread(lambda: tq.init(conf))
        try:
            bounded_wait(fut, timeout_s, what)
        except BaseException:
            kill_tq_actors()
            drop_client()
            _tqi._TQ_STORAGE = None
            raise
        controller = find_controller()
        if controller is None:
            raise DataPlaneError("transfer_queue.init() returned but no controller is registered.")
        _connected_to = _started_here = actor_id(controller)
        _expected = frozenset(tq_actors_alive())
        return _connected_to


def release_client(controller_actor_id: str) -> None:
    """Drop this process's client of ``controller_actor_id`` unless this process started that TQ (its owner
    keeps using the shared client); no actor is touched."""
    with _LOCK:
        if _connected_to == controller_actor_id and _started_here != _connected_to:
            drop_client()


def stop_tq(timeout_s: float) -> None:
    """Stop TQ: close it gracefully, kill its storage units and controller, drop the client, and wait (at
    most ``timeout_s``) until the actors' names are released (DataPlaneError if some survive)."""
    global _started_here, _expected
    with _LOCK:
        _started_here = None
        _expected = frozenset()  # the actors go now: a wait below must not take it for a loss
        try:  # graceful: storage units' shutdown(), then ray.kill of units and controller
            bounded_wait(in_daemon_thread(tq.close), timeout_s, "TransferQueue close")
        except DataPlaneTimeoutError:
            pass
        finally:
            kill_tq_actors()
            drop_client()
            _tqi._TQ_STORAGE = None
        deadline = time.monotonic() + timeout_s
        while tq_actors_alive():  # ray.kill is asynchronous: wait until the names are released
            if time.monotonic() > deadline:
                raise DataPlaneError(
                    f"TransferQueue actors still alive after shutdown: {tq_actors_alive()}"
                )
            time.sleep(0.05)


class TorchThreads:
    """Restore torch's intra-op thread count that TQ's put/get resets to its import-time value."""

    def __enter__(self) -> None:
        self.n = torch.get_num_threads()

    def __exit__(self, *exc: object) -> None:
        if torch.get_num_threads() != self.n:
            torch.set_num_threads(self.n)
