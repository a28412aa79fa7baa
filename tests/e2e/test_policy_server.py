"""The OpenAI-compatible policy server against the official ``openai`` client: real Ray workers with the torch
engine behind it, bound to loopback."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import ray
import torch

from screl.envs.calculator import CalculatorTask
from screl.models import TinyCausalLM
from screl.modules.grpo import token_logprobs
from screl.rollout.engines.protocol import EngineOptions, SamplingParams
from screl.rollout.server.server import PolicyServer
from screl.rollout.worker import spawn_workers
from screl.rollout.workflows.agent import AgentWorkflow
from screl.rollout.workflows.chat import chat_prompt_ids
from screl.rollout.workflows.trajectory import Turn, build_row
from screl.rollout.workflows.workflow import RolloutItem

pytestmark = [pytest.mark.usefixtures("ray_cluster")]

POLICY = TinyCausalLM(hidden_size=32, num_layers=1)


def _serve(workers: list[Any], **kwargs: Any) -> tuple[Any, str]:
    server = ray.remote(PolicyServer).options(num_cpus=0, max_concurrency=1000).remote(workers, POLICY, **kwargs)
    return server, ray.get(server.start.remote(), timeout=60)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str, list[Any], torch.nn.Module]]:
    model = POLICY.build_model().eval()
    workers = spawn_workers(2, POLICY, namespace_prefix="screl-srv", max_restarts=0)
    ray.get([w.update_weights.remote([model.state_dict()], 0) for w in workers], timeout=120)
    server, url = _serve(workers, max_tokens=8)
    yield server, url, workers, model
    for actor in (server, *workers):
        ray.kill(actor)


def _client(url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key=kwargs.pop("api_key", "unused"), max_retries=0, **kwargs)


@pytest.mark.parity
def test_chat_returns_token_ids_logprobs_and_versions_the_trainer_agrees_with(served: Any) -> None:
    _, url, _, model = served
    messages = [{"role": "user", "content": "3+4"}]
    r = _client(url).chat.completions.create(model="screl-policy", messages=messages, max_tokens=6, logprobs=True,
                                             top_logprobs=0, seed=5)
    tok = POLICY.build_tokenizer()
    prompt = r.model_extra["prompt_token_ids"]
    assert prompt == chat_prompt_ids(tok, messages)
    choice = r.choices[0]
    ids, versions = choice.model_extra["token_ids"], choice.model_extra["weight_versions"]
    assert 1 <= len(ids) <= 6 and versions == [0] * len(ids)
    assert choice.message.content == tok.decode(ids, skip_special_tokens=True)
    assert choice.message.model_extra["generation_token_ids"] == ids
    served_lp = [c.logprob for c in choice.logprobs.content]
    assert [c.token for c in choice.logprobs.content] == [tok.decode([i]) for i in ids]
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        trainer_lp = token_logprobs(model, seq, torch.ones_like(seq), 1.0)[0, len(prompt) - 1:]
    assert torch.allclose(torch.tensor(served_lp), trainer_lp, atol=1e-5)
    assert r.usage.prompt_tokens == len(prompt) and r.usage.completion_tokens == len(ids)


def test_n_choices_are_seeded_and_reproducible(served: Any) -> None:
    client = _client(served[1])
    first = client.completions.create(model="m", prompt="3+4=", max_tokens=8, n=3, seed=11, temperature=1.0)
    again = client.completions.create(model="m", prompt="3+4=", max_tokens=8, n=3, seed=11, temperature=1.0)
    ids = [c.model_extra["token_ids"] for c in first.choices]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert ids == [c.model_extra["token_ids"] for c in again.choices]
    assert len({tuple(i) for i in ids}) > 1, "the n choices sampled the same tokens"
    assert first.model_extra["prompt_token_ids"] == POLICY.build_tokenizer()("3+4=")["input_ids"]


def test_stop_strings_cut_the_text_and_the_tokens(served: Any) -> None:
    client = _client(served[1])
    tok = POLICY.build_tokenizer()
    free = [client.completions.create(model="m", prompt="1+1=", max_tokens=8, seed=s).choices[0] for s in range(20)]
    seed, text = next((s, c.text) for s, c in enumerate(free) if len(c.text) >= 5 and c.text[3] not in c.text[:3])
    for stop in (text[3], text[3:5]):  # one token (the engine stops) and two (the server cuts)
        cut = client.completions.create(model="m", prompt="1+1=", max_tokens=8, seed=seed, stop=[stop]).choices[0]
        assert cut.text == text[:3] and cut.finish_reason == "stop"
        assert tok.decode(cut.model_extra["token_ids"]) == text[:3 + len(stop)]


def test_message_level_token_ids_splice_the_past_without_a_session(served: Any) -> None:
    client = _client(served[1])
    first = client.chat.completions.create(model="m", messages=[{"role": "user", "content": "5+2"}], max_tokens=4,
                                           seed=8)
    reply = first.choices[0].message
    past = reply.model_extra["prompt_token_ids"] + reply.model_extra["generation_token_ids"]
    sent_back = {"role": "assistant", "content": reply.content, **{k: reply.model_extra[k] for k in (
        "prompt_token_ids", "generation_token_ids")}}
    second = client.chat.completions.create(model="m", max_tokens=4, seed=8, messages=[
        {"role": "user", "content": "5+2"}, sent_back, {"role": "tool", "content": "7"}])
    prompt = second.model_extra["prompt_token_ids"]
    assert prompt[:len(past)] == past
    tok = POLICY.build_tokenizer()
    tail = tok.decode(prompt[len(past):], skip_special_tokens=False)
    assert tail.endswith("tool 7<eos>assistant ") and len(tail) <= len("<eos>tool 7<eos>assistant ")


def test_32_concurrent_sessions_record_token_exact_conversations(served: Any) -> None:
    server, url, _, _ = served

    def converse(i: int) -> str:
        client = _client(url, default_headers={"X-Session-Id": f"s{i}"})
        messages = [{"role": "user", "content": f"{i % 10}+1"}]
        first = client.chat.completions.create(model="m", messages=messages, max_tokens=4, seed=i)
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "tool", "content": "ok"}]
        client.chat.completions.create(model="m", messages=messages, max_tokens=4, seed=i)
        return f"s{i}"

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        sessions = list(pool.map(converse, range(32)))
    for s in sessions:
        turns = [Turn.from_dict(t) for t in ray.get(server.take_session.remote(s))[0]]
        assert [t.tags["turn"] for t in turns] == [0, 1]
        row = build_row(turns, 1.0)  # raises unless turn 1 extends turn 0 token for token
        assert row["loss_mask"].sum().item() == sum(len(t.token_ids) for t in turns)


def test_bad_requests_get_a_400_naming_the_field(served: Any) -> None:
    client = _client(served[1])
    cases = [
        ({"messages": [{"role": "user", "content": "1"}], "temperature": -1}, "temperature"),
        ({"messages": [{"role": "user", "content": "1"}], "logprobs": True, "top_logprobs": 3}, "top_logprobs"),
        ({"messages": [{"role": "user", "content": "1"}], "stream": False, "max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
    ]
    for body, param in cases:
        with pytest.raises(openai.BadRequestError, match=param) as err:
            client.chat.completions.create(model="m", **body)
        assert err.value.body["param"] == param and err.value.body["type"] == "invalid_request_error"
    client.chat.completions.create(model="m", max_tokens=2, extra_body={"session_id": "edit"},
                                   messages=[{"role": "user", "content": "1"}])
    with pytest.raises(openai.BadRequestError, match="the last assistant message is not the reply"):
        client.chat.completions.create(model="m", extra_body={"session_id": "edit"}, messages=[
            {"role": "user", "content": "1"}, {"role": "assistant", "content": "edited"},
            {"role": "user", "content": "2"}])


def test_a_refit_between_turns_changes_the_versions_at_the_next_token(served: Any) -> None:
    server, url, workers, model = served
    client = _client(url, default_headers={"X-Session-Id": "refit"})
    messages = [{"role": "user", "content": "2+2"}]
    first = client.chat.completions.create(model="m", messages=messages, max_tokens=5, seed=1)
    assert set(first.choices[0].model_extra["weight_versions"]) == {0}
    moved = {k: v + 0.01 for k, v in model.state_dict().items()}
    ray.get([w.update_weights.remote([moved], 1) for w in workers], timeout=60)
    try:
        messages += [{"role": "assistant", "content": first.choices[0].message.content},
                     {"role": "user", "content": "again"}]
        second = client.chat.completions.create(model="m", messages=messages, max_tokens=5, seed=1)
        assert set(second.choices[0].model_extra["weight_versions"]) == {1}
        row = build_row([Turn.from_dict(t) for t in ray.get(server.take_session.remote("refit"))[0]], 0.0)
        mask, versions = row["loss_mask"].tolist(), row["token_versions"].tolist()
        n0 = len(first.choices[0].model_extra["token_ids"])
        assert versions[:n0] == [0] * n0 and mask[:n0] == [1.0] * n0
        model_versions = [v for v, m in zip(versions, mask, strict=True) if m == 1.0]
        assert model_versions == [0] * n0 + [1] * len(second.choices[0].model_extra["token_ids"])
    finally:
        ray.get([w.update_weights.remote([model.state_dict()], 0) for w in workers], timeout=60)


def test_a_client_that_disconnects_gets_its_engine_request_aborted() -> None:
    [worker] = spawn_workers(1, POLICY, namespace_prefix="screl-srv-hang", max_restarts=0,
                             backend="screl.rollout.faults.HangsOnceEngine")
    ray.get(worker.update_weights.remote([POLICY.build_model().state_dict()], 0), timeout=120)
    server, url = _serve([worker])
    try:
        with pytest.raises(openai.APITimeoutError, match="timed out"):
            _client(url, timeout=1.0).completions.create(model="m", prompt="1+1=", max_tokens=4)
        deadline = time.monotonic() + 30
        while not (stats := ray.get(server.get_stats.remote()))["aborted"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert stats["disconnect_aborts"] == 1
        assert [a["finish_reason"] for a in stats["aborted"]] == ["abort"]
        # the engine is free again: the next request is served
        assert _client(url).completions.create(model="m", prompt="1+1=", max_tokens=2).choices[0].text is not None
    finally:
        ray.kill(server)
        ray.kill(worker)


def test_keys_guard_the_server() -> None:
    with pytest.raises(ValueError, match=r"host='0.0.0.0' is not loopback and no generation.http_server.api_key is set"):
        PolicyServer([], POLICY, host="0.0.0.0")
    [worker] = spawn_workers(1, POLICY, namespace_prefix="screl-srv-key", max_restarts=0)
    ray.get(worker.update_weights.remote([POLICY.build_model().state_dict()], 0), timeout=120)
    server, url = _serve([worker], api_key="sesame")
    try:
        with pytest.raises(openai.AuthenticationError, match="invalid or missing API key"):
            _client(url, api_key="wrong").models.list()
        assert [m.id for m in _client(url, api_key="sesame").models.list()] == ["screl-policy"]
    finally:
        ray.kill(server)
        ray.kill(worker)


def test_aborting_an_agents_sibling_ends_its_requests_in_the_engine(tmp_path: Path) -> None:
    marker = tmp_path / "hanging"
    [worker] = spawn_workers(1, POLICY, namespace_prefix="screl-srv-agent", max_restarts=0,
                             backend="tests.e2e._scripted.MarkedHangEngine",
                             options=EngineOptions(args={"marker": str(marker)}))
    ray.get(worker.update_weights.remote([POLICY.build_model().state_dict()], 0), timeout=120)
    server, url = _serve([worker])
    task = CalculatorTask()
    wf = AgentWorkflow(task, POLICY.build_tokenizer(), agent="screl.envs.calculator:calculator_agent")
    wf.attach_server(server, url, None)
    prompt = task.prompts()[5]
    item = RolloutItem("g5_g0_a1", prompt, (), SamplingParams())

    async def scenario() -> Any:
        run = asyncio.ensure_future(wf.run([item], None))  # type: ignore[arg-type]
        while not marker.exists():  # the agent's first request hangs in the engine (not in the worker's queue)
            await asyncio.sleep(0.05)
        await wf.abort([item.attempt, "someone-else"])
        return await asyncio.wait_for(run, 60)

    try:
        [outcome] = asyncio.run(scenario())
        assert outcome.status == "abort" and outcome.row is None
        # the session is forgotten: a new sibling of the same prompt is served from scratch
        again = asyncio.run(wf.run([RolloutItem("g5_g0_a2", prompt, (), SamplingParams())], None))  # type: ignore[arg-type]
        assert again[0].status == "sealed" and again[0].row is not None
    finally:
        ray.kill(server)
        ray.kill(worker)
