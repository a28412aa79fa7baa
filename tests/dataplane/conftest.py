"""A real loopback Ray cluster for the whole session and a real TransferQueue per test module."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _ray_session import session_ray

from screl.dataplane import DataPlane


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with session_ray(num_cpus=6):
        yield


@pytest.fixture(scope="module")
def dp(ray_cluster: None) -> Iterator[DataPlane]:
    plane = DataPlane.start(num_storage_units=1, partition_id="train", timeout_s=30.0)
    yield plane
    plane.shutdown()
