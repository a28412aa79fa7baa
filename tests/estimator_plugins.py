"""An advantage estimator from outside screl, named in configs by its path (``tests.estimator_plugins:...``)."""

from __future__ import annotations

from typing import Any

from torch import Tensor


def mean_baseline(rewards: Tensor, group_size: int, config: Any) -> Tensor:
    """Each reward minus its group's mean, unnormalized (Dr. GRPO's advantage, Liu et al., 2025)."""
    groups = rewards.reshape(-1, group_size)
    return (groups - groups.mean(dim=1, keepdim=True)).reshape(rewards.shape)


NOT_A_FUNCTION = 3
