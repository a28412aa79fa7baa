"""A session's request that names no seed samples with one derived from the run's seed, the session and the turn
(``screl.rollout.server.session_seed``): an agent run's tokens do not depend on the order its concurrent requests
reach the engine (the engine draws the seeds of seedless requests in arrival order)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from screl.rollout.server import session_seed
from tests.rollout.inprocess_server import build_server, build_worker


def _reply(client: TestClient, session: str | None, **extra: Any) -> str:
    body = {"messages": [{"role": "user", "content": "3+4"}], "max_tokens": 6, "temperature": 1.0, **extra}
    headers = {"X-Session-Id": session} if session is not None else {}
    r = client.post("/v1/chat/completions", json=body, headers=headers)
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["message"]["content"])


def test_session_seeds_depend_on_the_run_seed_the_session_and_the_turn_only() -> None:
    assert session_seed(0, "g3_a0", 0) == session_seed(0, "g3_a0", 0)
    seeds = {session_seed(b, s, t) for b in (0, 1) for s in ("g3_a0", "g3_a1") for t in (0, 1)}
    assert len(seeds) == 8 and all(0 <= x < 2**62 for x in seeds)


def test_a_seedless_session_request_samples_the_same_tokens_whatever_came_before_it() -> None:
    worker = build_worker()
    first = TestClient(build_server(worker, seed=7).app())
    for k in range(3):  # other sessions' and seedless requests consume the engine's own seed stream first
        _reply(first, f"other-{k}")
        _reply(first, None)
    a = _reply(first, "g5_a1")
    b = _reply(TestClient(build_server(worker, seed=7).app()), "g5_a1")  # a fresh server, nothing before it
    assert a == b
    replies = {_reply(TestClient(build_server(worker, seed=s).app()), "g5_a1") for s in range(8)}
    assert len(replies) > 1  # the run's seed changes what is sampled
