"""The data plane: rollout rows in TransferQueue, and the loopback Ray cluster it runs on.

Only this package imports ``transfer_queue``. The names load on first use (PEP 562): :mod:`.cluster` (starting Ray)
imports neither torch nor TransferQueue, so ``screl fit`` can start Ray before it imports them. TransferQueue's
tensordict is imported without ``torch._dynamo`` (:mod:`screl.dataplane.lazy_dynamo`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from screl._lazy import lazy_exports
from screl.dataplane import lazy_dynamo

lazy_dynamo.install()

if TYPE_CHECKING:
    from screl.dataplane.client import (
        DataPlane,
        DataPlaneError,
        DataPlaneHandle,
        DataPlaneKeyError,
        DataPlaneLostError,
        DataPlaneTimeoutError,
        tq_actors_alive,
    )
    from screl.dataplane.cluster import (
        LOOPBACK_ENV,
        listening_addresses,
        start_local_ray,
        stop_ray_if_started,
    )

_WHERE = {
    "DataPlane": "client", "DataPlaneError": "client", "DataPlaneHandle": "client", "DataPlaneKeyError": "client",
    "DataPlaneLostError": "client", "DataPlaneTimeoutError": "client", "tq_actors_alive": "client",
    "LOOPBACK_ENV": "cluster", "listening_addresses": "cluster", "start_local_ray": "cluster",
    "stop_ray_if_started": "cluster",
}
__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())

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
