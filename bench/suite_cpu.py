"""Where a test run's CPU goes: run pytest with the given arguments and split the machine's CPU-seconds meanwhile by
kind of process (the pytest workers, which hold the in-process fits' trainers; ``screl fit`` launches; Ray's
services; each Ray actor class; ``ray-worker-boot``, a Ray worker process booting: Python's and Ray's start, then the
imports of the actor's module, until the actor's class names the process).

    python bench/suite_cpu.py [--out bench/results/suite_cpu.json] [--interval 0.2] -- -n 2 tests/e2e

Every process on the machine is read from ``/proc`` each ``--interval`` seconds (Linux only); one that was already
running when the sampling began counts only what it spends after. A process that exits between two readings loses
what it spent since the last one: ``unattributed_cpu_s`` (the machine's busy time from ``/proc/stat`` less the
sum over kinds) says how much that was. With the CI machine's two cores saturated (``busy_fraction`` near 1), the
suite's wall time follows its CPU-seconds, so this is the table to read before trying to make CI faster.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench scripts import each other as bench.*

from bench.startup import _kind  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TICK = os.sysconf("SC_CLK_TCK")


def kind(cmdline: list[str], name: str = "") -> str:
    """``startup``'s kinds (a Ray actor's class, a Ray worker booting, a Ray service, ``driver`` for ``screl fit``),
    and the pytest processes: ``pytest-worker`` (an xdist worker: the in-process fits' trainers run there) and ``pytest``."""
    args = " ".join(cmdline)
    if "exec(eval(sys.stdin.readline()))" in args:  # how execnet starts an xdist worker
        return "pytest-worker"
    if "_launch_zygote" in args:  # tests/_launch.py: the zygote's imports, and the `screl fit`s forked from it
        return "zygote-and-forked-drivers"
    if "-m pytest" in args or "/pytest " in f"{args} ":
        return "pytest"
    if "screl.cli check" in args:
        return "screl check"
    return _kind(cmdline, name)


def _cmdline(pid: str) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return [part.decode(errors="replace") for part in raw.split(b"\0") if part] or None


def _comm(pid: str) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def _cpu_s(pid: str) -> float | None:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _busy_s() -> float:
    """The machine's busy CPU-seconds so far (``/proc/stat``: every state but idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields) - fields[3] - fields[4]) / TICK


class Sampler:
    """CPU-seconds per kind of process, read from ``/proc`` every ``interval`` seconds in a thread; ``pids``: per
    kind, the processes that spent CPU meanwhile (an idle one's command line is not read)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.cpu: dict[str, float] = {}
        self.pids: dict[str, set[int]] = {}
        self._last: dict[int, float] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._me = os.getpid()

    def __enter__(self) -> Sampler:
        self._read(first=True)
        self._busy0 = _busy_s()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read(first=False)
        self.busy_s = _busy_s() - self._busy0

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self._read(first=False)

    def _read(self, first: bool) -> None:
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or int(pid) == self._me:
                continue
            seconds = _cpu_s(pid)
            if seconds is None:
                continue
            n = int(pid)
            before = self._last.get(n)
            self._last[n] = seconds
            if first:
                continue
            if before is None or seconds < before:  # a process born since the last reading (or a reused pid)
                before = 0.0
            if seconds == before:  # spent nothing since the last reading: its command line need not be read
                continue
            cmdline = _cmdline(pid)
            if cmdline is None:  # a kernel thread, or gone meanwhile
                continue
            k = kind(cmdline, _comm(pid))  # read at every pass: a Ray worker renames itself once it hosts an actor
            self.cpu[k] = self.cpu.get(k, 0.0) + seconds - before
            self.pids.setdefault(k, set()).add(n)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--out", type=Path, default=None, help="write the figures here as JSON")
    ap.add_argument("--interval", type=float, default=0.2, help="seconds between two readings of /proc")
    ap.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: pytest's arguments")
    args = ap.parse_args()
    pytest_args = args.pytest_args[1:] if args.pytest_args[:1] == ["--"] else args.pytest_args
    cores = len(os.sched_getaffinity(0))
    t0 = time.monotonic()
    with Sampler(args.interval) as sampler:
        rc = subprocess.run([sys.executable, "-m", "pytest", *pytest_args], cwd=REPO, check=False).returncode
    wall = time.monotonic() - t0
    total = sum(sampler.cpu.values())
    ranked = sorted(sampler.cpu.items(), key=lambda kv: -kv[1])
    res: dict[str, Any] = {
        "pytest_args": pytest_args, "returncode": rc, "wall_s": round(wall, 1), "cores": cores,
        "busy_cpu_s": round(sampler.busy_s, 1), "busy_fraction": round(sampler.busy_s / (wall * cores), 3),
        "attributed_cpu_s": round(total, 1), "unattributed_cpu_s": round(sampler.busy_s - total, 1),
        "kinds": {k: {"cpu_s": round(v, 1), "processes": len(sampler.pids[k])} for k, v in ranked if v >= 0.05},
    }
    print(f"\npytest {' '.join(pytest_args)}: rc {rc}, {wall:.0f} s on {cores} cores, {sampler.busy_s:.0f} CPU-s busy "
          f"({res['busy_fraction']:.0%}), {total:.0f} of them attributed")
    for k, v in res["kinds"].items():
        print(f"  {v['cpu_s']:8.1f} CPU-s {v['cpu_s'] / max(total, 1e-9):6.1%}  {v['processes']:5d} process(es)  {k}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1) + "\n")
    return rc


if __name__ == "__main__":
    raise SystemExit(main())
