"""The Ray helpers: loopback only, no-ops when Ray already runs, and no idle Ray monitors."""

from __future__ import annotations

import pytest
import ray

from screl.dataplane import listening_addresses, start_local_ray, stop_ray_if_started
from screl.dataplane.cluster import LOOPBACK_IPS, MONITORS_VAR, _node_params


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


def test_a_local_cluster_runs_without_rays_monitors(ray_cluster: None) -> None:
    """The session's cluster (``start_local_ray``, no ``log_to_driver``) runs neither Ray's autoscaler monitor nor
    its log monitor, and its GCS and raylet as ever."""
    from ray._private import ray_constants as c
    from ray._private import worker

    kinds = set(worker._global_node.all_processes)
    assert {c.PROCESS_TYPE_GCS_SERVER, c.PROCESS_TYPE_RAYLET} <= kinds
    assert kinds.isdisjoint({c.PROCESS_TYPE_MONITOR, c.PROCESS_TYPE_LOG_MONITOR}), kinds


@pytest.mark.parametrize(("log_to_driver", "env", "no_monitor", "log_monitor"), [
    (False, None, True, False),
    (True, None, True, True),  # the workers' output goes to the driver through the log monitor
    (False, "1", False, True),
])
def test_the_monitors_left_out_follow_log_to_driver_and_screl_ray_monitors(
        monkeypatch: pytest.MonkeyPatch, log_to_driver: bool, env: str | None, no_monitor: bool,
        log_monitor: bool) -> None:
    """What ``ray.init`` builds its head node from inside the start (Ray's own parameters), and nothing after."""
    import ray._private.parameter as parameter

    if env is None:
        monkeypatch.delenv(MONITORS_VAR, raising=False)
    else:
        monkeypatch.setenv(MONITORS_VAR, env)
    real = parameter.RayParams
    with _node_params(log_to_driver, "/screl/worker.py"):
        params = parameter.RayParams(num_cpus=1)
        params.update_if_absent(include_log_monitor=True, worker_path="/ray/default_worker.py")  # as ray's Node does
    assert parameter.RayParams is real
    assert (bool(params.no_monitor), bool(params.include_log_monitor)) == (no_monitor, log_monitor)
    assert params.worker_path == "/screl/worker.py"
