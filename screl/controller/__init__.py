"""The single controller (a Ray actor around the pure ``RolloutCore``) and the runtime that starts the rollout side."""

from screl.controller.controller import ROW_FIELDS, RolloutController, RolloutFailure
from screl.controller.runtime import RolloutRuntime, spawn_controller

__all__ = ["ROW_FIELDS", "RolloutController", "RolloutFailure", "RolloutRuntime", "spawn_controller"]
