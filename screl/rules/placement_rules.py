"""The device map (:mod:`screl.placement`): trainer and inference GPUs that overlap, a node oversubscribed, a shared
GPU whose engines leave the trainer less memory than its estimate. Checked from the config alone (the node's size
from ``colocated.resources.node_gpus`` when set); ``screl fit`` checks the same map again against the node's own
GPUs before anything starts."""

from __future__ import annotations

from screl.placement import device_map
from screl.rules.context import RuleContext


def placement_rules(c: RuleContext) -> None:
    if any(key.startswith(c.gen_key) for key in c.unreadable):
        return  # the map reads the generation block, reported as unreadable already
    for key, value, message, fix in device_map(c.cfg).problems:
        c.bad(key, value, message, fix)
