"""The program a local cluster's raylet runs as a Python worker (Ray's ``worker_path``).

Ray's own (``ray/_private/workers/default_worker.py``) imports Ray, connects to the raylet and then, when an actor's
class arrives, imports torch and screl's modules: about 2 CPU-seconds before the worker does anything, 4.5 for the
generation worker (transformers' model code). This program imports only the standard library and hands the start to
the cluster's *worker zygote* (:mod:`screl.dataplane.worker_zygote`): a process that imported those modules once and
forks a worker per request, which runs ``default_worker.py`` with this program's arguments, environment, working
directory and standard streams. The forked worker is the Ray worker (it registers with the raylet under its own
pid); this process stays its stand-in for the raylet: it passes on the signals it gets and ends when the worker ends,
with the worker's status, and the worker kills itself should this process be killed first. A start the zygote
refuses (another interpreter, variables that differ from the zygote's where they are read at import; see
:func:`screl.dataplane.worker_zygote.refusal`) or cannot take (no zygote) becomes Ray's own program, unchanged.

Run as a script by the raylet, with ``default_worker.py``'s arguments (after Ray's ``setup_worker.py`` applied a
runtime environment, where the worker has one).
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import struct
import sys
from typing import NoReturn

ZYGOTE_VAR = "SCREL_WORKER_ZYGOTE"
"""The zygote's socket path, in the raylet's environment (set by :func:`screl.dataplane.cluster.start_local_ray`)."""

SCRIPT = os.path.abspath(__file__)

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def default_worker() -> str:
    """Ray's own worker program, found without importing Ray."""
    import importlib.util

    spec = importlib.util.find_spec("ray")
    if spec is None or spec.origin is None:
        raise RuntimeError("ray is not importable by this interpreter")
    return os.path.join(os.path.dirname(spec.origin), "_private", "workers", "default_worker.py")


def _ray_own(argv: list[str]) -> NoReturn:
    """Become Ray's own worker program with the same arguments (never returns)."""
    os.execv(sys.executable, [sys.executable, default_worker(), *argv])


def stand_in_name(pid: int) -> str:
    """The process name (``ps -o comm``, ``psutil.Process.name()``) of the stand-in of the worker ``pid``."""
    return f"screl-w{pid}"


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def _wait_orphan(pid: int) -> int:
    """The zygote is gone before it reported the worker's end: wait for the worker itself (its status is lost)."""
    try:
        fd = os.pidfd_open(pid)
    except (ProcessLookupError, OSError):
        return 1
    select.select([fd], [], [])
    return 1


def main(argv: list[str]) -> None:
    path = os.environ.get(ZYGOTE_VAR)
    if not path:
        _ray_own(argv)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
        payload = json.dumps({"args": [default_worker(), *argv], "env": dict(os.environ), "cwd": os.getcwd(),
                              "executable": sys.executable}).encode()
        socket.send_fds(sock, [struct.pack("!I", len(payload)) + payload], [0, 1, 2])
        head = _recv_exact(sock, 1)
    except OSError:
        head = b""
    if head != b"P":  # refused, or no zygote to take it: Ray's own program
        sock.close()
        _ray_own(argv)
    pid = struct.unpack("!q", _recv_exact(sock, 8))[0]
    try:
        with open("/proc/self/comm", "w") as comm:  # which worker this process stands in for, in ps and top
            comm.write(stand_in_name(pid))
    except OSError:
        pass

    def forward(signum: int, frame: object) -> None:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = _recv_exact(sock, 5)  # the handlers above return: an interrupted recv is retried (PEP 475)
    if len(status) < 5 or status[:1] != b"X":
        os._exit(_wait_orphan(pid))
    code = struct.unpack("!i", status[1:])[0]
    if code < 0:  # the worker died of a signal: so does its stand-in
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code & 0xFF)


if __name__ == "__main__":
    main(sys.argv[1:])
