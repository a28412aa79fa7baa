"""Start (or join) the Ray cluster that screl runs on, bound to loopback only.

Ray listens on every interface by default. Two environment variables keep a local cluster on
127.0.0.1 (see ``shared/STACK.md``):

* ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` makes the node IP ``127.0.0.1`` and the GCS, raylet, core
  workers and actors bind there. Ray reads it **when ``ray`` is first imported**
  (``ray._private.ray_constants.ENABLE_RAY_CLUSTER``); setting it later is silently ignored and every
  Ray server binds ``*``. :func:`start_local_ray` therefore also sets that constant when Ray is already
  imported.
* ``RAY_AUTH_MODE=disabled``.

``_node_ip_address="127.0.0.1"`` alone does not help: the servers still bind all interfaces.
TransferQueue's ZMQ servers bind Ray's node IP, so they follow.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from screl.dataplane import ray_worker

log = logging.getLogger(__name__)

LOOPBACK_ENV: dict[str, str] = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled"}
"""Environment that keeps Ray on 127.0.0.1; set before ``ray.init`` (ideally before ``import ray``)."""

LOOPBACK_IPS = frozenset({"127.0.0.1", "::1", "::ffff:127.0.0.1"})

START_ATTEMPTS = 3
"""Starts of a local cluster whose raylet misses Ray's fixed 30 s registration (an overloaded machine) before the
error reaches the caller."""


MONITORS_VAR = "SCREL_RAY_MONITORS"
"""``1``: a local cluster screl starts keeps Ray's autoscaler monitor and log monitor (see :func:`_node_params`)."""


@contextmanager
def _node_params(log_to_driver: bool, worker: str | None) -> Iterator[None]:
    """A local cluster started in the block runs without Ray's autoscaler monitor (``monitor.py``: a fixed local
    cluster has nothing to scale; ``ray status`` then reports no autoscaler state) and, unless the workers' output
    goes to the driver, without its log monitor (which only forwards the workers' log files to the driver; the files
    are written all the same): about 0.85 CPU-s per cluster to boot, and their polling after. These are the
    ``no_monitor`` and ``include_log_monitor`` of Ray's node parameters, which ``ray start`` takes and ``ray.init``
    does not pass on. ``SCREL_RAY_MONITORS=1`` keeps both.

    ``worker``: the program the raylet runs as a Python worker (Ray's own when None; see
    :mod:`screl.dataplane.ray_worker`)."""
    monitors = os.environ.get(MONITORS_VAR) == "1"
    if monitors and worker is None:
        yield
        return
    import ray._private.parameter as parameter

    real = parameter.RayParams

    def node_params(*args: Any, **kwargs: Any) -> Any:
        params = real(*args, **kwargs)
        if not monitors:
            params.no_monitor = True
            if not log_to_driver:
                params.include_log_monitor = False  # type: ignore[assignment]  # Ray annotates it Optional[str]
        if worker is not None:
            params.worker_path = worker
        return params

    parameter.RayParams = node_params  # type: ignore[misc,assignment]
    try:
        yield
    finally:
        parameter.RayParams = real  # type: ignore[misc]


CLUSTER_DEFAULTS = {
    # TransferQueue's put/get pins torch to TQ_NUM_THREADS threads (default 8, clamped to the physical cores, with a
    # warning) and Ray workers inherit this environment: one thread is right on CPU.
    "TQ_NUM_THREADS": "1",
    # Ray prestarts one idle Python worker per logical CPU for the first driver; screl's few actors start their own,
    # so on a small machine the idle ones only compete with them for the cores (about 3 CPU-s and 2 s of wall time
    # per start-up on 2 cores). SCREL users may still set it to 1.
    "RAY_prestart_worker_first_driver": "0",
}
"""Variables a local cluster's start sets where they are unset (the raylet and its workers inherit them)."""


def cluster_env(env: Any) -> None:
    """Set in ``env`` (a mapping: ``os.environ``, or a process's environment to be) what this process's environment
    holds when it starts a local cluster: :data:`LOOPBACK_ENV`, and :data:`CLUSTER_DEFAULTS` where unset."""
    env.update(LOOPBACK_ENV)
    for key, value in CLUSTER_DEFAULTS.items():
        env.setdefault(key, value)


def _force_loopback_env() -> None:
    cluster_env(os.environ)
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # `import ray` already happened: its import-time read missed the variable
        constants.ENABLE_RAY_CLUSTER = False  # type: ignore[attr-defined]


