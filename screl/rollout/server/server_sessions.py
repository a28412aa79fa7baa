"""The policy server's per-session records, and how they are let go (``screl.rollout.server.server``).

A session's records (its turns, its last reply, its worker, whether it was aborted, its stored responses) go when
``AgentWorkflow`` takes the session. A session nobody takes (its rollout's worker died, or a client outside the
trainer sends an ``X-Session-Id``) would stay for the server's lifetime, one record per session: sessions idle for
``generation.http_server.session_idle_timeout_s`` are closed instead (:func:`forget_idle`), with a warning: their
records go, and their ids are noted (the newest :data:`MAX_CLOSED_NOTES`) so that a late request of one is a 404
naming it rather than the start of a new conversation. The notes on aborted requests (``get_stats()["aborted"]``)
keep the last :data:`MAX_ABORTED_NOTES`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from screl.rollout.server.openai_api import Reply
from screl.rollout.workflows.chat import message_text

log = logging.getLogger(__name__)

__all__ = ["MAX_ABORTED_NOTES", "MAX_CLOSED_NOTES", "assistant_message", "forget_idle", "forget_session",
           "record_reply", "same_reply"]

MAX_CLOSED_NOTES = 16384
"""The sessions closed for idleness whose late requests get a 404: the newest ones (an older one's is a new session)."""
MAX_ABORTED_NOTES = 1024
"""The aborted requests ``get_stats()`` reports: the newest ones."""


def forget_session(server: Any, session_id: str) -> tuple[list[dict[str, Any]], bool]:
    """Drop every record of ``session_id``; returns (its turns, whether it was aborted)."""
    server.sticky.pop(session_id, None)
    server.replies.pop(session_id, None)
    server.seen.pop(session_id, None)
    server.session_seeds.pop(session_id, None)
    for rid in [r for r, v in server.responses.items() if v["session"] == session_id]:
        del server.responses[rid]
    server.closed.pop(session_id, None)
    aborted = session_id in server.cancelled
    server.cancelled.discard(session_id)
    return server.sessions.pop(session_id, []), aborted


def forget_idle(server: Any, now: float) -> list[str]:
    """Close the sessions idle past ``server.session_idle_timeout_s`` with nothing in flight (their records
    forgotten, their ids noted in ``server.closed``); their ids."""
    cutoff = now - server.session_idle_timeout_s
    idle = [sid for sid, at in server.seen.items() if at < cutoff and not server.inflight.get(sid)]
    for sid in idle:
        forget_session(server, sid)
        server.closed[sid] = None
    while len(server.closed) > MAX_CLOSED_NOTES:
        server.closed.popitem(last=False)
    if idle:
        log.warning("screl: the policy server closed %d session(s) idle for over %.0f s that nobody took (e.g. %r): "
                    "a rollout whose worker died, or a client's own X-Session-Id", len(idle),
                    server.session_idle_timeout_s, idle[0])
    return idle


def assistant_message(reply: Reply) -> dict[str, Any]:
    """The reply as the assistant message a conversation continues from."""
    msg: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        msg["tool_calls"] = reply.tool_calls
    return msg


def tool_calls_of(message: Mapping[str, Any]) -> list[tuple[str, Any]]:
    out = []
    for c in message.get("tool_calls") or []:
        fn = c.get("function") or {}
        args = fn.get("arguments")
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            pass
        out.append((str(fn.get("name")), args))
    return out


def record_reply(reply: Reply) -> dict[str, Any]:
    return {"content": reply.content or "", "calls": tool_calls_of(assistant_message(reply))}


def same_reply(message: Mapping[str, Any], recorded: Mapping[str, Any] | None) -> bool:
    """Whether the client sent the session's last reply back as it got it (text and tool calls)."""
    return recorded is not None and message_text(message.get("content")) == recorded["content"] and \
        tool_calls_of(message) == recorded["calls"]
