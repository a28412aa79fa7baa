"""Ray and TransferQueue listen on loopback only."""

from __future__ import annotations

import ray
import torch

from screl.dataplane import DataPlane, listening_addresses, start_local_ray, stop_ray_if_started
from screl.dataplane.cluster import LOOPBACK_IPS


def test_every_listening_socket_is_loopback(dp: DataPlane) -> None:
    dp.put(["sock_g0"], {"x": [torch.arange(3)]})  # TQ's controller and storage unit are serving
    found = listening_addresses()
    # GCS, raylet, driver core worker, TQ controller + storage unit ZMQ servers, ...
    assert len(found) >= 6, found
    assert [(pid, ip, port) for pid, ip, port in found if ip not in LOOPBACK_IPS] == []
    assert ray.util.get_node_ip_address() == "127.0.0.1"
    dp.clear(["sock_g0"])


def test_start_local_ray_is_a_no_op_when_ray_runs(ray_cluster: None) -> None:
    assert start_local_ray() is False
    stop_ray_if_started(False)
    assert ray.is_initialized()
