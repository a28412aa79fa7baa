"""What the policy server's OpenAPI schema (``/openapi.json``) says it answers, and its refusals' bodies.

FastAPI documents every route with a body as answering 422 with its own ``{"detail": [...]}``; screl's server
answers a bad request with 400 and OpenAI's error body instead (``{"error": {"message", "type", "param",
"code"}}``), and a bad or missing API key with 401, an aborted session with 409, both with the same body. The
schema says so (``4XX`` with :class:`ErrorBody`, no 422), documents each route's 200 (the JSON object, and the
event stream where ``stream: true`` is accepted), so that a client generated from the schema, or a fuzzer checking
answers against it (``tests/rollout/test_server_fuzz.py``), sees what the server does.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, ConfigDict

from screl.rollout.server.openai_api import IGNORED_FIELDS, RequestError

log = logging.getLogger(__name__)

__all__ = ["ErrorBody", "client_token_ids", "max_request_tokens", "model_context", "model_vocab_size", "route_responses",
           "validation_error_message"]


class ErrorDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str
    type: str
    param: str | None
    code: str | None


class ErrorBody(BaseModel):
    """OpenAI's error body (``screl.rollout.server.openai_api.api_error``)."""

    model_config = ConfigDict(extra="forbid")

    error: ErrorDetail


