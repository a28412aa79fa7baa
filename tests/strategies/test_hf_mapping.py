"""Hugging Face configs onto Megatron's ``GPTModel``: the families that map give Hugging Face's logits, the rest
are refused naming the field.

Parity: a tiny Qwen2, Qwen3 (head_dim != hidden / heads, q/k norms), Llama-3.x (llama3 RoPE scaling) and an
untied-embedding Qwen3, each built in memory from its transformers config with random weights, give the
same fp32 logits in Megatron as in Hugging Face at TP=1 and at TP=2 (2 gloo ranks on loopback, file://
rendezvous); ``export_weights`` gives back the Hugging Face names and values; activation recompute leaves
the gradients unchanged.
"""

from __future__ import annotations

from typing import Any

import _hf_mapping_jobs as hfjobs
import _megatron_jobs as jobs
import pytest
import torch
from screl.strategies import GPTModelProvider
from torch import Tensor

LOGIT_ATOL = 1e-5
GRAD_ATOL = 1e-6


@pytest.fixture(scope="module", params=[1, 2], ids=["tp1", "tp2"])
def parity(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    world = int(request.param)
    out = jobs.spawn(hfjobs.parity_job, world, str(tmp_path_factory.mktemp(f"hf_parity_tp{world}")))
    results = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(world)]
    return {"world": world, "ranks": results}


def _max_diff(actual: dict[str, Tensor], expected: dict[str, Tensor]) -> float:
    assert set(actual) == set(expected)
    return max(float((actual[k] - expected[k]).abs().max()) for k in expected)


@pytest.mark.parity
@pytest.mark.parametrize("family", list(hfjobs.FAMILIES))
def test_megatron_logits_equal_hugging_face(parity: dict[str, Any], family: str) -> None:
    for rank in parity["ranks"]:
        got = rank[family]
        assert got["logit_scale"] > 1.0  # the random weights give logits far from zero
        assert got["logit_diff"] <= LOGIT_ATOL, f"{family} at TP={parity['world']}: {got['logit_diff']:.3g}"


def test_llama3_rope_scaling_changes_the_logits(parity: dict[str, Any]) -> None:
    """Without the scaling the same weights give other logits, so the parity above is a test of the scaling."""
    for rank in parity["ranks"]:
        assert rank["llama3"]["unscaled_logit_diff"] > 1000 * LOGIT_ATOL


@pytest.mark.parametrize("family", list(hfjobs.FAMILIES))
def test_export_gives_back_the_hugging_face_state(parity: dict[str, Any], family: str) -> None:
    for rank in parity["ranks"]:
        got = rank[family]
        if family.startswith("qwen3"):
            assert "model.layers.1.self_attn.q_norm.weight" in got["exported"]
        # exact: loaded from these very tensors and exported with no step between: copies and reshapes only
        assert _max_diff(got["exported"], got["expected_state"]) == 0.0


RECOMPUTED = {"full": {"mlp": 2, "core_attention": 2}, "selective": {"mlp": 1, "core_attention": 2}}
"""Forward calls of the first layer's modules in one forward-backward: a recomputed one runs twice."""


@pytest.mark.parity
@pytest.mark.parametrize("family", list(hfjobs.FAMILIES))
@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_leaves_gradients_unchanged(
    parity: dict[str, Any], family: str, granularity: str
) -> None:
    for rank in parity["ranks"]:
        plain, recomputed = rank[family]["grads"], rank[family][f"grads_{granularity}"]
        assert plain["forward_calls"] == {"mlp": 1, "core_attention": 1}
        assert recomputed["forward_calls"] == RECOMPUTED[granularity]
        assert min(float(g.abs().max()) for g in plain["grads"].values()) > 0.0  # every weight gets a gradient
        assert _max_diff(recomputed["grads"], plain["grads"]) <= GRAD_ATOL


# ------------------------------------------------------------------------- configs, no model built
SMALL = dict(vocab_size=125, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)