def start_local_ray(
    num_cpus: int = 6,
    namespace: str = "screl",
    address: str | None = None,
    *,
    log_to_driver: bool = False,
    object_store_memory: int | None = None,
    gpu_ids: Sequence[str] | None = None,
) -> bool:
    """Start a loopback-only local Ray cluster, or join ``address``; return whether this call started Ray.

    Args:
        num_cpus: Logical CPUs of a new local cluster (ignored when joining). TransferQueue needs
            ``1 + num_storage_units`` of them; logical CPUs may exceed the physical cores.
        namespace: Ray namespace of this driver (named actors live there).
        address: ``host:port`` of a running cluster to join; ``None`` always starts a new local
            cluster (never silently attaches to one found through ``RAY_ADDRESS`` or ``/tmp/ray``).
        log_to_driver: Forward worker stdout/stderr to this process.
        object_store_memory: Object store size in bytes for a new cluster (Ray's default when ``None``).
        gpu_ids: The GPUs a new local cluster may hand to actors (the device map's inference GPUs,
            :mod:`screl.placement`): Ray gets ``num_gpus=len(gpu_ids)`` and its raylet alone sees
            ``CUDA_VISIBLE_DEVICES`` naming them, so Ray's GPU pool is exactly those devices and ``ray.get_gpu_ids()``
            in an actor names the physical ids. ``None``: Ray counts the GPUs itself (every visible one).

    Returns:
        ``False`` when Ray was already initialised in this process (nothing is done), else ``True``. A cluster
        :func:`prestart_local_ray` began with the same arguments is this call's: it waits for it and returns
        ``True``; one begun with other arguments is shut down first.
    """
    _prestart_times.pop("taken", None)
    wanted = dict(num_cpus=num_cpus, namespace=namespace, log_to_driver=log_to_driver,
                  gpu_ids=None if gpu_ids is None else tuple(gpu_ids))
    if address is None and object_store_memory is None and _adopt_prestarted(wanted):
        return True
    return _start(num_cpus, namespace, address, log_to_driver=log_to_driver, object_store_memory=object_store_memory,
                  gpu_ids=gpu_ids)


def _start(num_cpus: int, namespace: str, address: str | None, *, log_to_driver: bool,
           object_store_memory: int | None, gpu_ids: Sequence[str] | None) -> bool:
    import ray

    _settle_prestart()
    if ray.is_initialized():
        return False
    _force_loopback_env()
    level = logging.INFO if log_to_driver else logging.WARNING  # quiet unless the workers' output is wanted
    if address is not None:
        ray.init(address=address, namespace=namespace, log_to_driver=log_to_driver, logging_level=level)
        return True
    kwargs: dict[str, Any] = dict(address="local", num_cpus=num_cpus, num_gpus=None if gpu_ids is None else len(gpu_ids),
                                  namespace=namespace, include_dashboard=False, log_to_driver=log_to_driver,
                                  logging_level=level, object_store_memory=object_store_memory)
    _start_local(ray, kwargs, gpu_ids)
    _check_loopback(ray)
    return True


PRESTART_THREAD = "screl-ray-prestart"
_prestart_lock = threading.Lock()
_prestarted: tuple[dict[str, Any], concurrent.futures.Future[bool]] | None = None
"""The arguments and the outcome of the local start :func:`prestart_local_ray` began, until a caller takes it."""
_prestart_times: dict[str, float] = {}  # monotonic: "up" (the prestart's start returned), "taken" (adopted)


def adopted_prestart_s() -> float | None:
    """How long before :func:`start_local_ray` took it over the prestarted cluster was up (0: the caller waited for
    it), or None when the running cluster was not prestarted."""
    if "taken" not in _prestart_times:
        return None
    return max(0.0, _prestart_times["taken"] - _prestart_times["up"])


