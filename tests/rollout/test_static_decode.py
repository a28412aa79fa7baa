"""The torch engine's static-cache decode path against Hugging Face's forward: the same logits and logprobs to
fp32 round-off, over left-padded prompts and many steps, for the Qwen2, Qwen3 and Llama layouts, after a refit too."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from screl.models import TinyCausalLM
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.static_decode import StaticDecoder, static_decode_support
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.engines.torch_model import DECODE_KEY

ATOL = 2e-5  # fp32 round-off of a different op order (fused RMSNorm, grouped-query attention without a copy)


def _llama() -> Any:
    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=50, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
                      attention_bias=False)
    return LlamaForCausalLM(cfg).eval()


def _qwen3() -> Any:
    """Qwen3's layout: a per-head RMSNorm on the queries and keys before the rotary embedding (random norm weights,
    so a path that skipped them would differ)."""
    torch.manual_seed(2)
    cfg = Qwen3Config(vocab_size=50, hidden_size=48, intermediate_size=96, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
            layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    return model


MODELS = {
    "qwen2_tiny": lambda: TinyCausalLM(scale="tiny").build_model().eval(),
    "qwen3_qk_norm": _qwen3,
    "qwen2_small": lambda: TinyCausalLM(scale="small").build_model().eval(),
    "llama_head_dim_16": _llama,
}


def _left_padded(lengths: list[int], vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    width = max(lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = torch.randint(3, vocab, (n,), generator=g)
        mask[i, width - n:] = 1
    return ids, mask


@pytest.mark.parity
@pytest.mark.parametrize("name", sorted(MODELS))
def test_static_logits_equal_hugging_face_over_padded_prompts_and_twelve_steps(name: str) -> None:
    model = MODELS[name]()
    vocab = model.config.vocab_size
    ids, mask = _left_padded([3, 7, 1, 5], vocab)
    dec = StaticDecoder(model)
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        ours = dec.start(ids, mask, ids.shape[1] + 12)
        pos = (mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=True, logits_to_keep=1)
        theirs, cache, nxt = out.logits[:, -1].float(), out.past_key_values, mask.sum(-1)
        for _ in range(12):
            torch.testing.assert_close(ours, theirs, atol=ATOL, rtol=0)
            torch.testing.assert_close(ours.log_softmax(-1), theirs.log_softmax(-1), atol=ATOL, rtol=0)
            tok = torch.randint(3, vocab, (ids.shape[0],), generator=g)
            ours = dec.step(tok)
            mask = torch.cat([mask, mask.new_ones(ids.shape[0], 1)], dim=1)
            out = model(input_ids=tok[:, None], attention_mask=mask, position_ids=nxt[:, None], past_key_values=cache,
                        use_cache=True)
            theirs, cache, nxt = out.logits[:, -1].float(), out.past_key_values, nxt + 1
        with pytest.raises(RuntimeError, match="the static KV cache is full"):
            dec.step(tok)


def _engine(decode: str, **kwargs: Any) -> TorchGenerationEngine:
    return TorchGenerationEngine(TinyCausalLM(scale="tiny"), num_threads=1, seed=0, decode=decode, **kwargs)


def _requests(prefix: str, n: int = 6, min_new: int = 0) -> list[GenerationRequest]:
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    return [GenerationRequest(f"{prefix}{i}", prompts[i % 4], SamplingParams(
        max_new_tokens=10 + i, min_new_tokens=min_new, seed=50 + i, temperature=0.9)) for i in range(n)]


@pytest.mark.parity
def test_the_engine_samples_the_same_tokens_and_logprobs_on_both_paths_and_after_a_refit() -> None:
    static, hf = _engine("static"), _engine("hf")
    assert (static.decode_path, hf.decode_path) == ("static", "hf")
    for version in (0, 1):
        if version:
            torch.manual_seed(7)
            new = {k: v + 0.05 * torch.randn_like(v) for k, v in static.model.state_dict().items()}
            static.update_weights(new, 1)
            hf.update_weights(new, 1)
        a, b = static.generate(_requests("a")), hf.generate(_requests("a"))
        for x, y in zip(a, b, strict=True):
            assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
            assert x.weight_versions == y.weight_versions == [version] * len(x.token_ids)
            torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0)


@pytest.mark.parity
def test_recomputing_the_cache_after_a_refit_matches_on_both_paths() -> None:
    """``recompute_kv_cache_after_weight_updates``: the batch is prefilled again under the new weights mid-way."""
    results = {}
    for decode in ("static", "hf"):
        engine = _engine(decode, recompute_kv_cache_after_weight_updates=True)
        torch.manual_seed(8)
        new = {k: v + 0.05 * torch.randn_like(v) for k, v in engine.model.state_dict().items()}
        sample = engine._sample_step

        def refit_at_step_4(rows: Any, batch: Any, logits: Any, version: int, engine: Any = engine,
                            sample: Any = sample, new: Any = new) -> None:
            sample(rows, batch, logits, version)
            if len(rows[0].tokens) == 4 and engine.version == 0:
                engine.update_weights(new, 1)

        engine._sample_step = refit_at_step_4  # type: ignore[method-assign]
        results[decode] = engine.generate(_requests("r", 4, min_new=8))
    for x, y in zip(results["static"], results["hf"], strict=True):
        assert x.token_ids == y.token_ids and x.weight_versions == y.weight_versions
        assert set(x.weight_versions) == {0, 1}
        torch.testing.assert_close(torch.tensor(x.logprobs), torch.tensor(y.logprobs), atol=ATOL, rtol=0)


def test_decode_setting_is_checked_and_an_unsupported_model_is_named() -> None:
    paths = r"\('auto', 'static', 'hf', 'continuous'\)"
    with pytest.raises(ValueError, match=rf"{DECODE_KEY}='fast': expected one of {paths}"):
        _engine("fast")
    model = Qwen2ForCausalLM(Qwen2Config(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, hidden_act="gelu"))
    assert static_decode_support(model) == "hidden_act 'gelu' (only silu)"
    with pytest.raises(ValueError, match="the static-cache decode path cannot run this model: hidden_act 'gelu'"):
        StaticDecoder(model)
    assert static_decode_support(torch.nn.Linear(2, 2)) == "model_type None is not one of ('qwen2', 'qwen3', 'llama')"
