"""A real multi-node Ray cluster on loopback, held by its own process, for tests that join it with ``ray.address``.

``ray start --address`` refuses to add a node while ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, the setting that keeps
every Ray server on 127.0.0.1 (screl.dataplane.cluster); ``ray.cluster_utils.Cluster``, Ray's own tool for
several nodes on one machine, starts the same GCS and raylet processes as ``ray start`` without that check.

Run as a script, it starts a head node and one node of each kind given (its CPUs and resources), prints one JSON
line per node (``address``, ``node_id``, ``raylet_pid``), then answers commands on stdin, one per line:

- ``add <kind>``: start another node of that kind (its index in the list); prints its JSON line;
- ``kill <node_id>``: SIGKILL that node's raylet (its workers die with it), as a lost machine would;
- end of input: shut the whole cluster down.

With ``private_dir``, the nodes other than the head run in a mount namespace of their own (one for all of them)
with an empty tmpfs over that directory: the head's files there are not on the other nodes' "disks", as on
machines without a shared filesystem (it needs the right to ``unshare`` mounts, as root has here;
:class:`NoPrivateDisk` otherwise).

:class:`RayNodes` drives it from a test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from types import TracebackType
from typing import Any

LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
HEALTH = {"health_check_initial_delay_ms": 500, "health_check_period_ms": 500, "health_check_timeout_ms": 500,
          "health_check_failure_threshold": 3}
"""The GCS declares a node dead about 1.5 s after its raylet stops answering (Ray's default: about 15 s)."""


class NoPrivateDisk(RuntimeError):
    """The cluster process may not create a mount namespace here."""


class RayNodes:
    """The cluster process: ``head`` and ``nodes`` (the other nodes' JSON lines, one per kind to start with),
    ``add(kind)``, ``kill(node_id)``. A kind is ``(cpus, resources)`` or ``(cpus, resources, gpus)`` (logical
    GPUs, as ``ray start --num-gpus``); ``head_gpus`` the head's."""

    def __init__(self, head_cpus: int, head_resources: dict[str, float],
                 kinds: list[tuple[int, dict[str, float]]] | list[tuple[int, dict[str, float], int]],
                 private_dir: str | None = None, env: dict[str, str] | None = None,
                 head_gpus: int | None = None) -> None:
        spec = json.dumps({"head_cpus": head_cpus, "head_resources": head_resources, "kinds": kinds,
                           "private_dir": private_dir, "head_gpus": head_gpus})
        self.proc = subprocess.Popen([sys.executable, __file__, spec], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env={**os.environ, **LOOPBACK, **(env or {})},
                                     start_new_session=True)
        self.head = self._read()
        self.nodes = [self._read() for _ in kinds]

    @property
    def address(self) -> str:
        return str(self.head["address"])

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Ray cluster process ended (rc {self.proc.wait()})")
        got: dict[str, Any] = json.loads(line)
        if "no_private_disk" in got:
            self.__exit__(None, None, None)
            raise NoPrivateDisk(got["no_private_disk"])
        return got

    def _send(self, command: str) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._read()

    def add(self, kind: int) -> dict[str, Any]:
        node = self._send(f"add {kind}")
        self.nodes.append(node)
        return node

    def kill(self, node_id: str) -> dict[str, Any]:
        return self._send(f"kill {node_id}")

    def pids(self) -> set[int]:
        """The cluster process and everything under it (GCS, raylets, workers)."""
        import psutil

        root = psutil.Process(self.proc.pid)
        return {root.pid} | {p.pid for p in root.children(recursive=True)}

    def __enter__(self) -> RayNodes:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


def _describe(node: Any, address: str) -> dict[str, Any]:
    return {"address": address, "node_id": node.node_id, "raylet_pid": node.all_processes["raylet"][0].process.pid}


def _private_mounts(path: str) -> str | None:
    """Move this process's main thread (and the processes it starts from now on) to a new mount namespace with
    an empty tmpfs over ``path``; None, or why not."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(0x00020000) != 0:  # CLONE_NEWNS
        return f"unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    for cmd in (["mount", "--make-rprivate", "/"], ["mount", "-t", "tmpfs", "screl-node-disk", path]):
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            return f"{' '.join(cmd)}: {done.stderr.strip()}"
    return None


def _serve(spec: dict[str, Any]) -> None:
    from ray.cluster_utils import Cluster

    head_gpus = {} if spec.get("head_gpus") is None else {"num_gpus": spec["head_gpus"]}  # logical GPUs
    cluster = Cluster(initialize_head=True, connect=False, head_node_args={
        "num_cpus": spec["head_cpus"], "resources": spec["head_resources"], "include_dashboard": False,
        "_system_config": HEALTH, **head_gpus})
    nodes = {}

    def add(kind: int) -> None:
        cpus, resources, *gpus = spec["kinds"][kind]  # an optional third entry: the node's logical GPUs
        node = cluster.add_node(num_cpus=cpus, resources=resources, **({"num_gpus": gpus[0]} if gpus else {}))
        nodes[node.node_id] = node
        print(json.dumps(_describe(node, cluster.address)), flush=True)

    print(json.dumps(_describe(cluster.head_node, cluster.address)), flush=True)
    why = _private_mounts(spec["private_dir"]) if spec.get("private_dir") else None
    if why is not None:
        print(json.dumps({"no_private_disk": why}), flush=True)
        cluster.shutdown()
        return
    for kind in range(len(spec["kinds"])):
        add(kind)
    try:
        for line in sys.stdin:
            command, *args = line.split()
            if command == "add":
                add(int(args[0]))
            elif command == "kill":
                node = nodes.pop(args[0])
                pid = node.all_processes["raylet"][0].process.pid
                os.kill(pid, signal.SIGKILL)
                print(json.dumps({"killed": args[0], "raylet_pid": pid}), flush=True)
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    _serve(json.loads(sys.argv[1]))
