"""How the policy server (:class:`screl.rollout.server.server.PolicyServer`) turns a parsed request into a
:class:`Job`: its prompt (a chat's past turns spliced verbatim, :mod:`screl.rollout.workflows.chat`), its token
budget, its sampling and its engine requests.

Invariant: a request is refused (:class:`~screl.rollout.server.openai_api.RequestError`,
:class:`~screl.rollout.workflows.chat.SpliceError`, :class:`SessionAborted`, and the bounds of
:mod:`screl.rollout.server.server_limits`) before any engine request exists: a token budget past the server's,
``n > 1`` or a batch of prompts within a session, more choices than ``max_choices``, a prompt longer than the
model's context, an aborted or closed session, a new session past ``max_open_sessions``, a past that does not
match the session's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from screl.rollout.engines.protocol import GenerationRequest, SamplingParams
from screl.rollout.server.openai_api import RequestError
from screl.rollout.server.openai_schema import client_token_ids
from screl.rollout.server.server_limits import (
    KEY,
    ServerBusy,
    SessionClosed,
    check_count,
    check_prompt,
    check_text,
    text_chars,
)
from screl.rollout.server.server_sessions import same_reply
from screl.rollout.server.tool_calls import ToolChoice, ToolSpec
from screl.rollout.workflows.chat import SpliceError, chat_prompt_ids, encode_text

if TYPE_CHECKING:
    from screl.rollout.server.server import PolicyServer

__all__ = ["Job", "SessionAborted", "admit", "chat_job", "completion_prompts", "max_tokens_of", "sampling_params",
           "spliced_prefix"]


@dataclass
class Job:
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

    @property
    def may_call_tools(self) -> bool:
        """Whether its replies may hold tool calls (tools given, ``tool_choice`` not ``none``)."""
        return bool(self.tools) and self.choice.mode != "none"


class SessionAborted(Exception):
    """A request of a session that was aborted (``PolicyServer.abort_sessions``): a 409."""


async def chat_job(server: PolicyServer, session: str | None, messages: list[dict[str, Any]], tools: list[ToolSpec],
                   choice: ToolChoice, n: int, parallel: bool | None, rollout: dict[str, Any] | None,
                   stops: list[str], max_tokens: int | None, temperature: float | None, top_p: float | None,
                   top_k: int | None, min_tokens: int, seed: int | None, param: str = "messages") -> Job:
    """The job of a chat (``/v1/chat/completions``, ``/v1/responses``): its one prompt, rendered with the tools
    and, when the tool choice requires a call, the parser's opener. Bounded before it is rendered: the text
    (:func:`check_text`), then the spliced past and the prompt's tokens (:func:`check_prompt`, naming ``param``);
    a long text renders on the tokenizing thread."""
    admit(server, session, n, n)
    opener = server.parser.opener(tools, choice.name) if choice.mode == "required" else ""
    chat_tools = [t.as_chat_tool() for t in tools]
    chars = text_chars(messages) + text_chars(chat_tools) + len(opener)
    check_text(server, chars, param)
    prefix = spliced_prefix(server, messages, session)
    if prefix is not None:
        check_prompt(server, prefix, param)
    prompt = await server.tokenizing.run(chars, chat_prompt_ids, server.tokenizer, messages, prefix, chat_tools,
                                         opener)
    check_prompt(server, prompt, param)
    sampling = sampling_params(server, max_tokens, temperature, top_p, top_k, min_tokens, stops)
    return Job(session, [prompt], server.session_requests([prompt], sampling, n, seed, session), n, stops, tools,
               choice, opener, parallel is not False, rollout)


async def completion_prompts(server: PolicyServer, prompts: list[str | list[int]]) -> list[list[int]]:
    """The prompts of ``/v1/completions`` as token ids, each bounded (:func:`check_prompt`) and within the
    vocabulary; a long text is tokenized on the tokenizing thread."""
    out = []
    for p in prompts:
        if isinstance(p, list):
            check_prompt(server, p, "prompt")
            out.append(client_token_ids(p, server.vocab_size, "prompt"))
        else:
            check_text(server, len(p), "prompt")
            ids = await server.tokenizing.run(len(p), encode_text, server.tokenizer, p)
            check_prompt(server, ids, "prompt")
            out.append(ids)
    return out


def admit(server: PolicyServer, session: str | None, n: int, choices: int) -> None:
    """Refuse ``n > 1`` within a session (one conversation records one reply), more engine requests than
    ``max_choices``, a closed or aborted session's request, and a new session past ``max_open_sessions``."""
    check_count(choices, server.limits.max_choices, "n", "choices (n times the prompts)", "max_choices")
    if session is None:
        return
    if n > 1:
        raise RequestError("n > 1 within a session_id cannot be recorded as one conversation", "n")
    if session in server.cancelled:
        raise SessionAborted(session)
    if session in server.closed:
        raise SessionClosed(session)
    bound = server.limits.max_open_sessions
    if session not in server.seen and len(server.seen) >= bound:
        server.stats["busy"] += 1
        raise ServerBusy(f"session {session!r}: the server holds {len(server.seen)} open sessions, its limit "
                         f"({KEY}.max_open_sessions={bound}); retry once sessions end (taken, or closed after "
                         f"{KEY}.session_idle_timeout_s={server.session_idle_timeout_s:g} s idle)")


