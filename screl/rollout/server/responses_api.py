"""``POST /v1/responses`` on the policy server: the subset of OpenAI's Responses API that agent frameworks use (the
OpenAI Agents SDK's default model class, NeMo-Gym); field by field in docs/agents.md, "The Responses API".

The subset: ``input`` as a string or as items (``user``, ``system``, ``developer`` and ``assistant`` text messages,
``function_call``, ``function_call_output``), ``instructions``, flat function ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``max_output_tokens``, ``temperature``, ``top_p``, ``seed``, ``stream`` (the events of
:mod:`screl.rollout.server.responses_stream`); output items ``message`` and ``function_call``;
``previous_response_id`` continues a response of the same session (or, without a session, one made without one),
and another session's is refused.

Invariant: the input becomes a chat conversation (a ``function_call`` item joins the assistant message before it, a
``function_call_output`` is a ``tool`` message) served exactly as ``/v1/chat/completions`` serves one (template,
token splice, session capture), so a Responses-API agent trains exactly like a chat one. Anything outside the
subset is a 400 naming it.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from pydantic import Field, field_validator

from screl.rollout.server.openai_api import SEED_MAX, SEED_MIN, Reply, RequestError, ScrelRequest
from screl.rollout.server.tool_calls import ToolChoice

__all__ = ["ResponseIds", "ResponsesRequest", "input_messages", "response_head", "response_object"]


class ResponsesRequest(ScrelRequest):
    model: str | None = None
    input: str | list[dict[str, Any]] = Field(..., min_length=1)
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    previous_response_id: str | None = None
    stream: bool = False
    include: list[str] | None = None
    truncation: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None

    @field_validator("include")
    @classmethod
    def _no_include(cls, v: list[str] | None) -> list[str] | None:
        if v:
            raise ValueError(f"{v[0]!r} is not supported (the server returns no extra output data)")
        return v

    @field_validator("truncation")
    @classmethod
    def _no_truncation(cls, v: str | None) -> str | None:
        if v not in (None, "disabled"):
            raise ValueError(f"{v!r} is not supported (only 'disabled')")
        return v

    @field_validator("text")
    @classmethod
    def _text_format(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        unknown = sorted(set(v or {}) - {"format"})
        if unknown:
            raise ValueError(f"{unknown[0]!r} is not supported")
        fmt = (v or {}).get("format")
        if fmt is not None and fmt.get("type") != "text":
            raise ValueError(f"format type {fmt.get('type')!r} is not supported (structured outputs are not "
                             "implemented)")
        return v

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v and any(x is not None for x in v.values()):
            raise ValueError("reasoning settings are not supported")
        return v


_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{where}: content must be a string or a list of text parts", where)
    out = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS:
            raise RequestError(f"{where}[{j}].type: content parts of type {kind!r} are not supported (text only)",
                               f"{where}[{j}].type")
        out.append(str(part.get("text", "")))
    return "".join(out)


def input_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat conversation the input items stand for."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{where}.role: {role!r} is not a message role", f"{where}.role")
            messages.append({"role": "system" if role == "developer" else role,
                             "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            missing = [k for k in ("call_id", "name", "arguments") if not isinstance(item.get(k), str)]
            if missing:
                raise RequestError(f"{where}.{missing[0]}: a function_call item needs it", f"{where}.{missing[0]}")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise RequestError(f"{where}.call_id: a function_call_output item needs it", f"{where}.call_id")
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": item["call_id"],
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        else:
            raise RequestError(f"{where}.type: input items of type {kind!r} are not supported (messages, "
                               "function_call and function_call_output are)", f"{where}.type")
    return messages


def _choice_echo(choice: ToolChoice) -> Any:
    return {"type": "function", "name": choice.name} if choice.name else choice.mode


@dataclass(frozen=True)
class ResponseIds:
    """A response's id, its message item's id and its creation time (a stream names them before the reply is
    done)."""

    response: str = field(default_factory=lambda: f"resp_{uuid.uuid4().hex}")
    message: str = field(default_factory=lambda: f"msg_{uuid.uuid4().hex}")
    created_at: float = field(default_factory=time.time)


def response_head(model: str, body: ResponsesRequest, choice: ToolChoice, ids: ResponseIds) -> dict[str, Any]:
    """The ``response`` object before its output (a stream's ``response.created`` carries it, ``in_progress``)."""
    return {
        "id": ids.response, "object": "response", "created_at": ids.created_at, "model": model,
        "status": "in_progress", "incomplete_details": None, "error": None, "instructions": body.instructions,
        "output": [], "tools": [{"strict": None, **t} for t in body.tools or []], "tool_choice": _choice_echo(choice),
        "parallel_tool_calls": body.parallel_tool_calls is not False, "temperature": body.temperature,
        "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "previous_response_id": body.previous_response_id, "usage": None,
    }


def response_object(model: str, body: ResponsesRequest, prompt: list[int], reply: Reply, choice: ToolChoice,
                    ids: ResponseIds | None = None) -> dict[str, Any]:
    """The ``response`` object (with the RL fields: ``prompt_token_ids``, ``token_ids``, ``weight_versions``)."""
    ids = ids or ResponseIds()
    output: list[dict[str, Any]] = []
    done = reply.result.finish_reason != "length" or reply.tool_calls
    status = "completed" if done else "incomplete"
    if reply.content:
        output.append({"type": "message", "id": ids.message, "role": "assistant", "status": status,
                       "content": [{"type": "output_text", "text": reply.content, "annotations": []}]})
    for call in reply.tool_calls:
        output.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
                       "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                       "status": "completed"})
    n_out = len(reply.result.token_ids)
    return {
        **response_head(model, body, choice, ids), "status": status,
        "incomplete_details": None if done else {"reason": "max_output_tokens"}, "output": output,
        "usage": {"input_tokens": len(prompt), "output_tokens": n_out, "total_tokens": len(prompt) + n_out,
                  "input_tokens_details": {"cached_tokens": 0}, "output_tokens_details": {"reasoning_tokens": 0}},
        "prompt_token_ids": list(prompt), **reply.extras(),
    }
