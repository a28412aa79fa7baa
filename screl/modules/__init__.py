"""The algorithms as LightningModules: GRPO, PPO and Distill, siblings over
:class:`~screl.modules.policy_gradient.PolicyGradientModule`."""

from screl.modules.distill import Distill
from screl.modules.grpo import GRPO, token_logprobs
from screl.modules.policy_gradient import PolicyGradientModule
from screl.modules.ppo import PPO

__all__ = ["GRPO", "PPO", "Distill", "PolicyGradientModule", "token_logprobs"]