# Released checkpoints' config.json (their architecture fields as published), loaded by transformers 5.x.
QWEN25_05B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643,
    "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 896, "initializer_range": 0.02,
    "intermediate_size": 4864, "max_position_embeddings": 32768, "max_window_layers": 21, "model_type": "qwen2",
    "num_attention_heads": 14, "num_hidden_layers": 24, "num_key_value_heads": 2, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "sliding_window": 32768, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.43.1", "use_cache": True, "use_sliding_window": False, "vocab_size": 151936,
}
QWEN3_06B = {
    "architectures": ["Qwen3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024,
    "initializer_range": 0.02, "intermediate_size": 3072, "max_position_embeddings": 40960, "max_window_layers": 28,
    "model_type": "qwen3", "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "bfloat16", "transformers_version": "4.51.0", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}
LLAMA32_1B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 128000, "eos_token_id": 128001, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2048,
    "initializer_range": 0.02, "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": False,
    "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16, "num_key_value_heads": 8,
    "pretraining_tp": 1, "rms_norm_eps": 1e-05,
    "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                     "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": True, "torch_dtype": "bfloat16",
    "transformers_version": "4.45.0.dev0", "use_cache": True, "vocab_size": 128256,
}

SMOLLM2_135M = {  # what transformers 5.24 reads from the GGUF that screl.models.SmolLM2 converts
    "vocab_size": 49152, "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_act": "silu", "max_position_embeddings": 8192,
    "initializer_range": 0.02, "rms_norm_eps": 1e-05, "use_cache": True, "pad_token_id": 2, "bos_token_id": 1,
    "eos_token_id": 2, "pretraining_tp": 1, "tie_word_embeddings": True,
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}, "attention_bias": False,
    "attention_dropout": 0.0, "mlp_bias": False, "head_dim": 64, "model_type": "llama",
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2", "unk_token_id": 0,
}


def _config(family: str, **fields: Any) -> Any:
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{**SMALL, **fields})


