"""An exported folder on vLLM's CPU build (run in .venv-vllm with ``pytest -m vllm``): vLLM loads it as it is, and
its greedy tokens equal the torch engine's on the same folder (whose logits equal the trainer's:
test_export_e2e.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed here: .ci/vllm-venv builds .venv-vllm, .ci/run runs it")

from screl.export import write_hf_folder  # noqa: E402
from screl.export.record import spec_to_dict  # noqa: E402
from screl.models import HFCausalLM, TinyCausalLM  # noqa: E402
from screl.models.tokenizer import char_vocab  # noqa: E402
from screl.rollout.engines.protocol import GenerationRequest, SamplingParams  # noqa: E402
from screl.rollout.engines.torch_engine import TorchGenerationEngine  # noqa: E402
from screl.rollout.engines.vllm_engine import VLLMGenerationEngine  # noqa: E402

pytestmark = [pytest.mark.vllm]
PROMPTS = ["count the a in banana", "abc", "the cat sat"]


def test_vllm_loads_an_exported_folder_and_decodes_as_the_torch_engine(tmp_path: Path) -> None:
    spec = TinyCausalLM(hidden_size=128, num_heads=2, num_kv_heads=1)  # head_dim 64, as vLLM's CPU attention needs
    model = spec.build_model()
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder = write_hf_folder({"policy": spec_to_dict(spec), "generation": {"temperature": 1.0}}, model.state_dict(),
                             str(tmp_path / "export"), dtype="fp32")
    vocab = char_vocab()
    greedy = SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    requests = [GenerationRequest(f"p{i}", [vocab[c] for c in text], greedy) for i, text in enumerate(PROMPTS)]
    policy = HFCausalLM(folder)
    by_torch = TorchGenerationEngine(policy).generate(requests)
    vllm = VLLMGenerationEngine(policy, seed=1, num_threads=1)
    try:
        by_vllm = vllm.generate(requests)
    finally:
        vllm.shutdown()
    assert [r.token_ids for r in by_vllm] == [r.token_ids for r in by_torch]
    assert all(len(r.token_ids) == 12 for r in by_torch)
    assert len({tuple(r.token_ids) for r in by_torch}) > 1  # the prompts lead somewhere different
