"""Prefix caching under in-flight refits on vLLM's CPU build: run in .venv-vllm with ``pytest -m vllm``.

The engine runs with its defaults (prefix caching on, the KV cache kept across refits) and salts each request with
its weight version at dispatch. vLLM's own counters say what was reused: each request's ``num_cached_tokens`` and
the ``vllm:prefix_cache_hits`` counter. The prompt is 200 tokens: one full KV block (128 tokens on the CPU build) is
cacheable.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/vllm-venv builds .venv-vllm, .ci/run runs it")

from screl.models import TinyCausalLM  # noqa: E402
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from screl.rollout.engines.vllm_engine import VLLMGenerationEngine, cache_salt  # noqa: E402

pytestmark = [pytest.mark.vllm]

POLICY = TinyCausalLM(hidden_size=128, num_heads=2, num_kv_heads=1, max_position_embeddings=512, seed=0)
PROMPT = [3 + (7 * i) % 40 for i in range(200)]
G = 4


@pytest.fixture(scope="module")
def engine() -> Iterator[VLLMGenerationEngine]:
    e = VLLMGenerationEngine(POLICY, seed=1, num_threads=1)
    yield e
    e.shutdown()


def _perturbed(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: v + 0.05 * torch.randn(v.shape, generator=g) for k, v in POLICY.build_model().state_dict().items()}


def _group(engine: VLLMGenerationEngine, tag: str) -> list[GenerationResult]:
    """A group of G siblings of one prompt (different seeds), dispatched together."""
    return engine.generate([GenerationRequest(f"{tag}-{i}", PROMPT, SamplingParams(max_new_tokens=8, seed=i))
                            for i in range(G)])


def _hits() -> int:
    from vllm.v1.metrics.reader import Counter, get_metrics_snapshot

    return sum(m.value for m in get_metrics_snapshot()
               if isinstance(m, Counter) and m.name == "vllm:prefix_cache_hits")


def _hits_reach(before: int, delta: int, timeout: float = 10.0) -> int:
    """The hits counter once it has grown by ``delta`` (stats arrive with the engine's outputs), or at timeout."""
    deadline = time.monotonic() + timeout
    while _hits() - before < delta and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.2)  # and no more than that
    return _hits() - before


def _block(engine: VLLMGenerationEngine) -> int:
    block: int = engine.llm.vllm_config.cache_config.block_size
    assert len(PROMPT) >= block, block
    return block


def test_the_defaults_cache_prefixes_and_keep_the_kv_cache_across_refits(engine: VLLMGenerationEngine) -> None:
    assert engine.prefix_caching and engine.llm.vllm_config.cache_config.enable_prefix_caching
    assert not engine.recompute_kv_cache  # the in-flight refit mode that had prefix caching off before


def test_siblings_share_the_prompts_kv(engine: VLLMGenerationEngine) -> None:
    """The first sibling computes the prompt; the others read its full block from the cache."""
    engine.update_weights(_perturbed(seed=1), 1)
    block, before = _block(engine), _hits()
    results = _group(engine, "sib")
    assert sorted(r.num_cached_tokens for r in results) == [0] + [block] * (G - 1)  # type: ignore[type-var]
    assert _hits_reach(before, (G - 1) * block) == (G - 1) * block


def test_after_a_refit_no_request_reads_an_old_versions_blocks(engine: VLLMGenerationEngine) -> None:
    """Version 2's first request computes the prompt again, though version 1's block is still cached (a request
    salted as version 1 still finds it); its siblings share version 2's block; and the completions equal a fresh
    engine's given version 2's weights."""
    engine.update_weights(_perturbed(seed=1), 1)
    _group(engine, "v1")  # version 1's block is cached
    new = _perturbed(seed=2)
    engine.update_weights(new, 2)
    block, before = _block(engine), _hits()
    results = _group(engine, "v2")
    assert sorted(r.num_cached_tokens for r in results) == [0] + [block] * (G - 1)  # type: ignore[type-var]
    assert _hits_reach(before, (G - 1) * block) == (G - 1) * block
    assert all(set(r.weight_versions) == {2} for r in results)
    assert engine._call(_cached_tokens(engine, cache_salt(1))) == block  # version 1's block was there to reuse

    fresh = VLLMGenerationEngine(POLICY, seed=1, num_threads=1)
    try:
        fresh.update_weights(new, 2)
        expected = _group(fresh, "fresh")
    finally:
        fresh.shutdown()
    for r, e in zip(results, expected, strict=True):
        assert r.token_ids == e.token_ids
        diff = (torch.tensor(r.logprobs, dtype=torch.float64) - torch.tensor(e.logprobs, dtype=torch.float64))
        assert diff.abs().max().item() < 1e-5, (r.request_id, diff)


async def _cached_tokens(engine: VLLMGenerationEngine, salt: str) -> Any:
    """vLLM's ``num_cached_tokens`` of a one-token request for PROMPT salted ``salt`` (straight to the AsyncLLM)."""
    from vllm import SamplingParams as VSamplingParams
    from vllm.inputs import TokensPrompt

    final = None
    async for out in engine.llm.generate(TokensPrompt(prompt_token_ids=PROMPT, cache_salt=salt),
                                         VSamplingParams(max_tokens=1, detokenize=False), f"probe-{salt}"):
        final = out
    assert final is not None
    return final.num_cached_tokens