@pytest.mark.parametrize(
    ("published", "expected"),
    [
        (QWEN25_05B, dict(kv_channels=64, add_qkv_bias=True, qk_layernorm=False, rotary_base=1000000,
                          rope_scaling=False, share_embeddings_and_output_weights=True, num_query_groups=2)),
        (QWEN3_06B, dict(kv_channels=128, add_qkv_bias=False, qk_layernorm=True, rotary_base=1000000,
                         rope_scaling=False, share_embeddings_and_output_weights=True, num_query_groups=8)),
        (LLAMA32_1B, dict(kv_channels=64, add_qkv_bias=False, qk_layernorm=False, rotary_base=500000,
                          rope_scaling=True, rope_scaling_factor=32.0, layernorm_epsilon=1e-5,
                          share_embeddings_and_output_weights=True, num_query_groups=8)),
        (SMOLLM2_135M, dict(kv_channels=64, add_qkv_bias=False, qk_layernorm=False, rotary_base=100000,
                            rope_scaling=False, share_embeddings_and_output_weights=True, num_query_groups=3)),
    ],
    ids=["qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b", "smollm2-135m"],
)
def test_released_configs_map(published: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every field of these released configs is mapped or known harmless: nothing is refused."""
    from transformers import AutoConfig

    fields = dict(published)
    provider = GPTModelProvider.from_hf_config(AutoConfig.for_model(fields.pop("model_type"), **fields))
    assert {k: getattr(provider, k) for k in expected} == expected
    assert provider.hidden_size == published["hidden_size"]
    assert provider.ffn_hidden_size == published["intermediate_size"]


REFUSED: list[tuple[str, str, dict[str, Any], str]] = [
    ("unsupported_model_type", "qwen3_moe", {}, r"model_type='qwen3_moe' is not a family screl maps"),
    ("mistral", "mistral", {}, r"model_type='mistral' is not a family"),
    ("experts", "qwen3", {"num_experts": 8}, r"num_experts=8: a mixture-of-experts field"),
    ("yarn", "llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                           "original_max_position_embeddings": 16}},
     r"rope_parameters\['rope_type'\]='yarn': megatron-core maps only 'default' and 'llama3'"),
    ("linear", "llama", {"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}},
     r"rope_parameters\['rope_type'\]='linear'"),
    ("dynamic", "qwen2", {"rope_parameters": {"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0}},
     r"rope_parameters\['rope_type'\]='dynamic'"),
    ("llama3_low_freq", "llama", {"max_position_embeddings": 16384, "rope_parameters": {
        **hfjobs.LLAMA3_ROPE, "low_freq_factor": 2.0}},
     r"rope_parameters\['low_freq_factor'\]=2.0: megatron-core 0.16.1 hard-codes low_freq_factor=1"),
    ("llama3_high_freq", "llama", {"max_position_embeddings": 16384, "rope_parameters": {
        **hfjobs.LLAMA3_ROPE, "high_freq_factor": 8.0}},
     r"rope_parameters\['high_freq_factor'\]=8.0: .* hard-codes high_freq_factor=4"),
    ("llama3_original_context", "llama", {"max_position_embeddings": 16384, "rope_parameters": {
        **hfjobs.LLAMA3_ROPE, "original_max_position_embeddings": 4096}},
     r"rope_parameters\['original_max_position_embeddings'\]=4096: .* hard-codes "
     r"original_max_position_embeddings=8192"),
    ("sliding_window", "qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1},
     r"layer_types=\['full_attention', 'sliding_attention'\] \(use_sliding_window=True, sliding_window=16, "
     r"max_window_layers=1\): layers \[1\] use sliding-window attention"),
    ("gelu", "qwen2", {"hidden_act": "gelu"}, r"hidden_act='gelu': GPTModelProvider maps only the SwiGLU MLP"),
    ("attention_bias", "llama", {"attention_bias": True}, r"attention_bias=True: biases on q/k/v and o_proj"),
    ("qwen3_attention_bias", "qwen3", {"attention_bias": True}, r"attention_bias=True"),
    ("mlp_bias", "llama", {"mlp_bias": True}, r"mlp_bias=True: biases on the MLP projections"),
    ("partial_rotary", "llama", {"partial_rotary_factor": 0.5},
     r"partial_rotary_factor'\]=0.5: RoPE on part of each head is not mapped"),
    ("unknown_field", "qwen2", {"foo_bar": 3}, r"foo_bar=3: a field screl does not know"),
    ("fractional_theta", "qwen2", {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.5}},
     r"rope_parameters\['rope_theta'\]=10000.5: Megatron's rotary_base is an integer"),
]


@pytest.mark.parametrize(("case", "family", "fields", "match"), REFUSED, ids=[r[0] for r in REFUSED])
def test_unmapped_fields_are_refused_naming_them(case: str, family: str, fields: dict[str, Any], match: str) -> None:
    config = _config(family, **fields)
    with pytest.raises(ValueError, match=match) as err:
        GPTModelProvider.from_hf_config(config)
    assert "Fix: " in str(err.value)


def test_every_refusal_is_reported_at_once() -> None:
    config = _config("llama", hidden_act="relu", mlp_bias=True, foo_bar=1)
    with pytest.raises(ValueError, match=r"(?s)foo_bar=1.*hidden_act='relu'.*mlp_bias=True"):
        GPTModelProvider.from_hf_config(config)


def test_full_attention_qwen2_with_a_window_size_still_maps() -> None:
    """``sliding_window`` alone (use_sliding_window=False) leaves every layer on full attention."""
    provider = GPTModelProvider.from_hf_config(_config("qwen2", use_sliding_window=False, sliding_window=16))
    assert provider.add_qkv_bias and not provider.qk_layernorm


RECOMPUTE_REFUSED = [
    (dict(recompute_granularity="full"), r"'full' recompute needs recompute_method"),
    (dict(recompute_granularity="full", recompute_method="uniform"), r"recompute_num_layers >= 1"),
    (dict(recompute_granularity="selective", recompute_num_layers=1), r"'selective' recompute needs "
                                                                       r"recompute_num_layers unset"),
    (dict(recompute_method="block", recompute_num_layers=1), r"need recompute_granularity='full'"),
    (dict(recompute_granularity="everything"), r"recompute_granularity must be None, 'full' or 'selective'"),
]


@pytest.mark.parametrize(("fields", "match"), RECOMPUTE_REFUSED)
def test_recompute_settings_megatron_rejects_fail_at_construction(fields: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        GPTModelProvider(**fields)
