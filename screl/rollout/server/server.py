"""The OpenAI-compatible policy server (``generation.expose_http_server: true``), in front of any backend; its routes
and fields are in docs/agents.md, "The OpenAI-compatible server".

One Ray actor, :class:`PolicyServer`, serves FastAPI through uvicorn and forwards every request to a generation
worker's engine (the same ``generate`` the rollouts use, so requests batch with them): chat and text completions,
``/v1/responses`` (:mod:`screl.rollout.server.responses_api`), function calling (:mod:`screl.rollout.server.tool_calls`) and
streaming (:mod:`screl.rollout.server.openai_stream`). A ``session_id`` (body field or ``X-Session-Id`` header) routes a
conversation to one worker and records its turns token by token for :class:`~screl.rollout.workflows.agent.AgentWorkflow` to
turn into a row; chat prompts splice the past turns' tokens verbatim (:mod:`screl.rollout.workflows.chat`). A client that
disconnects mid-request (or mid-stream) gets its engine request aborted.

Invariant: it binds loopback unless told otherwise, and a non-loopback bind needs ``api_key``; every ``/v1`` request
must then carry ``Authorization: Bearer <key>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hashlib
import itertools
import logging
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from screl.config_generation import bind_problem
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, SamplingParams
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
from screl.rollout.server.openai_schema import (
    client_token_ids,
    max_request_tokens,
    model_vocab_size,
    route_responses,
    validation_error_message,
)
from screl.rollout.server.openai_stream import DONE, OPEN, chat_chunks, completion_chunks, role_chunk, sse
from screl.rollout.server.responses_api import ResponsesRequest, input_messages, response_object
from screl.rollout.server.server_sessions import (
    MAX_ABORTED_NOTES,
    SESSION_IDLE_TIMEOUT_S,
    assistant_message,
    forget_idle,
    forget_session,
    record_reply,
    same_reply,
)
from screl.rollout.server.tool_calls import ParsedReply, ToolChoice, ToolSpec, resolve_tool_parser
from screl.rollout.workflows.chat import SpliceError, chat_prompt_ids, encode_text
from screl.rollout.workflows.multiturn import turn_seed
from screl.rollout.workflows.trajectory import turn_of

log = logging.getLogger(__name__)

__all__ = ["PolicyServer", "apply_stops", "check_bind", "session_seed"]


def session_seed(base: int, session: str, turn: int) -> int:
    """The sampling seed of a session's ``turn``-th request that names none: a function of the run's seed, the
    session (a rollout's attempt id) and the turn alone, so an agent run samples the same tokens whatever order its
    concurrent requests reach the engine in (the engine would otherwise draw seeds in arrival order)."""
    digest = hashlib.blake2b(f"{base}:{session}:{turn}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") >> 2  # non-negative, with room for the n choices' seed + i


def check_bind(host: str, api_key: str | None) -> None:
    """A non-loopback bind without an API key is refused (``bind_problem``)."""
    problem = bind_problem(host, api_key)
    if problem is not None:
        raise ValueError(f"{problem}; set the key (clients then send Authorization: Bearer <key>), or bind 127.0.0.1")


def apply_stops(tokenizer: Any, result: GenerationResult, stops: Sequence[str]) -> tuple[GenerationResult, str, bool]:
    """(result cut after the token that completes the first stop string, the text before it, whether it stopped)."""
    from screl.envs import decode_completion

    text = decode_completion(tokenizer, result.token_ids)
    hits = [(text.find(s), s) for s in stops if s and s in text]
    if not hits:
        return result, text, False
    at, stop = min(hits)
    for n in range(1, len(result.token_ids) + 1):  # the shortest token prefix whose text holds the stop string
        if decode_completion(tokenizer, result.token_ids[:n]).find(stop) == at:
            break
    cut = GenerationResult(result.request_id, result.prompt_token_ids, result.token_ids[:n], result.logprobs[:n],
                           "stop", result.weight_versions[:n], result.start_version, result.end_version)
    return cut, text[:at], True


@dataclass
class _Job:
    """A request made ready to generate: its prompts, engine requests (``n`` per prompt) and tool handling."""

    session: str | None
    prompts: list[list[int]]
    requests: list[GenerationRequest]
    n: int = 1
    stops: list[str] = field(default_factory=list)
    tools: list[ToolSpec] = field(default_factory=list)
    choice: ToolChoice = field(default_factory=ToolChoice)
    opener: str = ""
    parallel: bool = True
    rollout: dict[str, Any] | None = None


class PolicyServer:
    """The server actor. ``start()`` binds and returns the base URL (``http://host:port/v1``)."""

    MAX_STORED_RESPONSES = 4096
    """Responses kept for ``previous_response_id`` outside sessions (a session's go when it is taken)."""

    def __init__(self, workers: Sequence[Any], policy: Any, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_name: str = "screl-policy", max_tokens: int = 16,
                 temperature: float = 1.0, tool_parser: str = "auto",
                 session_idle_timeout_s: float = SESSION_IDLE_TIMEOUT_S, clock: Callable[[], float] = time.monotonic,
                 seed: int = 0) -> None:
        check_bind(host, api_key)
        self.workers = list(workers)
        self.tokenizer = policy.build_tokenizer()
        self.parser = resolve_tool_parser(tool_parser, self.tokenizer)
        self.host, self.port, self.api_key = host, port, api_key
        self.model_name, self.max_tokens, self.temperature = model_name, max_tokens, temperature
        config = policy.build_config()
        self.max_request_tokens = max_request_tokens(config, max_tokens)
        self.vocab_size = model_vocab_size(config)  # client-sent token ids are checked against it
        self.seed = seed  # a session's request without a seed samples with session_seed(seed, session, turn)
        self.session_seeds: dict[str, int] = {}  # a rollout's session -> its sibling's seed (open_session)
        self.sessions: dict[str, list[dict[str, Any]]] = {}
        self.replies: dict[str, dict[str, Any]] = {}  # session -> its last reply as the client got it
        self.responses: OrderedDict[str, dict[str, Any]] = OrderedDict()  # response id -> session, messages
        self.sticky: dict[str, int] = {}
        self.inflight: dict[str, list[str]] = {}  # session -> its engine requests now generating
        self.cancelled: set[str] = set()
        self._next = itertools.count()
        self.stats = {"requests": 0, "disconnect_aborts": 0, "errors": 0}
        self.aborted: deque[dict[str, Any]] = deque(maxlen=MAX_ABORTED_NOTES)
        self.seen: dict[str, float] = {}  # session -> the time of its last request (or abort)
        self.session_idle_timeout_s, self.clock = session_idle_timeout_s, clock
        self._swept = clock()
        self._server: Any = None
        self._background: set[asyncio.Future[Any]] = set()

    # -- lifecycle -------------------------------------------------------------------------------------
    async def start(self) -> str:
        import uvicorn

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self) -> Any:  # the actor's process keeps its own signal handling
                yield

        self._server = _Server(uvicorn.Config(self.app(), host=self.host, port=self.port, log_level="warning",
                                              lifespan="off", access_log=False))
        self._task = asyncio.ensure_future(self._server.serve())
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises the bind error
            await asyncio.sleep(0.01)
        self.port = self._server.servers[0].sockets[0].getsockname()[1]
        return self.url()

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task

    # -- recorded conversations -------------------------------------------------------------------------
    async def open_session(self, session_id: str, seed: int | None) -> None:
        """A rollout's session samples its seedless requests with ``turn_seed(seed, turn)``, as the multi-turn
        workflow does: the sibling's seed fixes its tokens in every run (its session id names a run's group)."""
        if seed is not None:
            self.session_seeds[session_id] = seed

    async def take_session(self, session_id: str) -> tuple[list[dict[str, Any]], bool]:
        """The turns recorded for ``session_id`` and whether it was aborted (all of it forgotten afterwards)."""
        return forget_session(self, session_id)

    async def abort_sessions(self, session_ids: Sequence[str]) -> None:
        """End these sessions: their requests in flight are aborted in the engine, later ones get a 409."""
        self.cancelled.update(session_ids)
        for sid in session_ids:
            self._touch(sid)
        pending = {sid: self.inflight[sid] for sid in session_ids if self.inflight.get(sid) and sid in self.sticky}
        while pending:  # until they end: an abort that reaches the engine before its requests finds nothing
            for sid, requests in pending.items():
                await self.workers[self.sticky[sid]].abort.remote(requests)
            await asyncio.sleep(0.1)
            pending = {sid: r for sid, r in pending.items() if self.inflight.get(sid) is r}

    async def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "sessions": len(self.sessions), "aborted": list(self.aborted)}

    # -- the app ----------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title="screl policy server", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            self.stats["errors"] += 1
            message, param = validation_error_message(exc.errors())
            return JSONResponse(api_error(message, param=param), status_code=400)

        async def auth(request: Request) -> None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                raise HTTPException(401, detail="invalid API key")

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

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models", dependencies=[Depends(auth)], responses=route_responses("models"))
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "screl"}]}

        @app.post("/v1/chat/completions", dependencies=[Depends(auth)], responses=route_responses("chat", stream=True))
        async def chat(body: ChatRequest, request: Request) -> Any:
            return await self._guard(self._chat(body, request), "messages")

        @app.post("/v1/completions", dependencies=[Depends(auth)],
                  responses=route_responses("completions", stream=True))
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await self._guard(self._completions(body, request), "prompt")

        @app.post("/v1/responses", dependencies=[Depends(auth)], responses=route_responses("responses"))
        async def responses(body: ResponsesRequest, request: Request) -> Any:
            return await self._guard(self._responses(body, request), "input")

        return app

    async def _guard(self, handler: Any, param: str) -> Any:
        self.stats["requests"] += 1
        try:
            return await handler
        except RequestError as err:
            self.stats["errors"] += 1
            return JSONResponse(api_error(str(err), param=err.param), status_code=400)
        except (SpliceError, ValueError) as err:
            self.stats["errors"] += 1
            return JSONResponse(api_error(str(err), param=param), status_code=400)
        except _SessionAborted as err:
            return JSONResponse(api_error(f"session {err.args[0]!r} was aborted (its rollout left the sampler's "
                                          "window or ran past its deadline)", code="session_aborted"),
                                status_code=409)

    # -- the routes -------------------------------------------------------------------------------------
    async def _chat(self, body: ChatRequest, request: Request) -> Any:
        session = body.session_id or request.headers.get("x-session-id")
        tools = parse_tools(body.tools)
        choice = parse_tool_choice(body.tool_choice, tools)
        job = self._job(session, body.messages, tools, choice, body.n, body.parallel_tool_calls, body.rollout,
                        body.stops, self._max_tokens(body), body.temperature, body.top_p,
                        body.top_k, body.min_tokens, body.seed)
        [prompt] = job.prompts
        if body.stream:
            rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

            def chunks(replies: list[Reply]) -> Iterator[dict[str, Any]]:
                return chat_chunks(rid, created, self.model_name, self.tokenizer, prompt, replies, body.logprobs,
                                   body.include_usage)

            return self._stream(job, sse(role_chunk(rid, created, self.model_name, body.n, body.include_usage)),
                                chunks)
        replies = await self._replies(job, request)
        if replies is None:
            return Response(status_code=499)
        return chat_response(self.model_name, self.tokenizer, prompt, replies, body.logprobs)

    async def _completions(self, body: CompletionRequest, request: Request) -> Any:
        session = body.session_id or request.headers.get("x-session-id")
        prompts = [client_token_ids(p, self.vocab_size, "prompt") if isinstance(p, list)
                   else encode_text(self.tokenizer, p) for p in body.prompts]
        if session is not None and len(prompts) > 1:
            raise RequestError("a batch of prompts within a session_id cannot be recorded as one conversation",
                               "prompt")
        self._admit(session, body.n)
        sampling = self._sampling(self._max_tokens(body), body.temperature, body.top_p,
                                  body.top_k, body.min_tokens, body.stops)
        job = _Job(session, prompts, self._requests(prompts, sampling, body.n, body.seed, session), body.n, body.stops,
                   rollout=body.rollout)
        logprobs = body.logprobs is not None
        if body.stream:
            rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())

            def chunks(replies: list[Reply]) -> Iterator[dict[str, Any]]:
                return completion_chunks(rid, created, self.model_name, self.tokenizer, prompts, replies, body.n,
                                         logprobs, body.include_usage)

            return self._stream(job, OPEN, chunks)
        replies = await self._replies(job, request)
        if replies is None:
            return Response(status_code=499)
        return completion_response(self.model_name, self.tokenizer, prompts, replies, logprobs)

    async def _responses(self, body: ResponsesRequest, request: Request) -> Any:
        session = body.session_id or request.headers.get("x-session-id")
        messages = input_messages(body.input)
        if body.previous_response_id is not None:
            stored = self.responses.get(body.previous_response_id)
            if stored is None or stored["session"] != session:
                whose = "" if stored is None else " (it belongs to another session)"
                raise RequestError(f"previous_response_id: {body.previous_response_id!r} is not a response of this "
                                   f"session{whose}", "previous_response_id")
            messages = [*stored["messages"], *messages]
        system = [{"role": "system", "content": body.instructions}] if body.instructions else []
        tools = parse_tools(body.tools, flat=True)
        choice = parse_tool_choice(body.tool_choice, tools, flat=True)
        job = self._job(session, [*system, *messages], tools, choice, 1, body.parallel_tool_calls, body.rollout,
                        [], self._max_tokens(body), body.temperature, body.top_p, None, 0, body.seed)
        replies = await self._replies(job, request)
        if replies is None:
            return Response(status_code=499)
        [reply] = replies
        out = response_object(self.model_name, body, job.prompts[0], reply, choice)
        self.responses[out["id"]] = {"session": session, "messages": [*messages, assistant_message(reply)]}
        while len(self.responses) > self.MAX_STORED_RESPONSES:
            self.responses.popitem(last=False)
        return out

    # -- preparing a request ----------------------------------------------------------------------------
    def _job(self, session: str | None, messages: list[dict[str, Any]], tools: list[ToolSpec], choice: ToolChoice,
             n: int, parallel: bool | None, rollout: dict[str, Any] | None, stops: list[str], max_tokens: int | None,
             temperature: float | None, top_p: float | None, top_k: int | None, min_tokens: int,
             seed: int | None) -> _Job:
        opener = self.parser.opener(tools, choice.name) if choice.mode == "required" else ""
        prefix = self._prefix(messages, session)
        prompt = chat_prompt_ids(self.tokenizer, messages, prefix, [t.as_chat_tool() for t in tools], opener)
        self._admit(session, n)
        sampling = self._sampling(max_tokens, temperature, top_p, top_k, min_tokens, stops)
        return _Job(session, [prompt], self._requests([prompt], sampling, n, seed, session), n, stops, tools, choice, opener,
                    parallel is not False, rollout)

    def _admit(self, session: str | None, n: int) -> None:
        if session is not None and n > 1:
            raise RequestError("n > 1 within a session_id cannot be recorded as one conversation", "n")
        if session in self.cancelled:
            raise _SessionAborted(session)

    def _prefix(self, messages: list[dict[str, Any]], session: str | None) -> list[int] | None:
        """The past tokens to splice: the last assistant message's own ids, else the session's last turn when
        that message is its reply; a session whose past cannot be matched is refused (SpliceError)."""
        assistant = [m for m in messages if m.get("role") == "assistant"]
        if not assistant:
            return None
        last = assistant[-1]
        if last.get("prompt_token_ids") is not None and last.get("generation_token_ids") is not None:
            return client_token_ids([*last["prompt_token_ids"], *last["generation_token_ids"]], self.vocab_size,
                                    "messages")
        turns = self.sessions.get(session or "", [])
        if turns:
            if same_reply(last, self.replies.get(session or "")):
                prev = turns[-1]
                return [*prev["prompt_token_ids"], *prev["token_ids"]]
            raise SpliceError(f"session {session!r}: the last assistant message is not the reply this session "
                              "recorded; send it back unchanged, its content and tool_calls (or with its "
                              "prompt_token_ids and generation_token_ids)")
        return None

    def _max_tokens(self, body: Any) -> int | None:
        """The request's token budget (``max_completion_tokens``, else ``max_tokens``; ``max_output_tokens``), refused
        above :attr:`max_request_tokens`: the engine sizes a request's buffers by it."""
        for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
            value = getattr(body, name, None)
            if value is not None:
                if value > self.max_request_tokens:
                    raise RequestError(f"{name}: {value} is more than this server generates for one request "
                                       f"({self.max_request_tokens}: the model's context length, or "
                                       "generation.max_new_tokens when larger)", name)
                return int(value)
        return None

    def _sampling(self, max_tokens: int | None, temperature: float | None, top_p: float | None, top_k: int | None,
                  min_tokens: int, stops: list[str]) -> SamplingParams:
        max_tokens = max_tokens or self.max_tokens
        one_token = [ids[0] for s in stops if len(ids := encode_text(self.tokenizer, s)) == 1]
        return SamplingParams(max_new_tokens=max_tokens, temperature=self.temperature if temperature is None
                              else temperature, top_p=1.0 if top_p is None else top_p, top_k=top_k,
                              min_new_tokens=min(min_tokens, max_tokens), stop_token_ids=tuple(one_token))

    def _requests(self, prompts: list[list[int]], sampling: SamplingParams, n: int, seed: int | None,
                  session: str | None) -> list[GenerationRequest]:
        """One engine request per prompt and choice; a session's request without a seed gets
        :func:`turn_seed` of its sibling's seed (:meth:`open_session`), or else :func:`session_seed` (reproducible
        whatever order the agents' requests arrive in)."""
        if seed is None and session is not None:
            turn, sibling = len(self.sessions.get(session, [])), self.session_seeds.get(session)
            seed = session_seed(self.seed, session, turn) if sibling is None else turn_seed(sibling, turn)
        return [GenerationRequest(f"srv-{uuid.uuid4().hex[:12]}", list(p),
                                  dataclasses.replace(sampling, seed=None if seed is None else seed + i))
                for p in prompts for i in range(n)]

    def _touch(self, session: str) -> None:
        """Note the session's activity; now and then, forget the sessions idle too long (:func:`forget_idle`)."""
        now = self.clock()
        self.seen[session] = now
        if now - self._swept >= min(60.0, self.session_idle_timeout_s):
            self._swept = now
            forget_idle(self, now)

    def _route(self, session: str | None) -> int:
        if session is None:
            return next(self._next) % len(self.workers)
        self._touch(session)
        if session not in self.sticky:
            self.sticky[session] = next(self._next) % len(self.workers)
        return self.sticky[session]

    # -- generating -------------------------------------------------------------------------------------
    async def _replies(self, job: _Job, request: Any) -> list[Reply] | None:
        """The replies; None when the client went away (its requests are aborted in the engine)."""
        worker = self._route(job.session)
        self._inflight(job, True)
        try:
            results = await self._generate(worker, job.requests, request)
        except Exception:
            if job.session in self.cancelled:  # dropped from the worker's queue by the session's abort
                raise _SessionAborted(job.session) from None
            raise
        finally:
            self._inflight(job, False)
        return None if results is None else self._finish(job, results)

    def _inflight(self, job: _Job, on: bool) -> None:
        if job.session is not None:
            if on:
                self.inflight[job.session] = [r.request_id for r in job.requests]
            else:
                self.inflight.pop(job.session, None)

    def _finish(self, job: _Job, results: list[GenerationResult]) -> list[Reply]:
        """Stop strings, tool calls, and the session's record of the turn."""
        replies = []
        for i, r in enumerate(results):
            cut, text, stopped = apply_stops(self.tokenizer, r, job.stops)
            replies.append(Reply(cut, text, stopped, self._parse(job, text), prompt=job.prompts[i // job.n]))
        if job.session is not None:
            turns = self.sessions.setdefault(job.session, [])
            tags = {**(job.rollout or {}), "turn": len(turns), "session": job.session}
            turns.append(turn_of(replies[0].result, tags).as_dict())
            self.replies[job.session] = record_reply(replies[0])
        return replies

    def _parse(self, job: _Job, text: str) -> ParsedReply | None:
        if not job.tools or job.choice.mode == "none":
            return None
        parsed = self.parser.parse(job.opener + text, job.tools)
        if job.choice.name is not None and any(c.name != job.choice.name for c in parsed.calls):
            return ParsedReply(job.opener + text, error=f"tool_choice names {job.choice.name!r} but the reply "
                                                        "calls another tool")
        if not job.parallel and len(parsed.calls) > 1:
            return ParsedReply(parsed.content, parsed.calls[:1], parsed.error)
        return parsed

    async def _generate(self, index: int, requests: list[GenerationRequest], request: Any) -> list[GenerationResult] | None:
        """The worker's results; None when the client went away (its requests are aborted in the engine)."""
        worker = self.workers[index]
        task = asyncio.ensure_future(_await(worker.generate.remote(requests)))
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.05)
            if done:
                return task.result()
            if await request.is_disconnected():
                await worker.abort.remote([r.request_id for r in requests])
                self.stats["disconnect_aborts"] += 1
                self._note_aborted(await task)
                return None

    def _note_aborted(self, results: list[GenerationResult]) -> None:
        self.aborted += [{"request_id": r.request_id, "finish_reason": r.finish_reason, "tokens": len(r.token_ids)}
                         for r in results]

    async def _abort_until_done(self, worker: Any, requests: list[GenerationRequest],
                                generating: asyncio.Future[Any]) -> None:
        """Abort the requests until their generation ends (an abort that reaches the engine before the requests
        do finds nothing to abort), then note them."""
        ids = [r.request_id for r in requests]
        while not generating.done():
            await worker.abort.remote(ids)
            await asyncio.wait({generating}, timeout=0.2)
        if generating.cancelled() or generating.exception() is not None:  # dropped from the worker's queue
            self.aborted += [{"request_id": i, "finish_reason": "abort", "tokens": 0} for i in ids]
        else:
            self._note_aborted(generating.result())

    def _stream(self, job: _Job, opening: str, chunks: Callable[[list[Reply]], Iterator[dict[str, Any]]]) -> Any:
        """A server-sent event stream (:mod:`screl.rollout.server.openai_stream`); a client that goes away mid-stream
        cancels it, and its requests are aborted in the engine."""
        index = self._route(job.session)
        worker = self.workers[index]

        async def events() -> AsyncIterator[str]:
            yield opening
            self._inflight(job, True)
            generating = asyncio.ensure_future(_await(worker.generate.remote(job.requests)))
            try:
                results = await asyncio.shield(generating)
            except asyncio.CancelledError:  # the client went away (Starlette cancels the stream on disconnect)
                self.stats["disconnect_aborts"] += 1
                cleanup = asyncio.ensure_future(self._abort_until_done(worker, job.requests, generating))
                self._background.add(cleanup)
                cleanup.add_done_callback(self._background.discard)
                raise
            finally:
                self._inflight(job, False)
            for chunk in chunks(self._finish(job, results)):
                yield sse(chunk)
            yield DONE

        return StreamingResponse(events(), media_type="text/event-stream")


class _SessionAborted(Exception):
    pass


async def _await(ref: Any) -> Any:
    return await ref
