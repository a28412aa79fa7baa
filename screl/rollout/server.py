"""The OpenAI-compatible policy server (``generation.expose_http_server: true``), in front of any backend.

One Ray actor, :class:`PolicyServer`, serves FastAPI through uvicorn and forwards every request to a
generation worker's engine (the same ``generate`` the rollouts use, so requests batch with them):

* ``POST /v1/chat/completions``, ``POST /v1/completions``, ``GET /v1/models``, ``GET /health``;
* a ``session_id`` (body field or ``X-Session-Id`` header) routes every request of a conversation to one
  worker, and the server records the conversation's turns (prompt and sampled tokens, logprobs, versions,
  the ``rollout`` tags) for :class:`~screl.rollout.agent.AgentWorkflow` to turn into a training row;
* chat prompts splice the past turns' tokens verbatim (:mod:`screl.rollout.chat`);
* stop strings of one token stop the engine; longer ones cut the completion where they appear;
* a client that disconnects mid-request gets its engine request aborted;
* it binds loopback unless told otherwise, and a non-loopback bind needs ``api_key``: every ``/v1`` request
  must then carry ``Authorization: Bearer <key>`` (401 otherwise).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import uuid
from collections.abc import Sequence
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response

from screl.config_generation import bind_problem
from screl.rollout.chat import SpliceError, chat_prompt_ids, encode_text
from screl.rollout.engine import GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.openai_api import (
    ChatRequest,
    CompletionRequest,
    api_error,
    chat_response,
    completion_response,
)
from screl.rollout.trajectory import turn_of

log = logging.getLogger(__name__)

__all__ = ["PolicyServer", "apply_stops", "check_bind"]


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


class PolicyServer:
    """The server actor. ``start()`` binds and returns the base URL (``http://host:port/v1``)."""

    def __init__(self, workers: Sequence[Any], policy: Any, host: str = "127.0.0.1", port: int = 0,
                 api_key: str | None = None, model_name: str = "screl-policy", max_tokens: int = 16,
                 temperature: float = 1.0) -> None:
        check_bind(host, api_key)
        self.workers = list(workers)
        self.tokenizer = policy.build_tokenizer()
        self.host, self.port, self.api_key = host, port, api_key
        self.model_name, self.max_tokens, self.temperature = model_name, max_tokens, temperature
        self.sessions: dict[str, list[dict[str, Any]]] = {}
        self.sticky: dict[str, int] = {}
        self.inflight: dict[str, list[str]] = {}  # session -> its engine requests now generating
        self.cancelled: set[str] = set()
        self._next = itertools.count()
        self.stats = {"requests": 0, "disconnect_aborts": 0, "errors": 0}
        self.aborted: list[dict[str, Any]] = []
        self._server: Any = None

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
    async def take_session(self, session_id: str) -> tuple[list[dict[str, Any]], bool]:
        """The turns recorded for ``session_id`` and whether it was aborted (both forgotten afterwards)."""
        self.sticky.pop(session_id, None)
        aborted = session_id in self.cancelled
        self.cancelled.discard(session_id)
        return self.sessions.pop(session_id, []), aborted

    async def abort_sessions(self, session_ids: Sequence[str]) -> None:
        """End these sessions: their requests in flight are aborted in the engine, later ones get a 409."""
        for sid in session_ids:
            self.cancelled.add(sid)
            requests = self.inflight.get(sid)
            if requests and sid in self.sticky:
                await self.workers[self.sticky[sid]].abort.remote(requests)

    async def get_stats(self) -> dict[str, Any]:
        return {**self.stats, "sessions": len(self.sessions), "aborted": list(self.aborted)}

    # -- the app ----------------------------------------------------------------------------------------
    def app(self) -> FastAPI:
        app = FastAPI(title="screl policy server", docs_url=None, redoc_url=None)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0]
            param = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            self.stats["errors"] += 1
            return JSONResponse(api_error(f"{param}: {first.get('msg')}", param=param), status_code=400)

        async def auth(request: Request) -> None:
            if self.api_key and request.headers.get("authorization") != f"Bearer {self.api_key}":
                raise HTTPException(401, detail="invalid API key")

        @app.exception_handler(401)
        async def unauthorized(request: Request, exc: Exception) -> JSONResponse:
            return JSONResponse(api_error("invalid or missing API key (Authorization: Bearer <key>)",
                                          kind="authentication_error", code="invalid_api_key"), status_code=401)

        @app.get("/health")
        async def health() -> dict[str, str]:
            return {"status": "ok"}

        @app.get("/v1/models", dependencies=[Depends(auth)])
        async def models() -> dict[str, Any]:
            return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "screl"}]}

        @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
        async def chat(body: ChatRequest, request: Request) -> Any:
            return await self._serve(body, request, chat=True)

        @app.post("/v1/completions", dependencies=[Depends(auth)])
        async def completions(body: CompletionRequest, request: Request) -> Any:
            return await self._serve(body, request, chat=False)

        return app

    async def _serve(self, body: ChatRequest | CompletionRequest, request: Request, chat: bool) -> Any:
        self.stats["requests"] += 1
        session = body.session_id or request.headers.get("x-session-id")
        try:
            prompt = self._prompt(body, session)
        except (SpliceError, ValueError) as err:
            self.stats["errors"] += 1
            return JSONResponse(api_error(str(err), param="messages" if chat else "prompt"), status_code=400)
        if session is not None and body.n > 1:
            return JSONResponse(api_error("n > 1 within a session_id cannot be recorded as one conversation",
                                          param="n"), status_code=400)
        if session in self.cancelled:
            return JSONResponse(api_error(f"session {session!r} was aborted (its rollout left the sampler's window "
                                          "or ran past its deadline)", code="session_aborted"), status_code=409)
        requests = self._requests(body, prompt)
        worker = self._route(session)
        if session is not None:
            self.inflight[session] = [r.request_id for r in requests]
        try:
            results = await self._generate(worker, requests, request)
        finally:
            if session is not None:
                self.inflight.pop(session, None)
        if results is None:
            return Response(status_code=499)
        choices = [apply_stops(self.tokenizer, r, body.stops) for r in results]
        if session is not None:
            turns = self.sessions.setdefault(session, [])
            tags = {**(body.rollout or {}), "turn": len(turns), "session": session}
            turns.append(turn_of(choices[0][0], tags).as_dict())
        logprobs = bool(body.logprobs is not None and body.logprobs is not False)
        build = chat_response if chat else completion_response
        return build(self.model_name, self.tokenizer, prompt, choices, logprobs)

    def _prompt(self, body: ChatRequest | CompletionRequest, session: str | None) -> list[int]:
        if isinstance(body, CompletionRequest):
            if isinstance(body.prompt, list):
                return [int(t) for t in body.prompt]
            return encode_text(self.tokenizer, body.prompt)
        return chat_prompt_ids(self.tokenizer, body.messages, self._prefix(body.messages, session))

    def _prefix(self, messages: list[dict[str, Any]], session: str | None) -> list[int] | None:
        """The past tokens to splice: the last assistant message's own ids, else the session's last turn when
        that message is its reply; a session whose past cannot be matched is refused (SpliceError)."""
        from screl.envs import decode_completion

        assistant = [m for m in messages if m.get("role") == "assistant"]
        if not assistant:
            return None
        last = assistant[-1]
        if last.get("prompt_token_ids") is not None and last.get("generation_token_ids") is not None:
            return [*map(int, last["prompt_token_ids"]), *map(int, last["generation_token_ids"])]
        turns = self.sessions.get(session or "", [])
        if turns:
            prev = turns[-1]
            if decode_completion(self.tokenizer, prev["token_ids"]) == str(last.get("content") or ""):
                return [*prev["prompt_token_ids"], *prev["token_ids"]]
            raise SpliceError(f"session {session!r}: the last assistant message is not the reply this session "
                              "recorded; send it back unchanged (or with its prompt_token_ids and "
                              "generation_token_ids)")
        return None

    def _requests(self, body: ChatRequest | CompletionRequest, prompt: list[int]) -> list[GenerationRequest]:
        max_tokens = body.max_completion_tokens or body.max_tokens or self.max_tokens
        one_token = [ids[0] for s in body.stops if len(ids := encode_text(self.tokenizer, s)) == 1]
        temperature = self.temperature if body.temperature is None else body.temperature
        reqs = []
        for i in range(body.n):
            sampling = SamplingParams(
                max_new_tokens=max_tokens, temperature=temperature, top_p=body.top_p, top_k=body.top_k,
                min_new_tokens=min(body.min_tokens, max_tokens),
                seed=None if body.seed is None else body.seed + i, stop_token_ids=tuple(one_token),
            )
            reqs.append(GenerationRequest(f"srv-{uuid.uuid4().hex[:12]}", list(prompt), sampling))
        return reqs

    def _route(self, session: str | None) -> int:
        if session is None:
            return next(self._next) % len(self.workers)
        if session not in self.sticky:
            self.sticky[session] = next(self._next) % len(self.workers)
        return self.sticky[session]

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
                results = await task
                self.aborted += [{"request_id": r.request_id, "finish_reason": r.finish_reason,
                                  "tokens": len(r.token_ids)} for r in results]
                return None


async def _await(ref: Any) -> Any:
    return await ref
