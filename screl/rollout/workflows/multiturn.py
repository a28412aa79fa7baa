"""Multi-turn rollout workflows: a conversation per sibling, captured token by token into one training row.

:class:`MultiTurnWorkflow` (the direct one) drives an :class:`~screl.envs.environment.Environment` from the
task (an :class:`~screl.envs.environment.EnvTask`) and calls the worker's engine in-process: each turn's
prompt is the chat template's rendering with the past turns' tokens spliced in verbatim
(:func:`screl.rollout.workflows.chat.chat_prompt_ids`), each reply is parsed for tool calls and stepped through the
environment, until it is done, ``max_turns`` replies were made, or the conversation reaches
``max_total_tokens``. The row (:func:`screl.rollout.workflows.trajectory.build_row`) trains on the model's tokens only;
a step the environment flags (``StepResult.mask``) masks the whole conversation (``sample_mask`` 0).

A sibling is sealed when its conversation ends, as a single-turn one is: ``sibling`` recovery keeps finished
conversations and redispatches unfinished ones from the start.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Sequence
from typing import Any

from screl.envs import PromptRecord, Task, decode_completion
from screl.envs.environment import Action, EnvTask, StepResult
from screl.rollout.engines.protocol import GenerationRequest
from screl.rollout.rows import ROW_SCHEMA, RowSchema
from screl.rollout.workflows.chat import chat_prompt_ids
from screl.rollout.workflows.trajectory import TrajectoryError, Turn, build_row, turn_of
from screl.rollout.workflows.workflow import Generate, RolloutItem, RolloutOutcome

__all__ = ["MultiTurnWorkflow", "turn_seed"]


def turn_seed(seed: int | None, turn: int) -> int | None:
    """The sampling seed of a sibling's ``turn`` (None stays None): distinct per turn, fixed per sibling."""
    return None if seed is None else (seed + 1_000_003 * turn) % (2**63)


class MultiTurnWorkflow:
    """Conversations with the task's environments, on the worker's engine.

    Args:
        task: An :class:`EnvTask`.
        tokenizer: The policy's tokenizer (its chat template renders every turn).
        schema: The row schema (the standard one).
        max_turns: Model replies per conversation at most.
        max_total_tokens: Prompt + every turn's tokens at most; a turn's ``max_new_tokens`` shrinks to fit.
        env_actors: Run each environment as a Ray actor of its own (heavy or stateful environments).
    """

    def __init__(self, task: Task, tokenizer: Any, schema: RowSchema = ROW_SCHEMA, max_turns: int = 4,
                 max_total_tokens: int = 256, env_actors: bool = False) -> None:
        if not isinstance(task, EnvTask):
            raise TypeError(f"MultiTurnWorkflow needs an EnvTask (one with make_env); data.init_args.task is "
                            f"{type(task).__name__}")
        if max_turns < 1 or max_total_tokens < 2:
            raise ValueError(f"generation.workflow_args: max_turns ({max_turns}) must be >= 1 and max_total_tokens "
                             f"({max_total_tokens}) >= 2")
        self.task, self.tokenizer, self.schema = task, tokenizer, schema
        self.max_turns, self.max_total_tokens, self.env_actors = max_turns, max_total_tokens, env_actors

    async def run(self, items: Sequence[RolloutItem], generate: Generate) -> list[RolloutOutcome]:
        return list(await asyncio.gather(*(self._conversation(item, generate) for item in items)))

    async def _conversation(self, item: RolloutItem, generate: Generate) -> RolloutOutcome:
        env = _EnvHandle(self.task, item.prompt, self.env_actors)
        try:
            messages = [{"role": "user", "content": await env.call("reset", item.prompt)}]
            turns: list[Turn] = []
            reward, prefix, flagged = 0.0, None, False
            for t in range(self.max_turns):
                prompt_ids = chat_prompt_ids(self.tokenizer, messages, prefix)
                budget = self.max_total_tokens - len(prompt_ids)
                if budget < 1:
                    break
                sampling = dataclasses.replace(item.sampling, max_new_tokens=min(item.sampling.max_new_tokens, budget),
                                               min_new_tokens=min(item.sampling.min_new_tokens, budget),
                                               seed=turn_seed(item.sampling.seed, t))
                result = (await generate([GenerationRequest(item.attempt, prompt_ids, sampling, item.priority)]))[0]
                if result.finish_reason == "abort":
                    return RolloutOutcome(item.attempt, "abort", finish_reason="abort")
                turns.append(turn_of(result, {"turn": t}))
                text = decode_completion(self.tokenizer, result.token_ids)
                calls = await env.call("parse_tool_calls", text)
                step: StepResult = await env.call("step", Action(text, tuple(calls)))
                reward += float(step.reward)
                flagged = flagged or step.mask
                if step.done:
                    break
                messages += [{"role": "assistant", "content": text},
                             {"role": env.observation_role, "content": step.observation}]
                prefix = [*result.prompt_token_ids, *result.token_ids]
            row = build_row(turns, reward, self.schema, sample_mask=0.0 if flagged else 1.0)
        except (TrajectoryError, ValueError, KeyError, TypeError, RuntimeError) as err:
            return RolloutOutcome(item.attempt, "data_error", detail=repr(err)[:200])
        finally:
            env.close()
        model_tokens = sum(len(t.token_ids) for t in turns)
        return RolloutOutcome(item.attempt, "sealed", row=row, reward=reward, end_version=turns[-1].weight_versions[-1]
                              if turns[-1].weight_versions else 0, response_len=model_tokens,
                              finish_reason=turns[-1].finish_reason)


class _EnvHandle:
    """An environment in this process (its calls on the executor thread) or in a Ray actor of its own."""

    def __init__(self, task: EnvTask, prompt: PromptRecord, actor: bool) -> None:
        self.actor: Any = None
        if actor:
            import ray

            self.actor = ray.remote(num_cpus=0)(_EnvActor).remote(task, prompt)
            self.env: Any = None
            self.observation_role = "tool"
        else:
            self.env = task.make_env(prompt)
            self.observation_role = str(getattr(self.env, "observation_role", "tool"))

    async def call(self, method: str, *args: Any) -> Any:
        if self.actor is not None:
            if method == "reset":
                self.observation_role = await self.actor.observation_role.remote()
            return await getattr(self.actor, method).remote(*args)
        return await asyncio.get_running_loop().run_in_executor(None, getattr(self.env, method), *args)

    def close(self) -> None:
        if self.actor is not None:
            import ray

            ray.kill(self.actor)


class _EnvActor:
    """One environment in a Ray actor."""

    def __init__(self, task: EnvTask, prompt: PromptRecord) -> None:
        self.env = task.make_env(prompt)

    def observation_role(self) -> str:
        return str(getattr(self.env, "observation_role", "tool"))

    def reset(self, prompt: PromptRecord) -> str:
        return str(self.env.reset(prompt))

    def parse_tool_calls(self, text: str) -> list[Any]:
        return list(self.env.parse_tool_calls(text))

    def step(self, action: Action) -> StepResult:
        result: StepResult = self.env.step(action)
        return result
