"""A colocated torch engine whose spec's dtype (bf16) is below the trainer's fp32 masters decodes with a bf16 copy
of the module (``torch_model.DecodeCopy``), cast once per wake, not per decode step under autocast.

Tolerance against the autocast path (the masters under ``torch.autocast(bfloat16)``): the same tokens for these
seeds, and logprobs within 0.02. Both compute the matmuls in bf16 from the same bf16-rounded weights; they differ
where autocast keeps fp32 (the embedding output and the residual stream, RoPE tables, norms' weights), i.e. by
bf16 rounding of activations (relative 2^-9 per op, a few ops deep in two layers: ~1e-2 on a logprob at most)."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from screl.models import TinyCausalLM
from screl.rollout.colocated import EngineTurns
from screl.rollout.engines.protocol import GenerationRequest, SamplingParams
from screl.rollout.engines.static_decode import StaticDecoder
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.engines.torch_model import DecodeCopy

PROMPTS = [[5, 9, 17, 3], [7, 8, 1], [12, 4, 4, 4, 20]]
BF16_TOLERANCE = 0.02


def _requests(temperature: float) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", p, SamplingParams(max_new_tokens=12, min_new_tokens=12,
                                                         temperature=temperature, seed=10 + i))
            for i, p in enumerate(PROMPTS)]


def _engine(dtype: str, master: torch.nn.Module, decode: str = "auto") -> TorchGenerationEngine:
    return TorchGenerationEngine(TinyCausalLM(seed=0, dtype=dtype), num_threads=None, seed=0, model=master,
                                 autocast=torch.bfloat16, decode=decode,
                                 continuous={"max_rows": 4, "kv_cache_gb": 0.01})


def test_an_fp32_spec_decodes_the_masters_themselves() -> None:
    master = TinyCausalLM(seed=0).build_model().train()
    assert _engine("float32", master).model is master


def test_a_bf16_spec_decodes_a_bf16_copy_cast_once_with_the_autocast_paths_tokens() -> None:
    master = TinyCausalLM(seed=0).build_model().train()
    copied, autocast = _engine("bfloat16", master), _engine("float32", master)
    twin = copied.model.screl_decode_copy
    assert isinstance(twin, DecodeCopy) and copied.model is not master
    assert {p.dtype for p in copied.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in master.parameters()} == {torch.float32} and master.training  # masters untouched
    for temperature in (0.0, 1.0):
        a, b = copied.generate(_requests(temperature)), autocast.generate(_requests(temperature))
        assert [r.token_ids for r in a] == [r.token_ids for r in b]
        diff = max(abs(x - y) for ra, rb in zip(a, b, strict=True)
                   for x, y in zip(ra.logprobs, rb.logprobs, strict=True))
        assert diff <= BF16_TOLERANCE, diff
    assert sum(len(r.token_ids) for r in a) == 12 * len(PROMPTS)
    assert twin.checks >= 2 and twin.casts == 1  # checked at each prefill, cast once (at the build)


def _weight_casts(model: Any, weight_shapes: set[tuple[int, ...]]) -> int:
    """``aten::_to_copy`` calls on weight-shaped tensors in one decode step under bf16 autocast."""
    decoder = StaticDecoder(model)
    ids = torch.tensor([PROMPTS[0]])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        decoder.start(ids, torch.ones_like(ids), 8)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            decoder.step(torch.tensor([3]))
    return sum(1 for e in prof.events() if e.name == "aten::_to_copy" and tuple(e.input_shapes[0]) in weight_shapes)


def test_a_decode_step_on_the_copy_casts_no_weight() -> None:
    master = TinyCausalLM(seed=0).build_model()
    shapes = {tuple(p.shape) for p in master.parameters() if p.dim() == 2}
    layers = master.config.num_hidden_layers
    assert _weight_casts(master, shapes) >= 7 * layers  # the autocast path: q, k, v, o, gate, up, down every step
    assert _weight_casts(DecodeCopy(master, torch.bfloat16).module, shapes) == 0


@pytest.mark.parametrize("decode", ["static", "continuous"])
def test_the_copy_follows_the_masters_and_a_stand_down_frees_it(decode: str) -> None:
    master = TinyCausalLM(seed=0).build_model().train()
    engine = _engine("bfloat16", master, decode)
    twin = engine.model.screl_decode_copy
    with torch.no_grad():
        master.lm_head.weight.add_(0.5)  # an optimizer step, in place
    engine.generate(_requests(1.0))
    assert twin.casts == 2
    torch.testing.assert_close(engine.model.lm_head.weight, master.lm_head.weight.to(torch.bfloat16))
    worker = types.SimpleNamespace(engine=engine, in_flight_weight_updates=True,
                                   clock=types.SimpleNamespace(pause=lambda: None, resume=lambda: None))
    turns = EngineTurns(worker)
    turns.stand_down()
    assert all(p.numel() == 0 for p in engine.model.parameters())  # freed while the trainer trains
    turns.wake()
    with torch.no_grad():
        master.lm_head.weight.mul_(-1.0)  # the trainer's step while the engine stood down
    out = engine.generate(_requests(0.0))
    assert twin.casts == 3 and all(p.numel() > 0 for p in engine.model.parameters())
    assert all(len(r.token_ids) == 12 for r in out)
    fresh = _engine("bfloat16", master, decode)  # an engine built on the trained masters: the same greedy tokens
    assert [r.token_ids for r in out] == [r.token_ids for r in fresh.generate(_requests(0.0))]
