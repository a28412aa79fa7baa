"""Streaming (``stream: true``) and ``/v1/responses`` against the official ``openai`` client's streaming iterator and
Responses resource: real Ray workers behind the real server (scripted replies where a reply of a given shape is
needed: ``tests.e2e._scripted``)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import ray

from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import EngineOptions
from screl.rollout.workflows.trajectory import Turn, build_row
from tests.e2e._scripted import HermesTinyLM, serve

pytestmark = [pytest.mark.usefixtures("ray_cluster")]

HERMES = HermesTinyLM(hidden_size=32, num_layers=1, max_position_embeddings=1024)  # tool prompts: ~500 tokens
ADD = {"type": "function", "name": "add", "description": "add two integers", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}
MUL = {**ADD, "name": "mul", "description": "multiply two integers"}
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in (ADD, MUL)]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, openai.OpenAI]]:
    server, url, workers = serve(HERMES, max_tokens=200)
    yield server, openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    for actor in (server, *workers):
        ray.kill(actor)


def _decode(ids: list[int], skip: bool = False) -> str:
    return HERMES.build_tokenizer().decode(ids, skip_special_tokens=skip)


# -- streaming -----------------------------------------------------------------------------------------------------
def test_a_streamed_chat_gives_the_same_tokens_as_a_plain_one(served: Any) -> None:
    client = served[1]
    kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 12,
                              "seed": 3, "temperature": 1.0, "logprobs": True}
    plain = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == plain.choices[0].message.content and text
    [final] = [c for c in chunks if c.choices and c.choices[0].finish_reason is not None]
    want = plain.choices[0]
    assert final.choices[0].finish_reason == want.finish_reason
    assert final.choices[0].model_extra["token_ids"] == want.model_extra["token_ids"]
    assert final.choices[0].model_extra["weight_versions"] == want.model_extra["weight_versions"] == \
        [0] * len(want.model_extra["token_ids"])
    assert final.model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"]
    streamed_lp = [t.logprob for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    # exact: the same engine decodes the same request (seed 3) alone in a batch of one both times; a stream only
    # re-packs the finished reply (and JSON carries a float's repr exactly)
    assert streamed_lp == [t.logprob for t in want.logprobs.content]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.model_extra["token_ids"])
    assert all(c.usage is None for c in chunks[:-1])


def test_a_long_reply_streams_its_text_while_it_is_generated(served: Any) -> None:
    """Chunks leave as the engine produces tokens: the first text of a long reply arrives before half the reply's
    time, many chunks carry it, and joined they are the plain reply's text (same seed)."""
    client = served[1]
    kwargs: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "tell"}], "max_tokens": 900,
                              "seed": 11, "temperature": 1.0, "extra_body": {"min_tokens": 900}}
    plain = client.chat.completions.create(**kwargs)
    start = time.monotonic()
    arrivals: list[tuple[float, str]] = []
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            arrivals.append((time.monotonic() - start, chunk.choices[0].delta.content))
    total = time.monotonic() - start
    assert "".join(t for _, t in arrivals) == plain.choices[0].message.content
    assert len(arrivals) >= 5
    assert arrivals[0][0] < 0.5 * total, (arrivals[0][0], total)


def test_a_streamed_response_sends_the_responses_api_events(served: Any) -> None:
    client = served[1]
    kwargs: dict[str, Any] = {"model": "m", "input": "tell", "max_output_tokens": 900,
                              "extra_body": {"seed": 2}}  # a 322-token reply
    plain = client.responses.create(**kwargs)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete" if plain.status == "incomplete" else "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) >= 2 and "".join(deltas) == plain.output_text
    final = events[-1].response
    assert final.output_text == plain.output_text and final.id == events[0].response.id
    assert final.model_extra["token_ids"] == plain.model_extra["token_ids"]
    assert final.output[0].id == events[2].item.id


def test_a_streamed_response_with_tool_calls_ends_with_the_whole_response(served: Any) -> None:
    client = served[1]
    events = list(client.responses.create(model="m", input=[{"role": "user", "content": "@two"}], tools=[ADD, MUL],
                                          max_output_tokens=200, stream=True))
    final = events[-1]
    assert final.type == "response.completed"
    assert [o.type for o in final.response.output] == ["message", "function_call", "function_call"]
    args = [e.arguments for e in events if e.type == "response.function_call_arguments.done"]
    assert [json.loads(a) for a in args] == [{"a": 1, "b": 2}, {"a": 5, "b": 6}]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Both."


def test_streamed_tool_calls_arrive_keyed_by_index(served: Any) -> None:
    stream = served[1].chat.completions.create(model="m", messages=[{"role": "user", "content": "@two"}],
                                               tools=CHAT_TOOLS, max_tokens=200, stream=True)
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in stream:
        for piece in chunk.choices[0].delta.tool_calls or []:
            slot = calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
            slot["id"] += piece.id or ""
            slot["name"] += piece.function.name or ""
            slot["arguments"] += piece.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls"
    assert [(calls[i]["name"], json.loads(calls[i]["arguments"])) for i in sorted(calls)] == [
        ("add", {"a": 1, "b": 2}), ("mul", {"a": 5, "b": 6})]
    assert all(c["id"].startswith("call_") for c in calls.values())


