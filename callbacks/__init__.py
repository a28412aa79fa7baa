"""screl's Lightning callbacks (installed as ``screl.callbacks``)."""

from screl.callbacks.checkpoint import DataPlaneCheckpoint
from screl.callbacks.weight_sync import WeightSync

__all__ = ["DataPlaneCheckpoint", "WeightSync"]
