"""The Ray helpers: loopback only, and no-ops when Ray already runs."""

from __future__ import annotations

import ray

from screl.dataplane import listening_addresses, start_local_ray, stop_ray_if_started
from screl.dataplane.cluster import LOOPBACK_IPS


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
