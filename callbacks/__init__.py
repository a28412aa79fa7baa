"""screl's Lightning callbacks (installed as ``screl.callbacks``)."""

from screl.callbacks.checkpoint import DataPlaneCheckpoint
from screl.callbacks.completions import Completions
from screl.callbacks.hf_export import HFExport
from screl.callbacks.progress import RichRLProgressBar, TQDMRLProgressBar, rl_progress_bar
from screl.callbacks.summary import ModelSummary
from screl.callbacks.weight_sync import WeightSync

__all__ = [
    "Completions", "DataPlaneCheckpoint", "HFExport", "ModelSummary", "RichRLProgressBar", "TQDMRLProgressBar", "WeightSync", "rl_progress_bar",
]
