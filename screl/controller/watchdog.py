"""Pinging the generation workers (the stall watchdog's dead-worker report; see ``screl.data.watchdog``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


async def dead_for_good(worker: Any, timeout_s: float = 5.0) -> str | None:
    """Why ``worker`` is dead and will not come back (a ping, and a second one after it, raise ``ActorDiedError``:
    a call to an actor Ray is restarting waits instead), or None while it answers, restarts or hangs."""
    import ray

    why = None
    for _ in range(2):  # the first ping may have been in flight when the process died
        try:
            await asyncio.wait_for(worker.ping.remote(), timeout_s)
            return None
        except ray.exceptions.ActorDiedError as err:
            why = str(err).splitlines()[0][:200]
        except Exception:  # noqa: BLE001 - restarting, unavailable or hung: not known to be gone
            return None
    return why


async def unreachable_workers(workers: Sequence[Any], timeout_s: float = 5.0) -> list[int]:
    """Indices of the workers that do not answer a ping within ``timeout_s``."""

    async def ping(w: Any) -> bool:
        try:
            await asyncio.wait_for(w.pid.remote(), timeout_s)
            return True
        except Exception:  # noqa: BLE001 - dead, restarting or hung: all count as unreachable
            return False

    alive = await asyncio.gather(*(ping(w) for w in workers))
    return [i for i, ok in enumerate(alive) if not ok]
