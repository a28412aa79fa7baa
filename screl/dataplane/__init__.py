"""The data plane: rollout rows in TransferQueue, and the loopback Ray cluster it runs on.

Only this package imports ``transfer_queue``.
"""

from screl.dataplane.client import (
    DataPlane,
    DataPlaneError,
    DataPlaneHandle,
    DataPlaneKeyError,
    DataPlaneLostError,
    DataPlaneTimeoutError,
    tq_actors_alive,
)
from screl.dataplane.cluster import LOOPBACK_ENV, listening_addresses, start_local_ray, stop_ray_if_started

__all__ = [
    "LOOPBACK_ENV",
    "DataPlane",
    "DataPlaneError",
    "DataPlaneHandle",
    "DataPlaneKeyError",
    "DataPlaneLostError",
    "DataPlaneTimeoutError",
    "listening_addresses",
    "start_local_ray",
    "stop_ray_if_started",
    "tq_actors_alive",
]
