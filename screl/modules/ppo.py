"""The PPO LightningModule (policy + critic). Configurable and validated today; training is not built yet."""

from __future__ import annotations

from typing import Any

from screl.algos import ClippedPGLoss, ClippedValueLoss
from screl.models import PolicySpec
from screl.modules.grpo import GRPO


class PPO(GRPO):
    """PPO on the single controller: ``ppo.ppo_epochs`` policy and ``ppo.critic_ppo_epochs`` critic updates
    per RL step over the same batch, GAE advantages from the critic.

    Args:
        policy: The policy spec.
        value: The critic's model spec (a causal LM whose hidden states feed a scalar value head).
        value_loss_fn: The critic loss (``screl.algos.ClippedValueLoss``).
        loss_fn: The policy loss.
        learning_rate: Policy AdamW learning rate.
        value_learning_rate: Critic AdamW learning rate.
        offload_optimizer_for_logprob: Keep the policy optimizer off the device while the critic runs
            (required on the single controller).
        train_global_batch_size: Rows per policy update (None: derived).
        value_train_global_batch_size: Rows per critic update; must equal the step's rows (None: derived).
        temperature: Sampling temperature (linked from generation).
        algo: The ``ppo`` block (linked by the CLI).
    """

    def __init__(
        self,
        policy: PolicySpec,
        value: PolicySpec | None = None,
        value_loss_fn: ClippedValueLoss | None = None,
        loss_fn: ClippedPGLoss | None = None,
        learning_rate: float = 1e-3,
        value_learning_rate: float = 1e-3,
        offload_optimizer_for_logprob: bool = True,
        train_global_batch_size: int | None = None,
        value_train_global_batch_size: int | None = None,
        temperature: float = 1.0,
        algo: dict[str, Any] | None = None,
    ) -> None:
        raise NotImplementedError(
            "PPO training on the single controller is not implemented yet: `screl check` validates PPO "
            "configs, but `screl fit` runs GRPO only (model.class_path: screl.GRPO)"
        )