def spliced_prefix(server: PolicyServer, messages: list[dict[str, Any]], session: str | None) -> list[int] | None:
    """The past tokens to splice: the last assistant message's own ids, else the session's last turn when
    that message is its reply; a session whose past cannot be matched is refused (SpliceError)."""
    assistant = [m for m in messages if m.get("role") == "assistant"]
    if not assistant:
        return None
    last = assistant[-1]
    if last.get("prompt_token_ids") is not None and last.get("generation_token_ids") is not None:
        return client_token_ids([*last["prompt_token_ids"], *last["generation_token_ids"]], server.vocab_size,
                                "messages")
    turns = server.sessions.get(session or "", [])
    if turns:
        if same_reply(last, server.replies.get(session or "")):
            prev = turns[-1]
            return [*prev["prompt_token_ids"], *prev["token_ids"]]
        raise SpliceError(f"session {session!r}: the last assistant message is not the reply this session "
                          "recorded; send it back unchanged, its content and tool_calls (or with its "
                          "prompt_token_ids and generation_token_ids)")
    return None


def max_tokens_of(server: PolicyServer, body: Any) -> int | None:
    """The request's token budget (``max_completion_tokens``, else ``max_tokens``; ``max_output_tokens``), refused
    above :attr:`PolicyServer.max_request_tokens`: the engine sizes a request's buffers by it."""
    for name in ("max_completion_tokens", "max_tokens", "max_output_tokens"):
        value = getattr(body, name, None)
        if value is not None:
            if value > server.max_request_tokens:
                why = (f"{KEY}.max_request_tokens" if server.limits.max_request_tokens is not None else
                       "the model's context length, or generation.max_new_tokens when larger")
                raise RequestError(f"{name}: {value} is more than this server generates for one request "
                                   f"({server.max_request_tokens}: {why})", name)
            return int(value)
    return None


def sampling_params(server: PolicyServer, max_tokens: int | None, temperature: float | None, top_p: float | None,
                    top_k: int | None, min_tokens: int, stops: list[str]) -> SamplingParams:
    """The request's sampling, the server's defaults where it names none; a stop string of one token stops in the
    engine (longer ones are cut afterwards, ``apply_stops``)."""
    max_tokens = max_tokens or server.max_tokens
    one_token = [ids[0] for s in stops if len(ids := encode_text(server.tokenizer, s)) == 1]
    return SamplingParams(max_new_tokens=max_tokens, temperature=server.temperature if temperature is None
                          else temperature, top_p=1.0 if top_p is None else top_p, top_k=top_k,
                          min_new_tokens=min(min_tokens, max_tokens), stop_token_ids=tuple(one_token))
