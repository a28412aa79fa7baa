"""Python subprocesses for the tests, forked from a warm interpreter instead of started cold.

A ``screl fit`` a test launches spends about 6 CPU-seconds importing torch, Lightning and transformers before it
does anything the test looks at, and the fault-injection tests launch dozens (``bench/README.md``, "Where the test
suite's CPU goes"). :func:`launch` hands the launch to a *zygote*: one process per pytest worker that imported those
modules once and forks a child per launch. The child is a real process like the one ``subprocess.Popen`` would
start: its own session (``start_new_session``), its output in the given file, its environment and working
directory set, ``sys.argv`` and ``sys.path[0]`` as ``python -m`` (or ``-c``, or a script) sets them, and at its end
Python's own shutdown (non-daemon threads joined, ``atexit`` run) before it exits with the run's code. It is
killed, signalled and waited on like a ``Popen`` (:class:`Forked`).

The zygote imports under the environment the launch would have had: some variables are read at import time
(``OMP_NUM_THREADS`` by the OpenMP runtime torch loads). When the worker's own environment changes (an in-process
fit sets ``PL_GLOBAL_SEED``, a Ray start its loopback variables), the next launch starts a new zygote under it and
the old one exits once its children have. A launch with variables of its own (``env``) goes to a plain
``subprocess.Popen``, as does every launch when ``SCREL_TEST_FORK=0``. Tests of the start-up itself
(``tests/dataplane/test_ray_prestart.py``, ``tests/test_lazy_exports.py``) start their processes cold, as before.
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from screl._as_main import run_as_main

PRELOAD = ("screl.cli", "screl.datamodule", "screl.modules", "screl.callbacks",
           "transformers.models.qwen2.modeling_qwen2")
"""What a ``screl fit`` imports before it trains. Ray and TransferQueue are left to the child (about 1 CPU-second):
a process that forks after loading gRPC and ZMQ is not one their authors support."""

ENABLED = os.environ.get("SCREL_TEST_FORK", "1") != "0"


def launch(args: Sequence[str], out: Path, *, env: dict[str, str] | None = None,
           cwd: str | Path | None = None) -> Any:
    """``python *args`` in a new session with stdout and stderr appended to ``out``, ``fit_env(env)`` as its
    environment: a :class:`Forked` child of the zygote, or a ``subprocess.Popen`` (see the module's docstring)."""
    from _fit_env import fit_env  # here: the zygote imports this module without the tests' folder on its path

    full_env = fit_env(env)
    if ENABLED and not env:
        return _zygote(full_env).fork(list(args), out, full_env, str(cwd or os.getcwd()))
    with out.open("ab") as handle:
        return subprocess.Popen([sys.executable, *args], stdout=handle, stderr=subprocess.STDOUT,
                                start_new_session=True, env=full_env, cwd=cwd)


RUNTIME_ONLY = frozenset({"PYTEST_CURRENT_TEST"})
"""Variables that change between launches and that nothing reads at import time (pytest's, per test)."""


def _import_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k not in RUNTIME_ONLY}


