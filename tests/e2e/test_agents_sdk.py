"""Agents written the usual way, through ``AgentWorkflow`` and the real policy server: the OpenAI Agents SDK (both of
its model classes, tracing disabled) with a ``function_tool`` calculator, and a plain ``openai`` client loop with
function calling. The replies are scripted (``tests.e2e._scripted``: call the tool with ``=``, then answer ``7``)
so that the whole protocol runs: the SDK's requests, the compact tool-call parser, the tool result sent back, the
session's token capture, the row."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from screl.envs.base import PromptRecord
from screl.envs.calculator import CalculatorTask
from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.workflows.agent import AgentResult, AgentWorkflow
from screl.rollout.workflows.workflow import RolloutItem
from tests.e2e._scripted import serve

pytest.importorskip("agents", reason="the OpenAI Agents SDK is in the agents and dev extras")

pytestmark = [pytest.mark.usefixtures("ray_cluster")]

POLICY = TinyCausalLM(hidden_size=32, num_layers=1)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str]]:
    server, url, workers = serve(POLICY, max_tokens=4)
    yield server, url
    for actor in (server, *workers):
        ray.kill(actor)


@pytest.mark.parametrize("agent", ["sdk_chat_agent", "sdk_responses_agent", "sdk_streamed_agent",
                                   "function_calling_agent"])
def test_an_agent_calls_the_tool_answers_and_becomes_one_row(served: Any, agent: str) -> None:
    server, url = served
    tok = POLICY.build_tokenizer()
    wf = AgentWorkflow(CalculatorTask(), tok, agent=f"screl.envs.tool_agents:{agent}")
    wf.attach_server(server, url, None)
    prompt = PromptRecord(34, "3+4", {"a": 3, "b": 4, "task_source": "calculator"})
    [outcome] = asyncio.run(wf.run([RolloutItem(f"g34_g0_{agent}", prompt, (), SamplingParams())], None))  # type: ignore[arg-type]
    assert outcome.status == "sealed", outcome.detail
    assert outcome.reward == 1.25  # the first well-formed call (0.25) + the right sum after the tool's result (1.0)
    row = outcome.row
    assert row is not None and row["sample_mask"].tolist() == [1.0]
    ids, mask = row["input_ids"].tolist(), row["loss_mask"].tolist()
    text = tok.decode(ids, skip_special_tokens=False)
    assert text == "<bos>tools calculator<eos>user 3+4<eos>assistant =<eos>tool 7<eos>assistant 7<eos>"
    model_tokens = [t for t, m in zip(ids[int(row["prompt_len"][0]):], mask, strict=True) if m]
    assert tok.decode(model_tokens, skip_special_tokens=False) == "=<eos>7<eos>"  # the model's tokens only


def test_the_sdk_agents_create_no_trace(served: Any) -> None:
    """Tracing would upload to OpenAI: the SDK agents switch it off, so a run makes no trace at all."""
    from agents import tracing

    made: list[Any] = []

    class Recorder(tracing.TracingProcessor):
        def on_trace_start(self, trace: Any) -> None:
            made.append(trace)

        def on_trace_end(self, trace: Any) -> None: ...
        def on_span_start(self, span: Any) -> None: ...
        def on_span_end(self, span: Any) -> None: ...
        def shutdown(self) -> None: ...
        def force_flush(self) -> None: ...

    tracing.set_trace_processors([Recorder()])  # replaces the OpenAI exporter: nothing could leave anyway
    server, url = served
    wf = AgentWorkflow(CalculatorTask(), POLICY.build_tokenizer(), agent="screl.envs.tool_agents:sdk_chat_agent")
    wf.attach_server(server, url, None)
    prompt = PromptRecord(34, "3+4", {"a": 3, "b": 4, "task_source": "calculator"})
    [outcome] = asyncio.run(wf.run([RolloutItem("g34_g0_trace", prompt, (), SamplingParams())], None))  # type: ignore[arg-type]
    assert outcome.status == "sealed" and outcome.reward == 1.25
    assert made == [] and tracing.get_trace_provider()._disabled is True  # noqa: SLF001 - the SDK's own flag


def flagging_agent(client: Any, prompt: PromptRecord, env: Any) -> AgentResult:
    """Masks its conversation when the reply's call does not parse (the server says so: ``tool_call_error``)."""
    tools = [{"type": "function", "function": {"name": n, "parameters": {
        "type": "object", "properties": {"x": {"type": "string"}}}}} for n in ("add", "mul")]
    reply = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "=bad"}], tools=tools,
                                           max_tokens=8)
    error = reply.choices[0].model_extra.get("tool_call_error")
    if reply.choices[0].message.tool_calls or error != "the call names 'div', which the request does not offer":
        raise AssertionError(f"expected an unparsed call, got {reply.choices[0]}")  # the sibling fails: data_error
    return AgentResult(0.5, mask=True)


def test_an_agent_masks_a_conversation_whose_call_does_not_parse(served: Any) -> None:
    server, url = served
    wf = AgentWorkflow(CalculatorTask(), POLICY.build_tokenizer(), agent="tests.e2e.test_agents_sdk:flagging_agent")
    wf.attach_server(server, url, None)
    prompt = PromptRecord(34, "3+4", {"a": 3, "b": 4, "task_source": "calculator"})
    [outcome] = asyncio.run(wf.run([RolloutItem("g34_g0_mask", prompt, (), SamplingParams())], None))  # type: ignore[arg-type]
    assert outcome.status == "sealed", outcome.detail
    assert outcome.status == "sealed" and outcome.reward == 0.5  # it keeps its reward (and group)
    assert outcome.row is not None and outcome.row["sample_mask"].tolist() == [0.0]  # and trains nothing
