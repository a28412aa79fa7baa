"""A local cluster's *worker zygote*: one process that imports what screl's Ray workers import, once, and forks a
Ray worker per request of :mod:`screl.dataplane.ray_worker` (the program the raylet runs as a worker).

A Ray worker started cold imports Ray and, once its actor's class arrives, torch and screl's modules; the generation worker then imports transformers' model
code while it unpickles its arguments: 2 to 4.5 CPU-seconds a process, several processes a run, every run. The zygote
pays that once per cluster, while the driver imports Lightning; a forked worker starts in a few hundredths of a second
and runs Ray's ``default_worker.py`` as a cold one would (its arguments, environment, working directory and standard
streams are the raylet's).

A worker is forked only under the environment the zygote imported under (:data:`PER_WORKER` may differ: Ray sets them
per worker and nothing reads them at import; ``OMP_NUM_THREADS`` is applied with ``torch.set_num_threads``). Anything
else is refused and started by Ray's own program. The zygote ends with the process that started it (its stdin closes),
or once the cluster's raylet is gone; the workers it forked are the raylet's to end, as ever. ``SCREL_RAY_WORKER_FORK=0``
turns it off (Ray's own program starts every worker).
"""

from __future__ import annotations

import json
import logging
import os
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

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
                        "SCREL_WORKER_ZYGOTE", "PYTEST_CURRENT_TEST", "PYTORCH_NVML_BASED_CUDA_CHECK",
                        "TOKENIZERS_PARALLELISM"})
"""Variables a forked worker may have other than the zygote's, none of them read at import time: Ray sets the first
ones for the raylet or per worker (or per job; ``OMP_NUM_THREADS`` is applied in the worker), screl names the
zygote's socket, pytest the current test, and the driver's own imports set the last two (Lightning's CUDA check, read
when CUDA's availability is asked; the tokenizers' fork guard, read when a tokenizer goes parallel) while Ray starts
beside them (:mod:`screl.prestart`), so the raylet may or may not have them. ``TORCHINDUCTOR_CACHE_DIR`` is read when
something compiles."""

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
    """The driver's handle on a zygote it started: its socket path (for the raylet's environment), and its end."""

    def __init__(self, env: dict[str, str]) -> None:
        self.dir = tempfile.mkdtemp(prefix="screl-zygote-")
        self.path = os.path.join(self.dir, "sock")
        env = {**env, **{k: v for k, v in WORKER_DEFAULTS.items() if k not in env}}
        bootstrap = ("import sys; from screl.dataplane.worker_zygote import serve; serve(sys.argv[1])")
        self.proc = subprocess.Popen([sys.executable, "-c", bootstrap, self.path], stdin=subprocess.PIPE, env=env,
                                     stdout=subprocess.DEVNULL)

    def watch_raylet(self, pid: int) -> None:
        """Tell the zygote the cluster's raylet: it ends when that process does."""
        try:
            assert self.proc.stdin is not None
            self.proc.stdin.write(f"raylet {pid}\n".encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            pass

    def stop(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        for name in ("sock",):
            try:
                os.unlink(os.path.join(self.dir, name))
            except FileNotFoundError:
                pass
        try:
            os.rmdir(self.dir)
        except OSError:
            pass


# --- the zygote's side ---------------------------------------------------------------------------------------


def serve(path: str) -> None:
    """Listen on ``path``, import :data:`PRELOAD`, then fork a Ray worker per request until stdin closes or the
    raylet named on stdin ends."""
    import importlib

    from screl.dataplane.ray_worker import default_worker

    if sys.path and sys.path[0] == "":  # ``-c``: as a cold worker's, the path starts at Ray's workers' folder
        sys.path[0] = os.path.dirname(default_worker())
    try:
        from setproctitle import setproctitle

        setproctitle("screl::worker-zygote")
    except ImportError:
        pass
    os.nice(max(0, worker_niceness() - os.nice(0)))  # as the workers run: the driver's start-up comes first
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as err:  # noqa: BLE001 - a worker that needs it imports it (and reports it) itself
            print(f"screl worker zygote: {name} not preloaded: {err}", file=sys.stderr)
    env = dict(os.environ)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    control = sys.stdin.fileno()
    conns: dict[int, tuple[socket.socket, int]] = {}  # client fd -> (socket, worker pid)
    by_pid: dict[int, socket.socket] = {}
    raylets: set[int] = set()
    pending = b""
    while True:
        try:
            readable, _, _ = select.select([listener, wake_r, control, *conns], [], [], 1.0)
        except InterruptedError:
            readable = []
        if wake_r in readable:
            os.read(wake_r, 4096)
        _reap(by_pid, conns)
        if control in readable:
            chunk = os.read(control, 4096)
            if not chunk:
                break  # the driver is gone or done with the cluster
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                if line.startswith(b"raylet "):
                    raylets.add(int(line.split()[1]))
        if raylets and not any(_alive(pid) for pid in raylets):
            break
        for fd in [fd for fd in readable if fd in conns]:
            sock, pid = conns.pop(fd)
            if not sock.recv(1, socket.MSG_PEEK):  # its stand-in is gone: so is the worker
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                sock.close()
                by_pid.pop(pid, None)
        if listener in readable:
            _accept(listener, env, conns, by_pid, keep=(listener.fileno(), wake_r, wake_w, control))
    listener.close()
    os.unlink(path)


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
    or variables other than :data:`PER_WORKER` that differ."""
    if request.get("executable") != sys.executable:
        return f"interpreter {request.get('executable')} (the zygote's: {sys.executable})"
    theirs = request["env"]
    differ = sorted(k for k in set(theirs) | set(env) if k not in PER_WORKER and theirs.get(k) != env.get(k))
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
        code = _run(request["args"])
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


def _run(args: list[str]) -> int:
    """Run the script ``args[0]`` with ``args[1:]`` as a fresh interpreter would; its exit code."""
    import atexit
    import runpy

    code = 0
    try:
        sys.argv = list(args)
        sys.path[0] = str(Path(args[0]).resolve().parent)
        runpy.run_path(args[0], run_name="__main__")
    except SystemExit as done:
        code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 - as the interpreter reports an uncaught exception
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # the interpreter's exit: non-daemon threads, then atexit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    return code
