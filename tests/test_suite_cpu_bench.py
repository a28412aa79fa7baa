"""``bench/suite_cpu.py`` names each kind of process a test run starts, and its sampler adds up a process's CPU
under its kind: all of it for a process born while it samples, read from ``/proc`` as the kernel counts it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
from _launch import zygote_command

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the bench scripts import each other as bench.*

from bench.suite_cpu import Sampler, kind  # noqa: E402

pytestmark = pytest.mark.skipif(not Path("/proc/stat").exists(), reason="the sampler reads Linux's /proc")


@pytest.mark.parametrize(("cmdline", "expected"), [
    (["/v/bin/python", "-u", "-c", "import sys;exec(eval(sys.stdin.readline()))"], "pytest-worker"),
    (["/v/bin/python", "-m", "pytest", "-n", "2", "tests/e2e"], "pytest"),
    (["/v/bin/python", "-m", "screl.cli", "fit", "--config", "c.yaml"], "driver"),
    (["/v/bin/python", "-m", "screl.cli", "check", "--config", "c.yaml"], "screl check"),
    (["ray::GenerationWorker.update_weights"], "GenerationWorker"),
    (["ray::screl-generation-0-7:GenerationWorker.generate"], "GenerationWorker"),  # a named actor
    (["ray::IDLE"], "ray-worker-boot"),
    (["/v/bin/python", "/v/lib/python3.11/site-packages/ray/_private/workers/default_worker.py",
      "--raylet-name=/tmp/ray/session_1/sockets/raylet"], "ray-worker-boot"),  # not the raylet it names
    (["/v/lib/python3.11/site-packages/ray/core/src/ray/raylet/raylet", "--raylet_socket_name=/tmp/s"], "raylet"),
    (zygote_command(), "zygote-and-forked-drivers"),  # tests/_launch.py's, and the `screl fit`s it forks
    (["/v/bin/python", "-c", "import sys; from screl.dataplane.worker_zygote import serve; serve(sys.argv[1])",
      "/tmp/screl-zygote-x/sock", "torch"], "worker-zygote"),  # a local cluster's, and a worker it just forked
    (["/v/bin/python", "/r/screl/dataplane/ray_worker.py", "--raylet-name=/tmp/ray/session_1/sockets/raylet"],
     "ray-worker-stand-in"),  # the raylet's process for a forked worker
])
def test_each_process_is_named_by_its_kind(cmdline: list[str], expected: str) -> None:
    assert kind(cmdline) == expected


def test_a_zygote_forked_from_screl_fit_is_named_by_its_process_name() -> None:
    driver = ["/v/bin/python", "-m", "screl.cli", "fit", "--config", "c.yaml"]  # what it inherits
    assert kind(driver, "screl-zygote") == "worker-zygote"
    assert kind(driver, "python") == "driver"
    assert kind(["ray::GenerationWorker.generate"], "screl-zygote") == "GenerationWorker"  # a worker it forked


def test_a_process_born_while_sampling_counts_all_its_cpu_under_its_kind() -> None:
    burn = ("import sys, time\nwhile time.process_time() < 0.6: pass\nprint(time.process_time(), flush=True)\n"
            "sys.stdin.read()")  # idle until told to exit: the sampler reads all it spent, however loaded the machine
    with Sampler(interval=0.05) as sampler:
        proc = subprocess.Popen(["suite-cpu-probe", "-c", burn], executable=sys.executable, stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdin is not None and proc.stdout is not None
        own = float(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while sampler.cpu.get("suite-cpu-probe", 0.0) < own - 0.02 and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.stdin.close()
        assert proc.wait(timeout=30) == 0
    # the kernel's count in clock ticks (1/100 s) against the process's own clock: equal within two ticks
    assert sampler.cpu["suite-cpu-probe"] == pytest.approx(own, abs=0.02)
    assert len(sampler.pids["suite-cpu-probe"]) == 1
    assert sampler.busy_s >= sampler.cpu["suite-cpu-probe"] - 0.02  # the machine was busy at least that long
