"""The policy server's per-session records stay bounded (issue 40, item 4: the server's memory under load). Structural,
not a timing or RSS test: the app in this process over a real engine (``tests/rollout/inprocess_server.py``), its
clock stepped by hand.

Found while looking for the load benchmark's RSS growth: a session nobody takes (its rollout's worker died, or a
client's own ``X-Session-Id``) kept its turns, last reply, worker and abort mark for the server's lifetime, and every
aborted request added a note to a list never cut. Neither grew in the benchmark (every session is taken and nothing
is aborted there); tracemalloc over the real server found no Python object of ours growing (docs/failures.md).
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi.testclient import TestClient

from screl.rollout.engines.protocol import GenerationResult
from screl.rollout.server.server_sessions import MAX_ABORTED_NOTES
from tests.rollout.inprocess_server import build_server, build_worker

WORKER = build_worker()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _records(server: Any) -> dict[str, int]:
    return {name: len(getattr(server, name)) for name in ("sessions", "replies", "sticky", "seen", "cancelled",
                                                         "inflight", "responses")}


def _turn(client: TestClient, session: str, route: str = "/v1/chat/completions") -> None:
    body: dict[str, Any] = {"seed": 1}
    if route == "/v1/responses":
        body.update(input="3+4", max_output_tokens=2)
    else:
        body.update(messages=[{"role": "user", "content": "3+4"}], max_tokens=2)
    r = client.post(route, json=body, headers={"X-Session-Id": session})
    assert r.status_code == 200, r.text


def test_sessions_nobody_takes_are_forgotten_once_idle_and_the_records_stay_bounded() -> None:
    clock = Clock()
    server = build_server(WORKER, session_idle_timeout_s=600.0, clock=clock)
    client = TestClient(server.app())
    for wave in range(5):  # 5 waves of 20 abandoned sessions, 10 minutes apart
        for k in range(20):
            _turn(client, f"w{wave}-{k}", "/v1/responses" if k % 2 else "/v1/chat/completions")
        asyncio.run(server.abort_sessions([f"w{wave}-aborted"]))  # an abort for a session that never came back
        assert max(_records(server).values()) <= 21, _records(server)  # this wave only: the earlier ones went
        clock.now += 601.0
    kept = build_server(WORKER, session_idle_timeout_s=600.0, clock=clock)  # a taken session leaves nothing behind
    kept_client = TestClient(kept.app())
    _turn(kept_client, "taken")
    turns, aborted = asyncio.run(kept.take_session("taken"))
    assert len(turns) == 1 and not aborted and max(_records(kept).values()) == 0, _records(kept)
    _turn(client, "last")  # the sweep at this request forgets every earlier wave
    assert _records(server) == {"sessions": 1, "replies": 1, "sticky": 1, "seen": 1, "cancelled": 0, "inflight": 0,
                                "responses": 0}


def test_a_session_idle_but_still_generating_is_kept() -> None:
    clock = Clock()
    server = build_server(WORKER, session_idle_timeout_s=60.0, clock=clock)
    client = TestClient(server.app())
    _turn(client, "busy")
    server.inflight["busy"] = ["srv-x"]  # a request of it is generating (as _replies marks it)
    clock.now += 3600.0
    _turn(client, "other")
    assert "busy" in server.sessions and "busy" in server.seen
    server.inflight.pop("busy")
    clock.now += 61.0
    _turn(client, "other")
    assert "busy" not in server.sessions and set(server.seen) == {"other"}


def test_the_notes_on_aborted_requests_keep_the_newest() -> None:
    server = build_server(WORKER)
    for i in range(3 * MAX_ABORTED_NOTES):
        server._note_aborted([GenerationResult(f"r{i}", [1], [], [], "abort", [], 0, 0)])
    stats = asyncio.run(server.get_stats())
    assert len(stats["aborted"]) == MAX_ABORTED_NOTES
    assert stats["aborted"][-1]["request_id"] == f"r{3 * MAX_ABORTED_NOTES - 1}"
