"""A local cluster's Ray workers are forked from its worker zygote (:mod:`screl.dataplane.worker_zygote`) through
the raylet's worker program (:mod:`screl.dataplane.ray_worker`): on the session's real cluster, an actor's process
is the zygote's child with the raylet's environment and Ray's niceness, its stand-in is the raylet's child, each dies
with the other, and a worker the zygote must refuse (a runtime environment with variables of its own) starts cold."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import psutil
import pytest
import ray

from screl.dataplane.ray_worker import stand_in_name
from screl.dataplane.worker_zygote import NAME as ZYGOTE_NAME
from screl.dataplane.worker_zygote import PER_WORKER, RAY_WORKER_NICENESS, WorkerZygote, refusal

QWEN2 = "transformers.models.qwen2.modeling_qwen2"


def _wait(cond: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


@ray.remote(max_restarts=0)
class Probe:
    def info(self) -> dict[str, Any]:
        return {"pid": os.getpid(), "qwen2_preloaded": QWEN2 in sys.modules, "nice": os.nice(0),
                "job_id": os.environ.get("RAY_JOB_ID"), "var": os.environ.get("TEST_RUNTIME_ENV_VAR"),
                "cwd": os.getcwd(), "path0": sys.path[0]}


def _parent(pid: int) -> str:
    parent = psutil.Process(pid).parent()
    return parent.name() if parent is not None else ""


def _stand_in(pid: int) -> psutil.Process:
    found = [p for p in psutil.process_iter(["name"]) if p.info["name"] == stand_in_name(pid)]
    assert len(found) == 1, f"stand-ins of worker {pid}: {found}"
    return found[0]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_an_actor_is_forked_with_the_raylets_environment_and_a_stand_in(ray_cluster: None) -> None:
    probe = Probe.remote()  # type: ignore[attr-defined]
    forked = ray.get(probe.info.remote(), timeout=120)
    cold = Probe.options(runtime_env={"env_vars": {"TEST_RUNTIME_ENV_VAR": "x"}}).remote()  # type: ignore[attr-defined]
    started_cold = ray.get(cold.info.remote(), timeout=120)
    try:
        assert _parent(forked["pid"]) == ZYGOTE_NAME
        assert forked["qwen2_preloaded"] is True  # imported before the worker asked for anything
        stand_in = _stand_in(forked["pid"])
        assert "raylet" in " ".join(stand_in.parent().cmdline())  # type: ignore[union-attr]
        assert "screl/dataplane/ray_worker.py" in " ".join(stand_in.cmdline())
        # what a cold worker gets: Ray's niceness once (not twice), the job id, the working directory and the front
        # of the module path (the driver's, which Ray puts there)
        assert forked["nice"] == started_cold["nice"] == RAY_WORKER_NICENESS
        assert forked["job_id"] == started_cold["job_id"] is not None
        assert forked["cwd"] == started_cold["cwd"]
        assert forked["path0"] == started_cold["path0"]
        # variables of its own: refused by the zygote, started by Ray's own program, with them
        assert started_cold["var"] == "x"
        assert _parent(started_cold["pid"]) == "raylet"
        assert started_cold["qwen2_preloaded"] is False
    finally:
        ray.kill(probe)
        ray.kill(cold)
    assert _wait(lambda: _gone(forked["pid"]))
    assert _wait(lambda: not [p for p in psutil.process_iter(["name"]) if p.info["name"] == stand_in_name(forked["pid"])])


@pytest.mark.parametrize("killed", ["stand-in", "worker"])
def test_a_worker_and_its_stand_in_die_together(ray_cluster: None, killed: str) -> None:
    probe = Probe.remote()  # type: ignore[attr-defined]
    pid = ray.get(probe.info.remote(), timeout=120)["pid"]
    stand_in = _stand_in(pid)
    victim, other = (stand_in.pid, pid) if killed == "stand-in" else (pid, stand_in.pid)
    os.kill(victim, signal.SIGKILL)
    assert _wait(lambda: _gone(other)), f"the {killed} was killed and its counterpart {other} lives on"
    with pytest.raises(ray.exceptions.RayActorError, match="(?i)died|unexpected|exit"):
        ray.get(probe.info.remote(), timeout=60)


def test_refusal_names_the_variables_that_differ_but_not_the_per_worker_ones() -> None:
    env = {"PATH": "/bin", "OMP_NUM_THREADS": "1", "HF_HOME": "/a"}
    same = {"env": {**env, "RAY_JOB_ID": "02000000", "OMP_NUM_THREADS": "4", "PL_GLOBAL_SEED": "0",
                    "SCREL_DEVICE_MAP": "{}", "RAY_CLIENT_MODE": "0"}, "executable": sys.executable}
    assert {"RAY_JOB_ID", "OMP_NUM_THREADS"} <= PER_WORKER
    assert refusal(same, env) is None
    differs = {"env": {"PATH": "/bin", "HF_HOME": "/b", "MKL_NUM_THREADS": "2"}, "executable": sys.executable}
    assert refusal(differs, env) == "environment differs from the zygote's: HF_HOME, MKL_NUM_THREADS"
    other = {"env": env, "executable": "/usr/bin/python3.9"}
    assert refusal(other, env) == f"interpreter /usr/bin/python3.9 (the zygote's: {sys.executable})"


def test_the_zygote_ends_with_its_raylet_and_when_its_driver_closes_it() -> None:
    raylet = subprocess.Popen(["sleep", "60"])  # stands for the raylet: a process the zygote watches
    zygote = WorkerZygote(dict(os.environ), preload=())
    other = WorkerZygote(dict(os.environ), preload=())
    try:
        assert _wait(lambda: os.path.exists(zygote.path) and os.path.exists(other.path))
        zygote.watch_raylet(raylet.pid)
        time.sleep(1.5)  # it polls every second
        assert zygote.poll() is None
        raylet.kill()
        raylet.wait()
        assert _wait(lambda: zygote.poll() is not None, 10), "the zygote outlived its raylet"
        assert zygote.returncode == 0
        assert not os.path.exists(zygote.path)
        other.stop()  # its control pipe closes, as when the driver exits
        assert other.returncode == 0
        assert not os.path.exists(other.dir)
    finally:
        for z in (zygote, other):
            z.stop()


def _maps_torch(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as maps:
        return "libtorch_cpu" in maps.read()


def test_a_zygote_imports_when_told_or_at_once_where_eager() -> None:
    """A cluster's zygote imports at its first worker or when the driver warms it (the rollout side is coming): a
    cluster that starts no actor pays a bare interpreter. An eager one (``screl fit``'s) imports at once."""
    lazy = WorkerZygote(dict(os.environ), preload=("torch",))
    eager = WorkerZygote(dict(os.environ), preload=("torch",), eager=True)
    try:
        assert _wait(lambda: _maps_torch(eager.pid), 60), "the eager zygote did not import"
        assert not _maps_torch(lazy.pid)
        lazy.warm()
        assert _wait(lambda: _maps_torch(lazy.pid), 60), "the warmed zygote did not import"
    finally:
        lazy.stop()
        eager.stop()
