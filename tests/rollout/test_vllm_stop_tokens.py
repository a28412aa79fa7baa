"""The one stop rule on vLLM's CPU build: run in .venv-vllm with ``pytest -m vllm``.

The model directory of ``stop_model.py`` (its ``generation_config.json`` lists two EOS ids, neither the tokenizer's;
its chat template ends a turn with ``<|im_end|>``) served by the torch engine and by vLLM: the same greedy
completions, stopping at the same tokens, with the same finish reasons and stop kinds.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/vllm-venv builds .venv-vllm, .ci/run runs it")

from screl.models import HFCausalLM  # noqa: E402
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, SamplingParams  # noqa: E402
from screl.rollout.engines.stop_tokens import StopTokens  # noqa: E402
from screl.rollout.engines.torch_engine import TorchGenerationEngine  # noqa: E402
from screl.rollout.engines.vllm_engine import VLLMGenerationEngine  # noqa: E402
from tests.rollout.stop_model import MAX_NEW, PROMPTS, StopModel, build_stop_model  # noqa: E402

pytestmark = [pytest.mark.vllm]
GREEDY = SamplingParams(max_new_tokens=MAX_NEW, temperature=0)


@pytest.fixture(scope="module")
def stop_model(tmp_path_factory: pytest.TempPathFactory) -> StopModel:
    return build_stop_model(tmp_path_factory.mktemp("stop-model"))


@pytest.fixture(scope="module")
def engines(stop_model: StopModel) -> Iterator[tuple[TorchGenerationEngine, VLLMGenerationEngine]]:
    policy = HFCausalLM(stop_model.path)
    vllm = VLLMGenerationEngine(policy, seed=1, num_threads=1)
    yield TorchGenerationEngine(policy), vllm
    vllm.shutdown()


def _run(engine: TorchGenerationEngine | VLLMGenerationEngine, sp: SamplingParams) -> list[GenerationResult]:
    return engine.generate([GenerationRequest(f"p{i}", list(p), sp) for i, p in enumerate(PROMPTS)])


def test_both_engines_hold_the_same_rule(engines: tuple[TorchGenerationEngine, VLLMGenerationEngine],
                                         stop_model: StopModel) -> None:
    torch_engine, vllm = engines
    expected = StopTokens((stop_model.eos,), tuple(sorted(stop_model.generation_config)), (stop_model.end_of_turn,))
    assert torch_engine.stop_tokens == vllm.stop_tokens == expected


def test_both_engines_stop_on_the_same_tokens_and_say_which(
        engines: tuple[TorchGenerationEngine, VLLMGenerationEngine], stop_model: StopModel) -> None:
    """Greedy completions: equal tokens, the stop token kept, finish reason, stop token and rule equal; the
    logprobs agree to fp32 summation order (as in test_vllm_engine.py)."""
    torch_engine, vllm = engines
    by_torch, by_vllm = _run(torch_engine, GREEDY), _run(vllm, GREEDY)
    for t, v, (pos, kind) in zip(by_torch, by_vllm, stop_model.expected, strict=True):
        assert v.token_ids == t.token_ids, (v.request_id, v.token_ids, t.token_ids)
        assert (v.finish_reason, v.stop_token_id, v.stop_kind) == (t.finish_reason, t.stop_token_id, t.stop_kind)
        assert (v.finish_reason, v.stop_kind, len(v.token_ids) - 1) == ("stop", kind, pos)
        assert v.stop_token_id == v.token_ids[-1]
        diff = (torch.tensor(v.logprobs, dtype=torch.float64) - torch.tensor(t.logprobs, dtype=torch.float64))
        assert diff.abs().max().item() < 1.5e-5, (v.request_id, diff)
    fired = {(v.stop_kind, v.stop_token_id) for v in by_vllm}
    assert fired >= {("eos", stop_model.eos), ("end_of_turn", stop_model.end_of_turn),
                     *(("generation_config", g) for g in stop_model.generation_config)}


def test_ignore_eos_runs_to_the_length_cap_on_both(
        engines: tuple[TorchGenerationEngine, VLLMGenerationEngine]) -> None:
    torch_engine, vllm = engines
    sp = SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True)
    for t, v in zip(_run(torch_engine, sp), _run(vllm, sp), strict=True):
        assert v.token_ids == t.token_ids and len(v.token_ids) == MAX_NEW
        assert v.finish_reason == t.finish_reason == "length" and v.stop_token_id is v.stop_kind is None


def test_vllm_stops_on_screls_ids_alone(engines: tuple[TorchGenerationEngine, VLLMGenerationEngine],
                                        stop_model: StopModel) -> None:
    """The model directory's generation_config.json lists both ids, but vLLM stops only on what screl passes: with
    one of them dropped from the engine's rule, the prompts that stopped at it run past it."""
    _, vllm = engines
    dropped, kept = stop_model.generation_config
    full = vllm.stop_tokens
    vllm.stop_tokens = StopTokens(full.eos, (kept,), full.end_of_turn)
    try:
        results = _run(vllm, GREEDY)
    finally:
        vllm.stop_tokens = full
    stopped_there = [i for i, (pos, _) in enumerate(stop_model.expected) if stop_model.greedy[i][pos] == dropped]
    assert stopped_there
    for i in stopped_there:
        pos, r = stop_model.expected[i][0], results[i]
        assert r.token_ids[:pos + 1] == list(stop_model.greedy[i][:pos + 1]) and len(r.token_ids) > pos + 1, i
        assert r.stop_token_id != dropped
