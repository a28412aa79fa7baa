"""A local cluster's *worker zygote*: one process that imports what screl's Ray workers import, once, and forks a
Ray worker per request of :mod:`screl.dataplane.ray_worker` (the program the raylet runs as a worker).

A Ray worker started cold imports Ray and, once its actor's class arrives, torch and screl's modules; the generation
worker then imports transformers' model code while it unpickles its arguments: 2 to 4.5 CPU-seconds a process,
several processes a run, every run. The zygote pays that once per cluster, beside the driver's own start-up; a forked
worker imports only Ray and screl's actor modules, and runs Ray's ``default_worker.py`` as a cold one would (its
arguments, environment, working directory and standard streams are the raylet's).

A worker is forked only under the environment the zygote imported under (:func:`refusal`: what may differ is what
nothing it imported reads at import). Anything else is refused and started by Ray's own program. The zygote ends with
the process that started it (its control pipe closes), or once the cluster's raylet is gone; the workers it forked
are the raylet's to end, as ever. ``SCREL_RAY_WORKER_FORK=0`` turns it off (Ray's own program starts every worker).
See ``docs/running.md`` ("What starts").
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

from screl._as_main import run_as_main

OFF_VAR = "SCREL_RAY_WORKER_FORK"

PRELOAD = ("torch", "transformers.models.qwen2.modeling_qwen2", "tensordict", "pyarrow", "zmq", "omegaconf",
           "screl.rollout.engines")
"""What screl's actors import before they work, Ray aside: torch, the policy model's code the generation worker
unpickles, TransferQueue's tensordict, ZMQ and omegaconf, pyarrow, and the engines' modules. One that fails to import
is left to the workers (they import it themselves, as cold ones do). Ray is not among them, nor anything that imports
it: its core library reads its configuration (the worker's job id among it) from the environment once, when it
loads, so each worker loads it under its own variables (a zygote that finds Ray imported refuses every worker)."""

PER_WORKER = frozenset({"RAY_JOB_ID", "RAY_RAYLET_PID", "OMP_NUM_THREADS", "PYTHONBREAKPOINT", "SPT_NOENV",
                        "RAY_LD_PRELOAD_ON_WORKERS", "TORCHINDUCTOR_CACHE_DIR", "RAY_USAGE_STATS_ENABLED",
                        "CUDA_VISIBLE_DEVICES", "PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK",
                        "TOKENIZERS_PARALLELISM"})
RUNTIME_PREFIXES = ("RAY_", "SCREL_", "PL_")
"""Variables a forked worker may have other than the zygote's, none read at import by what the zygote imported. Ray
sets the first ones per worker or job (``OMP_NUM_THREADS`` is applied in the worker; ``CUDA_VISIBLE_DEVICES`` is read
when CUDA initialises, which a zygote never does); pytest names its test. ``RAY_*`` are read by the worker's own
import of Ray, screl's and Lightning's as the run goes (the device map, the seed); they and the last two (Lightning's
CUDA check, the tokenizers' fork guard) are set by the driver while Ray starts beside it (:mod:`screl.prestart`), so
the raylet may or may not have them. ``TORCHINDUCTOR_CACHE_DIR`` is read when something compiles."""

WORKER_DEFAULTS = {"OMP_NUM_THREADS": "1", "SPT_NOENV": "1", "RAY_LD_PRELOAD_ON_WORKERS": "0"}
"""What the raylet adds to a Python worker's environment (``OMP_NUM_THREADS`` when it is unset): the zygote imports
under them."""


NICENESS_VAR = "RAY_worker_niceness"
RAY_WORKER_NICENESS = 15
"""Ray's default: a worker lowers its priority by this much when it starts (``RAY_worker_niceness``)."""


def worker_niceness() -> int:
    """The niceness Ray gives its workers (the zygote's environment's ``RAY_worker_niceness``, else Ray's default).
    The zygote takes it before it imports, and its workers keep it (Ray's own adjustment is set to 0 in them)."""
    value = os.environ.get(NICENESS_VAR, "")
    return int(value) if value.lstrip("-").isdigit() else RAY_WORKER_NICENESS


def enabled() -> bool:
    return os.environ.get(OFF_VAR) != "0"


class WorkerZygote:
    """The driver's handle on a zygote it started: its socket path (for the raylet's environment), and its end.

    Started as a fresh interpreter under ``env`` (``WorkerZygote(env)``), or forked from this process
    (:meth:`forked`) while it has not imported Ray: it then starts from what this process imported already."""

    def __init__(self, env: dict[str, str] | None, preload: Sequence[str] = PRELOAD, *, fork: bool = False,
                 eager: bool = False, cluster: Mapping[str, str] | None = None) -> None:
        self.dir = tempfile.mkdtemp(prefix="screl-zygote-")
        self.path = os.path.join(self.dir, "sock")
        control_r, self.control = os.pipe()
        if fork:
            self.pid = os.fork()
            if self.pid == 0:  # the zygote: never returns into the caller
                code = 1
                try:
                    os.close(self.control)
                    apply_worker_defaults(os.environ, cluster)
                    code = serve(self.path, preload, control_r, eager=True)
                finally:
                    os._exit(code)
        else:
            assert env is not None
            env = dict(env)
            apply_worker_defaults(env, cluster)
            bootstrap = ("import os, sys; from screl.dataplane.worker_zygote import serve; "
                         "sys.exit(serve(sys.argv[2], sys.argv[3:], int(os.environ.pop('SCREL_ZYGOTE_CONTROL')), "
                         "eager=sys.argv[1] == 'eager'))")
            env["SCREL_ZYGOTE_CONTROL"] = str(control_r)
            proc = subprocess.Popen([sys.executable, "-c", bootstrap, "eager" if eager else "lazy", self.path, *preload],
                                    env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, pass_fds=(control_r,))
            self.pid = proc.pid
            proc.returncode = 0  # reaped here (see poll), not by subprocess
        os.close(control_r)
        self.returncode: int | None = None

    @classmethod
    def forked(cls, preload: Sequence[str] = PRELOAD, cluster: Mapping[str, str] | None = None) -> WorkerZygote:
        """A zygote forked from this process (which must not have imported Ray, nor started threads); it imports at
        once."""
        return cls(None, preload, fork=True, cluster=cluster)

    def watch_raylet(self, pid: int) -> None:
        """Tell the zygote the cluster's raylet: it ends when that process does."""
        self._send(f"raylet {pid}")

    def warm(self) -> None:
        """Tell the zygote to import now (a lazy one waits for its first worker): workers are on their way."""
        self._send("preload")

    def _send(self, line: str) -> None:
        try:
            os.write(self.control, f"{line}\n".encode())
        except OSError:
            pass

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                self.returncode = -1
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def stop(self, timeout_s: float = 10.0) -> None:
        """Close its control pipe (it exits, as when this process ends) and wait for it; kill it past ``timeout_s``."""
        try:
            os.close(self.control)
        except OSError:
            pass
        end = time.monotonic() + timeout_s
        while self.poll() is None and time.monotonic() < end:
            time.sleep(0.02)
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)
            while self.poll() is None:
                time.sleep(0.02)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


def apply_worker_defaults(env: Any, cluster: Mapping[str, str] | None) -> None:
    """``cluster`` (what the driver sets in its environment before it starts the cluster:
    :func:`screl.dataplane.cluster.cluster_env`) and what the raylet adds to a worker's, into ``env``: the zygote
    imports under the workers' variables."""
    env.update(cluster or {})
    for key, value in WORKER_DEFAULTS.items():
        env.setdefault(key, value)


# --- the zygote's side ---------------------------------------------------------------------------------------


NAME = "screl-zygote"
"""A zygote's process name (``ps -o comm``, ``psutil.Process.name()``): a zygote forked from ``screl fit`` has the
driver's command line."""


def serve(path: str, preload: Sequence[str], control: int, eager: bool = True) -> int:
    """Listen on ``path``, import ``preload`` (at once where ``eager``, else at the first worker's request or when the
    driver says so), then fork a Ray worker per request until ``control`` (a pipe from the driver) closes or the
    raylet it names ends."""
    from screl.dataplane.ray_worker import default_worker

    if sys.path and sys.path[0] == "":  # ``-c``: as a cold worker's, the path starts at Ray's workers' folder
        sys.path[0] = os.path.dirname(default_worker())
    try:
        with open("/proc/self/comm", "w") as comm:
            comm.write(NAME)
    except OSError:
        pass
    os.nice(max(0, worker_niceness() - os.nice(0)))  # as the workers run: the driver's start-up comes first
    server = _Server(path, control, preload)
    if eager:
        server.preload()
    server.run()
    return 0


class _Server:
    def __init__(self, path: str, control: int, preload: Sequence[str]) -> None:
        self.path, self.control, self.modules = path, control, tuple(preload)
        self.env: dict[str, str] | None = None  # what the imports saw, once they are done
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(path)
        self.listener.listen(64)
        self.conns: dict[int, tuple[socket.socket, int]] = {}  # a stand-in's connection fd -> (it, worker pid)
        self.by_pid: dict[int, socket.socket] = {}
        self.raylets: set[int] = set()
        self.pending = b""

    def preload(self) -> None:
        import importlib

        if self.env is not None:
            return
        for module in self.modules:
            try:
                importlib.import_module(module)
            except Exception as err:  # noqa: BLE001 - a worker that needs it imports it (and reports it) itself
                print(f"screl worker zygote: {module} not preloaded: {err}", file=sys.stderr)
        self.env = dict(os.environ)

    def run(self) -> None:
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.signal(signal.SIGCHLD, lambda signum, frame: None)
        signal.set_wakeup_fd(wake_w)
        listening = self.listener.fileno()
        keep = (listening, wake_r, wake_w, self.control)
        while True:
            try:
                readable, _, _ = select.select([listening, wake_r, self.control, *self.conns], [], [], 1.0)
            except InterruptedError:
                readable = []
            if wake_r in readable:
                os.read(wake_r, 4096)
            _reap(self.by_pid, self.conns)
            if self.control in readable and not self._read_control():
                break  # the driver is gone or done with the cluster
            if self.raylets and not any(_alive(pid) for pid in self.raylets):
                break
            for fd in [fd for fd in readable if fd in self.conns]:
                self._stand_in_readable(fd)
            if listening in readable:
                self.preload()
                assert self.env is not None
                _accept(self.listener, self.env, self.conns, self.by_pid, keep)
        self.listener.close()
        os.unlink(self.path)

    def _read_control(self) -> bool:
        chunk = os.read(self.control, 4096)
        if not chunk:
            return False
        self.pending += chunk
        while b"\n" in self.pending:
            line, self.pending = self.pending.split(b"\n", 1)
            if line.startswith(b"raylet "):
                self.raylets.add(int(line.split()[1]))
            elif line == b"preload":
                self.preload()
        return True

    def _stand_in_readable(self, fd: int) -> None:
        sock, pid = self.conns[fd]
        if sock.recv(1, socket.MSG_PEEK):
            return
        del self.conns[fd]  # its stand-in is gone: so is the worker
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        sock.close()
        self.by_pid.pop(pid, None)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, IndexError):
        return False


