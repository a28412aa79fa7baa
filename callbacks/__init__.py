"""screl's Lightning callbacks (installed as ``screl.callbacks``)."""

from screl.callbacks.checkpoint import DataPlaneCheckpoint
from screl.callbacks.progress import RichRLProgressBar, TQDMRLProgressBar, rl_progress_bar
from screl.callbacks.summary import ModelSummary
from screl.callbacks.weight_sync import WeightSync

__all__ = [
    "DataPlaneCheckpoint", "ModelSummary", "RichRLProgressBar", "TQDMRLProgressBar", "WeightSync", "rl_progress_bar",
]
