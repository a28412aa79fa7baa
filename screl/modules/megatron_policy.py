"""The policy under ``MegatronStrategy``: next-token logprobs of a Megatron ``GPTModel`` (vocabulary-parallel
under tensor parallelism) and the provider that builds the policy's architecture. ``GRPO`` and the pipelined
schedule (:mod:`screl.modules.pipelined`) use them."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor


def megatron_token_logprobs(
    strategy: Any, model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float
) -> Tensor:
    """:func:`screl.modules.grpo.token_logprobs` for a Megatron ``GPTModel`` under ``MegatronStrategy``: ``[rows, len - 1]``.

    Rows must be right-padded (as ``collate_chunk`` makes them): under the causal mask no real token
    attends to padding, and positions count from 0 as in the Hugging Face model, so the real tokens'
    logprobs equal the unpadded ones. Padded positions hold garbage that the token mask drops.
    """
    require_right_padding(attention_mask)
    position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
    return megatron_logprobs_of(strategy, model(input_ids, position_ids, None), input_ids, temperature)


def require_right_padding(attention_mask: Tensor) -> None:
    """Megatron's positions count from 0 on every row: refuse a row with padding before a real token."""
    mask = attention_mask.bool()
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError(
            "GRPO under MegatronStrategy needs right-padded rows (attention_mask 1...1 0...0); "
            "got a row with padding before a real token"
        )


def megatron_logprobs_of(strategy: Any, logits: Tensor, input_ids: Tensor, temperature: float) -> Tensor:
    """The next-token logprobs ``[rows, len - 1]`` of a ``GPTModel``'s logits (vocabulary-parallel under TP)."""
    logits = logits[:, :-1]
    if temperature != 1.0:
        logits = logits.float() / temperature
    return strategy.token_logprobs(logits, input_ids[:, 1:])  # type: ignore[no-any-return]


#: ``GPTModelProvider`` fields that ``from_hf_config`` derives from the policy's architecture.
ARCH_FIELDS = (
    "vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads", "num_query_groups",
    "kv_channels", "qk_layernorm", "max_sequence_length", "layernorm_epsilon", "add_qkv_bias", "rotary_base",
    "rope_scaling", "rope_scaling_factor", "attention_dropout", "share_embeddings_and_output_weights",
)

#: ``activation_checkpointing`` values and the ``GPTModelProvider`` recompute fields each sets.
RECOMPUTE: dict[str, dict[str, Any]] = {
    "full": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1},
    "selective": {"recompute_granularity": "selective", "recompute_method": None, "recompute_num_layers": None},
}


def check_policy_layout(strategy: Any) -> None:
    """The policy under ``MegatronStrategy`` needs whole sequences on every rank: refuse context parallelism."""
    parallelism = getattr(strategy, "parallelism", None)
    cp = int(getattr(parallelism, "context_parallel_size", 1) or 1)
    if cp > 1:
        raise ValueError(
            f"trainer.strategy.init_args.parallelism.context_parallel_size={cp}: GRPO under MegatronStrategy does "
            "not support context parallelism (every rank computes the policy's logprobs over whole sequences). "
            "Fix: set context_parallel_size: 1 and use tensor or pipeline parallelism instead."
        )


def fit_provider_to_policy(
    strategy: Any, hf_model: torch.nn.Module, recompute_granularity: str | bool | None = None
) -> None:
    """Make the strategy build the policy's architecture: derive its provider from the Hugging Face config
    when none was given; check an explicit ``GPTModelProvider`` against it.

    Raises ``ValueError`` when the layout is refused (:func:`check_policy_layout`), when the policy's config
    does not map onto Megatron (``GPTModelProvider.from_hf_config`` names the field) or when an explicit
    provider's architecture differs from the policy's.

    Args:
        recompute_granularity: activation checkpointing (the module's ``activation_checkpointing``):
            ``"full"`` (or ``True``) recomputes every layer (``uniform``, one layer per unit), ``"selective"``
            the core attention only; ``None``/``False`` leaves the provider's own setting.
    """
    from screl.strategies import GPTModelProvider

    check_policy_layout(strategy)
    recompute = _recompute_fields(recompute_granularity)
    dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
    expected = GPTModelProvider.from_hf_config(hf_model.config, params_dtype=dtype)
    if getattr(strategy, "model_provider_is_default", False):
        strategy.model_provider = dataclasses.replace(expected, **recompute)
        strategy.model_provider_is_default = False
        return
    given = strategy.model_provider
    if isinstance(given, GPTModelProvider):
        have, want = _architecture(given), _architecture(expected)
        bad = [f"{k}={have[k]!r} (policy: {want[k]!r})" for k in ARCH_FIELDS if have[k] != want[k]]
        if bad:
            raise ValueError(
                "trainer.strategy.init_args.model_provider does not match model.init_args.policy: "
                + ", ".join(bad)
                + ". Drop model_provider (GRPO derives it from the policy) or fix these fields."
            )
        if recompute:
            strategy.model_provider = dataclasses.replace(given, **recompute)


def _architecture(provider: Any) -> dict[str, Any]:
    """A provider's ``ARCH_FIELDS``, with the defaults that mean a size spelled out (``kv_channels=None``)."""
    arch = {k: getattr(provider, k) for k in ARCH_FIELDS}
    if arch["kv_channels"] is None:
        arch["kv_channels"] = provider.hidden_size // provider.num_attention_heads
    if arch["num_query_groups"] is None:
        arch["num_query_groups"] = provider.num_attention_heads
    return arch


def _recompute_fields(granularity: str | bool | None) -> dict[str, Any]:
    if granularity is None or granularity is False:
        return {}
    key = "full" if granularity is True else granularity
    if key not in RECOMPUTE:
        raise ValueError(
            f"activation_checkpointing={granularity!r} under MegatronStrategy must be one of "
            f"{sorted(RECOMPUTE)}, True or None."
        )
    return RECOMPUTE[key]
