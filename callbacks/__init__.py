"""screl's Lightning callbacks (installed as ``screl.callbacks``)."""

from screl.callbacks.weight_sync import WeightSync

__all__ = ["WeightSync"]
