"""Jobs that ``test_hf_mapping.py`` runs in spawned gloo ranks (see ``_megatron_jobs.spawn``).

Each family is a tiny Hugging Face model built in memory from its own config class, with every weight drawn
at random (norm weights around 1), so that a wrongly mapped head width, query/key norm, bias or RoPE
frequency shows in the logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

VOCAB = 125  # padded to 128 by Megatron: the padding rows are exercised
SEQ = 32
BATCH = 2
WEIGHT_STD = 0.1
_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2,
)
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
    "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
}


def _qwen2() -> Any:
    from transformers import Qwen2Config

    return Qwen2Config(**_COMMON, max_position_embeddings=64, tie_word_embeddings=True)


def _qwen3() -> Any:
    from transformers import Qwen3Config

    # head_dim 32 != hidden / heads = 16: Megatron's default kv_channels would be wrong
    return Qwen3Config(**_COMMON, head_dim=32, max_position_embeddings=64, tie_word_embeddings=True)


def _llama3() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**_COMMON, max_position_embeddings=16384, tie_word_embeddings=True,
                       rope_parameters=dict(LLAMA3_ROPE))


def _qwen3_untied() -> Any:
    from transformers import Qwen3Config

    kw = dict(_COMMON, num_key_value_heads=4)  # plain multi-head attention, head_dim 8
    return Qwen3Config(**kw, head_dim=8, max_position_embeddings=64, tie_word_embeddings=False)


FAMILIES: dict[str, Callable[[], Any]] = {
    "qwen2": _qwen2, "qwen3": _qwen3, "llama3": _llama3, "qwen3_untied": _qwen3_untied,
}


def hf_model(family: str) -> Any:
    """The family's tiny model, every weight random (the same on every rank)."""
    from transformers import AutoModelForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(FAMILIES[family]()).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name else 0.0) + WEIGHT_STD * torch.randn(p.shape, generator=g))
    return model


def token_ids() -> Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(2))


def _full_logits(model: torch.nn.Module, ids: Tensor) -> Tensor:
    """Megatron's logits gathered over the vocabulary-parallel ranks, padding dropped."""
    from megatron.core import parallel_state

    local = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)
    tp = parallel_state.get_tensor_model_parallel_world_size()
    if tp > 1:
        parts = [torch.empty_like(local) for _ in range(tp)]
        dist.all_gather(parts, local.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
        local = torch.cat(parts, dim=-1)
    return local[..., :VOCAB]


def _grads(hf: Any, ids: Tensor, **recompute: Any) -> dict[str, Any]:
    """Full gradients (Hugging Face naming) of a fixed random projection of the logits, with ``recompute``,
    and how often the first layer's MLP and core attention ran forward (a recomputed module runs twice)."""
    from megatron.core import parallel_state
    from screl.strategies import GPTModelProvider, export_weights, load_hf_weights

    model = GPTModelProvider.from_hf_config(hf.config, **recompute)()
    load_hf_weights(model, hf.state_dict())
    model.train()  # recompute runs in training mode only
    layer = model.decoder.layers[0]
    calls = {"mlp": 0, "core_attention": 0}
    for name in calls:
        owner = layer.self_attention if name == "core_attention" else layer
        getattr(owner, name).register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
    local = model(ids, torch.arange(ids.shape[1]).expand_as(ids), None)  # this rank's vocabulary slice
    width, rank = local.shape[-1], parallel_state.get_tensor_model_parallel_rank()
    tp = parallel_state.get_tensor_model_parallel_world_size()
    probe = torch.randn(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(3))
    probe = torch.nn.functional.pad(probe, (0, width * tp - VOCAB))
    # the sum over every rank's slice: the output layer's backward all-reduces the hidden states' gradient
    (local * probe[..., rank * width : (rank + 1) * width]).sum().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.grad)
    return {"grads": export_weights(model), "forward_calls": calls}


def parity_job(rank: int, out: str) -> None:
    """At TP = world size: each family's logits against Hugging Face's, the export round trip and
    gradients with and without activation recompute."""
    from megatron.core import parallel_state
    from screl.strategies import GPTModelProvider, ParallelismConfig, export_weights, load_hf_weights
    from screl.strategies.parallel import initialize_model_parallel

    tp = dist.get_world_size()
    initialize_model_parallel(ParallelismConfig(tensor_model_parallel_size=tp), seed=0, cpu=True)
    assert parallel_state.get_tensor_model_parallel_world_size() == tp
    ids = token_ids()
    result: dict[str, Any] = {}
    for family in FAMILIES:
        hf = hf_model(family)
        with torch.no_grad():
            expected = hf(ids).logits
        model = GPTModelProvider.from_hf_config(hf.config)()
        load_hf_weights(model, hf.state_dict())
        with torch.no_grad():
            logits = _full_logits(model, ids)
        exported = export_weights(model)
        expected_state = hf.state_dict()
        if hf.config.tie_word_embeddings:
            expected_state.pop("lm_head.weight")
        plain = _grads(hf, ids)
        result[family] = {
            "logit_diff": float((logits - expected).abs().max()),
            "logit_scale": float(expected.abs().max()),
            "exported": exported,
            "expected_state": expected_state,
            "grads": plain,
            "grads_full": _grads(hf, ids, recompute_granularity="full", recompute_method="uniform",
                                 recompute_num_layers=1),
            "grads_selective": _grads(hf, ids, recompute_granularity="selective"),
        }
        if family == "llama3":  # the same model without Llama-3 RoPE scaling: must not match
            unscaled = GPTModelProvider.from_hf_config(hf.config, rope_scaling=False)()
            load_hf_weights(unscaled, hf.state_dict())
            with torch.no_grad():
                result[family]["unscaled_logit_diff"] = float((_full_logits(unscaled, ids) - expected).abs().max())
    torch.save(result, f"{out}.{rank}")
