"""Pure torch RL math: advantages (registered estimators: GRPO, RLOO, GAE) and policy/value losses with IS correction
(registered policy losses: ``clipped``)."""

from screl.algos.advantages import (
    AdvantageEstimator,
    adv_estimator_names,
    gae_advantages,
    get_adv_estimator,
    grpo_advantages,
    masked_whiten,
    register_adv_estimator,
    rloo_advantages,
    terminal_token_rewards,
)
from screl.algos.distill import ReverseKLDistillLoss, distill_advantages, top_k_forward_kl, top_k_reverse_kl
from screl.algos.losses import ClippedPGLoss, ClippedValueLoss, KLEstimator, kl_estimate
from screl.algos.policy_loss import (
    PolicyLoss,
    get_policy_loss,
    policy_loss,
    policy_loss_names,
    register_policy_loss,
)

__all__ = [
    "AdvantageEstimator",
    "ClippedPGLoss",
    "ClippedValueLoss",
    "KLEstimator",
    "PolicyLoss",
    "ReverseKLDistillLoss",
    "adv_estimator_names",
    "distill_advantages",
    "gae_advantages",
    "get_adv_estimator",
    "get_policy_loss",
    "grpo_advantages",
    "kl_estimate",
    "masked_whiten",
    "policy_loss",
    "policy_loss_names",
    "register_adv_estimator",
    "register_policy_loss",
    "rloo_advantages",
    "terminal_token_rewards",
    "top_k_forward_kl",
    "top_k_reverse_kl",
]
