"""``stream: true`` on the policy server: OpenAI's server-sent chunk format for chat and text completions.

A stream opens at once (a chat stream's first chunk carries the role; a completion stream starts with an SSE
comment). While the replies are generated, their text goes out in content (or text) chunks as the engine produces
tokens (:mod:`screl.rollout.server.live_text` says what may be sent early, and when a reply's text waits until it
is done: tool calls, engines that do not declare ``streams_tokens``). When the replies are done come the rest of
each reply's text with its logprobs, one chunk per tool call (keyed by ``index``, as ``ChoiceDeltaToolCall``
pieces), then each choice's final chunk with its ``finish_reason`` and the RL fields (``token_ids``,
``weight_versions``, and ``prompt_token_ids`` at the top level), then the usage chunk (empty ``choices``) when
``stream_options.include_usage`` asks for it, then ``data: [DONE]``. Streamed and plain requests give the same
tokens for the same seed, and a choice's streamed text, joined, is the plain reply's. A client that goes away
mid-stream gets its engine request aborted (``screl.rollout.server.server``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from screl.rollout.server.live_text import rest
from screl.rollout.server.openai_api import Reply, chat_logprobs, completion_logprobs, usage

__all__ = ["DONE", "OPEN", "ChunkStream", "StreamFormat", "chat_chunks", "chat_delta", "completion_chunks",
           "completion_delta", "role_chunk", "sse"]

DONE = "data: [DONE]\n\n"
OPEN = ": screl stream open\n\n"
"""An SSE comment: clients skip it; it sends the headers before the reply is generated."""


class StreamFormat(Protocol):
    """What a route's stream sends (``PolicyServer.stream_replies`` sends it): its opening, text deltas while the
    replies are generated, its closing events when they are done, an engine failure's event, its end marker."""

    opening: str
    done: str
    live: bool
    """Whether its replies' text may stream before they are done (no tool calls to parse)."""

    def delta(self, i: int, text: str) -> list[dict[str, Any]]: ...

    def closing(self, replies: list[Reply], sent: list[str]) -> Iterator[dict[str, Any]]: ...

    def failure(self, error: dict[str, Any]) -> list[dict[str, Any]]: ...


@dataclass
class ChunkStream:
    """The chat and text-completion streams: OpenAI's chunks (see the module docstring)."""

    opening: str
    make_delta: Callable[[int, str], dict[str, Any]]
    make_closing: Callable[[list[Reply], list[str]], Iterator[dict[str, Any]]]
    live: bool
    done: str = DONE

    def delta(self, i: int, text: str) -> list[dict[str, Any]]:
        return [self.make_delta(i, text)]

    def closing(self, replies: list[Reply], sent: list[str]) -> Iterator[dict[str, Any]]:
        return self.make_closing(replies, sent)

    def failure(self, error: dict[str, Any]) -> list[dict[str, Any]]:
        return [error]


def sse(chunk: dict[str, Any]) -> str:
    return f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"


def _head(kind: str, rid: str, created: int, model: str, include_usage: bool) -> dict[str, Any]:
    head: dict[str, Any] = {"id": rid, "object": kind, "created": created, "model": model}
    if include_usage:
        head["usage"] = None
    return head


def role_chunk(rid: str, created: int, model: str, n: int, include_usage: bool) -> dict[str, Any]:
    """The chat stream's first chunk: each choice's role."""
    return {**_head("chat.completion.chunk", rid, created, model, include_usage),
            "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                         "finish_reason": None} for i in range(n)]}


def chat_delta(rid: str, created: int, model: str, include_usage: bool, i: int, text: str) -> dict[str, Any]:
    """A chunk of choice ``i``'s text while it is generated."""
    return {**_head("chat.completion.chunk", rid, created, model, include_usage),
            "choices": [{"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None}]}


def chat_chunks(rid: str, created: int, model: str, tokenizer: Any, prompt: list[int], replies: list[Reply],
                logprobs: bool, include_usage: bool, sent: Sequence[str]) -> Iterator[dict[str, Any]]:
    """Every chunk after the replies are done (``sent``: each choice's text streamed already)."""
    head = _head("chat.completion.chunk", rid, created, model, include_usage)
    for i, r in enumerate(replies):
        lp = chat_logprobs(tokenizer, r.result) if logprobs else None
        content = rest(sent[i], r.content or "")
        if content or (lp is not None and r.content):
            yield {**head, "choices": [{"index": i, "delta": {"content": content}, "logprobs": lp,
                                        "finish_reason": None}]}
            lp = None
        for k, call in enumerate(r.tool_calls):
            yield {**head, "choices": [{"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "logprobs": lp,
                                        "finish_reason": None}]}
            lp = None
        yield {**head, "prompt_token_ids": list(prompt),
               "choices": [{"index": i, "delta": {}, "logprobs": lp, "finish_reason": r.finish_reason, **r.extras()}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage([prompt], replies)}


def completion_delta(rid: str, created: int, model: str, include_usage: bool, i: int, text: str) -> dict[str, Any]:
    """A chunk of choice ``i``'s text while it is generated."""
    return {**_head("text_completion", rid, created, model, include_usage),
            "choices": [{"index": i, "text": text, "logprobs": None, "finish_reason": None}]}


def completion_chunks(rid: str, created: int, model: str, tokenizer: Any, prompts: list[list[int]],
                      replies: list[Reply], per_prompt: int, logprobs: bool, include_usage: bool,
                      sent: Sequence[str]) -> Iterator[dict[str, Any]]:
    """Every chunk of a text-completion stream after the replies are done (``per_prompt`` = n: reply i answers
    prompt i // n; ``sent``: each choice's text streamed already)."""
    head = _head("text_completion", rid, created, model, include_usage)
    for i, r in enumerate(replies):
        lp = completion_logprobs(tokenizer, r.result) if logprobs else None
        text = rest(sent[i], r.text)
        if text or (lp is not None and r.text):
            yield {**head, "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": None}]}
        yield {**head, "prompt_token_ids": list(prompts[i // per_prompt]),
               "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": r.finish_reason,
                            **r.extras()}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompts, replies)}
