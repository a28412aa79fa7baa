"""Pure torch RL math: advantages (GRPO, GAE) and policy/value losses with IS correction."""

from screl.algos.advantages import gae_advantages, grpo_advantages, masked_whiten, terminal_token_rewards
from screl.algos.distill import ReverseKLDistillLoss, distill_advantages, top_k_forward_kl, top_k_reverse_kl
from screl.algos.losses import ClippedPGLoss, ClippedValueLoss, KLEstimator, PolicyLoss, kl_estimate

__all__ = [
    "ClippedPGLoss",
    "ClippedValueLoss",
    "KLEstimator",
    "PolicyLoss",
    "ReverseKLDistillLoss",
    "distill_advantages",
    "gae_advantages",
    "grpo_advantages",
    "kl_estimate",
    "masked_whiten",
    "terminal_token_rewards",
    "top_k_forward_kl",
    "top_k_reverse_kl",
]