def _obj(required: Sequence[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": list(required), "properties": props}


_INT = {"type": "integer"}
_STR = {"type": "string"}
_INTS = {"type": "array", "items": _INT}
_USAGE = _obj(["prompt_tokens", "completion_tokens", "total_tokens"], prompt_tokens=_INT, completion_tokens=_INT,
              total_tokens=_INT)
_RL = {"token_ids": _INTS, "weight_versions": _INTS}
_FINISH = {"type": "string", "enum": ["stop", "length", "abort", "tool_calls"]}

OK_BODIES: dict[str, dict[str, Any]] = {
    "chat": _obj(["id", "object", "created", "model", "choices", "usage", "prompt_token_ids"],
                 id=_STR, object={"const": "chat.completion"}, created=_INT, model=_STR, usage=_USAGE,
                 prompt_token_ids=_INTS, choices={"type": "array", "minItems": 1, "items": _obj(
                     ["index", "message", "finish_reason", "token_ids", "weight_versions"], index=_INT,
                     finish_reason=_FINISH, **_RL, message=_obj(["role", "content"], role={"const": "assistant"},
                                                                content={"type": ["string", "null"]}))}),
    "completions": _obj(["id", "object", "created", "model", "choices", "usage", "prompt_token_ids"],
                        id=_STR, object={"const": "text_completion"}, created=_INT, model=_STR, usage=_USAGE,
                        prompt_token_ids={"type": "array"}, choices={"type": "array", "minItems": 1, "items": _obj(
                            ["index", "text", "finish_reason", "token_ids", "weight_versions"], index=_INT,
                            text=_STR, finish_reason=_FINISH, **_RL)}),
    "responses": _obj(["id", "object", "created_at", "model", "status", "output", "usage", "prompt_token_ids",
                       *_RL], id=_STR, object={"const": "response"}, created_at={"type": "number"}, model=_STR,
                      status={"enum": ["completed", "incomplete"]}, output={"type": "array"},
                      usage=_obj(["input_tokens", "output_tokens", "total_tokens"], input_tokens=_INT,
                                 output_tokens=_INT, total_tokens=_INT),
                      prompt_token_ids=_INTS, **_RL),
    "models": _obj(["object", "data"], object={"const": "list"}, data={"type": "array", "items": _obj(
        ["id", "object"], id=_STR, object={"const": "model"})}),
}


def route_responses(kind: str, stream: bool = False) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` of a route: its 200 body (``OK_BODIES[kind]``; and an event stream with ``stream``) and
    every 4xx with OpenAI's error body (which keeps FastAPI from documenting a 422 the server never sends)."""
    content: dict[str, Any] = {"application/json": {"schema": OK_BODIES[kind]}}
    if stream:
        content["text/event-stream"] = {"schema": {"type": "object", "required": ["data"],  # one event
                                                   "properties": {"data": {"type": "string"}}}}
    return {200: {"content": content},
            "4XX": {"model": ErrorBody, "description": "OpenAI's error body; `param` names the field at fault "
                                                       "(400: a bad request, 401: the API key, 404: a closed "
                                                       "session, 409: an aborted session, 413: the body's size, "
                                                       "429: too many requests or sessions, with Retry-After)"}}


def validation_error_message(errors: Sequence[Any]) -> tuple[str, str]:
    """(message, param) for pydantic's first error of a request: ``param`` is the dotted path of the field at fault,
    ``body`` when the body itself is missing or is not a JSON object."""
    first = errors[0]
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    kind = first.get("type")
    if kind == "json_invalid":  # loc is ("body", <position>): the position is not a field
        return f"body: the request body is not valid JSON ({first.get('msg')})", "body"
    param = ".".join(loc) or "body"
    if kind == "extra_forbidden":
        return (f"{param}: the field is not supported by screl's policy server (accepted and ignored: "
                f"{', '.join(IGNORED_FIELDS)})"), param
    if not loc:
        return f"body: the request body must be a JSON object of the route's fields ({first.get('msg')})", "body"
    return f"{param}: {first.get('msg')}", param


CONTEXT_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length")
UNKNOWN_CONTEXT_MAX_TOKENS = 32768
"""The bound when the policy cannot tell its context length without loading the model (a warning says so)."""


def _config_int(config: Any, names: Sequence[str]) -> int | None:
    """The first positive int among ``names`` on the model's config, or on its text model's config (a VLM)."""
    for cfg in (config, getattr(config, "text_config", None)):
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value > 0:
                return value
    return None


def model_context(config: Any) -> int:
    """The model's context length (its ``config``'s ``max_position_embeddings`` or the like), or
    :data:`UNKNOWN_CONTEXT_MAX_TOKENS` when it names none: the longest prompt the server takes."""
    return _config_int(config, CONTEXT_FIELDS) or UNKNOWN_CONTEXT_MAX_TOKENS


def max_request_tokens(config: Any, default_max_tokens: int) -> int:
    """The most tokens one request may ask the server to generate: the model's context length (its ``config``'s
    ``max_position_embeddings`` or the like), or the run's ``generation.max_new_tokens`` when that is larger. A
    request's budget sizes the engine's per-request buffers, so an unbounded one (``max_tokens: 10**12``) would
    exhaust the host's memory instead of getting a 400."""
    context = _config_int(config, CONTEXT_FIELDS)
    if context is not None:
        return max(context, default_max_tokens)
    log.warning("screl: the policy server cannot tell the model's context length (%s has none of %s): a request "
                "may ask for at most %d tokens", type(config).__name__, ", ".join(CONTEXT_FIELDS),
                max(UNKNOWN_CONTEXT_MAX_TOKENS, default_max_tokens))
    return max(UNKNOWN_CONTEXT_MAX_TOKENS, default_max_tokens)


def model_vocab_size(config: Any) -> int | None:
    """The model's vocabulary size (its ``config``'s ``vocab_size``, or its text model's); ``None`` when it names none."""
    return _config_int(config, ("vocab_size",))


def client_token_ids(ids: Sequence[int], vocab_size: int | None, param: str) -> list[int]:
    """Token ids a client sent, refused when the model has no embedding for one (a 400 naming ``param``; the engine
    would refuse them too, without naming the field)."""
    out = [int(t) for t in ids]
    if vocab_size is not None and (bad := [t for t in out if not 0 <= t < vocab_size]):
        raise RequestError(f"{param}: token ids outside the model's vocabulary (0 to {vocab_size - 1}): {bad[:5]}",
                           param)
    return out
