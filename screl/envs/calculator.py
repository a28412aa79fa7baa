"""A calculator tool task: the model calls the tool, reads its result, answers (multi-turn, CPU-sized).

The prompt is a sum, ``"a+b"``. A reply that starts with ``=`` is a tool call: the calculator evaluates the
expression right after it (``=3+4``), or the question's own when there is none (``=``), and answers with
the number as a ``tool`` message. Any other reply is the final answer. Rewards:

* ``call_reward`` for the first well-formed tool call;
* 1.0 for a final answer that starts with the right sum after a tool result, ``unaided_reward`` before one;
* ``answer_reward`` for a wrong final answer after a tool result (0 by default).

With ``syntax="json"`` a tool call is written the way instruct models are taught
(``<tool_call>{"name": "calculator", "arguments": {"expression": "3+4"}}</tool_call>``).
"""

from __future__ import annotations

import json
import re
from typing import Any

from screl.envs.base import PromptRecord
from screl.envs.environment import Action, Environment, EnvTask, StepResult, ToolCall
from screl.envs.tasks import split_holdout

__all__ = ["CalculatorEnv", "CalculatorTask", "calculator_agent", "evaluate_sum", "instruct_calculator_agent"]

_COMPACT = re.compile(r"^\s*=\s*([0-9+]*)")
_JSON = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)
_SUM = re.compile(r"^\d+(?:\+\d+)*$")


def evaluate_sum(expression: str) -> int | None:
    """The value of ``"12+3+4"`` (None if it is not a sum of non-negative integers)."""
    expression = expression.replace(" ", "")
    if not _SUM.match(expression):
        return None
    return sum(int(t) for t in expression.split("+"))


class CalculatorEnv:
    """One episode of :class:`CalculatorTask`."""

    observation_role = "tool"

    def __init__(self, syntax: str = "compact", call_reward: float = 0.25, unaided_reward: float = 0.5,
                 answer_reward: float = 0.0, mask_malformed_calls: bool = False) -> None:
        self.syntax = syntax
        self.mask_malformed_calls = mask_malformed_calls
        self.answer_reward = answer_reward
        self.call_reward = call_reward
        self.unaided_reward = unaided_reward
        self.question = ""
        self.answer = 0
        self.results: list[int] = []

    def reset(self, prompt: PromptRecord) -> str:
        self.question = prompt.text
        self.answer = int(prompt.metadata["a"]) + int(prompt.metadata["b"])
        self.results = []
        return prompt.text

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        if self.syntax == "json":
            calls = []
            for body in _JSON.findall(text):
                try:
                    call = json.loads(body)
                    calls.append(ToolCall(str(call["name"]), dict(call.get("arguments", {}))))
                except (ValueError, KeyError, TypeError):
                    calls.append(ToolCall("invalid", {"raw": body}))
            return calls
        m = _COMPACT.match(text)
        if m is None:
            return []
        return [ToolCall("calculator", {"expression": m.group(1) or self.question})]

    def step(self, action: Action) -> StepResult:
        if action.tool_calls:
            call = action.tool_calls[0]
            value = evaluate_sum(str(call.arguments.get("expression", ""))) if call.name == "calculator" else None
            if value is None:  # a call of another tool, unparsable JSON or no sum: the protocol is broken
                return StepResult("error", 0.0, False, mask=self.mask_malformed_calls)
            reward = self.call_reward if not self.results else 0.0
            self.results.append(value)
            return StepResult(str(value), reward, False)
        correct = action.text.strip().startswith(str(self.answer))
        if not correct:
            return StepResult("", self.answer_reward if self.results else 0.0, True)
        return StepResult("", 1.0 if self.results else self.unaided_reward, True)


class CalculatorTask(EnvTask):
    """Sums ``a+b`` with ``a, b`` in ``[0, max_operand]`` (``prompt_id = a * (max_operand + 1) + b``), solved
    with a calculator tool. Prompts carry ``task_source: calculator`` (``rollout_recovery`` overrides key on it).

    Args:
        max_operand: The largest operand.
        syntax: ``compact`` (``=`` or ``=3+4``: what the character tokenizer can write) or ``json``.
        call_reward: Reward for the episode's first well-formed tool call.
        unaided_reward: Reward for a right answer given without calling the tool.
        answer_reward: Reward for a wrong answer given after a tool result (shaping: answering beats calling
            again).
        holdout: Prompts kept back for validation.
        mask_malformed_calls: A conversation with a malformed tool call (unparsable JSON, an unknown tool, no
            sum) stays in its group but trains nothing (the environment flags it: ``StepResult.mask``).
    """

    def __init__(self, max_operand: int = 9, syntax: str = "compact", call_reward: float = 0.25,
                 unaided_reward: float = 0.5, answer_reward: float = 0.0, holdout: int = 0,
                 mask_malformed_calls: bool = False) -> None:
        if syntax not in ("compact", "json"):
            raise ValueError(f"CalculatorTask(syntax={syntax!r}) must be 'compact' or 'json'")
        self.syntax, self.call_reward, self.unaided_reward = syntax, call_reward, unaided_reward
        self.answer_reward, self.mask_malformed_calls = answer_reward, mask_malformed_calls
        n = max_operand + 1
        records = [PromptRecord(a * n + b, f"{a}+{b}", {"a": a, "b": b, "task_source": "calculator"})
                   for a in range(n) for b in range(n)]
        self._train, self._held = split_holdout(records, holdout)

    def prompts(self) -> list[PromptRecord]:
        return list(self._train)

    def val_prompts(self) -> list[PromptRecord]:
        return list(self._held)

    def make_env(self, prompt: PromptRecord) -> Environment:
        return CalculatorEnv(self.syntax, self.call_reward, self.unaided_reward, self.answer_reward,
                             self.mask_malformed_calls)

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """A single-turn completion (validation): the unaided reward for the right sum."""
        correct = completion.strip().startswith(str(int(prompt.metadata["a"]) + int(prompt.metadata["b"])))
        return self.unaided_reward if correct else 0.0


def calculator_agent(client: Any, prompt: PromptRecord, env: Environment | None, max_turns: int = 3,
                     max_tokens: int = 4) -> float:
    """A plain-Python agent over the OpenAI API (what ``screl.rollout.AgentWorkflow`` runs, and
    ``examples/agent_loop.py`` shows on its own): ask, run the tool calls through ``env``, answer.

    It sends the assistant messages back unchanged, so the server keeps their tokens verbatim; the sampling
    temperature is left to the server (the run's ``generation.temperature``), which the trainer's logprobs use.
    """
    assert env is not None, "the calculator agent needs the task's environment"
    messages: list[dict[str, str]] = [{"role": "user", "content": env.reset(prompt)}]
    reward = 0.0
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="screl-policy", messages=messages, max_tokens=max_tokens)
        text = reply.choices[0].message.content or ""
        step = env.step(Action(text, tuple(env.parse_tool_calls(text))))
        reward += step.reward
        if step.done:
            break
        messages += [{"role": "assistant", "content": text}, {"role": env.observation_role, "content": step.observation}]
    return reward


def instruct_calculator_agent(client: Any, prompt: PromptRecord, env: Environment | None) -> float:
    """:func:`calculator_agent` with room for an instruct model: up to 4 turns of 256 tokens each, enough for a
    ``<tool_call>{"name": "calculator", ...}</tool_call>`` (``CalculatorTask(syntax="json")``) and a short answer
    (``configs/recipes/grpo_qwen3_0.6b_agent.yaml``)."""
    return calculator_agent(client, prompt, env, max_turns=4, max_tokens=256)