def _reap(by_pid: dict[int, socket.socket], conns: dict[int, tuple[socket.socket, int]]) -> None:
    """Report every worker that ended to its stand-in."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        sock = by_pid.pop(pid, None)
        if sock is None:
            continue
        conns.pop(sock.fileno(), None)
        try:
            sock.sendall(b"X" + struct.pack("!i", os.waitstatus_to_exitcode(status)))
        except OSError:
            pass
        sock.close()


def refusal(request: dict[str, Any], env: dict[str, str]) -> str | None:
    """Why a worker cannot be forked from a zygote that imported under ``env`` (None: it can): another interpreter,
    or variables that differ other than :data:`PER_WORKER` and those with a :data:`RUNTIME_PREFIXES` prefix."""
    if request.get("executable") != sys.executable:
        return f"interpreter {request.get('executable')} (the zygote's: {sys.executable})"
    theirs = request["env"]
    differ = sorted(k for k in set(theirs) | set(env)
                    if k not in PER_WORKER and not k.startswith(RUNTIME_PREFIXES) and theirs.get(k) != env.get(k))
    if differ:
        return f"environment differs from the zygote's: {', '.join(differ)}"
    return None


_refused: list[str] = []


def _accept(listener: socket.socket, env: dict[str, str], conns: dict[int, tuple[socket.socket, int]],
            by_pid: dict[int, socket.socket], keep: tuple[int, ...]) -> None:
    sock, _ = listener.accept()
    try:
        data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
        if len(data) < 4 or len(fds) != 3:
            raise OSError("a short request")
        size = struct.unpack("!I", data[:4])[0]
        body = data[4:]
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                raise OSError("a short request")
            body += chunk
        request = json.loads(body)
    except (OSError, ValueError) as err:
        print(f"screl worker zygote: a bad request: {err}", file=sys.stderr)
        sock.close()
        return
    reason = "Ray was imported by the preload" if "ray" in sys.modules else refusal(request, env)
    if reason is not None:
        if not _refused:  # once: every worker of a cluster would say the same
            print(f"screl: the worker zygote refused a Ray worker ({reason}); Ray's own program starts it, and "
                  "the next that differ the same way", file=sys.stderr)
        _refused.append(reason)
        for fd in fds:
            os.close(fd)
        sock.sendall(b"R")
        sock.close()
        return
    pid = os.fork()
    if pid == 0:
        for fd in keep:
            os.close(fd)
        for other, _ in conns.values():
            other.close()
        _child(request, fds, sock)  # never returns
    for fd in fds:
        os.close(fd)
    sock.sendall(b"P" + struct.pack("!q", pid))
    conns[sock.fileno()] = (sock, pid)
    by_pid[pid] = sock


def _child(request: dict[str, Any], fds: list[int], sock: socket.socket) -> None:
    """Become the Ray worker ``python *request["args"]``, then exit with its code."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()  # its own process group, as the raylet starts a cold worker (not the driver's, as the zygote)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in fds:
            if fd > 2:
                os.close(fd)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[NICENESS_VAR] = "0"  # Ray's worker makes itself this much nicer: the zygote already is
        tempfile.tempdir = None  # TMPDIR is read again
        _apply_threads()
        _reseed()
        threading.Thread(target=_die_with_stand_in, args=(sock,), name="screl-stand-in-watch", daemon=True).start()
        code = run_as_main(request["args"])
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit code
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)


def _die_with_stand_in(sock: socket.socket) -> None:
    """The raylet's process for this worker is its stand-in: when it is killed, so is the worker."""
    try:
        while sock.recv(1):
            pass
    except OSError:
        pass
    os.kill(os.getpid(), signal.SIGKILL)


def _apply_threads() -> None:
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if torch is not None and threads.isdigit() and int(threads) > 0 and torch.get_num_threads() != int(threads):
        torch.set_num_threads(int(threads))


def _reseed() -> None:
    """Forked workers would share the zygote's random state where a cold one draws its own."""
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed()
