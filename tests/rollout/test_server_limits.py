"""The policy server's bounds (issue 51): every limit refuses before any work, with the status code, the field, the
size and the key. The app in this process over a real worker and engine (``tests/rollout/inprocess_server.py``),
the engine's calls counted: a refused request never reaches it. Over Ray and loopback with the official client
(poisoned requests, the 100k-token prompt, the 20 MB message): ``tests/e2e/test_server_limits.py``."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from screl.config_generation import HttpServerConfig
from screl.rollout.decode_queue import DecodeQueue
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.server.server import PolicyServer
from screl.rollout.server.server_limits import INLINE_CHARS
from tests.rollout.inprocess_server import POLICY, InProcess, build_worker

WORKER = build_worker()
USER = [{"role": "user", "content": "3+4"}]


class Counted(InProcess):
    """The worker handle, counting the engine calls (``generate``) it forwards; ``hold`` keeps them waiting."""

    def __init__(self, target: Any) -> None:
        super().__init__(target)
        self.calls = 0
        self.hold: asyncio.Event | None = None

    def __getattr__(self, name: str) -> Any:
        method = super().__getattr__(name)
        if name != "generate":
            return method
        outer = self

        class _Generate:
            @staticmethod
            def remote(*args: Any) -> Any:
                outer.calls += 1

                async def run() -> Any:
                    if outer.hold is not None:
                        await outer.hold.wait()
                    return await method.remote(*args)

                return run()

        return _Generate


def _server(clock: Any = time.monotonic, **limits: Any) -> tuple[PolicyServer, Counted, TestClient]:
    handle = Counted(WORKER)
    server = PolicyServer([handle], POLICY, max_tokens=4, limits=HttpServerConfig(**limits), clock=clock)
    return server, handle, TestClient(server.app())


def _error(response: Any, status: int, param: str | None, *says: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = dict(response.json()["error"])
    assert error["param"] == param, error
    for part in says:
        assert part in error["message"], (part, error)
    return error


SERVER, ENGINE, CLIENT = _server(max_choices=4, max_messages=3, max_tools=1)


@pytest.mark.parametrize(("content", "headers"), [
    (b"{" + b" " * 5000 + b"}", {}),  # Content-Length says it: refused before a byte is read
    ([b"{", b" " * 3000, b" " * 3000, b"}"], {}),  # chunked, no Content-Length: refused while read
])
def test_a_body_past_max_body_bytes_is_a_413_naming_the_limit(content: Any, headers: dict[str, str]) -> None:
    server, engine, client = _server(max_body_bytes=4096)
    error = _error(client.post("/v1/chat/completions", content=iter(content) if isinstance(content, list) else content,
                               headers={"content-type": "application/json", **headers}),
                   413, "body", "4096 bytes", "generation.http_server.max_body_bytes")
    assert error["code"] == "request_too_large" and engine.calls == 0
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/completions", {"prompt": [3] * 129}, "prompt", "the prompt is 129 tokens"),
    ("/v1/completions", {"prompt": [3] * 100_000}, "prompt", "the prompt is 100000 tokens"),
    ("/v1/completions", {"prompt": ["3+4", "1" * 200]}, "prompt", "the prompt is 200 tokens"),
    ("/v1/completions", {"prompt": "1" * 700}, "prompt", "the text is 700 characters"),  # not tokenized
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "1" * 150}]}, "messages",
     "the prompt is 1"),
    ("/v1/chat/completions", {"messages": [*USER, {"role": "assistant", "content": "7", "prompt_token_ids": [3] * 140,
                                                   "generation_token_ids": [4]}, *USER]}, "messages",
     "the prompt is 141 tokens"),  # the spliced past alone is too long
    ("/v1/chat/completions", {"messages": [*USER, {"role": "tool", "tool_call_id": "c", "content": "9" * 140}]},
     "messages", "the prompt is 1"),  # a tool result
    ("/v1/responses", {"input": [{"role": "user", "content": "3+4"}, {"type": "function_call_output",
                                                                      "call_id": "c", "output": "8" * 130}]},
     "input", "the prompt is 1"),
    ("/v1/responses", {"input": "2" * 5000}, "input", "the text is 50"),
])
def test_a_prompt_longer_than_the_context_is_a_400_naming_the_field_before_the_engine(
        path: str, body: dict[str, Any], param: str, says: str) -> None:
    assert SERVER.max_prompt_tokens == 128 and SERVER.max_token_chars == 5  # the tiny model's context, "<eos>"
    before = ENGINE.calls
    t0 = time.monotonic()
    _error(CLIENT.post(path, json=body), 400, param, says, "128 tokens", "context length")
    assert ENGINE.calls == before and time.monotonic() - t0 < 5.0
    ok = CLIENT.post("/v1/completions", json={"prompt": [3] * 128, "max_tokens": 2})  # at the limit
    assert ok.status_code == 200, ok.text


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/v1/chat/completions", {"messages": USER, "n": 5}, "n", "5 choices"),
    ("/v1/completions", {"prompt": ["1", "2", "3"], "n": 2}, "n", "6 choices"),
    ("/v1/chat/completions", {"messages": USER * 4}, "messages", "4 messages"),
    ("/v1/responses", {"input": USER * 4}, "input", "4 input items"),
    ("/v1/chat/completions", {"messages": USER, "tools": [
        {"type": "function", "function": {"name": f"f{i}"}} for i in range(2)]}, "tools", "2 tools"),
    ("/v1/responses", {"input": "3+4", "tools": [{"type": "function", "name": f"f{i}"} for i in range(2)]},
     "tools", "2 tools"),
])
def test_counts_past_their_limits_are_a_400_naming_the_field_and_the_key(path: str, body: dict[str, Any],
                                                                         param: str, says: str) -> None:
    key = {"n": "max_choices", "tools": "max_tools"}.get(param, "max_messages")
    before = ENGINE.calls
    _error(CLIENT.post(path, json={**body, "max_tokens" if path != "/v1/responses" else "max_output_tokens": 2}),
           400, param, says, f"generation.http_server.{key}")
    assert ENGINE.calls == before


def test_max_request_tokens_is_a_key() -> None:
    server, engine, client = _server(max_request_tokens=10)
    _error(client.post("/v1/completions", json={"prompt": "1+1=", "max_tokens": 11}), 400, "max_tokens",
           "(10: generation.http_server.max_request_tokens)")
    assert engine.calls == 0 and server.max_request_tokens == 10


def test_a_long_text_is_tokenized_off_the_event_loop() -> None:
    server, engine, client = _server()
    server.max_token_chars = 10**6  # no bound from characters: the text is tokenized
    threads = []
    tokenize = server.tokenizer.__call__
    server.tokenizer.__class__ = type("Watched", (type(server.tokenizer),), {  # note the thread each call runs on
        "__call__": lambda self, *a, **k: threads.append(threading.current_thread().name) or tokenize(*a, **k)})
    _error(client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "1" * 50_000}]}),
           400, "messages", "the prompt is 50")
    assert threads and all(t.startswith("screl-tokenize") for t in threads), threads
    assert client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2}).status_code == 200
    assert not threads[-1].startswith("screl-tokenize")  # a short one stays on the loop (< INLINE_CHARS)
    assert engine.calls == 1 and INLINE_CHARS < 50_000


def test_requests_past_max_concurrent_requests_get_a_429_with_retry_after() -> None:
    server, engine, _ = _server(max_concurrent_requests=2)

    async def scenario() -> list[httpx.Response]:
        engine.hold = asyncio.Event()
        transport = httpx.ASGITransport(app=server.app())
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            body = {"messages": USER, "max_tokens": 2}
            held = [asyncio.ensure_future(client.post("/v1/chat/completions", json=body)) for _ in range(2)]
            while engine.calls < 2:
                await asyncio.sleep(0.01)
            refused = await client.post("/v1/chat/completions", json=body)
            engine.hold.set()
            return [refused, *await asyncio.gather(*held), await client.post("/v1/chat/completions", json=body)]

    refused, *served = asyncio.run(scenario())
    error = _error(refused, 429, None, "serving 2 requests", "generation.http_server.max_concurrent_requests=2")
    assert refused.headers["retry-after"] == "1" and error["type"] == "rate_limit_error"
    assert [r.status_code for r in served] == [200, 200, 200] and server.stats["busy"] == 1


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _turn(client: TestClient, session: str) -> Any:
    return client.post("/v1/chat/completions", json={"messages": USER, "max_tokens": 2},
                       headers={"X-Session-Id": session})


def test_a_new_session_past_max_open_sessions_gets_a_429_until_one_ends() -> None:
    server, _, client = _server(max_open_sessions=2)
    assert _turn(client, "a").status_code == 200 and _turn(client, "b").status_code == 200
    refused = _turn(client, "c")
    _error(refused, 429, None, "session 'c'", "2 open sessions", "generation.http_server.max_open_sessions=2")
    assert refused.headers["retry-after"] == "1"
    assert _turn(client, "a").status_code == 200  # an open session goes on
    asyncio.run(server.take_session("a"))
    assert _turn(client, "c").status_code == 200


def test_an_idle_session_is_closed_its_records_freed_and_its_late_request_a_404_naming_it() -> None:
    clock = Clock()
    server, _, client = _server(clock, session_idle_timeout_s=60.0)
    assert server.session_idle_timeout_s == 60.0
    assert _turn(client, "late").status_code == 200
    clock.now += 61.0
    assert _turn(client, "other").status_code == 200  # its request sweeps
    assert "late" not in server.sessions and "late" not in server.seen and "late" not in server.sticky
    error = _error(_turn(client, "late"), 404, None, "session 'late' was closed after 60 s",
                   "generation.http_server.session_idle_timeout_s")
    assert error["code"] == "session_closed"
    asyncio.run(server.take_session("late"))  # the trainer's take forgets the note: the id starts afresh
    assert _turn(client, "late").status_code == 200


@pytest.mark.parametrize(("key", "value"), [("max_body_bytes", 0), ("max_open_sessions", -1),
                                             ("session_idle_timeout_s", 0.0), ("max_prompt_tokens", 1.5)])
def test_a_limit_that_is_not_a_positive_number_is_refused_naming_its_key(key: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"generation\.http_server\.{key}={value!r} must be"):
        PolicyServer([], POLICY, limits=HttpServerConfig(**{key: value}))


def test_a_batch_the_engine_fails_is_decoded_again_call_by_call_so_only_the_poisoned_call_fails() -> None:
    batches = []

    def decode(requests: list[GenerationRequest]) -> list[GenerationResult]:
        batches.append(len(requests))
        if any(r.request_id == "poison" for r in requests):
            raise MemoryError("the engine cannot hold it")
        return [GenerationResult(r.request_id, list(r.prompt_token_ids), [1], [0.0], "stop", [0], 0, 0)
                for r in requests]

    queue = DecodeQueue(decode, max_batch_size=64, batch_window_s=0.2)

    async def scenario() -> list[Any]:
        loop = asyncio.get_running_loop()
        futures = [queue.put([GenerationRequest(rid, [3], SamplingParams())], loop, None)
                   for rid in ("a", "poison", "b")]
        return await asyncio.gather(*futures, return_exceptions=True)

    a, poison, b = asyncio.run(scenario())
    assert isinstance(poison, MemoryError) and batches == [3, 1, 1, 1]  # one batch failed, then each alone
    assert [r.request_id for r in a] == ["a"] and [r.request_id for r in b] == ["b"]


def test_a_tokenizer_failure_fails_its_request_alone_with_a_500_naming_it() -> None:
    server, engine, client = _server()
    encode = server.tokenizer.__call__

    def failing(self: Any, text: str, *args: Any, **kwargs: Any) -> Any:
        if "zz" in text:
            raise RuntimeError("Already borrowed")
        return encode(text, *args, **kwargs)

    server.tokenizer.__class__ = type("Failing", (type(server.tokenizer),), {"__call__": failing})
    error = _error(client.post("/v1/completions", json={"prompt": "zz", "max_tokens": 2}), 500, None,
                   "the server failed on it (RuntimeError: Already borrowed)")
    assert error["type"] == "server_error" and error["code"] == "server_error" and engine.calls == 0
    assert client.post("/v1/completions", json={"prompt": "3+4", "max_tokens": 2}).status_code == 200
    assert server.stats["engine_errors"] == 1
