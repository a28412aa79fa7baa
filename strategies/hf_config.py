"""Which Hugging Face model configs map onto a Megatron ``GPTModel``, and how (fail closed).

:func:`provider_kwargs` turns a ``Qwen2Config``, ``Qwen3Config`` or ``LlamaConfig`` (transformers 5.x) into
:class:`~screl.strategies.GPTModelProvider` keyword arguments. Every field of the config is either

- known not to change the network (:data:`HARMLESS`: token ids, init range, bookkeeping),
- mapped or checked here (:data:`MAPPED`), or
- refused: a ``ValueError`` names each such field, its value and the fix.

So a config never maps silently onto a different network: an unknown field, another RoPE type, sliding-window
layers, experts, another activation or biases Megatron cannot place all stop the run at setup.

RoPE: megatron-core 0.16.1 applies Llama-3 scaling (``GPTModel(rope_scaling=True, rope_scaling_factor=...)``)
with ``low_freq_factor=1``, ``high_freq_factor=4`` and ``original_max_position_embeddings=8192`` hard-coded
(``RotaryEmbedding._apply_scaling``), so a ``llama3`` config with other values is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["FAMILIES", "HARMLESS", "LLAMA3_FIXED", "MAPPED", "provider_kwargs"]


@dataclass(frozen=True)
class Family:
    """What a supported ``model_type`` fixes about the network beyond its config's sizes."""

    qkv_bias: bool
    """The query/key/value projections always have a bias (Qwen2); else ``attention_bias`` decides (and must
    be false: it also puts a bias on the output projection)."""
    qk_layernorm: bool
    """RMSNorm over each query and key head before RoPE (Qwen3's ``q_norm``/``k_norm``)."""


FAMILIES: dict[str, Family] = {
    "qwen2": Family(qkv_bias=True, qk_layernorm=False),
    "qwen3": Family(qkv_bias=False, qk_layernorm=True),
    "llama": Family(qkv_bias=False, qk_layernorm=False),
}
"""The ``model_type`` values that map (Qwen2/Qwen2.5, Qwen3 dense, Llama 2/3.x)."""

HARMLESS = frozenset({
    "_name_or_path", "_model_name_or_path", "architectures", "bos_token_id", "eos_token_id", "pad_token_id",
    "unk_token_id", "sep_token_id", "cls_token_id", "mask_token_id", "chunk_size_feed_forward",
    "dtype", "torch_dtype", "id2label", "label2id", "initializer_range", "output_attentions",
    "output_hidden_states", "problem_type", "return_dict", "transformers_version", "use_cache", "tokenizer_class",
    "pretraining_tp",  # transformers 5.x's Llama ignores it
    "sliding_window", "max_window_layers",  # act only through layer_types, which is checked
})
"""Config fields that do not change the network's function."""

MAPPED = frozenset({
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
    "attention_dropout", "rope_parameters", "rope_scaling", "rope_theta", "hidden_act", "attention_bias",
    "mlp_bias", "use_sliding_window", "layer_types", "is_encoder_decoder", "partial_rotary_factor",
})
"""Config fields that :func:`provider_kwargs` maps or checks."""

MOE_FIELDS = frozenset({
    "num_experts", "num_local_experts", "n_routed_experts", "n_shared_experts", "num_experts_per_tok",
    "moe_intermediate_size", "shared_expert_intermediate_size", "decoder_sparse_step", "mlp_only_layers",
    "router_aux_loss_coef", "output_router_logits", "norm_topk_prob", "first_k_dense_replace", "moe_layer_freq",
})
"""Mixture-of-experts fields (named as such in the refusal)."""

LLAMA3_FIXED: dict[str, float] = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192.0,
}
"""The Llama-3 RoPE scaling parameters megatron-core 0.16.1 hard-codes; the config must have exactly these."""

_ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "llama3": {"rope_type", "rope_theta", "factor", *LLAMA3_FIXED},
}
_NO_MEGATRON = "train this model without MegatronStrategy (trainer.strategy: screl.strategies.DDPStrategy or auto)"
_FAMILY_LIST = ", ".join(sorted(FAMILIES))


