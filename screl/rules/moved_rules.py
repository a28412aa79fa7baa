"""Class paths whose module moved (``screl.rollout.workflow.SingleTurnWorkflow`` ->
``screl.rollout.workflows.workflow.SingleTurnWorkflow``): every string of the config that names one is a problem
naming the new home (the table is :data:`screl.rollout.moved.MOVED`). The rules that resolve a class path leave a
moved one to this rule, so each is reported once."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from screl.rollout.moved import moved_to
from screl.rules.context import RuleContext

__all__ = ["moved_path_rules"]


def moved_path_rules(c: RuleContext) -> None:
    """A problem for each config value that names a moved module or class, wherever it is written."""
    for key, value, new in _moved(c.cfg, ""):
        c.bad(key, value, f"moved to {new}", f"write {new}")


def _moved(node: Any, key: str) -> list[tuple[str, str, str]]:
    if isinstance(node, str):
        new = moved_to(node)
        return [(key, node, new)] if new is not None else []
    if isinstance(node, Mapping):
        return [hit for k, v in node.items() for hit in _moved(v, f"{key}.{k}" if key else str(k))]
    if isinstance(node, (list, tuple)):
        return [hit for i, v in enumerate(node) for hit in _moved(v, f"{key}[{i}]")]
    return []
