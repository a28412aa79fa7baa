"""Export tests: one loopback Ray cluster for a file's fits (as tests/e2e's)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _ray_session import session_ray


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with session_ray(num_cpus=8, namespace="screl-tests"):
        yield