def _rope_parameters(cfg: Any) -> dict[str, Any]:
    """RoPE parameters (transformers 5.x ``rope_parameters``; the legacy ``rope_scaling``/``rope_theta``)."""
    rope = getattr(cfg, "rope_parameters", None)
    if not rope:
        rope = dict(getattr(cfg, "rope_scaling", None) or {})
        rope.setdefault("rope_theta", getattr(cfg, "rope_theta", 10000.0))
    rope = dict(rope)
    if "type" in rope and "rope_type" not in rope:  # the oldest spelling
        rope["rope_type"] = rope.pop("type")
    rope.setdefault("rope_type", "default")
    return rope


def _rope_kwargs(cfg: Any, bad: list[str]) -> dict[str, Any]:
    rope = _rope_parameters(cfg)
    if any(isinstance(v, Mapping) for v in rope.values()):
        bad.append(f"rope_parameters={rope!r}: RoPE per layer type; Megatron's GPTModel has one RoPE for every "
                   f"layer. Fix: {_NO_MEGATRON}")
        return {}
    kind = rope["rope_type"]
    if kind not in _ROPE_KEYS:
        bad.append(f"rope_parameters['rope_type']={kind!r}: megatron-core maps only 'default' and 'llama3' RoPE. "
                   f"Fix: {_NO_MEGATRON}")
        return {}
    partial = rope.pop("partial_rotary_factor", 1.0)
    if partial is not None and float(partial) != 1.0:
        bad.append(f"rope_parameters['partial_rotary_factor']={partial!r}: RoPE on part of each head is not "
                   f"mapped. Fix: {_NO_MEGATRON}")
    for key in sorted(set(rope) - _ROPE_KEYS[kind]):
        bad.append(f"rope_parameters[{key!r}]={rope[key]!r}: not part of {kind!r} RoPE as Megatron builds it. "
                   f"Fix: {_NO_MEGATRON}")
    theta = float(rope.get("rope_theta", 10000.0))
    if not theta.is_integer():
        bad.append(f"rope_parameters['rope_theta']={theta!r}: Megatron's rotary_base is an integer. "
                   f"Fix: {_NO_MEGATRON}")
    out: dict[str, Any] = {"rotary_base": int(theta), "rope_scaling": False}
    if kind == "llama3":
        given = dict(rope)
        given.setdefault("original_max_position_embeddings", cfg.max_position_embeddings)  # transformers' fallback
        for key, fixed in LLAMA3_FIXED.items():
            if float(given[key]) != fixed:
                bad.append(f"rope_parameters[{key!r}]={given[key]!r}: megatron-core 0.16.1 hard-codes {key}="
                           f"{fixed:g} for Llama-3 RoPE scaling, so this model would get other frequencies. "
                           f"Fix: {_NO_MEGATRON}")
        if "factor" not in rope:
            bad.append("rope_parameters['factor'] is missing: Llama-3 RoPE scaling needs it. Fix: set it as the "
                       "model was trained")
        else:
            out.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    return out


