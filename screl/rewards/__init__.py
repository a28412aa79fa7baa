"""Rewards as the field writes them (docs/rewards.md): TRL-style reward functions with weights, ``None`` for "does
not apply", async functions, verl's ``compute_score`` through an adapter, and a reward model in a Ray actor.

* :class:`RewardFuncs`: the functions and weights; ``score(records, completions, completion_ids)`` gives
  ``(totals, per_function_values)``.
* :class:`WithRewardFuncs`: any task's prompts scored by them (the per-function values reach the logs).
* :func:`verl_score`: verl's ``compute_score(data_source, solution_str, ground_truth, extra_info)`` adapted.
* :class:`RewardModel`: an ``AutoModelForSequenceClassification`` scoring in its own actor.
"""

from screl.rewards.funcs import (
    EXPECTED,
    NonFiniteRewardError,
    RewardFunc,
    RewardFuncError,
    RewardFuncs,
    Scores,
    load_reward_func,
)
from screl.rewards.inputs import PROMPT_MESSAGES, RewardInputs, reward_inputs
from screl.rewards.model import RewardModel
from screl.rewards.stats import RewardStats
from screl.rewards.task import WithRewardFuncs
from screl.rewards.verl import VerlScore, verl_score

__all__ = [
    "EXPECTED",
    "PROMPT_MESSAGES",
    "NonFiniteRewardError",
    "RewardFunc",
    "RewardFuncError",
    "RewardFuncs",
    "RewardInputs",
    "RewardModel",
    "RewardStats",
    "Scores",
    "VerlScore",
    "WithRewardFuncs",
    "load_reward_func",
    "reward_inputs",
    "verl_score",
]
