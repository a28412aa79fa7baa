"""Pinging the generation workers (the stall watchdog's dead-worker report; see ``screl.data.watchdog``)."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any


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
