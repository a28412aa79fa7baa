"""The policy under ``MegatronStrategy``: next-token logprobs of a Megatron ``GPTModel`` (vocabulary-parallel
under tensor parallelism) and the provider that builds the policy's architecture. ``GRPO`` and the pipelined
schedule (:mod:`screl.modules.pipelined`) use them."""

from __future__ import annotations

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
    "max_sequence_length", "layernorm_epsilon", "add_qkv_bias", "rotary_base",
    "share_embeddings_and_output_weights",
)


def fit_provider_to_policy(strategy: Any, hf_model: torch.nn.Module) -> None:
    """Make the strategy build the policy's architecture: derive its provider from the Hugging Face config
    when none was given; check an explicit ``GPTModelProvider`` against it."""
    from screl.strategies import GPTModelProvider

    dtype = str(next(hf_model.parameters()).dtype).removeprefix("torch.")
    expected = GPTModelProvider.from_hf_config(hf_model.config, params_dtype=dtype)
    if getattr(strategy, "model_provider_is_default", False):
        strategy.model_provider = expected
        strategy.model_provider_is_default = False
        return
    given = strategy.model_provider
    if isinstance(given, GPTModelProvider):
        bad = [f"{k}={getattr(given, k)!r} (policy: {getattr(expected, k)!r})" for k in ARCH_FIELDS
               if getattr(given, k) != getattr(expected, k)]
        if bad:
            raise ValueError(
                "trainer.strategy.init_args.model_provider does not match model.init_args.policy: "
                + ", ".join(bad)
                + ". Drop model_provider (GRPO derives it from the policy) or fix these fields."
            )
