"""The single controller (a Ray actor around the pure ``RolloutCore``) and the runtime that starts the rollout side.

The names load on first use (PEP 562): :mod:`.resources`, which ``screl check``'s plan reads, imports neither Ray
nor TransferQueue.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from screl._lazy import lazy_exports

if TYPE_CHECKING:
    from screl.controller.controller import ROW_FIELDS, RolloutController, RolloutFailure
    from screl.controller.runtime import RolloutRuntime, spawn_controller

_WHERE = {"ROW_FIELDS": "controller", "RolloutController": "controller", "RolloutFailure": "controller",
          "RolloutRuntime": "runtime", "spawn_controller": "runtime"}
__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())

__all__ = ["ROW_FIELDS", "RolloutController", "RolloutFailure", "RolloutRuntime", "spawn_controller"]
