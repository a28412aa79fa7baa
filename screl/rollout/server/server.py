"""The OpenAI-compatible policy server (``generation.expose_http_server: true``), in front of any backend; its routes
and fields are in docs/agents.md, "The OpenAI-compatible server".

One Ray actor, :class:`PolicyServer`, serves FastAPI through uvicorn and forwards every request to a generation
worker's engine (the same ``generate`` the rollouts use, so requests batch with them): chat and text completions,
``/v1/responses`` (:mod:`screl.rollout.server.responses_api`), function calling (:mod:`screl.rollout.server.tool_calls`) and
streaming (:mod:`screl.rollout.server.openai_stream`). A ``session_id`` (body field or ``X-Session-Id`` header) routes a
conversation to one worker and records its turns token by token for :class:`~screl.rollout.workflows.agent.AgentWorkflow` to
turn into a row; chat prompts splice the past turns' tokens verbatim (:mod:`screl.rollout.workflows.chat`). A client that
disconnects mid-request (or mid-stream) gets its engine request aborted. The routes and their error replies are
``server_routes.py`` beside it, a request's prompt, sampling and engine requests ``server_requests.py``, its bounds
(``generation.http_server``'s limits: body size, prompt length, counts, requests and sessions at once)
``server_limits.py``, an engine failure's answer ``server_failures.py``; the actor keeps the sessions' records and
the generating, and every 30 s closes idle sessions and hands freed heap back to the system.

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
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.responses import StreamingResponse

from screl.config_generation import HttpServerConfig, bind_problem, server_limit_problems
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.server import server_requests, server_routes
from screl.rollout.server.live_text import LiveText
from screl.rollout.server.openai_api import Reply
from screl.rollout.server.openai_schema import max_request_tokens, model_context, model_vocab_size
from screl.rollout.server.openai_stream import StreamFormat, sse
from screl.rollout.server.server_failures import EngineFailure
from screl.rollout.server.server_limits import HOUSEKEEPING_S, Tokenizing, max_token_chars, release_memory
from screl.rollout.server.server_sessions import MAX_ABORTED_NOTES, forget_idle, forget_session, record_reply
from screl.rollout.server.tool_calls import ParsedReply, resolve_tool_parser
from screl.rollout.workflows.multiturn import turn_seed
from screl.rollout.workflows.trajectory import turn_of

log = logging.getLogger(__name__)

__all__ = ["PolicyServer", "apply_stops", "check_bind", "check_limits", "session_seed"]


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


def check_limits(limits: HttpServerConfig) -> HttpServerConfig:
    """The server's limits, refused when one is not a positive number (``server_limit_problems``)."""
    problems = server_limit_problems(limits)
    if problems:
        raise ValueError("; ".join(f"{key}={value!r} {why}" for key, value, why in problems))
    return limits


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


