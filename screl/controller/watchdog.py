"""Pinging the generation workers: the stall watchdog's dead-worker report (see ``screl.data.watchdog``) and the
health checks between requests."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

log = logging.getLogger(__name__)


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


async def health_checks(controller: Any) -> None:
    """The controller's loop between requests, every ``async_rl.watchdog.health_check_interval_s``: a worker dead
    for good gets no more work and its rollouts move to the others (``RolloutCore.worker_lost``)."""
    interval = float(controller.run.async_rl.watchdog.health_check_interval_s or 5.0)
    while not controller.shutting_down:
        await asyncio.sleep(interval)
        live = [i for i in range(len(controller.workers)) if i not in controller.core.dead]
        verdicts = await asyncio.gather(*(dead_for_good(controller.workers[i], min(5.0, interval)) for i in live))
        for i, why in zip(live, verdicts, strict=True):
            if why is not None and not controller.shutting_down:
                log.warning("screl: generation worker %d is dead for good (%s); its work moves to the others", i, why)
                await controller._execute(controller.core.worker_lost(i, why))