def test_a_streamed_completion_gives_the_same_tokens_as_a_plain_one(served: Any) -> None:
    client = served[1]
    plain = client.completions.create(model="m", prompt=["3+4=", "1+1="], max_tokens=8, seed=5, n=2)
    chunks = list(client.completions.create(model="m", prompt=["3+4=", "1+1="], max_tokens=8, seed=5, n=2,
                                            stream=True))
    finals = {c.choices[0].index: c for c in chunks if c.choices[0].finish_reason is not None}
    assert sorted(finals) == [0, 1, 2, 3]
    for choice in plain.choices:
        assert finals[choice.index].choices[0].model_extra["token_ids"] == choice.model_extra["token_ids"]
        text = "".join(c.choices[0].text for c in chunks if c.choices[0].index == choice.index)
        assert text == choice.text
    assert finals[2].model_extra["prompt_token_ids"] == plain.model_extra["prompt_token_ids"][1]


def test_a_stream_cut_by_the_client_aborts_its_engine_request(tmp_path: Path) -> None:
    policy = TinyCausalLM(hidden_size=32, num_layers=1)
    marker = tmp_path / "hanging"
    server, url, workers = serve(policy, backend="tests.e2e._scripted.MarkedHangEngine",
                                 options=EngineOptions(args={"marker": str(marker)}))
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60)
        stream = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}],
                                                max_tokens=4, stream=True)
        first = next(iter(stream))  # the role chunk
        assert first.choices[0].delta.role == "assistant"
        deadline = time.monotonic() + 30
        while not marker.exists() and time.monotonic() < deadline:  # the request hangs in the engine
            time.sleep(0.05)
        assert marker.exists()
        stream.close()
        deadline = time.monotonic() + 30
        while not (stats := ray.get(server.get_stats.remote()))["aborted"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats["disconnect_aborts"] == 1
        assert [a["finish_reason"] for a in stats["aborted"]] == ["abort"]
        again = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "1+1"}], max_tokens=2)
        assert again.choices[0].model_extra["token_ids"]  # the engine is free again
    finally:
        for actor in (server, *workers):
            ray.kill(actor)


# -- /v1/responses ---------------------------------------------------------------------------------------------------
def test_a_responses_request_from_a_string(served: Any) -> None:
    r = served[1].responses.create(model="m", input="hello", instructions="be brief", max_output_tokens=6,
                                   extra_body={"seed": 2})
    assert r.status in ("completed", "incomplete") and [o.type for o in r.output] == ["message"]
    ids = r.model_extra["token_ids"]
    assert r.output_text == _decode(ids, skip=True) and r.usage.output_tokens == len(ids) <= 6
    assert r.model_extra["weight_versions"] == [0] * len(ids)
    assert _decode(r.model_extra["prompt_token_ids"]) == \
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\n"


def test_responses_function_calls_and_outputs_round_trip_token_exact(served: Any) -> None:
    server, client = served
    session = client.with_options(default_headers={"X-Session-Id": "resp-items"})
    first = session.responses.create(model="m", input=[{"role": "user", "content": "@two"}], tools=[ADD, MUL],
                                     max_output_tokens=200)
    assert [o.type for o in first.output] == ["message", "function_call", "function_call"]
    assert first.output[0].content[0].text == "Both."
    calls = first.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("add", {"a": 1, "b": 2}), ("mul", {"a": 5, "b": 6})]
    items: list[Any] = [{"role": "user", "content": "@two"}, *[o.model_dump(exclude_none=True) for o in first.output],
                        *[{"type": "function_call_output", "call_id": c.call_id, "output": v}
                          for c, v in zip(calls, ("3", "30"), strict=True)]]
    second = session.responses.create(model="m", input=items, tools=[ADD, MUL], max_output_tokens=200)
    past = first.model_extra["prompt_token_ids"] + first.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][:len(past)] == past
    turns = [Turn.from_dict(t) for t in ray.get(server.take_session.remote("resp-items"))[0]]
    row = build_row(turns, 1.0)
    assert row["loss_mask"].sum().item() == len(first.model_extra["token_ids"]) + len(second.model_extra["token_ids"])


def test_previous_response_id_continues_a_session_and_another_session_is_refused(served: Any) -> None:
    _, client = served
    a = client.with_options(default_headers={"X-Session-Id": "resp-a"})
    first = a.responses.create(model="m", input="@one", tools=[ADD], max_output_tokens=200)
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments) == {"a": 3, "b": 4}
    second = a.responses.create(model="m", previous_response_id=first.id, tools=[ADD], max_output_tokens=4,
                                input=[{"type": "function_call_output", "call_id": call.call_id, "output": "7"}])
    past = first.model_extra["prompt_token_ids"] + first.model_extra["token_ids"]
    assert second.model_extra["prompt_token_ids"][:len(past)] == past
    assert second.previous_response_id == first.id
    b = client.with_options(default_headers={"X-Session-Id": "resp-b"})
    with pytest.raises(openai.BadRequestError, match="belongs to another session") as err:
        b.responses.create(model="m", previous_response_id=first.id, input="go on", max_output_tokens=4)
    assert err.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError, match="is not a response of this session"):
        client.responses.create(model="m", previous_response_id="resp_unknown", input="go on")


def test_responses_features_outside_the_subset_get_a_400_naming_them(served: Any) -> None:
    client = served[1]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "reasoning", "id": "r1", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input[0].content[0].type"),
        ({"input": "x", "background": True}, "background"),
        ({"input": "x", "include": ["message.output_text.logprobs"]}, "include"),
        ({"input": "x", "text": {"format": {"type": "json_object"}}}, "text"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError, match=param.replace("[", r"\[").replace("]", r"\]")) as err:
            client.responses.create(model="m", **body)
        assert err.value.body["param"] == param
