"""Tasks and reward functions (plain Python; see ``screl.envs.base`` for the plugin point)."""

from screl.envs.base import (
    CustomReward,
    HeldOut,
    PromptRecord,
    RewardFn,
    Scored,
    SlowReward,
    Task,
    Verifier,
    decode_completion,
    load_reward_fn,
)
from screl.envs.datasets import DatasetTask
from screl.envs.format_tasks import StrictAnswer
from screl.envs.math_verify import MathVerify, MathVerifyError
from screl.envs.mixture import TaskMixture
from screl.envs.shapes import ShapesTask
from screl.envs.tasks import Addition, CountLetter, JsonlTask, arithmetic_prompts, split_holdout

__all__ = [
    "Addition",
    "CountLetter",
    "CustomReward",
    "DatasetTask",
    "HeldOut",
    "JsonlTask",
    "MathVerify",
    "MathVerifyError",
    "PromptRecord",
    "RewardFn",
    "Scored",
    "ShapesTask",
    "SlowReward",
    "StrictAnswer",
    "Task",
    "TaskMixture",
    "Verifier",
    "arithmetic_prompts",
    "decode_completion",
    "load_reward_fn",
    "split_holdout",
]
