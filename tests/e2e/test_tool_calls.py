"""OpenAI function calling, every prompt form of /v1/completions and unknown fields, against the official ``openai``
client: real Ray workers and the real server. Replies of a given shape come from ``tests.e2e._scripted``'s engine
(the reply's text is fixed, its tokens are scored by the real model); the rest of the path is the production one."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
import ray

from screl.models import TinyCausalLM
from screl.rollout.workflows.trajectory import Turn, build_row
from tests.e2e._scripted import HermesTinyLM, serve

pytestmark = [pytest.mark.usefixtures("ray_cluster")]

HERMES = HermesTinyLM(hidden_size=32, num_layers=1, max_position_embeddings=1024)  # tool prompts: ~500 tokens
CHAR = TinyCausalLM(hidden_size=32, num_layers=1)


def _fn(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "description": f"{name} two integers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}


TOOLS = [_fn("add"), _fn("mul")]


@pytest.fixture(scope="module")
def hermes_server() -> Iterator[tuple[Any, openai.OpenAI]]:
    server, url, workers = serve(HERMES, max_tokens=200)
    yield server, openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
    for actor in (server, *workers):
        ray.kill(actor)


@pytest.fixture(scope="module")
def hermes(hermes_server: tuple[Any, openai.OpenAI]) -> openai.OpenAI:
    return hermes_server[1]


def _ask(client: openai.OpenAI, text: str, **kwargs: Any) -> Any:
    kwargs.setdefault("tools", TOOLS)
    return client.chat.completions.create(model="m", messages=[{"role": "user", "content": text}], max_tokens=200,
                                          **kwargs)


def _decode(ids: list[int]) -> str:
    return HERMES.build_tokenizer().decode(ids, skip_special_tokens=False)


def test_a_tool_call_is_parsed_and_the_tools_are_in_the_prompt(hermes: openai.OpenAI) -> None:
    r = _ask(hermes, "add three and four @one")
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"a": 3, "b": 4}
    prompt = _decode(r.model_extra["prompt_token_ids"])
    assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>") and '"name": "mul"' in prompt
    assert _decode(choice.model_extra["token_ids"]).endswith("</tool_call><|im_end|>")


def test_two_parallel_tool_calls_in_one_reply(hermes: openai.OpenAI) -> None:
    choice = _ask(hermes, "@two").choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Both."
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2}), ("mul", {"a": 5, "b": 6})]
    assert len({c.id for c in calls}) == 2
    one = _ask(hermes, "@two", parallel_tool_calls=False).choices[0]
    assert [c.function.name for c in one.message.tool_calls] == ["add"]


def test_a_call_that_does_not_parse_is_returned_as_content(hermes: openai.OpenAI) -> None:
    choice = _ask(hermes, "@bad").choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content == '<tool_call>\n{"name": "add", "arguments": {"a": 3,, }\n</tool_call>'
    assert choice.model_extra["tool_call_error"].startswith("a <tool_call> block does not parse")


def test_tool_choice_none_produces_no_call(hermes: openai.OpenAI) -> None:
    r = _ask(hermes, "@one", tool_choice="none")
    choice = r.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason == "stop"
    assert choice.message.content.startswith('<tool_call>\n{"name": "add"')
    assert "tool_call_error" not in choice.model_extra
    assert "# Tools" in _decode(r.model_extra["prompt_token_ids"])  # the tools are still shown to the model


def test_a_named_tool_choice_opens_the_call_in_the_prompt(hermes: openai.OpenAI) -> None:
    r = _ask(hermes, "@named", tool_choice={"type": "function", "function": {"name": "mul"}})
    assert _decode(r.model_extra["prompt_token_ids"]).endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "mul", "arguments": ')
    choice = r.choices[0]
    [call] = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls"
    assert (call.function.name, json.loads(call.function.arguments)) == ("mul", {"a": 8, "b": 9})
    with pytest.raises(openai.BadRequestError, match="names 'div', which is not among the request's tools") as err:
        _ask(hermes, "@named", tool_choice={"type": "function", "function": {"name": "div"}})
    assert err.value.body["param"] == "tool_choice"


def test_the_next_turn_takes_tool_calls_and_tool_messages_back_token_exact(hermes: openai.OpenAI) -> None:
    server_url = str(hermes.base_url)
    client = openai.OpenAI(base_url=server_url, api_key="unused", max_retries=0,
                           default_headers={"X-Session-Id": "tools-1"})
    messages: list[Any] = [{"role": "user", "content": "@one"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=200)
    reply = first.choices[0].message
    messages += [reply.model_dump(include={"role", "content", "tool_calls"}),
                 {"role": "tool", "tool_call_id": reply.tool_calls[0].id, "content": "7"}]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=200)
    past = first.model_extra["prompt_token_ids"] + first.choices[0].model_extra["token_ids"]
    prompt = second.model_extra["prompt_token_ids"]
    assert prompt[:len(past)] == past
    assert _decode(prompt[len(past):]) == "\n<|im_start|>user\n<tool_response>\n7\n</tool_response><|im_end|>\n" \
                                          "<|im_start|>assistant\n"
    edited = json.loads(json.dumps(messages))
    edited[1]["tool_calls"][0]["function"]["arguments"] = '{"a": 3, "b": 5}'
    with pytest.raises(openai.BadRequestError, match="the last assistant message is not the reply this session"):
        client.chat.completions.create(model="m", messages=edited, tools=TOOLS, max_tokens=200)


def test_the_recorded_tool_conversation_becomes_one_row(hermes_server: tuple[Any, openai.OpenAI]) -> None:
    server, hermes = hermes_server
    client = hermes.with_options(default_headers={"X-Session-Id": "tools-row"})
    messages: list[Any] = [{"role": "user", "content": "@two"}]
    first = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=200)
    calls = first.choices[0].message.tool_calls
    messages.append(first.choices[0].message.model_dump(include={"role", "content", "tool_calls"}))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": str(v)} for c, v in zip(calls, (3, 30), strict=True)]
    second = client.chat.completions.create(model="m", messages=messages, tools=TOOLS, max_tokens=200)
    turns = [Turn.from_dict(t) for t in ray.get(server.take_session.remote("tools-row"))[0]]
    row = build_row(turns, 1.0)  # raises unless turn 1 extends turn 0 token for token
    ids0, ids1 = (x.choices[0].model_extra["token_ids"] for x in (first, second))
    assert row["loss_mask"].sum().item() == len(ids0) + len(ids1)
    mask = row["loss_mask"].tolist()
    p0 = len(first.model_extra["prompt_token_ids"])
    assert mask[:len(ids0)] == [1.0] * len(ids0) and mask[len(ids0)] == 0.0  # the tool messages train nothing
    assert row["input_ids"][p0:p0 + len(ids0)].tolist() == ids0


def test_the_compact_syntax_of_the_character_tokenizer() -> None:
    server, url, workers = serve(CHAR, max_tokens=16)
    try:
        client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0)
        tools = [{"type": "function", "function": {"name": "calculator", "parameters": {
            "type": "object", "properties": {"expression": {"type": "string"}}}}}]
        r = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "=one"}], tools=tools)
        assert CHAR.build_tokenizer().decode(r.model_extra["prompt_token_ids"], skip_special_tokens=False) == \
            "<bos>tools calculator<eos>user =one<eos>assistant "
        [call] = r.choices[0].message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == ("calculator", {"expression": "3+4"})
        two = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "=two"}],
                                             tools=[_fn("add"), _fn("mul")], max_tokens=24).choices[0]
        assert [(c.function.name, json.loads(c.function.arguments)) for c in two.message.tool_calls] == [
            ("add", {"a": "1+2"}), ("mul", {"a": "5+6"})]
        # a session's turns with tool calls make one token-exact row
        session = client.with_options(default_headers={"X-Session-Id": "compact"})
        messages: list[Any] = [{"role": "user", "content": "=one"}]
        first = session.chat.completions.create(model="m", messages=messages, tools=tools)
        messages += [first.choices[0].message.model_dump(include={"role", "content", "tool_calls"}),
                     {"role": "tool", "tool_call_id": first.choices[0].message.tool_calls[0].id, "content": "7"}]
        second = session.chat.completions.create(model="m", messages=messages, tools=tools, max_tokens=3)
        turns = [Turn.from_dict(t) for t in ray.get(server.take_session.remote("compact"))[0]]
        row = build_row(turns, 1.0)
        n0, n1 = (len(x.choices[0].model_extra["token_ids"]) for x in (first, second))
        assert row["loss_mask"].sum().item() == n0 + n1
        assert row["input_ids"][:len(second.model_extra["prompt_token_ids"])].tolist() == \
            second.model_extra["prompt_token_ids"]
    finally:
        for actor in (server, *workers):
            ray.kill(actor)


def test_every_prompt_form_of_completions(hermes: openai.OpenAI) -> None:
    tok = HERMES.build_tokenizer()
    a, b = "3+4=", "1+1="
    ids_a, ids_b = (tok(x, add_special_tokens=False)["input_ids"] for x in (a, b))
    forms = {"string": a, "strings": [a, b], "tokens": ids_a, "token lists": [ids_a, ids_b]}
    got = {name: hermes.completions.create(model="m", prompt=p, max_tokens=5, seed=7, n=2) for name, p in forms.items()}
    tokens = {name: [c.model_extra["token_ids"] for c in r.choices] for name, r in got.items()}
    assert tokens["string"] == tokens["tokens"] == tokens["strings"][:2] == tokens["token lists"][:2]
    assert tokens["strings"] == tokens["token lists"] and len(tokens["strings"]) == 4
    assert [c.index for c in got["strings"].choices] == [0, 1, 2, 3]
    assert got["string"].model_extra["prompt_token_ids"] == ids_a
    assert got["token lists"].model_extra["prompt_token_ids"] == [ids_a, ids_b]
    assert got["strings"].usage.prompt_tokens == len(ids_a) + len(ids_b)
    for bad in ([], [ids_a, "x"], [-1]):
        with pytest.raises(openai.BadRequestError, match="prompt: .*must be a non-empty string, a list of strings"):
            hermes.completions.create(model="m", prompt=bad, max_tokens=2)


def test_unknown_fields_get_a_400_naming_them(hermes: openai.OpenAI) -> None:
    msg = [{"role": "user", "content": "hi"}]
    with pytest.raises(openai.BadRequestError, match=r"logit_bias: the field is not supported .*accepted and ignored: "
                                                     r"user, metadata") as err:
        hermes.chat.completions.create(model="m", messages=msg, logit_bias={"5": 1.0})
    assert err.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError, match="frequency_penalty") as err:
        hermes.chat.completions.create(model="m", messages=msg, frequency_penalty=0.5)
    assert err.value.body["param"] == "frequency_penalty"
    with pytest.raises(openai.BadRequestError, match="tools\\[0\\]: tools of type 'custom' are not supported"):
        hermes.chat.completions.create(model="m", messages=msg, tools=[{"type": "custom", "custom": {"name": "x"}}])
    with pytest.raises(openai.BadRequestError, match="echo: the field is not supported"):
        hermes.completions.create(model="m", prompt="hi", echo=True)
    ok = hermes.chat.completions.create(model="m", messages=msg, max_tokens=2, user="u1", metadata={"k": "v"},
                                        store=False, frequency_penalty=0.0)
    assert ok.choices[0].model_extra["token_ids"]
