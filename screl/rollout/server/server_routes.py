"""The policy server's FastAPI app (:meth:`screl.rollout.server.server.PolicyServer.app`): its routes
(``/health``, ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``), the API-key check
and the error handlers that answer in OpenAI's error shape.

Invariant: a request is never answered with a 5xx for what it sent: an invalid body or a refused request is a 400,
a missing or wrong key a 401 (when the server has one), a closed session a 404, an aborted session a 409, a body
too large a 413, a server at its bounds a 429 (``server_limits.py``), a client gone mid-request a 499. An engine
failure on one request is that request's 500 or 503 alone (``server_failures.py``).
"""

from __future__ import annotations

import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Iterator
from typing import TYPE_CHECKING, Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from screl.rollout.server import server_requests
from screl.rollout.server.openai_api import (
    ChatRequest,
    CompletionRequest,
    Reply,
    RequestError,
    api_error,
    chat_response,
    completion_response,
    parse_tool_choice,
    parse_tools,
)
from screl.rollout.server.openai_schema import route_responses, validation_error_message
from screl.rollout.server.openai_stream import (
    OPEN,
    ChunkStream,
    chat_chunks,
    chat_delta,
    completion_chunks,
    completion_delta,
    role_chunk,
    sse,
)
from screl.rollout.server.responses_api import ResponsesRequest, input_messages, response_object
from screl.rollout.server.responses_stream import ResponsesStream
from screl.rollout.server.server_failures import EngineFailure
from screl.rollout.server.server_limits import (
    LimitsMiddleware,
    ServerBusy,
    SessionClosed,
    busy_response,
    check_count,
)
from screl.rollout.server.server_sessions import assistant_message
from screl.rollout.workflows.chat import SpliceError

if TYPE_CHECKING:
    from screl.rollout.server.server import PolicyServer

log = logging.getLogger(__name__)

__all__ = ["build_app"]


def build_app(server: PolicyServer) -> FastAPI:
    """The app of ``server``: every ``/v1`` route asks for the API key, and each route's reply is its handler's."""
    app = FastAPI(title="screl policy server", docs_url=None, redoc_url=None)
    app.add_middleware(LimitsMiddleware, server=server)
    _add_error_handlers(app, server)

    async def auth(request: Request) -> None:
        if server.api_key and request.headers.get("authorization") != f"Bearer {server.api_key}":
            raise HTTPException(401, detail="invalid API key")

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models", dependencies=[Depends(auth)], responses=route_responses("models"))
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": server.model_name, "object": "model", "owned_by": "screl"}]}

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)], responses=route_responses("chat", stream=True))
    async def chat(body: ChatRequest, request: Request) -> Any:
        return await _guard(server, chat_route(server, body, request), "messages")

    @app.post("/v1/completions", dependencies=[Depends(auth)],
              responses=route_responses("completions", stream=True))
    async def completions(body: CompletionRequest, request: Request) -> Any:
        return await _guard(server, completions_route(server, body, request), "prompt")

    @app.post("/v1/responses", dependencies=[Depends(auth)], responses=route_responses("responses", stream=True))
    async def responses(body: ResponsesRequest, request: Request) -> Any:
        return await _guard(server, responses_route(server, body, request), "input")

    return app


def _add_error_handlers(app: FastAPI, server: PolicyServer) -> None:
    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        server.stats["errors"] += 1
        message, param = validation_error_message(exc.errors())
        return JSONResponse(api_error(message, param=param), status_code=400)

    @app.exception_handler(401)
    async def unauthorized(request: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(api_error("invalid or missing API key (Authorization: Bearer <key>)",
                                      kind="authentication_error", code="invalid_api_key"), status_code=401)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:  # 404, 405, ...
        if exc.status_code == 400:  # FastAPI's own: the body could not be read (not UTF-8, not JSON)
            return JSONResponse(api_error(f"body: {exc.detail}", param="body"), status_code=400)
        return JSONResponse(api_error(f"{request.method} {request.url.path}: {exc.detail}", code=str(
            exc.status_code)), status_code=exc.status_code, headers=exc.headers)


async def _guard(server: PolicyServer, handler: Awaitable[Any], param: str) -> Any:
    """The handler's reply, or the 400 (naming ``param`` when the error names none) or 409 it was refused with."""
    server.stats["requests"] += 1
    try:
        return await handler
    except RequestError as err:
        server.stats["errors"] += 1
        return JSONResponse(api_error(str(err), param=err.param), status_code=400)
    except (SpliceError, ValueError) as err:
        server.stats["errors"] += 1
        return JSONResponse(api_error(str(err), param=param), status_code=400)
    except ServerBusy as err:
        return busy_response(str(err), "too_many_sessions")
    except SessionClosed as err:
        return JSONResponse(api_error(f"session {err.args[0]!r} was closed after "
                                      f"{server.session_idle_timeout_s:g} s without a request "
                                      "(generation.http_server.session_idle_timeout_s): its records are gone",
                                      code="session_closed"), status_code=404)
    except EngineFailure as err:
        server.stats["engine_errors"] += 1
        return err.response()
    except server_requests.SessionAborted as err:
        return JSONResponse(api_error(f"session {err.args[0]!r} was aborted (its rollout left the sampler's "
                                      "window or ran past its deadline)", code="session_aborted"),
                            status_code=409)
    except Exception as err:  # noqa: BLE001 - a tokenizer's or a template's failure: this request's 500 alone
        log.exception("screl: the policy server failed on a request")
        server.stats["engine_errors"] += 1
        return EngineFailure(err, stage="the server").response()


async def chat_route(server: PolicyServer, body: ChatRequest, request: Request) -> Any:
    """``/v1/chat/completions``: one prompt, ``n`` choices, streamed or not."""
    session = body.session_id or request.headers.get("x-session-id")
    limits = server.limits
    check_count(len(body.messages), limits.max_messages, "messages", "messages", "max_messages")
    check_count(len(body.tools or ()), limits.max_tools, "tools", "tools", "max_tools")
    tools = parse_tools(body.tools)
    choice = parse_tool_choice(body.tool_choice, tools)
    job = await server_requests.chat_job(server, session, body.messages, tools, choice, body.n,
                                         body.parallel_tool_calls, body.rollout, body.stops,
                                         server_requests.max_tokens_of(server, body), body.temperature, body.top_p,
                                         body.top_k, body.min_tokens, body.seed)
    [prompt] = job.prompts
    if body.stream:
        rid, created, name = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), server.model_name

        def chunks(replies: list[Reply], sent: list[str]) -> Iterator[dict[str, Any]]:
            return chat_chunks(rid, created, name, server.tokenizer, prompt, replies, body.logprobs,
                               body.include_usage, sent)

        opening = sse(role_chunk(rid, created, name, body.n, body.include_usage))
        delta = functools.partial(chat_delta, rid, created, name, body.include_usage)
        return server.stream_replies(job, ChunkStream(opening, delta, chunks, live=not job.may_call_tools))
    replies = await server.generate_replies(job, request)
    if replies is None:
        return Response(status_code=499)
    return chat_response(server.model_name, server.tokenizer, prompt, replies, body.logprobs)


