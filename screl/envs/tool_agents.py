"""Calculator agents written the usual way, with OpenAI function calling, for ``screl.rollout.AgentWorkflow``.

The calculator task (:class:`~screl.envs.calculator.CalculatorTask`) scores them: its environment's rewards are
kept (``call_reward`` for the first well-formed call, 1.0 for the right sum after a tool result, ``unaided_reward``
without one), only the protocol changes: the tool is a JSON-schema function the server renders through the chat
template, and the model's calls come back as ``tool_calls`` (the character tokenizer writes them ``=`` or
``=3+4``: ``generation.http_server.tool_parser: auto`` picks the compact parser for it).

* :func:`function_calling_agent`: a plain ``openai`` client loop (``tools=[...]``, ``tool_calls`` answered by
  ``tool`` messages with their ``tool_call_id``);
* :func:`sdk_chat_agent` and :func:`sdk_responses_agent`: the OpenAI Agents SDK (``pip install -e '.[agents]'``)
  with a ``function_tool`` calculator, over ``OpenAIChatCompletionsModel`` or ``OpenAIResponsesModel``. Tracing is
  disabled: the SDK would upload traces to OpenAI otherwise. ``configs/grpo_agent_sdk_tiny.yaml`` trains with it;
* :func:`sdk_streamed_agent`: the same SDK agent's streamed run (``Runner.run_streamed``, the Responses model).

Every reply is sent back as the client got it, so the server splices the conversation's tokens verbatim.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any

from screl.envs.base import PromptRecord
from screl.envs.environment import Action, Environment, ToolCall

__all__ = ["CALCULATOR_TOOL", "function_calling_agent", "sdk_chat_agent", "sdk_responses_agent"]

os.environ.setdefault("OPENAI_AGENTS_DISABLE_TRACING", "1")  # before the SDK is imported anywhere in the process

CALCULATOR_TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "The value of a sum such as 3+4 (empty: the question's own sum).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}


_LEADING_SUM = re.compile(r"\s*([0-9+]*)")


class _Episode:
    """The environment's rewards for calls and the final answer."""

    def __init__(self, env: Environment | None, prompt: PromptRecord) -> None:
        assert env is not None, "the calculator agents need the task's environment"
        self.env, self.question, self.reward, self.done = env, env.reset(prompt), 0.0, False

    def call(self, expression: str) -> str:
        """The calculator reads the sum the expression starts with (``3+4`` of ``3+4 please``), as the task's
        compact syntax does; none at all is the question's own sum."""
        expression = _LEADING_SUM.match(expression).group(1)  # type: ignore[union-attr]  # always matches
        step = self.env.step(Action("", (ToolCall("calculator", {"expression": expression or self.question}),)))
        self.reward += step.reward
        return step.observation

    def answer(self, text: str) -> None:
        if not self.done:
            self.reward += self.env.step(Action(text)).reward
            self.done = True


def function_calling_agent(client: Any, prompt: PromptRecord, env: Environment | None, max_turns: int = 3,
                           max_tokens: int = 4) -> float:
    """A plain ``openai`` client loop with function calling: ask with the calculator tool, answer each
    ``tool_call`` with a ``tool`` message, stop at the first reply without calls (the final answer)."""
    episode = _Episode(env, prompt)
    messages: list[dict[str, Any]] = [{"role": "user", "content": episode.question}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="screl-policy", messages=messages, tools=[CALCULATOR_TOOL],
                                               max_tokens=max_tokens)
        message = reply.choices[0].message
        if not message.tool_calls:
            episode.answer(message.content or "")
            break
        messages.append(message.model_dump(include={"role", "content", "tool_calls"}))
        for call in message.tool_calls:
            expression = str(json.loads(call.function.arguments or "{}").get("expression", ""))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": episode.call(expression)})
    return episode.reward


async def _sdk_agent(client: Any, prompt: PromptRecord, env: Environment | None, responses: bool,
                     max_turns: int, max_tokens: int, streamed: bool = False) -> float:
    from agents import (
        Agent,
        MaxTurnsExceeded,
        ModelBehaviorError,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)
    episode = _Episode(env, prompt)

    @function_tool
    def calculator(expression: str) -> str:
        """The value of a sum such as 3+4 (empty: the question's own sum).

        Args:
            expression: The sum.
        """
        return episode.call(expression)

    model_cls = OpenAIResponsesModel if responses else OpenAIChatCompletionsModel
    agent = Agent(name="calculator", model=model_cls(model="screl-policy", openai_client=client),
                  tools=[calculator], model_settings=ModelSettings(max_tokens=max_tokens))
    try:
        if streamed:  # the server streams the Responses API's events; the SDK assembles each turn from them
            run = Runner.run_streamed(agent, episode.question, max_turns=max_turns)
            async for _ in run.stream_events():
                pass
            episode.answer(str(run.final_output or ""))
        else:
            result = await Runner.run(agent, episode.question, max_turns=max_turns)
            episode.answer(str(result.final_output or ""))
    except MaxTurnsExceeded:  # it kept calling the tool: the calls' rewards stand
        pass
    except ModelBehaviorError as err:  # the Responses model refuses a reply max_output_tokens cut (incomplete)
        if "incomplete" not in str(err):
            raise
    return episode.reward


async def sdk_chat_agent(client: Any, prompt: PromptRecord, env: Environment | None, max_turns: int = 3,
                         max_tokens: int = 4) -> float:
    """The Agents SDK over chat completions (``OpenAIChatCompletionsModel``); ``client`` is an ``AsyncOpenAI``."""
    return await _sdk_agent(client, prompt, env, False, max_turns, max_tokens)


async def sdk_responses_agent(client: Any, prompt: PromptRecord, env: Environment | None, max_turns: int = 3,
                              max_tokens: int = 4) -> float:
    """The Agents SDK over the Responses API (``OpenAIResponsesModel``, the SDK's default)."""
    return await _sdk_agent(client, prompt, env, True, max_turns, max_tokens)


async def sdk_streamed_agent(client: Any, prompt: PromptRecord, env: Environment | None, max_turns: int = 3,
                             max_tokens: int = 4) -> float:
    """The Agents SDK's streamed run (``Runner.run_streamed``) over the Responses API."""
    return await _sdk_agent(client, prompt, env, True, max_turns, max_tokens, streamed=True)
