"""The policy server against careless and hostile clients (issue 51), over Ray and loopback with the official
``openai`` client: a poisoned request fails alone, the 100k-token prompt and the 20 MB message are refused before
any work while the requests around them are served, and an agent's failed request is its rollout's data failure.
Each limit's own test, in-process: ``tests/rollout/test_server_limits.py``."""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
import ray

from screl.envs.calculator import CalculatorTask
from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.workflows.agent import AgentWorkflow
from screl.rollout.workflows.workflow import RolloutItem
from tests.e2e._scripted import serve

pytestmark = [pytest.mark.usefixtures("ray_cluster")]

POLICY = TinyCausalLM(hidden_size=32, num_layers=1)
USER = [{"role": "user", "content": "3+4"}]


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, str, list[Any]]]:
    server, url, workers = serve(POLICY, backend="tests.e2e._scripted.PoisonedEngine")
    yield server, url, workers
    for actor in (server, *workers):
        ray.kill(actor)


def _client(url: str, **kwargs: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=60.0, **kwargs)


def _ordinary(url: str, k: int) -> str:
    reply = _client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": f"{k}+4"}],
                                                 max_tokens=3, seed=k)
    return reply.choices[0].finish_reason


@pytest.mark.parametrize(("poison", "status", "says"), [
    ("zzoom", 503, "the engine ran out of memory on it; retry later, or ask for fewer tokens (OutOfMemoryError: "
                   "poisoned request"),
    ("zzboom", 500, "the engine failed on it (RuntimeError: poisoned request"),
])
def test_a_poisoned_request_fails_alone_and_every_ordinary_one_around_it_succeeds(
        served: Any, poison: str, status: int, says: str) -> None:
    server, url, [worker] = served
    mixed = ray.get(worker.__ray_call__.remote(lambda w: type(w.engine).mixed))

    def poisoned() -> openai.APIStatusError:
        with pytest.raises(openai.APIStatusError, match="poisoned request") as err:
            _client(url).chat.completions.create(model="m", messages=[{"role": "user", "content": poison}],
                                                 max_tokens=3)
        return err.value

    with concurrent.futures.ThreadPoolExecutor(17) as pool:  # sent together: they share the engine's batches
        before = [pool.submit(_ordinary, url, k) for k in range(8)]
        bad = pool.submit(poisoned)
        after = [pool.submit(_ordinary, url, k) for k in range(8, 16)]
        finishes = [f.result() for f in before + after]
        err = bad.result()
    assert finishes and all(f in ("stop", "length") for f in finishes), finishes
    assert err.status_code == status and says in err.body["message"], err.body
    assert err.body["type"] == "server_error" and (status != 503 or err.response.headers["retry-after"] == "1")
    assert [_ordinary(url, k) in ("stop", "length") for k in range(20)] == [True] * 20  # the worker serves on
    shared = ray.get(worker.__ray_call__.remote(lambda w: type(w.engine).mixed)) - mixed
    print(f"the poisoned request shared {shared} failed batch(es) with ordinary ones")
    assert ray.get(server.get_stats.remote())["engine_errors"] >= 1


def test_the_100k_token_prompt_is_a_400_at_once_and_the_requests_after_it_succeed(served: Any) -> None:
    """Was: a 500 after about 20 s (the engine tried to hold it: on CPU an O(n^2) attention, the worker's process
    OOM-killed), then 8 of the next 200 requests failed with 500s while Ray restarted the worker."""
    _, url, _ = served
    t0 = time.monotonic()
    with pytest.raises(openai.BadRequestError, match=r"prompt: the prompt is 100000 tokens, longer than this "
                                                     r"server takes \(128 tokens: the model's context length\)"):
        _client(url).completions.create(model="m", prompt=[3] * 100_000, max_tokens=2)
    assert time.monotonic() - t0 < 5.0
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        finishes = list(pool.map(lambda k: _ordinary(url, k), range(64)))
    assert len(finishes) == 64 and set(finishes) <= {"stop", "length"}


def test_a_20mb_message_is_a_413_at_once_and_a_request_beside_it_is_not_held_up(served: Any) -> None:
    """Was: no answer within 60 s, and the request sent after it waited about 20 s for its own 400 (the message
    was tokenized on the event loop)."""
    _, url, _ = served
    big = {"model": "m", "messages": [{"role": "user", "content": "1" * (20 * 2**20)}], "max_tokens": 2}

    def send_big() -> tuple[int, dict[str, Any], float]:
        t0 = time.monotonic()
        r = httpx.post(f"{url}/chat/completions", json=big, timeout=60.0)
        return r.status_code, r.json()["error"], time.monotonic() - t0

    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        sent = pool.submit(send_big)
        t0 = time.monotonic()
        assert _ordinary(url, 1) in ("stop", "length")
        beside = time.monotonic() - t0
        status, error, took = sent.result()
    assert status == 413 and error["param"] == "body" and "generation.http_server.max_body_bytes" in error["message"]
    assert took < 20.0 and beside < 10.0, (took, beside)


def poisoned_agent(client: openai.OpenAI, prompt: Any, env: Any) -> float:
    """An agent whose first request poisons the engine (the official client raises on its 503)."""
    client.chat.completions.create(model="m", messages=[{"role": "user", "content": "zzoom"}], max_tokens=2)
    return 1.0


def test_under_training_a_poisoned_agent_request_is_its_rollouts_data_failure_and_its_sibling_seals(
        served: Any) -> None:
    server, url, _ = served
    task = CalculatorTask()
    prompt = task.prompts()[3]
    poisoned = AgentWorkflow(task, POLICY.build_tokenizer(), agent="tests.e2e.test_server_limits:poisoned_agent")
    fine = AgentWorkflow(task, POLICY.build_tokenizer(), agent="screl.envs.calculator:calculator_agent")
    for wf in (poisoned, fine):
        wf.attach_server(server, url, None)

    async def both() -> list[Any]:
        return list(await asyncio.gather(
            poisoned.run([RolloutItem("g3_g0_a1", prompt, (), SamplingParams(seed=1))], None),  # type: ignore[arg-type]
            fine.run([RolloutItem("g3_g1_a1", prompt, (), SamplingParams(seed=2))], None)))  # type: ignore[arg-type]

    [[bad], [good]] = asyncio.run(both())
    assert bad.status == "data_error" and "InternalServerError" in bad.detail and "out of memory" in bad.detail
    assert good.status == "sealed" and good.row is not None
    stats = ray.get(server.get_stats.remote())
    assert stats["sessions"] == 0  # both sessions taken: nothing of the failed one is left behind