async def completions_route(server: PolicyServer, body: CompletionRequest, request: Request) -> Any:
    """``/v1/completions``: one or more prompts (text or token ids), ``n`` choices each, streamed or not."""
    session = body.session_id or request.headers.get("x-session-id")
    if session is not None and len(body.prompts) > 1:
        raise RequestError("a batch of prompts within a session_id cannot be recorded as one conversation",
                           "prompt")
    server_requests.admit(server, session, body.n, body.n * len(body.prompts))
    prompts = await server_requests.completion_prompts(server, body.prompts)
    sampling = server_requests.sampling_params(server, server_requests.max_tokens_of(server, body),
                                               body.temperature, body.top_p, body.top_k, body.min_tokens, body.stops)
    job = server_requests.Job(session, prompts, server.session_requests(prompts, sampling, body.n, body.seed, session),
                              body.n, body.stops, rollout=body.rollout)
    logprobs = body.logprobs is not None
    if body.stream:
        rid, created, name = f"cmpl-{uuid.uuid4().hex}", int(time.time()), server.model_name

        def chunks(replies: list[Reply], sent: list[str]) -> Iterator[dict[str, Any]]:
            return completion_chunks(rid, created, name, server.tokenizer, prompts, replies, body.n, logprobs,
                                     body.include_usage, sent)

        delta = functools.partial(completion_delta, rid, created, name, body.include_usage)
        return server.stream_replies(job, ChunkStream(OPEN, delta, chunks, live=True))
    replies = await server.generate_replies(job, request)
    if replies is None:
        return Response(status_code=499)
    return completion_response(server.model_name, server.tokenizer, prompts, replies, logprobs)


async def responses_route(server: PolicyServer, body: ResponsesRequest, request: Request) -> Any:
    """``/v1/responses``: one reply, continuing a stored response of the same session (``previous_response_id``)."""
    session = body.session_id or request.headers.get("x-session-id")
    limits = server.limits
    check_count(1 if isinstance(body.input, str) else len(body.input), limits.max_messages, "input", "input items",
                "max_messages")
    check_count(len(body.tools or ()), limits.max_tools, "tools", "tools", "max_tools")
    messages = input_messages(body.input)
    if body.previous_response_id is not None:
        stored = server.responses.get(body.previous_response_id)
        if stored is None or stored["session"] != session:
            whose = "" if stored is None else " (it belongs to another session)"
            raise RequestError(f"previous_response_id: {body.previous_response_id!r} is not a response of this "
                               f"session{whose}", "previous_response_id")
        messages = [*stored["messages"], *messages]
        check_count(len(messages), limits.max_messages, "input", "messages (with previous_response_id's)",
                    "max_messages")
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    tools = parse_tools(body.tools, flat=True)
    choice = parse_tool_choice(body.tool_choice, tools, flat=True)
    job = await server_requests.chat_job(server, session, [*system, *messages], tools, choice, 1,
                                         body.parallel_tool_calls, body.rollout, [],
                                         server_requests.max_tokens_of(server, body), body.temperature, body.top_p,
                                         None, 0, body.seed, param="input")

    def keep(out: dict[str, Any], reply: Reply) -> None:
        server.responses[out["id"]] = {"session": session, "messages": [*messages, assistant_message(reply)]}
        while len(server.responses) > server.MAX_STORED_RESPONSES:
            server.responses.popitem(last=False)

    if body.stream:
        return server.stream_replies(job, ResponsesStream(server.model_name, body, choice, job.prompts[0],
                                                          not job.may_call_tools, keep))
    replies = await server.generate_replies(job, request)
    if replies is None:
        return Response(status_code=499)
    [reply] = replies
    out = response_object(server.model_name, body, job.prompts[0], reply, choice)
    keep(out, reply)
    return out
