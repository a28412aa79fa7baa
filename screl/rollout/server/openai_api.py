"""The OpenAI-compatible request and response shapes of screl's policy server (``screl.rollout.server.server``).

Requests are validated by pydantic; a bad field becomes a 400 with an OpenAI-style error body naming it. A field
the server does not implement is a 400 naming it too: nothing is silently dropped, except the fields listed in
:data:`IGNORED_FIELDS` (bookkeeping that does not change what is generated). Responses follow OpenAI's chat and
completion objects, plus what RL needs (docs/agents.md):

* ``prompt_token_ids`` at the top level and ``token_ids`` on every choice (vLLM's ``return_token_ids``);
* ``weight_versions`` on every choice: the policy version that sampled each token;
* on a chat choice's message, NeMo-Gym's ``prompt_token_ids`` / ``generation_token_ids`` /
  ``generation_log_probs``: sent back unchanged on that message next turn, they make the server splice the
  past tokens verbatim instead of re-tokenizing the conversation;
* ``message.tool_calls`` (``finish_reason: tool_calls``) parsed from the reply (:mod:`screl.rollout.server.tool_calls`).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from screl.rollout.engines.protocol import GenerationResult
from screl.rollout.server.tool_calls import ParsedReply, ToolChoice, ToolSpec, new_call_id

__all__ = ["IGNORED_FIELDS", "ChatRequest", "CompletionRequest", "Reply", "RequestError", "ScrelRequest", "api_error",
           "chat_response", "completion_response", "parse_tool_choice", "parse_tools"]

SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1 - 64
"""A seed is a signed 64-bit integer (the engine's generators take no more); ``n`` choices use ``seed .. seed+n-1``."""

IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
"""Accepted and ignored: they label or store a request, and change nothing that is generated."""


class RequestError(ValueError):
    """A request the server refuses (400), naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class ScrelRequest(BaseModel):
    """What every route's request takes besides its own fields: the session, the rollout it belongs to, and the
    fields accepted and ignored (:data:`IGNORED_FIELDS`); any other unknown field is refused."""

    model_config = ConfigDict(extra="forbid", strict=True)  # strict: no "0" for 0, no 0 for false (as the schema says)

    session_id: str | None = None
    """Sticky routing to one worker, and the conversation the server records (also the ``X-Session-Id`` header)."""
    rollout: dict[str, Any] | None = None
    """What the request belongs to (``group``, ``sibling``, ``turn``): recorded with the turn."""
    # accepted and ignored (IGNORED_FIELDS)
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None


class _Sampling(ScrelRequest):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    """None: the run's ``generation.temperature`` (the trainer's logprobs use it)."""
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1, le=2**31 - 1)  # any k >= the vocabulary keeps every token
    min_tokens: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=64)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    frequency_penalty: float | None = Field(None, ge=0.0, le=0.0, description="penalties are not implemented")
    presence_penalty: float | None = Field(None, ge=0.0, le=0.0, description="penalties are not implemented")

    @field_validator("stream_options")
    @classmethod
    def _stream_options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = sorted(set(v or {}) - {"include_usage"})
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not supported (only include_usage)")
        return v

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool((self.stream_options or {}).get("include_usage"))


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]] = Field(..., min_length=1, json_schema_extra={"items": {
        "type": "object", "required": ["role"], "properties": {"role": {"type": "string"}}}})
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is returned")
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None

    @field_validator("messages")
    @classmethod
    def _roles(cls, v: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for i, m in enumerate(v):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"message {i} has no role")
        return v

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None and v.get("type") != "text":
            raise ValueError(f"type {v.get('type')!r} is not supported (structured outputs are not implemented)")
        return v


class CompletionRequest(_Sampling):
    prompt: Any = Field(...)
    """A string, a list of strings, a token array, or a list of token arrays."""
    logprobs: int | None = Field(None, ge=0, le=0, description="only the sampled token's logprob is returned")

    @field_validator("prompt")
    @classmethod
    def _forms(cls, v: Any) -> Any:
        def tokens(x: Any) -> bool:
            return isinstance(x, list) and bool(x) and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                                                          for t in x)

        if isinstance(v, str) and v:
            return v
        if isinstance(v, list) and v and (tokens(v) or all(isinstance(p, str) and p for p in v)
                                          or all(tokens(p) for p in v)):
            return v
        raise ValueError("must be a non-empty string, a list of strings, a token array (non-negative integers), "
                         "or a list of token arrays")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per batched form's element."""
        v = self.prompt
        if isinstance(v, str) or (v and isinstance(v[0], int)):
            return [v]
        return list(v)


def parse_tools(tools: Sequence[Any] | None, param: str = "tools", flat: bool = False) -> list[ToolSpec]:
    """The request's function tools (``flat``: the Responses API's ``{type, name, parameters}``)."""
    out = []
    for i, t in enumerate(tools or []):
        where = f"{param}[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function":
            kind = t.get("type") if isinstance(t, dict) else type(t).__name__
            raise RequestError(f"{where}: tools of type {kind!r} are not supported (only function tools)", where)
        fn = t if flat else t.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise RequestError(f"{where}: a function tool needs a name", where)
        params = fn.get("parameters") or {}
        if not isinstance(params, dict):
            raise RequestError(f"{where}: parameters must be a JSON schema object", where)
        out.append(ToolSpec(fn["name"], params, str(fn.get("description") or "")))
    names = [t.name for t in out]
    if len(set(names)) != len(names):
        raise RequestError(f"{param}: tool names repeat ({names})", param)
    return out


