"""Which lost nodes fail the run: a worker Ray can restart on a live node is left to Ray, one it cannot is lost."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from screl.controller import watchdog
from screl.controller.watchdog import NodeTracker


class _Ref:
    def __init__(self, value: str) -> None:
        self.value = value

    def __await__(self) -> Any:
        return asyncio.sleep(0, self.value).__await__()


class _Method:
    def __init__(self, node: str) -> None:
        self.node = node

    def remote(self) -> _Ref:
        return _Ref(self.node)


class _Worker:
    """What the tracker calls on a worker actor: ``node_id.remote()``."""

    def __init__(self, node: str) -> None:
        self.node_id = _Method(node)


def _node(alive: bool, **resources: float) -> dict[str, Any]:
    return {"Alive": alive, "NodeManagerAddress": "10.0.0.7", "Resources": resources}


@pytest.mark.parametrize(
    ("spare", "lost"),
    [
        (_node(True, CPU=4.0, rollout_node=1.0), False),  # Ray restarts the worker on the spare node
        (_node(True, CPU=4.0), True),  # no live node offers rollout_node
        (_node(True, CPU=0.5, rollout_node=2.0), True),  # too few CPUs for one worker
        (_node(False, CPU=4.0, rollout_node=1.0), True),  # the spare is gone too
    ],
)
def test_a_worker_on_a_lost_node_is_lost_only_when_no_live_node_can_hold_it(
    monkeypatch: pytest.MonkeyPatch, spare: dict[str, Any], lost: bool
) -> None:
    nodes = {"gone": _node(False, CPU=2.0, rollout_node=2.0), "head": _node(True, CPU=8.0), "spare": spare}
    monkeypatch.setattr(watchdog, "_node_table", lambda: nodes)
    tracker = NodeTracker([_Worker("gone"), _Worker("head")], {"CPU": 1.0, "rollout_node": 1.0})
    found = asyncio.run(tracker.lost([0, 1], 1.0))
    if not lost:
        assert found == [] and 0 not in tracker.node_of, "relearned after Ray restarts it"
        return
    assert found == [(0, "worker 0 was on Ray node gone (10.0.0.7), which left the Ray cluster, and no live node "
                         "offers {'CPU': 1.0, 'rollout_node': 1.0} to restart it (data.init_args.generation."
                         "resources, num_cpus_per_worker, num_gpus_per_worker)")]
