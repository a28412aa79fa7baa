"""Multi-turn environments: the protocol a multi-turn rollout workflow drives, and tasks that make them.

An :class:`Environment` holds one conversation's state. ``reset(prompt)`` gives the first user message;
after each model turn the workflow parses the reply's tool calls (``parse_tool_calls``) and calls
``step(action)``, which answers with an observation (the next message, in ``observation_role``), a reward
for that step and whether the episode is done. The rollout's reward is the sum of its steps' rewards.

An :class:`EnvTask` is a :class:`~screl.envs.Task` whose prompts each start an environment (``make_env``).
Its ``reward(prompt, completion)`` scores a single-turn completion, which is what validation runs.
Environments run in the generation worker's process, on its executor thread; a heavy one (a sandbox, a
browser) runs as a Ray actor with ``MultiTurnWorkflow(env_actors=True)``.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from screl.envs.base import PromptRecord, Task

__all__ = ["Action", "EnvTask", "Environment", "StepResult", "ToolCall"]


@dataclass(frozen=True)
class ToolCall:
    """One tool call parsed from a model turn."""

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Action:
    """A model turn: its text and the tool calls parsed from it."""

    text: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class StepResult:
    """What the environment answers to one action."""

    observation: str
    """The next message's content (empty when ``done``)."""
    reward: float
    done: bool
    mask: bool = False
    """Flag the conversation: it stays a row (its group keeps G siblings) but trains nothing (``sample_mask`` 0),
    for a malformed tool call or a broken protocol the reward should not teach from. Any flagged step masks it."""


@runtime_checkable
class Environment(Protocol):
    """One episode's state: the first message, then an answer to every model turn."""

    observation_role: str
    """The chat role of observations (``tool`` for tool results, ``user`` for a simulated user)."""

    def reset(self, prompt: PromptRecord) -> str:
        """Start the episode; returns the first user message."""
        ...

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        """The tool calls in a model turn (none: a final answer)."""
        ...

    def step(self, action: Action) -> StepResult:
        """Answer one model turn."""
        ...


class EnvTask(Task):
    """A task whose prompts each start an environment."""

    @abstractmethod
    def make_env(self, prompt: PromptRecord) -> Environment:
        """A fresh environment for one rollout of ``prompt``."""
