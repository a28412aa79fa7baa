"""The policy server's bounds (``generation.http_server``'s limits; docs/agents.md, "Limits"): what a request may
ask for, and how many requests and sessions it serves at once.

Refused first, cheapest first: a body past ``max_body_bytes`` is a 413 before it is parsed (from
``Content-Length``, else while it is read, :class:`LimitsMiddleware`); a request past ``max_concurrent_requests`` a
429 with ``Retry-After`` before its body is read; ``n``, ``max_tokens``, the messages and the tools are counted
before anything is tokenized; a text longer than the prompt limit times the longest token (in characters) is a 400
without tokenizing it (:func:`check_text`); a long text is tokenized on a thread of its own
(:meth:`Tokenizing.run`), never on the event loop; the prompt's token count is checked against the model's
context after templating (:func:`check_prompt`), before any engine request exists.

Invariant: every refusal here is a 4xx with OpenAI's error body naming the field, the size and the limit, and the
key that sets the limit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Awaitable, Callable, Mapping, MutableMapping, Sequence
from typing import Any, TypeVar

from starlette.responses import JSONResponse

from screl.rollout.server.openai_api import RequestError, api_error

__all__ = ["KEY", "LimitsMiddleware", "ServerBusy", "SessionClosed", "Tokenizing", "check_count", "check_prompt",
           "check_text", "max_token_chars", "text_chars"]

KEY = "generation.http_server"
T = TypeVar("T")
Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

INLINE_CHARS = 8192
"""A text up to this long is tokenized on the event loop (microseconds); a longer one on the tokenizing thread."""
RETRY_AFTER_S = 1


class ServerBusy(Exception):
    """A 429: the server is at a bound (``args[0]``: the message)."""


class SessionClosed(Exception):
    """A request of a session closed for idleness (``args[0]``: the session id): a 404 naming it."""


def busy_response(message: str, code: str) -> JSONResponse:
    return JSONResponse(api_error(message, kind="rate_limit_error", code=code), status_code=429,
                        headers={"Retry-After": str(RETRY_AFTER_S)})


def too_large(size: int, limit: int) -> JSONResponse:
    return JSONResponse(api_error(f"body: the request body is {size} bytes or more, more than this server takes "
                                  f"({limit} bytes: {KEY}.max_body_bytes)", param="body",
                                  code="request_too_large"), status_code=413)


class LimitsMiddleware:
    """ASGI middleware on every ``POST``: at most ``max_concurrent_requests`` at once (429 beyond), and its body
    read whole up to ``max_body_bytes`` before the app sees it (413 beyond: ``Content-Length`` is checked before
    a byte is read, a body sent without it is counted as it arrives)."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], server: Any) -> None:
        self.app, self.server = app, server
        self.active = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        limits = self.server.limits
        if self.active >= limits.max_concurrent_requests:
            self.server.stats["busy"] += 1
            response = busy_response(f"the server is serving {self.active} requests, its limit "
                                     f"({KEY}.max_concurrent_requests={limits.max_concurrent_requests}): retry "
                                     f"after {RETRY_AFTER_S} s", "too_many_requests")
            return await response(scope, receive, send)
        self.active += 1
        try:
            body = await self._body(scope, receive, limits.max_body_bytes)
            if isinstance(body, JSONResponse):
                self.server.stats["errors"] += 1
                return await body(scope, receive, send)
            await self.app(scope, _replay(body, receive), send)
        finally:
            self.active -= 1

    @staticmethod
    async def _body(scope: Scope, receive: Receive, limit: int) -> bytes | JSONResponse:
        declared = dict(scope.get("headers") or ()).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            return too_large(int(declared), limit)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away: let the app see it
                return b"".join(chunks)
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                return too_large(size, limit)
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` that hands over the body read already, then the client's later messages (its disconnect)."""
    sent = False

    async def again() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


class Tokenizing:
    """A long text's tokenizing (a chat's rendering with it), off the event loop on a thread of its own: one at a
    time, so a flood of long prompts queues there while every other request is served."""

    def __init__(self) -> None:
        self.pool: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self, chars: int, fn: Callable[..., T], *args: Any) -> T:
        if chars <= INLINE_CHARS:
            return fn(*args)
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="screl-tokenize")
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token of ``tokenizer`` stands for: its vocabulary's longest entry (a byte-level
    BPE entry is one character per byte, so it bounds the decoded text too)."""
    try:
        return max((len(t) for t in tokenizer.get_vocab()), default=1) or 1
    except Exception:  # noqa: BLE001 - a tokenizer without a vocabulary: no bound from characters
        return 2**31


def text_chars(value: Any) -> int:
    """Characters of every string in a JSON value (keys included): a chat template renders at least that much of
    the messages and tools. Numbers count none (token ids and log-probabilities are not rendered as text)."""
    total, stack = 0, [value]
    while stack:  # not recursive: a deeply nested value is no stack overflow
        v = stack.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, Mapping):
            total += sum(len(str(k)) for k in v)
            stack.extend(v.values())
        elif isinstance(v, (list, tuple)):
            stack.extend(v)
    return total


def _limit_note(server: Any) -> str:
    if server.limits.max_prompt_tokens is not None:
        return f"{KEY}.max_prompt_tokens"
    return "the model's context length"


def check_text(server: Any, chars: int, param: str) -> None:
    """A text of ``chars`` characters cannot be a prompt within the limit when each token covers at most
    :func:`max_token_chars`: refused without tokenizing it."""
    if chars > server.max_prompt_tokens * server.max_token_chars:
        raise RequestError(f"{param}: the text is {chars} characters, more than a prompt of at most "
                           f"{server.max_prompt_tokens} tokens ({_limit_note(server)}) can hold (a token here is at "
                           f"most {server.max_token_chars} characters)", param)


def check_prompt(server: Any, ids: Sequence[int], param: str) -> None:
    """A prompt longer than the limit is a 400 naming ``param``, its length and the limit (as vLLM's server
    refuses one longer than its context)."""
    if len(ids) > server.max_prompt_tokens:
        raise RequestError(f"{param}: the prompt is {len(ids)} tokens, longer than this server takes "
                           f"({server.max_prompt_tokens} tokens: {_limit_note(server)}); shorten it", param)


def check_count(count: int, limit: int, param: str, what: str, key: str) -> None:
    """``count`` ``what`` within ``limit`` (``key``), else a 400 naming ``param``."""
    if count > limit:
        raise RequestError(f"{param}: {count} {what}, more than this server takes in one request ({limit}: "
                           f"{KEY}.{key})", param)


HOUSEKEEPING_S = 30.0
"""How often the server closes idle sessions and hands freed heap back to the system (:func:`release_memory`)."""


def release_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``); False where there is none.

    The server's per-request allocations (request bodies, JSON, Ray's serialized calls, on the event loop's and
    Ray's own threads) are freed, but glibc keeps the freed pages of its arenas mapped: without a trim the actor's
    RSS crept up by about 0.6 KB per request while its Python heap stayed flat (docs/failures.md)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        return bool(libc.malloc_trim(0))
    except (OSError, AttributeError):  # not glibc (macOS, musl): nothing to trim
        return False
