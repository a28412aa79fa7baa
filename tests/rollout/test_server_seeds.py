"""A session's request that names no seed samples with one derived from the run's seed, the session and the turn
(``screl.rollout.server.server.session_seed``): an agent run's tokens do not depend on the order its concurrent requests
reach the engine (the engine draws the seeds of seedless requests in arrival order)."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from screl.rollout.server.server import session_seed
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


def test_a_rollouts_session_samples_by_its_siblings_seed_whatever_the_session_is_called() -> None:
    """The agent workflow opens each rollout's session with its sibling's seed: the session id names the run's group
    (a fresh prefix in every run), so deriving from it made the same config sample other tokens in every run (CI:
    an Agents SDK run that never learned). The turns sample as the multi-turn workflow's (turn_seed)."""
    import asyncio

    from screl.rollout.workflows.multiturn import turn_seed

    worker = build_worker()
    replies = []
    for session in ("1a2b3c4d-5_g1_a0", "9f8e7d6c-5_g1_a0"):  # two runs' names for the same sibling
        server = build_server(worker, seed=7)
        asyncio.run(server.open_session(session, 1234))
        client = TestClient(server.app())
        replies.append(_reply(client, session))
        assert server.session_seeds == {session: 1234}
        asyncio.run(server.take_session(session))
        assert server.session_seeds == {}  # forgotten with the session
    assert replies[0] == replies[1]
    explicit = _reply(TestClient(build_server(worker, seed=7).app()), None, seed=turn_seed(1234, 0))
    assert replies[0] == explicit  # turn 0 samples with turn_seed(sibling seed, 0)
    others = {_reply(TestClient(build_server(worker, seed=7).app()), "1a2b3c4d-5_g1_a0", seed=s) for s in range(8)}
    assert len(others) > 1  # the seed decides what is sampled
