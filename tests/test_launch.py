"""The tests' launcher (``tests/_launch.py``): a process forked from the zygote behaves as ``python ...`` started
cold would, to everything the fault-injection tests look at."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import ENABLED, Forked, launch

pytestmark = pytest.mark.skipif(not ENABLED, reason="SCREL_TEST_FORK=0: every launch is a plain Popen")

PROBE = """
import atexit, os, sys, threading, time
print("argv", sys.argv, "path0", repr(sys.path[0]), "cwd", os.getcwd(), flush=True)
print("session", os.getsid(0) == os.getpid(), "offline", os.environ.get("HF_HUB_OFFLINE"), flush=True)
atexit.register(lambda: print("atexit ran", flush=True))
threading.Thread(target=lambda: (time.sleep(0.3), print("thread joined", flush=True))).start()
sys.exit(int(sys.argv[1]))
"""


def test_a_forked_python_c_exits_with_its_code_after_threads_and_atexit(tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    proc = launch(["-c", PROBE, "7", "second"], log, cwd=tmp_path)
    assert isinstance(proc, Forked)
    assert proc.wait(timeout=60) == 7
    lines = log.read_text().splitlines()
    assert lines[0] == f"argv ['-c', '7', 'second'] path0 '' cwd {tmp_path}"
    assert lines[1] == f"session True offline {os.environ.get('HF_HUB_OFFLINE')}"
    assert lines[2:] == ["thread joined", "atexit ran"]  # the interpreter's order: threads first, then atexit


def test_a_forked_module_runs_as_main_with_its_spec_as_python_m_sets_it(tmp_path: Path) -> None:
    """Lightning's launcher starts rank 1 as ``python -m <__main__.__spec__.name>``: the fork must set it."""
    (tmp_path / "probe_mod.py").write_text(
        "import __main__, sys\nprint(__name__, __main__.__spec__.name, sys.argv[1:], sys.argv[0].endswith('probe_mod.py'))\n"
        "raise RuntimeError('boom')\n")
    log = tmp_path / "out.log"
    proc = launch(["-m", "probe_mod", "--flag", "x"], log, cwd=tmp_path)
    assert isinstance(proc, Forked)
    assert proc.wait(timeout=60) == 1  # an uncaught exception: its traceback, then 1
    text = log.read_text()
    assert text.splitlines()[0] == "__main__ probe_mod ['--flag', 'x'] True"
    assert "RuntimeError: boom" in text


def test_a_killed_fork_reports_the_signal_as_popen_does(tmp_path: Path) -> None:
    proc = launch(["-c", "import time; print('up', flush=True); time.sleep(600)"], tmp_path / "out.log")
    assert isinstance(proc, Forked)
    deadline = time.monotonic() + 60
    while "up" not in (tmp_path / "out.log").read_text() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc.poll() is None
    with pytest.raises(subprocess.TimeoutExpired, match="timed out after 0.1 seconds"):
        proc.wait(timeout=0.1)
    os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group is the process
    assert proc.wait(timeout=60) == -signal.SIGKILL
    assert proc.poll() == -signal.SIGKILL


def test_a_launch_with_its_own_variables_starts_cold(tmp_path: Path) -> None:
    """Variables a test adds may be read at import time, which the zygote did before them: a plain Popen."""
    proc = launch(["-c", "import os, sys; print(os.environ['PROBE_VAR'], 'torch' in sys.modules)"], tmp_path / "o",
                  env={"PROBE_VAR": "seen"})
    assert isinstance(proc, subprocess.Popen)
    assert proc.wait(timeout=60) == 0
    assert (tmp_path / "o").read_text().split() == ["seen", "False"]
    forked = launch(["-c", "import sys; print('torch' in sys.modules, sys.executable)"], tmp_path / "f")
    assert isinstance(forked, Forked)
    assert forked.wait(timeout=60) == 0
    assert (tmp_path / "f").read_text().split() == ["True", sys.executable]  # warm: the zygote's imports


def test_a_changed_environment_gets_a_zygote_of_its_own_and_the_old_one_waits_for_its_children(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A variable may be read at import time: a launch under a changed environment forks from a zygote that
    imported under it, and the old zygote still reports its running child's end before it exits."""
    marker = tmp_path / "go"
    first = launch(["-c", f"import os, time\nwhile not os.path.exists({str(marker)!r}): time.sleep(0.02)"],
                   tmp_path / "a")
    assert isinstance(first, Forked)
    monkeypatch.setenv("SCREL_PROBE_IMPORT_VAR", "seen")
    second = launch(["-c", "import os; print(os.environ['SCREL_PROBE_IMPORT_VAR'])"], tmp_path / "b")
    assert isinstance(second, Forked) and second.zygote is not first.zygote
    assert second.zygote.env["SCREL_PROBE_IMPORT_VAR"] == "seen"
    assert second.wait(timeout=60) == 0 and (tmp_path / "b").read_text() == "seen\n"
    assert first.poll() is None and first.zygote.proc.poll() is None  # retired, but its child still runs
    marker.touch()
    assert first.wait(timeout=60) == 0
    assert first.zygote.proc.wait(timeout=60) == 0  # then it exits
