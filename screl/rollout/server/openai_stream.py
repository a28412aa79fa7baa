"""``stream: true`` on the policy server: OpenAI's server-sent chunk format for chat and text completions.

The engines return whole replies (a reply is one engine request, batched with the rollouts), so a stream opens at
once (a chat stream's first chunk carries the role; a completion stream starts with an SSE comment) and the rest
of its chunks come when the reply is done: the content, one chunk per tool call (keyed by ``index``, as
``ChoiceDeltaToolCall`` pieces), then each choice's final chunk with its ``finish_reason`` and the RL fields
(``token_ids``, ``weight_versions``, and ``prompt_token_ids`` at the top level), then the usage chunk (empty
``choices``) when ``stream_options.include_usage`` asks for it, then ``data: [DONE]``. Streamed and plain
requests give the same tokens for the same seed. A client that goes away mid-stream gets its engine request
aborted (``screl.rollout.server.server``).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from screl.rollout.server.openai_api import Reply, chat_logprobs, completion_logprobs, usage

__all__ = ["DONE", "OPEN", "chat_chunks", "completion_chunks", "role_chunk", "sse"]

DONE = "data: [DONE]\n\n"
OPEN = ": screl stream open\n\n"
"""An SSE comment: clients skip it; it sends the headers before the reply is generated."""


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


def chat_chunks(rid: str, created: int, model: str, tokenizer: Any, prompt: list[int], replies: list[Reply],
                logprobs: bool, include_usage: bool) -> Iterator[dict[str, Any]]:
    """Every chunk after the role chunk."""
    head = _head("chat.completion.chunk", rid, created, model, include_usage)
    for i, r in enumerate(replies):
        lp = chat_logprobs(tokenizer, r.result) if logprobs else None
        if r.content:
            yield {**head, "choices": [{"index": i, "delta": {"content": r.content}, "logprobs": lp,
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


def completion_chunks(rid: str, created: int, model: str, tokenizer: Any, prompts: list[list[int]],
                      replies: list[Reply], per_prompt: int, logprobs: bool,
                      include_usage: bool) -> Iterator[dict[str, Any]]:
    """Every chunk of a text-completion stream (``per_prompt`` = n: reply i answers prompt i // n)."""
    head = _head("text_completion", rid, created, model, include_usage)
    for i, r in enumerate(replies):
        lp = completion_logprobs(tokenizer, r.result) if logprobs else None
        if r.text:
            yield {**head, "choices": [{"index": i, "text": r.text, "logprobs": lp, "finish_reason": None}]}
        yield {**head, "prompt_token_ids": list(prompts[i // per_prompt]),
               "choices": [{"index": i, "text": "", "logprobs": None, "finish_reason": r.finish_reason,
                            **r.extras()}]}
    if include_usage:
        yield {**head, "choices": [], "usage": usage(prompts, replies)}
