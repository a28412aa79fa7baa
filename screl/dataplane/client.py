"""``DataPlane``: the one place screl talks to TransferQueue (TQ).

Rollout rows are keyed per sample (``<group_id>_g<i>``) in one TQ partition. A row is a dict of
per-sample tensors whose lengths may differ (prompt/response tokens, per-token behaviour logprobs and
weight versions, a scalar reward, ...). The controller and the trainer exchange keys only; the rows
travel through TQ's storage units.

How TQ is used (transferqueue 0.1.11, SimpleStorage backend):

* One TQ per Ray cluster: the controller is the named actor ``TransferQueueController`` in namespace
  ``transfer_queue``; the storage units are named ``TransferQueueStorageUnit#<i>`` in the starter's
  namespace; each is a ``num_cpus=1`` actor, so the cluster needs ``1 + num_storage_units`` free CPUs. One unit
  placed anywhere (screl's default) lives inside the controller's actor instead: one process
  (:mod:`screl.dataplane.tq_host`, same names, same CPUs).
* One TQ client per process (module globals in ``transfer_queue.interface``). Another process attaches
  by looking the controller up by name and reading its stored config (``transfer_queue.init()`` does
  this when a controller exists). A :class:`DataPlane` pickles to its :class:`DataPlaneHandle` and
  attaches lazily on first use, so it can be passed to Ray actors as is.
* Columns: a per-sample 0-d tensor becomes one regular ``(B,)`` column; per-sample tensors of one or
  more dims always travel as a jagged nested tensor (only the first dim may vary). :meth:`DataPlane.get`
  returns plain dense CPU tensors per sample, in key order, with their dtype unchanged (int64, float32
  bit for bit, bfloat16, bool, ...).

TQ quirks handled here: it silently returns an empty or short batch for missing keys or fields (we
check and raise); its controller RPCs have no timeout (every call here has one); ``tq.close()`` in an
attached process kills the shared controller (attached processes only drop their client); its put/get
resets ``torch.set_num_threads`` to the value seen when TQ was imported (we restore the caller's).

The process-wide TQ client (connect, start, stop, bounded waits) lives in :mod:`screl.dataplane.tq_client`,
the put and checked get of rows in :mod:`screl.dataplane.rows`, the row <-> column conversion in
:mod:`screl.dataplane.columns`, the errors in :mod:`screl.dataplane.errors`; this module re-exports the
names in its ``__all__``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

# Read once at import by TQ's client and storage units: pin their torch thread pool to one thread.
os.environ.setdefault("TQ_NUM_THREADS", "1")

import torch  # noqa: E402
import transfer_queue as tq  # noqa: E402
from omegaconf import OmegaConf  # noqa: E402

from screl.dataplane import snapshot  # noqa: E402
from screl.dataplane.columns import Column, check_keys, from_batch  # noqa: E402
from screl.dataplane.errors import (  # noqa: E402
    DataPlaneError,
    DataPlaneKeyError,
    DataPlaneLostError,
    DataPlaneTimeoutError,
)
from screl.dataplane.rows import get_call, put_call  # noqa: E402
from screl.dataplane.snapshot import RemoteTree  # noqa: E402
from screl.dataplane.tq_client import (  # noqa: E402
    CONTROLLER_NAME,
    CONTROLLER_NAMESPACE,
    STORAGE_UNIT_PREFIX,
    TorchThreads,
    bounded_await,
    bounded_wait,
    check_can_start,
    connect,
    current_client,
    in_daemon_thread,
    is_connected,
    lost_tq_actors,
    release_client,
    start_tq,
    stop_tq,
    tq_actors_alive,
)

__all__ = [
    "CONTROLLER_NAME",
    "CONTROLLER_NAMESPACE",
    "DEFAULT_TIMEOUT_S",
    "STORAGE_UNIT_PREFIX",
    "Column",
    "DataPlane",
    "DataPlaneError",
    "DataPlaneHandle",
    "DataPlaneKeyError",
    "DataPlaneLostError",
    "DataPlaneTimeoutError",
    "tq_actors_alive",
]

T = TypeVar("T")

DEFAULT_TIMEOUT_S = 60.0
START_TIMEOUT_S = 180.0
"""TransferQueue's start-up bound: its controller and storage actors boot one after the other, which took 22 s
on a loaded 2-core machine (and machines 3x slower exist)."""


@dataclass(frozen=True)
class DataPlaneHandle:
    """Picklable address of a running data plane: enough for another process to attach."""

    partition_id: str
    controller_actor_id: str
    """Ray actor id (hex) of the TQ controller; a handle outlives a restarted TQ only to fail clearly."""
    timeout_s: float = DEFAULT_TIMEOUT_S


class DataPlane:
    """Per-sample rollout rows in one TransferQueue partition; sync methods plus async twins.

    Create it once with :meth:`start` (the owner; only the owner can :meth:`shutdown`), then hand it
    (or :meth:`handle`) to other processes: unpickled or :meth:`attach`-ed copies talk to the same TQ.
    Sync methods block the calling thread (they run on TQ's own client loop); inside an asyncio actor
    use the ``a*`` twins, which await TQ on the caller's loop. Every call has a timeout
    (``timeout_s`` per call, default the handle's) and raises :class:`DataPlaneTimeoutError`.
    """

    def __init__(self, handle: DataPlaneHandle, *, _owner: bool = False) -> None:
        self._handle = handle
        self._owner = _owner
        self._closed = False

    # ---- lifecycle

    @classmethod
    def start(
        cls,
        num_storage_units: int = 1,
        partition_id: str = "train",
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        total_storage_size: int | None = None,
        start_timeout_s: float | None = None,
        storage_node_resource: str | None = None,
    ) -> DataPlane:
        """Start TQ's controller and ``num_storage_units`` SimpleStorage units in the current Ray cluster.

        Args:
            num_storage_units: Storage unit actors (``num_cpus=1`` each). A checkpoint loads only into a
                data plane with the same number.
            partition_id: TQ partition all rows of this data plane live in.
            timeout_s: Default timeout of every call.
            total_storage_size: Capacity in samples across all units (``None``: unlimited).
            start_timeout_s: Bound of this start (default: ``START_TIMEOUT_S``, or ``timeout_s`` if larger).
            storage_node_resource: Only nodes offering this custom Ray resource host storage units (None: TQ
                spreads them round-robin over every live node).

        Raises:
            DataPlaneError: Ray is not initialised, a TQ already runs in this cluster, or too few CPUs.
            DataPlaneTimeoutError: TQ did not come up within ``start_timeout_s`` (its actors are killed).
        """
        check_can_start(num_storage_units)
        conf = OmegaConf.create(
            {
                "backend": {
                    "storage_backend": "SimpleStorage",
                    "SimpleStorage": {
                        "num_data_storage_units": num_storage_units,
                        "total_storage_size": total_storage_size,
                        "required_node_resource": storage_node_resource,
                    },
                }
            }
        )
        bound = start_timeout_s if start_timeout_s is not None else max(timeout_s, START_TIMEOUT_S)
        cid = start_tq(conf, bound, f"Starting TransferQueue ({num_storage_units} storage units)")
        return cls(DataPlaneHandle(partition_id, cid, timeout_s), _owner=True)

    @classmethod
    def attach(cls, handle: DataPlaneHandle) -> DataPlane:
        """Attach this process to the data plane ``handle`` names (connects now; see :meth:`handle`)."""
        dp = cls(handle)
        dp._ensure_connected()
        return dp

    def handle(self) -> DataPlaneHandle:
        """Picklable address of this data plane for :meth:`attach` in another process."""
        return self._handle

    def __getstate__(self) -> dict[str, Any]:
        return {"handle": self._handle}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self._handle = state["handle"]
        self._owner = False  # an unpickled copy never owns TQ; it attaches on first use
        self._closed = False

    @property
    def partition_id(self) -> str:
        return self._handle.partition_id

    @property
    def is_owner(self) -> bool:
        """Whether this object started TQ (and so may shut it down)."""
        return self._owner

    def _timeout(self, timeout_s: float | None) -> float:
        return self._handle.timeout_s if timeout_s is None else timeout_s

    def _ensure_connected(self) -> None:
        if self._closed:
            raise DataPlaneError("This DataPlane was closed or shut down.")
        if not is_connected(self._handle.controller_actor_id):
            bounded_wait(
                in_daemon_thread(lambda: connect(self._handle.controller_actor_id, self._handle.timeout_s)),
                self._handle.timeout_s + 5.0,
                "Attaching to TransferQueue",
            )

    async def _aensure_connected(self) -> None:
        if self._closed:
            raise DataPlaneError("This DataPlane was closed or shut down.")
        if not is_connected(self._handle.controller_actor_id):
            fut = in_daemon_thread(
                lambda: connect(self._handle.controller_actor_id, self._handle.timeout_s)
            )
            await bounded_await(
                asyncio.wrap_future(fut), self._handle.timeout_s + 5.0, "Attaching to TransferQueue"
            )

    def _run(self, make: Callable[[], Awaitable[T]], timeout_s: float | None, what: str) -> T:
        """Run a TQ coroutine on TQ's client loop (thread) and wait for it, bounded."""
        self._ensure_connected()
        client = current_client()

        async def call() -> T:
            return await make()

        with TorchThreads():
            fut = asyncio.run_coroutine_threadsafe(call(), client._loop)
            return bounded_wait(fut, self._timeout(timeout_s), what)

    async def _arun(self, make: Callable[[], Awaitable[T]], timeout_s: float | None, what: str) -> T:
        """Await a TQ coroutine on the caller's event loop, bounded."""
        await self._aensure_connected()
        with TorchThreads():
            return await bounded_await(make(), self._timeout(timeout_s), what)

    def lost_actors(self) -> list[str]:
        """The TransferQueue actors this process connected to that have died (empty before it connected)."""
        return lost_tq_actors()

    # ---- put / get / clear

    def put(
        self,
        keys: Sequence[str],
        rows: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Write (or add fields to) the rows ``keys``.

        Args:
            keys: One unique key per sample, e.g. ``f"{group_id}_g{i}"``.
            rows: Field name -> a list of per-sample tensors (lengths may differ in the first dim) or one
                tensor whose first dim indexes the samples. Existing keys get the fields added/replaced.
            tags: Optional small picklable dict per key (e.g. ``{"weight_version": 3}``); see :meth:`list_tags`.
        """
        self._run(put_call(self.partition_id, keys, rows, tags), timeout_s, f"put of {len(keys)} rows")

    async def aput(
        self,
        keys: Sequence[str],
        rows: Mapping[str, Column],
        tags: Sequence[Mapping[str, Any]] | None = None,
        *,
        timeout_s: float | None = None,
    ) -> None:
        """Async :meth:`put`."""
        await self._arun(put_call(self.partition_id, keys, rows, tags), timeout_s, f"put of {len(keys)} rows")

    def get(
        self, keys: Sequence[str], fields: Sequence[str], *, timeout_s: float | None = None
    ) -> dict[str, list[torch.Tensor]]:
        """Read ``fields`` of ``keys``: ``{field: [per-sample dense CPU tensor, in key order]}``.

        Raises:
            DataPlaneKeyError: A key is not in the partition or a field is not written for every key.
        """
        keys, fields = check_keys(keys), list(fields)
        if not fields:
            raise ValueError("fields must not be empty.")
        td = self._run(get_call(self.partition_id, keys, fields), timeout_s, f"get of {len(keys)} rows")
        return from_batch(td, keys, fields)

    async def aget(
        self, keys: Sequence[str], fields: Sequence[str], *, timeout_s: float | None = None
    ) -> dict[str, list[torch.Tensor]]:
        """Async :meth:`get`."""
        keys, fields = check_keys(keys), list(fields)
        if not fields:
            raise ValueError("fields must not be empty.")
        td = await self._arun(get_call(self.partition_id, keys, fields), timeout_s, f"get of {len(keys)} rows")
        return from_batch(td, keys, fields)

    def clear(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Delete the rows ``keys`` (keys not present are ignored)."""
        keys = check_keys(keys)
        self._run(lambda: tq.async_kv_clear(keys=keys, partition_id=self.partition_id), timeout_s, "clear")

    async def aclear(self, keys: Sequence[str], *, timeout_s: float | None = None) -> None:
        """Async :meth:`clear`."""
        keys = check_keys(keys)
        await self._arun(
            lambda: tq.async_kv_clear(keys=keys, partition_id=self.partition_id), timeout_s, "clear"
        )

    def list_tags(self, *, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """``{key: tags}`` of every row in the partition, in insertion order."""
        listing = self._run(lambda: tq.async_kv_list(self.partition_id), timeout_s, "list")
        return {k: dict(v or {}) for k, v in listing.get(self.partition_id, {}).items()}

    async def alist_tags(self, *, timeout_s: float | None = None) -> dict[str, dict[str, Any]]:
        """Async :meth:`list_tags`."""
        listing = await self._arun(lambda: tq.async_kv_list(self.partition_id), timeout_s, "list")
        return {k: dict(v or {}) for k, v in listing.get(self.partition_id, {}).items()}

    def list_keys(self, *, timeout_s: float | None = None) -> list[str]:
        """Keys of every row in the partition, in insertion order."""
        return list(self.list_tags(timeout_s=timeout_s))

    async def alist_keys(self, *, timeout_s: float | None = None) -> list[str]:
        """Async :meth:`list_keys`."""
        return list(await self.alist_tags(timeout_s=timeout_s))

    # ---- checkpoint

    @staticmethod
    def _local(path: str | os.PathLike[str]) -> Path:
        s = os.fspath(path)
        if "://" in s:
            raise ValueError(
                f"{s!r}: TransferQueue checkpoints need a local path (copy to remote storage after)."
            )
        return Path(s)

    def save(
        self,
        local_dir: str | os.PathLike[str],
        metadata: Mapping[str, Any] | None = None,
        *,
        timeout_s: float | None = None,
        remote: RemoteTree | None = None,
    ) -> None:
        """Save every partition (controller state + storage units) to ``local_dir`` with TQ's checkpoint.

        TQ writes ``<dir>.tmp`` then swaps it in: ``metadata.json``, ``controller_state.pkl`` and
        ``simple_storage/``. Do not clear rows concurrently (TQ would save a mixed view). TQ actors on other nodes
        write their parts on their own disks: those go straight to ``remote.url`` from there
        (:mod:`screl.dataplane.snapshot`).

        Raises:
            DataPlaneError: TQ actors live on other nodes and no ``remote`` was given.
        """
        path = self._local(local_dir)
        self._ensure_connected()
        meta = dict(metadata or {})
        snapshot.save_tq(path, meta, self._timeout(timeout_s), remote)

    def load(
        self, local_dir: str | os.PathLike[str], *, timeout_s: float | None = None, remote: RemoteTree | None = None
    ) -> None:
        """Restore a :meth:`save` into this data plane.

        TQ requires a freshly started system (no rows in any partition) with the same number of storage
        units as at save time (units are matched by position); load is not transactional. TQ actors on other
        nodes read their parts there: with ``remote`` (the published snapshot and its digests), each such node
        gets its own checked copy first, removed after the load.
        """
        path = self._local(local_dir)
        if not (path / "metadata.json").exists():
            raise FileNotFoundError(f"{path} is not a TransferQueue checkpoint (no metadata.json).")
        everything = self._run(lambda: tq.async_kv_list(None), timeout_s, "list")
        nonempty = {p: len(k) for p, k in everything.items() if k}
        if nonempty:
            raise DataPlaneError(
                f"TransferQueue load needs a freshly started data plane, but it holds rows {nonempty}: "
                f"shut it down and DataPlane.start() a new one with the same num_storage_units."
            )
        snapshot.load_tq(path, self._timeout(timeout_s), remote)

    # ---- teardown

    def close(self) -> None:
        """Drop this process's TQ client (no actor is touched). The owner's ``close`` is :meth:`shutdown`."""
        if self._owner:
            self.shutdown()
            return
        if self._closed:
            return
        self._closed = True
        release_client(self._handle.controller_actor_id)  # the owner in this process keeps it

    def shutdown(self, *, timeout_s: float | None = None) -> None:
        """Stop TQ: kill its storage units and controller and close the client; idempotent (owner only).

        Raises:
            DataPlaneError: Called on an attached copy, or some TQ actor survived ``timeout_s``.
        """
        if not self._owner:
            raise DataPlaneError(
                "Only the DataPlane returned by DataPlane.start() may shut TQ down; use close()."
            )
        if self._closed:
            return
        self._closed = True
        timeout = self._timeout(timeout_s)
        stop_tq(timeout)

    def __enter__(self) -> DataPlane:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        role = "owner" if self._owner else "attached"
        return f"DataPlane(partition_id={self.partition_id!r}, {role}, controller={self._handle.controller_actor_id[:8]})"