def prestart_local_ray(num_cpus: int, namespace: str, log_to_driver: bool, gpu_ids: Sequence[str] = ()) -> None:
    """Begin starting the local cluster :func:`start_local_ray` will ask for, in a thread: ``screl fit`` calls it
    before it imports Lightning and parses its config, so Ray's processes come up meanwhile (Ray's start is mostly
    waiting for them). ``start_local_ray`` with the same arguments takes it over; if nobody does, it is shut down
    at exit. Call it from the main thread.

    The thread outlives the start: Ray binds its GCS and raylet to the life of the *thread* that spawned them
    (Linux's parent-death signal), so it waits, idle, until the process ends. Ray sets its SIGTERM handler (exit,
    so that its shutdown runs) only from the main thread: this sets the same one here."""
    global _prestarted
    _fork_zygote()
    import ray  # here, not in the thread: one import of Ray at a time beside the driver's own imports

    with _prestart_lock:
        if _prestarted is not None or ray.is_initialized():
            return
        args = dict(num_cpus=num_cpus, namespace=namespace, log_to_driver=log_to_driver, gpu_ids=tuple(gpu_ids))
        future: concurrent.futures.Future[bool] = concurrent.futures.Future()

        def run() -> None:
            quiet = _DropMessage("SIGTERM handler is not set")
            ray_worker_log = logging.getLogger("ray._private.worker")
            ray_worker_log.addFilter(quiet)
            try:
                started = _start(num_cpus, namespace, None, log_to_driver=log_to_driver, object_store_memory=None,
                                 gpu_ids=list(gpu_ids))
                _prestart_times["up"] = time.monotonic()
                future.set_result(started)
            except BaseException as err:  # noqa: BLE001 - handed to whoever takes the start
                future.set_exception(err)
            finally:
                ray_worker_log.removeFilter(quiet)
            threading.Event().wait()  # Ray's processes die with the thread that started them

        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))  # Ray's own, from the main thread
        _prestarted = (args, future)
        _prestart_times.clear()
        threading.Thread(target=run, name=PRESTART_THREAD, daemon=True).start()
        atexit.register(_settle_prestart)


def _fork_zygote() -> None:
    """The worker zygote of the cluster the prestart begins, forked from this process before it imports Ray (a
    zygote must not have it) while it runs one thread: it imports its modules beside the driver, from what this
    process has imported (a process forked with torch and transformers imported, as the tests' launches are, has
    little left to import)."""
    from screl.dataplane import worker_zygote

    if _early_zygote or not worker_zygote.enabled() or "ray" in sys.modules or threading.active_count() > 1:
        return
    _early_zygote.append(worker_zygote.WorkerZygote.forked(cluster=_cluster_vars()))


def _cluster_vars() -> dict[str, str]:
    """What :func:`cluster_env` will have set in this process's environment when it starts the cluster."""
    env = dict(os.environ)
    cluster_env(env)
    return {k: env[k] for k in (*LOOPBACK_ENV, *CLUSTER_DEFAULTS)}


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def _take_prestart() -> tuple[dict[str, Any], concurrent.futures.Future[bool]] | None:
    global _prestarted
    with _prestart_lock:
        taken, _prestarted = _prestarted, None
    return taken


def _adopt_prestarted(wanted: dict[str, Any]) -> bool:
    """Whether a prestarted cluster with the ``wanted`` arguments came up (it is then the caller's). A failed
    prestart is logged and the caller starts Ray itself (any error comes again, from its own start)."""
    taken = _take_prestart()
    if taken is None:
        return False
    args, future = taken
    try:
        future.result()
    except BaseException as err:  # noqa: BLE001
        log.warning("screl: Ray's early start failed (%s); starting it again", err)
        return False
    if args == wanted:
        _prestart_times["taken"] = time.monotonic()
        return True
    import ray

    log.info("screl: Ray was started early with %s, the run asks for %s: starting it again", args, wanted)
    ray.shutdown()
    return False


def _settle_prestart() -> None:
    """Stop a prestarted cluster nobody took (after it came up: two starts never overlap): at exit, or before a
    start with other arguments (a joined cluster, GPUs)."""
    if threading.current_thread().name == PRESTART_THREAD:
        return
    taken = _take_prestart()
    if taken is None:
        return
    try:
        started = taken[1].result(timeout=120)
    except BaseException:  # noqa: BLE001 - nothing started
        return
    import ray

    if started and ray.is_initialized():
        ray.shutdown()


def _check_loopback(ray: Any) -> None:
    """Shut the new cluster down, and say how to fix it, unless its node IP is loopback."""
    node_ip = ray.util.get_node_ip_address()
    if node_ip.strip("[]") not in LOOPBACK_IPS:
        ray.shutdown()
        raise RuntimeError(
            f"Ray started with node IP {node_ip!r}, not loopback: set "
            f"{' '.join(f'{k}={v}' for k, v in LOOPBACK_ENV.items())} before `import ray`."
        )