class PolicyServer:
    """The server actor. ``start()`` binds and returns the base URL (``http://host:port/v1``)."""

    MAX_STORED_RESPONSES = 4096
    """Responses kept for ``previous_response_id`` outside sessions (a session's go when it is taken)."""

    def __init__(self, workers: Sequence[Any], policy: Any, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_name: str = "screl-policy", max_tokens: int = 16,
                 temperature: float = 1.0, tool_parser: str = "auto", session_idle_timeout_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic, seed: int = 0,
                 limits: HttpServerConfig | None = None) -> None:
        check_bind(host, api_key)
        self.limits = check_limits(limits or HttpServerConfig())  # its bounds (server_limits.py)
        self.workers = list(workers)
        self.tokenizer = policy.build_tokenizer()
        self.parser = resolve_tool_parser(tool_parser, self.tokenizer)
        self.host, self.port, self.api_key = host, port, api_key
        self.model_name, self.max_tokens, self.temperature = model_name, max_tokens, temperature
        config = policy.build_config()
        self.max_request_tokens = self.limits.max_request_tokens or max_request_tokens(config, max_tokens)
        self.max_prompt_tokens = self.limits.max_prompt_tokens or model_context(config)
        self.max_token_chars = max_token_chars(self.tokenizer)
        self.tokenizing = Tokenizing()
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
        self.stats = {"requests": 0, "disconnect_aborts": 0, "errors": 0, "busy": 0, "engine_errors": 0}
        self.aborted: deque[dict[str, Any]] = deque(maxlen=MAX_ABORTED_NOTES)
        self.seen: dict[str, float] = {}  # session -> the time of its last request (or abort)
        self.closed: OrderedDict[str, None] = OrderedDict()  # sessions closed idle (their late requests: 404)
        self.session_idle_timeout_s = session_idle_timeout_s or self.limits.session_idle_timeout_s
        self.clock = clock
        self._swept = clock()
        self._server: Any = None
        self._housekeeping: asyncio.Future[None] | None = None
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
        self._housekeeping = asyncio.ensure_future(self._keep_house())
        return self.url()

    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/v1"

    async def _keep_house(self) -> None:
        """Every :data:`HOUSEKEEPING_S`: close the sessions idle too long, and (when requests came since) hand the
        freed heap back to the system (``release_memory``: RSS stays flat under load)."""
        served = -1
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            forget_idle(self, self.clock())
            if self.stats["requests"] != served:
                served = self.stats["requests"]
                release_memory()

    async def stop(self) -> None:
        if self._housekeeping is not None:
            self._housekeeping.cancel()
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
        """The FastAPI app (its routes: ``server_routes.py``)."""
        return server_routes.build_app(self)

    # -- sessions ---------------------------------------------------------------------------------------
    def session_requests(self, prompts: list[list[int]], sampling: SamplingParams, n: int, seed: int | None,
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
    async def generate_replies(self, job: server_requests.Job, request: Any) -> list[Reply] | None:
        """The replies; None when the client went away (its requests are aborted in the engine)."""
        worker = self._route(job.session)
        self._inflight(job, True)
        try:
            results = await self._generate(worker, job.requests, request)
        except Exception as err:
            if job.session in self.cancelled:  # dropped from the worker's queue by the session's abort
                raise server_requests.SessionAborted(job.session) from None
            raise EngineFailure(err) from err  # this request's 500 or 503 alone (server_failures.py)
        finally:
            self._inflight(job, False)
        return None if results is None else self._finish(job, results)

    def _inflight(self, job: server_requests.Job, on: bool) -> None:
        if job.session is not None:
            if on:
                self.inflight[job.session] = [r.request_id for r in job.requests]
            else:
                self.inflight.pop(job.session, None)

    def _finish(self, job: server_requests.Job, results: list[GenerationResult]) -> list[Reply]:
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

    def _parse(self, job: server_requests.Job, text: str) -> ParsedReply | None:
        if not job.may_call_tools:
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

    def stream_replies(self, job: server_requests.Job, form: StreamFormat) -> Any:
        """A server-sent event stream in ``form``: the replies' text as the engine produces it
        (:mod:`screl.rollout.server.live_text`), then the closing events; a client that goes away mid-stream
        cancels it, and its requests are aborted in the engine."""
        index = self._route(job.session)
        worker = self.workers[index]
        ids = [r.request_id for r in job.requests]

        async def events() -> AsyncIterator[str]:
            yield form.opening
            self._inflight(job, True)
            live = LiveText(self.tokenizer, len(ids), job.stops, form.live)
            generating = asyncio.ensure_future(_await(worker.generate.remote(job.requests)))
            try:
                async for i, text in live.follow(worker, ids, generating):
                    for event in form.delta(i, text):
                        yield sse(event)
                results = await asyncio.shield(generating)
            except asyncio.CancelledError:  # the client went away (Starlette cancels the stream on disconnect)
                self.stats["disconnect_aborts"] += 1
                cleanup = asyncio.ensure_future(self._abort_until_done(worker, job.requests, generating))
                self._background.add(cleanup)
                cleanup.add_done_callback(self._background.discard)
                raise
            except Exception as err:  # the engine failed it: the stream's last event says so
                self.stats["engine_errors"] += 1
                for event in form.failure(EngineFailure(err).event()):
                    yield sse(event)
                yield form.done
                return
            finally:
                self._inflight(job, False)
            for chunk in form.closing(self._finish(job, results), live.sent):
                yield sse(chunk)
            yield form.done

        return StreamingResponse(events(), media_type="text/event-stream")


async def _await(ref: Any) -> Any:
    return await ref