class Forked:
    """A child of the zygote, with ``Popen``'s ``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal`` and
    ``kill``."""

    def __init__(self, zygote: _Zygote, pid: int, args: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.exit_code(self.pid, timeout=0.0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            code = self.zygote.exit_code(self.pid, timeout=timeout)
            if code is None:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            self.returncode = code
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Zygote:
    """The client side: the zygote process, and a thread that reads what it reports (forks, exits)."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen(zygote_command(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env,
                                     start_new_session=True)
        self.lock = threading.Condition()
        self.pids: dict[int, int] = {}  # request id -> pid
        self.errors: dict[int, str] = {}
        self.exits: dict[int, int] = {}  # pid -> exit code
        self.dead = False
        self.next_id = 0
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            msg = json.loads(line)
            with self.lock:
                if "rc" in msg:
                    self.exits[msg["pid"]] = msg["rc"]
                elif "error" in msg:
                    self.errors[msg["id"]] = msg["error"]
                else:
                    self.pids[msg["id"]] = msg["pid"]
                self.lock.notify_all()
        self.proc.wait()  # a retired zygote exits by itself: reaped here, not left a zombie until the worker ends
        with self.lock:
            self.dead = True
            self.lock.notify_all()

    def fork(self, args: list[str], out: Path, env: dict[str, str], cwd: str) -> Forked:
        out.open("ab").close()  # there when this returns, as Popen's output file is
        with self.lock:
            rid = self.next_id
            self.next_id += 1
            assert self.proc.stdin is not None
            self.proc.stdin.write((json.dumps({"id": rid, "args": args, "out": str(out), "env": env,
                                               "cwd": cwd}) + "\n").encode())
            self.proc.stdin.flush()
            if not self.lock.wait_for(lambda: rid in self.pids or rid in self.errors or self.dead, timeout=300):
                raise RuntimeError("the test zygote did not fork within 300 s")
            if rid in self.errors or self.dead:
                raise RuntimeError(f"the test zygote could not fork: {self.errors.get(rid, 'it exited')}")
            return Forked(self, self.pids[rid], args)

    def exit_code(self, pid: int, timeout: float | None) -> int | None:
        with self.lock:
            self.lock.wait_for(lambda: pid in self.exits or self.dead, timeout=timeout)
            if pid in self.exits:
                return self.exits[pid]
            if self.dead:
                raise RuntimeError(f"the test zygote exited before it reported process {pid}'s end")
            return None

    def retire(self) -> None:
        """Fork nothing more; exit once every child has ended (and been reported)."""
        with self.lock:
            if not self.dead:
                assert self.proc.stdin is not None
                self.proc.stdin.write(b'{"retire": true}\n')
                self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def zygote_command() -> list[str]:
    """The zygote's command line (its forked children carry it too: ``bench/suite_cpu.py`` counts them under it)."""
    bootstrap = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('_launch_zygote', "
                 f"{str(Path(__file__).resolve())!r}); mod = importlib.util.module_from_spec(spec); "
                 "spec.loader.exec_module(mod); mod.serve()")
    return [sys.executable, "-c", bootstrap]


_zygote_lock = threading.Lock()
_current: list[_Zygote] = []


def _zygote(env: dict[str, str]) -> _Zygote:
    """The zygote for a launch under ``env``: this process's current one if it imported under the same variables,
    else a new one (the old one retires)."""
    with _zygote_lock:
        if _current and _import_env(_current[0].env) == _import_env(env):
            return _current[0]
        if _current:
            _current.pop().retire()
        zygote = _Zygote(env)
        atexit.register(zygote.close)
        _current.append(zygote)
        return zygote


# --- the zygote's side ---------------------------------------------------------------------------------------


def serve() -> None:
    """Import :data:`PRELOAD`, then fork a child per request read from stdin, and report each child's pid and,
    when it ends, its exit code (one JSON line each on stdout)."""
    import importlib
    import select

    control_in, control_out = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # stray output of the imports goes to the worker's stderr, not into the reports

    def report(msg: dict[str, Any]) -> None:
        os.write(control_out, (json.dumps(msg) + "\n").encode())

    for name in PRELOAD:
        importlib.import_module(name)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    signal.set_wakeup_fd(wake_w)
    pending = b""
    children: set[int] = set()
    retired = False
    while not (retired and not children):
        try:
            readable, _, _ = select.select([control_in, wake_r], [], [])
        except InterruptedError:
            readable = []
        if wake_r in readable:
            os.read(wake_r, 4096)
        children -= _reap(report)
        if control_in not in readable:
            continue
        chunk = os.read(control_in, 65536)
        if not chunk:
            return  # the pytest worker is gone: running children go on, as Popen's would
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            if request.get("retire"):
                retired = True
                continue
            try:
                pid = os.fork()
            except OSError as err:
                report({"id": request["id"], "error": str(err)})
                continue
            if pid == 0:
                for fd in (control_in, control_out, wake_r, wake_w):
                    os.close(fd)
                _child(request, devnull)  # never returns
            children.add(pid)
            report({"id": request["id"], "pid": pid})


def _reap(report: Any) -> set[int]:
    """Report every child that ended; their pids."""
    ended: set[int] = set()
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return ended
        if pid == 0:
            return ended
        ended.add(pid)
        report({"pid": pid, "rc": os.waitstatus_to_exitcode(status)})


def _child(request: dict[str, Any], devnull: int) -> None:
    """Become ``python *request["args"]``: as a fresh interpreter would run it, then exit with its code."""
    import tempfile

    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        os.setsid()
        out = os.open(request["out"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(devnull, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.close(out)
        os.close(devnull)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        tempfile.tempdir = None  # TMPDIR is read again
        code = run_as_main(request["args"])
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then the exit code
        sys.excepthook(*sys.exc_info())
    finally:
        os._exit(code)