def parse_tool_choice(choice: Any, tools: Sequence[ToolSpec], flat: bool = False) -> ToolChoice:
    """``auto`` | ``none`` | ``required`` | a named function (``{"type": "function", "function": {"name"}}``,
    or ``{"type": "function", "name"}`` with ``flat``)."""
    if choice is None:
        return ToolChoice("auto" if tools else "none")
    if isinstance(choice, str):
        if choice not in ("auto", "none", "required"):
            raise RequestError(f"tool_choice: {choice!r} is not one of 'auto', 'none', 'required' or a named "
                               "function", "tool_choice")
        if choice == "required" and not tools:
            raise RequestError("tool_choice: 'required' but the request offers no tools", "tool_choice")
        return ToolChoice(choice)
    fn = choice if flat else (choice.get("function") or {}) if isinstance(choice, dict) else {}
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or not isinstance(name, str):
        raise RequestError(f"tool_choice: {choice!r} is not a named function tool choice", "tool_choice")
    if not any(t.name == name for t in tools):
        raise RequestError(f"tool_choice: names {name!r}, which is not among the request's tools", "tool_choice")
    return ToolChoice("required", name)


def api_error(message: str, param: str | None = None, kind: str = "invalid_request_error",
              code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


@dataclass
class Reply:
    """One choice's reply: the engine's result (cut at a stop string), its text, and what the parser made of it."""

    result: GenerationResult
    text: str
    stopped: bool
    parsed: ParsedReply | None = None
    call_ids: list[str] = field(default_factory=list)
    prompt: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.parsed is not None and len(self.call_ids) != len(self.parsed.calls):
            self.call_ids = [new_call_id() for _ in self.parsed.calls]

    @property
    def content(self) -> str | None:
        return self.text if self.parsed is None else self.parsed.content

    @property
    def tool_calls(self) -> list[dict[str, Any]]:
        calls = self.parsed.calls if self.parsed is not None else ()
        return [{"id": cid, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for cid, c in zip(self.call_ids, calls, strict=True)]

    @property
    def finish_reason(self) -> str:
        if self.tool_calls and self.result.finish_reason != "abort":
            return "tool_calls"
        return "stop" if self.stopped else self.result.finish_reason

    def message(self) -> dict[str, Any]:
        """The chat message, with NeMo-Gym's token fields."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        msg.update(prompt_token_ids=list(self.prompt), generation_token_ids=list(self.result.token_ids),
                   generation_log_probs=list(self.result.logprobs))
        return msg

    def extras(self) -> dict[str, Any]:
        """The RL fields every choice carries (and the parse error, when call-like text did not parse)."""
        out: dict[str, Any] = {"token_ids": list(self.result.token_ids),
                               "weight_versions": list(self.result.weight_versions)}
        if self.parsed is not None and self.parsed.error:
            out["tool_call_error"] = self.parsed.error
        return out


def token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([token_id], skip_special_tokens=False))


def usage(prompts: Sequence[Sequence[int]], replies: Sequence[Reply]) -> dict[str, int]:
    done = sum(len(r.result.token_ids) for r in replies)
    asked = sum(len(p) for p in prompts)
    return {"prompt_tokens": asked, "completion_tokens": done, "total_tokens": asked + done}


def chat_logprobs(tokenizer: Any, r: GenerationResult) -> dict[str, Any]:
    return {"content": [{"token": (tok := token_text(tokenizer, t)), "logprob": p, "bytes": list(tok.encode()),
                         "top_logprobs": []} for t, p in zip(r.token_ids, r.logprobs, strict=True)]}


def completion_logprobs(tokenizer: Any, r: GenerationResult, at: int = 0) -> dict[str, Any]:
    tokens = [token_text(tokenizer, t) for t in r.token_ids]
    offsets = []
    for tok in tokens:
        offsets.append(at)
        at += len(tok)
    return {"tokens": tokens, "token_logprobs": list(r.logprobs), "top_logprobs": None, "text_offset": offsets}


def chat_response(model: str, tokenizer: Any, prompt: list[int], replies: list[Reply], logprobs: bool) -> dict[str, Any]:
    """A ``chat.completion``."""
    out = [{"index": i, "message": r.message(), "logprobs": chat_logprobs(tokenizer, r.result) if logprobs else None,
            "finish_reason": r.finish_reason, **r.extras()} for i, r in enumerate(replies)]
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage([prompt], replies), "prompt_token_ids": list(prompt)}


def completion_response(model: str, tokenizer: Any, prompts: list[list[int]], replies: list[Reply],
                        logprobs: bool) -> dict[str, Any]:
    """A ``text_completion``: ``replies`` in prompt order, ``n`` per prompt; ``prompt_token_ids`` is the prompt's
    ids for one prompt, the list of them for a batch."""
    out = [{"index": i, "text": r.text, "logprobs": completion_logprobs(tokenizer, r.result) if logprobs else None,
            "finish_reason": r.finish_reason, **r.extras()} for i, r in enumerate(replies)]
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": model, "choices": out, "usage": usage(prompts, replies),
            "prompt_token_ids": list(prompts[0]) if len(prompts) == 1 else [list(p) for p in prompts]}
