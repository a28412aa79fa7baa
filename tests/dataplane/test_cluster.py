"""The Ray helpers: loopback only, no-ops when Ray already runs, and no idle Ray monitors."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import ray

from screl.dataplane import listening_addresses, start_local_ray, stop_ray_if_started
from screl.dataplane.cluster import LOOPBACK_IPS, MONITORS_VAR


def test_ray_listens_on_loopback_only(ray_cluster: None) -> None:
    # `import ray` ran before start_local_ray set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER: the helper covers that.
    found = listening_addresses()
    assert len(found) >= 3, found  # GCS, raylet, driver core worker, ...
    assert [(pid, ip, port) for pid, ip, port in found if ip not in LOOPBACK_IPS] == []
    assert ray.util.get_node_ip_address() == "127.0.0.1"


def test_start_local_ray_is_a_no_op_when_ray_runs(ray_cluster: None) -> None:
    assert start_local_ray() is False
    stop_ray_if_started(False)
    assert ray.is_initialized()


def test_a_local_cluster_runs_without_rays_monitors_unless_asked() -> None:
    """``start_local_ray`` leaves out Ray's autoscaler monitor and (without ``log_to_driver``) its log monitor;
    ``SCREL_RAY_MONITORS=1`` keeps both, and ``log_to_driver`` keeps the log monitor. Fresh interpreters: the session's
    cluster is this process's."""
    script = ("import json, ray\nfrom screl.dataplane import start_local_ray\n"
              "start_local_ray(num_cpus=1, log_to_driver={log})\n"
              "from ray._private import ray_constants as c, worker\n"
              "kinds = worker._global_node.all_processes\n"
              "print(json.dumps([c.PROCESS_TYPE_MONITOR in kinds, c.PROCESS_TYPE_LOG_MONITOR in kinds, "
              "c.PROCESS_TYPE_GCS_SERVER in kinds]))\nray.shutdown()\n")
    found = {}
    for label, log, env in (("off", False, {}), ("kept", False, {MONITORS_VAR: "1"}), ("to_driver", True, {})):
        proc = subprocess.run([sys.executable, "-c", script.format(log=log)], capture_output=True, text=True,
                              timeout=180, env={**os.environ, **env}, check=False)
        assert proc.returncode == 0, proc.stderr[-3000:]
        found[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found == {"off": [False, False, True], "kept": [True, True, True], "to_driver": [False, True, True]}