def _structure_problems(cfg: Any, fields: Mapping[str, Any], family: Family, bad: list[str]) -> None:
    """Refuse the checked fields whose value changes the network in a way Megatron's ``GPTModel`` cannot."""
    if fields.get("hidden_act", "silu") != "silu":
        bad.append(f"hidden_act={fields['hidden_act']!r}: GPTModelProvider maps only the SwiGLU MLP (silu). "
                   f"Fix: {_NO_MEGATRON}")
    if fields.get("is_encoder_decoder"):
        bad.append(f"is_encoder_decoder=True: GPTModel is decoder-only. Fix: {_NO_MEGATRON}")
    if fields.get("attention_bias") and not family.qkv_bias:
        bad.append("attention_bias=True: biases on q/k/v and o_proj; Megatron's add_qkv_bias covers q/k/v only. "
                   f"Fix: {_NO_MEGATRON}")
    if fields.get("mlp_bias"):
        bad.append(f"mlp_bias=True: biases on the MLP projections are not mapped. Fix: {_NO_MEGATRON}")
    factor = fields.get("partial_rotary_factor", 1.0)  # transformers 5.x moves it into rope_parameters
    if factor is not None and float(factor) != 1.0 and "partial_rotary_factor" not in _rope_parameters(cfg):
        bad.append(f"partial_rotary_factor={factor!r}: RoPE on part of each head is not mapped. Fix: {_NO_MEGATRON}")
    layer_types = list(fields.get("layer_types") or [])
    windowed = [i for i, t in enumerate(layer_types) if t != "full_attention"]
    if windowed or (fields.get("use_sliding_window") and not layer_types):
        bad.append(f"layer_types={layer_types!r} (use_sliding_window={fields.get('use_sliding_window')!r}, "
                   f"sliding_window={fields.get('sliding_window')!r}, max_window_layers="
                   f"{fields.get('max_window_layers')!r}): layers {windowed or 'all'} use sliding-window attention, "
                   "which GPTModelProvider does not map. Fix: set use_sliding_window=False if the model was trained "
                   f"with full attention, else {_NO_MEGATRON}")
    heads, groups = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    if heads % groups:
        bad.append(f"num_key_value_heads={groups}: must divide num_attention_heads={heads}. Fix: correct the config")
    if not getattr(cfg, "head_dim", None) and cfg.hidden_size % heads:
        bad.append(f"hidden_size={cfg.hidden_size}: not a multiple of num_attention_heads={heads} and no head_dim "
                   "given. Fix: set head_dim")


def provider_kwargs(cfg: Any) -> dict[str, Any]:
    """``GPTModelProvider`` keyword arguments for a Hugging Face Qwen2/Qwen3/Llama config.

    Raises:
        ValueError: the config has fields that change the network and are not mapped (all named at once,
            each with its value and the fix).
    """
    fields: dict[str, Any] = cfg.to_dict()
    model_type = fields.get("model_type")
    family = FAMILIES.get(model_type)  # type: ignore[arg-type]
    if family is None:
        raise ValueError(
            f"GPTModelProvider.from_hf_config: model_type={model_type!r} is not a family screl maps onto Megatron "
            f"(supported: {_FAMILY_LIST}; docs/megatron.md, 'Model families'). Fix: {_NO_MEGATRON}."
        )
    bad: list[str] = []
    for name in sorted(set(fields) - HARMLESS - MAPPED):
        if name in MOE_FIELDS:
            bad.append(f"{name}={fields[name]!r}: a mixture-of-experts field; experts are not mapped. "
                       f"Fix: {_NO_MEGATRON}")
        else:
            bad.append(f"{name}={fields[name]!r}: a field screl does not know, so it may change the network. "
                       f"Fix: delete it from the config only if it does not change the network, else {_NO_MEGATRON}")
    _structure_problems(cfg, fields, family, bad)
    rope = _rope_kwargs(cfg, bad)
    if bad:
        lines = "\n".join(f"  - {b}" for b in bad)
        raise ValueError(
            f"GPTModelProvider.from_hf_config: this {model_type} config does not map onto a Megatron GPTModel "
            f"(screl refuses rather than build a different network; docs/megatron.md, 'Model families'):\n{lines}"
        )
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.hidden_size,
        ffn_hidden_size=cfg.intermediate_size,
        num_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=getattr(cfg, "num_key_value_heads", None),
        kv_channels=int(head_dim),
        max_sequence_length=cfg.max_position_embeddings,
        layernorm_epsilon=cfg.rms_norm_eps,
        add_qkv_bias=family.qkv_bias,
        qk_layernorm=family.qk_layernorm,
        attention_dropout=float(getattr(cfg, "attention_dropout", 0.0) or 0.0),
        share_embeddings_and_output_weights=bool(cfg.tie_word_embeddings),
        **rope,
    )
