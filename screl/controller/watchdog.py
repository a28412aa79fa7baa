"""Pinging the generation workers: the stall watchdog's dead-worker report (see ``screl.data.watchdog``) and the
health checks between requests, which also notice a worker whose Ray node left the cluster."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from screl.controller.resources import worker_resources

log = logging.getLogger(__name__)

HEALTH_CHECK = "the controller's health check stopped the run"
"""What leads the trainer's error when the health check fails the run (see ``RolloutController.fail``)."""


class PolicyServerLostError(RuntimeError):
    """The OpenAI-compatible policy server's actor died: the agents' calls can no longer be served."""


async def dead_for_good(worker: Any, timeout_s: float = 5.0, method: str = "ping") -> str | None:
    """Why ``worker`` is dead and will not come back (a ping, and a second one after it, raise ``ActorDiedError``:
    a call to an actor Ray is restarting waits instead), or None while it answers, restarts or hangs. ``method``:
    the actor's cheap call to ping it with."""
    import ray

    why = None
    for _ in range(2):  # the first ping may have been in flight when the process died
        try:
            await asyncio.wait_for(getattr(worker, method).remote(), timeout_s)
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


def _node_table() -> dict[str, dict[str, Any]]:
    import ray

    return {str(n["NodeID"]): n for n in ray.nodes()}


def _hosts(nodes: dict[str, dict[str, Any]], demand: dict[str, float]) -> list[str]:
    """Live nodes whose total resources could hold one worker (Ray restarts a lost worker on one of them)."""
    return [nid for nid, n in nodes.items()
            if n.get("Alive") and all(float(n.get("Resources", {}).get(k, 0.0)) >= v for k, v in demand.items())]


class NodeTracker:
    """Which Ray node each generation worker runs on, and which workers a lost node took with it for good.

    A worker on a node that left the cluster is restarted by Ray elsewhere when some live node offers its
    resources (``generation.num_cpus_per_worker``, ``num_gpus_per_worker``, ``resources``); when none does, Ray
    would keep it pending forever, so it is reported lost (and with no worker left the run fails naming the node).
    """

    def __init__(self, workers: Sequence[Any], demand: dict[str, float]) -> None:
        self.workers = workers
        self.demand = demand
        self.node_of: dict[int, str] = {}

    async def learn(self, indices: Sequence[int], timeout_s: float) -> None:
        """Ask the workers in ``indices`` whose node is not known yet where they run."""
        ask = [i for i in indices if i not in self.node_of]

        async def one(i: int) -> None:
            try:
                self.node_of[i] = await asyncio.wait_for(self.workers[i].node_id.remote(), timeout_s)
            except Exception:  # noqa: BLE001 - restarting, dead or hung: asked again next round
                pass

        await asyncio.gather(*(one(i) for i in ask))

    async def lost(self, live: Sequence[int], timeout_s: float) -> list[tuple[int, str]]:
        """``(worker, why)`` for each live worker whose node is gone with no live node able to host it again."""
        await self.learn(live, timeout_s)
        nodes = await asyncio.get_running_loop().run_in_executor(None, _node_table)
        found = []
        for i in live:
            nid = self.node_of.get(i)
            node = nodes.get(nid) if nid is not None else None
            if node is None or node.get("Alive"):
                continue
            del self.node_of[i]  # relearned once Ray restarted it elsewhere
            where = f"Ray node {nid} ({node.get('NodeManagerAddress', '?')})"
            if _hosts(nodes, self.demand):
                log.warning("screl: generation worker %d was on %s, which left the cluster; Ray restarts it on a "
                            "live node", i, where)
                continue
            found.append((i, f"worker {i} was on {where}, which left the Ray cluster, and no live node offers "
                             f"{self.demand} to restart it (data.init_args.generation.resources, "
                             "num_cpus_per_worker, num_gpus_per_worker)"))
        return found


async def _data_plane_lost(controller: Any) -> bool:
    """Whether a TransferQueue actor died (then the pump fails naming it: the rows it held are gone)."""
    from screl.dataplane.tq_client import lost_error

    if controller.dp is None:
        return False
    lost = await asyncio.get_running_loop().run_in_executor(None, controller.dp.lost_actors)
    if not lost or controller.shutting_down:
        return False
    err = lost_error(lost, "the controller's health check of the data plane")
    log.error("screl: %s", err)
    controller.fail(err, HEALTH_CHECK)
    controller.notify()
    return True


async def _server_lost(controller: Any, timeout_s: float) -> bool:
    """Whether the policy server died (Ray does not restart it): then the pump fails naming it, instead of each
    agent call failing in turn until the retry budget is spent."""
    server = getattr(controller, "server", None)
    if server is None:
        return False
    why = await dead_for_good(server, timeout_s, method="url")
    if why is None or controller.shutting_down:
        return False
    err = PolicyServerLostError(
        f"the OpenAI-compatible policy server (data.init_args.generation.expose_http_server) died: {why}. The agents' "
        "calls cannot be served and Ray does not restart it. Run the same command again: it resumes from the last "
        "checkpoint bundle.")
    log.error("screl: %s", err)
    controller.fail(err, HEALTH_CHECK)
    controller.notify()
    return True


async def health_checks(controller: Any) -> None:
    """The controller's loop between requests, every ``async_rl.watchdog.health_check_interval_s``: a TransferQueue
    actor or the policy server that died fails the run naming it; a worker dead for good, or on a lost node that no live node can replace, gets no more work and its rollouts move to the
    others (``RolloutCore.worker_lost``)."""
    interval = float(controller.run.async_rl.watchdog.health_check_interval_s or 5.0)
    tracker = NodeTracker(controller.workers, worker_resources(controller.generation).demand())
    await tracker.learn(range(len(controller.workers)), 5.0)
    while not controller.shutting_down:
        await asyncio.sleep(interval)
        if await _data_plane_lost(controller) or await _server_lost(controller, min(5.0, interval)):
            return
        live = [i for i in range(len(controller.workers)) if i not in controller.core.dead]
        for i, gone in await tracker.lost(live, min(5.0, interval)):
            if not controller.shutting_down:
                log.warning("screl: generation worker %d is lost: %s", i, gone)
                await controller._execute(controller.core.worker_lost(i, gone, restartable=False))
        live = [i for i in live if i not in controller.core.dead]
        verdicts = await asyncio.gather(*(dead_for_good(controller.workers[i], min(5.0, interval)) for i in live))
        for i, why in zip(live, verdicts, strict=True):
            if why is not None and not controller.shutting_down:
                log.warning("screl: generation worker %d is dead for good (%s); its work moves to the others", i, why)
                await controller._execute(controller.core.worker_lost(i, why))