def _start_local(ray: Any, kwargs: dict[str, Any], gpu_ids: Sequence[str] | None) -> None:
    """``ray.init(**kwargs)`` of a new local cluster whose raylet sees only ``gpu_ids`` (None: every GPU)."""
    # Ray prestarts one idle Python worker per logical CPU for the first driver; screl's few actors start
    # their own, so on a small machine the idle ones only compete with them for the cores (about 3 CPU-s
    # and 2 s of wall time per start-up on 2 cores). SCREL users may still set it to 1.
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    saved = os.environ.get("CUDA_VISIBLE_DEVICES")
    if gpu_ids is not None:  # the raylet (a child process) inherits it; this process's CUDA read its own already
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(gpu_ids)
    zygote = None
    try:
        zygote = _start_zygote(gpu_ids)
        worker = None if zygote is None else ray_worker.SCRIPT
        with _node_params(kwargs["log_to_driver"], worker):
            _init_with_retries(ray, kwargs)
        if zygote is not None:
            zygote.watch_raylet(_raylet_pid(ray))
    except BaseException:
        if zygote is not None:
            zygote.stop()
        raise
    finally:
        os.environ.pop(ray_worker.ZYGOTE_VAR, None)
        if gpu_ids is not None:
            if saved is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = saved


_early_zygote: list[Any] = []
"""The worker zygote :func:`prestart_local_ray` forked, until the start it began takes it."""


def _start_zygote(gpu_ids: Sequence[str] | None) -> Any:
    """The worker zygote of the cluster about to start (:mod:`screl.dataplane.worker_zygote`), its socket in this
    process's environment for the raylet to inherit: the one forked at the prestart, else a new interpreter. None
    when ``SCREL_RAY_WORKER_FORK=0`` or where the cluster may have GPUs (``gpu_ids`` not empty, or None: Ray counts
    them): a worker forked after its zygote touched CUDA could not use it, so Ray's own program starts those."""
    from screl.dataplane import worker_zygote
    from screl.placement_env import node_gpu_ids

    early = _early_zygote.pop() if _early_zygote else None
    if node_gpu_ids(os.environ) if gpu_ids is None else gpu_ids:
        if early is not None:
            early.stop()
        return None
    if early is not None:
        zygote = early
    elif worker_zygote.enabled():
        zygote = worker_zygote.WorkerZygote(dict(os.environ))  # imports at its first worker (or warm_worker_zygote)
    else:
        return None
    atexit.register(zygote.stop)
    os.environ[ray_worker.ZYGOTE_VAR] = zygote.path
    _zygote[:] = [zygote]
    return zygote


_zygote: list[Any] = []
"""The worker zygote of the local cluster this process started last."""


def warm_worker_zygote() -> None:
    """Have the local cluster's worker zygote import now, if it waits for its first worker: the caller is about to
    start actors (the rollout side at its first batch)."""
    if _zygote:
        _zygote[0].warm()


def _raylet_pid(ray: Any) -> int:
    node = ray._private.worker._global_node
    return int(node.all_processes[ray._private.ray_constants.PROCESS_TYPE_RAYLET][0].process.pid)


def _init_with_retries(ray: Any, kwargs: dict[str, Any]) -> None:
    """``ray.init``, started again (at most ``START_ATTEMPTS`` in all) while its raylet misses registration."""
    for attempt in range(1, START_ATTEMPTS + 1):
        try:
            ray.init(**kwargs)
            break
        except Exception as err:  # Ray raises a bare Exception when its raylet misses its 30 s registration
            if "timed out during startup" not in str(err) or attempt == START_ATTEMPTS:
                raise
            log.warning("screl: the local Ray cluster did not come up (%s); starting it again (%d of %d): an "
                        "overloaded machine", str(err).split(".")[0], attempt + 1, START_ATTEMPTS)
            ray.shutdown()


def stop_ray_if_started(started: bool) -> None:
    """Shut Ray down if ``started`` (the value :func:`start_local_ray` returned); otherwise leave it be."""
    if not started:
        return
    import ray

    if ray.is_initialized():
        ray.shutdown()


def listening_addresses(pids: set[int] | None = None) -> list[tuple[int, str, int]]:
    """``(pid, ip, port)`` of every listening TCP socket of this process and its descendants (or ``pids``).

    A local Ray cluster's GCS, raylet, workers and actors all descend from the driver that started it,
    so this covers Ray and TransferQueue; used to check that nothing listens beyond loopback.
    """
    import psutil

    if pids is None:
        me = psutil.Process()
        pids = {me.pid} | {p.pid for p in me.children(recursive=True)}
    found = []
    for conn in psutil.net_connections(kind="tcp"):
        if conn.status == psutil.CONN_LISTEN and conn.pid in pids and conn.laddr:
            found.append((int(conn.pid), str(conn.laddr.ip), int(conn.laddr.port)))
    return found
