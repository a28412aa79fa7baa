"""The algorithms as LightningModules."""

from screl.modules.grpo import GRPO, token_logprobs
from screl.modules.ppo import PPO

__all__ = ["GRPO", "PPO", "token_logprobs"]
