"""The trainer's memory, estimated from the policy's shape before anything is built (``screl check``).

The model, per training process (one GPU, or the CPU), for a decoder-only transformer with hidden size ``h``,
query width ``q`` (heads x head_dim), key/value width ``k``, MLP width ``f``, ``n`` layers, vocabulary ``V``
and ``P`` parameters:

- **state**: fp32 master weights, fp32 gradients and AdamW's two fp32 moments: ``16 P`` bytes; under
  ``bf16-mixed`` autocast also caches a bf16 copy of the weights during the forward: ``+ 2 P``; a KL reference
  policy in the engine's dtype: ``+ P x its bytes``;
- **activations** of one micro-batch of ``T`` tokens (what autograd keeps for the backward pass), per layer
  per token ``b (2h + 3q + 3k + 4f) + 8h`` bytes in compute dtype ``b`` (the norms' fp32 inputs, the q/k/v
  projections and their rotated copies, the attention output, the gated MLP's four ``f``-wide tensors). With
  ``activation_checkpointing`` only each layer's input (``4h``) is kept, plus one layer's activations while it is
  recomputed. Attention scores are not counted: an accelerator's fused attention keeps none (a CPU's math
  kernel does, ``T x L`` per head);
- **logits** of one logprob chunk of ``C`` tokens (:mod:`screl.modules.logprobs`): ``4 C V`` bytes (one fp32
  buffer worked in place; ``+ 2 C V`` for the bf16 matmul output under autocast), the head's fp32 gradient
  accumulator ``4 V h``, and the final hidden states ``T h (4 + b)``.
  With ``logprob_chunk_tokens: 0`` the chunk is the whole micro-batch, about three fp32 ``T x V`` tensors.

An estimate, not a measurement: ``bench/memory.py`` measures the real peak (CPU RSS, or
``torch.cuda.max_memory_allocated``) and ``docs/real-scale.md`` compares the two.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from screl.modules.logprobs import auto_chunk_tokens

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """The sizes the estimate needs, read from a Hugging Face config."""

    hidden: int
    query: int
    kv: int
    ffn: int
    layers: int
    vocab: int
    tied: bool

    @classmethod
    def from_hf_config(cls, config: Any) -> ModelShape:
        heads = int(config.num_attention_heads)
        head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
        kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
        return cls(hidden=int(config.hidden_size), query=heads * head_dim, kv=kv_heads * head_dim,
                   ffn=int(config.intermediate_size), layers=int(config.num_hidden_layers),
                   vocab=int(config.vocab_size), tied=bool(getattr(config, "tie_word_embeddings", False)))

    @property
    def parameters(self) -> int:
        h = self.hidden
        attention = h * self.query + 2 * h * self.kv + self.query * h + self.query + 2 * self.kv
        layer = attention + 3 * h * self.ffn + 2 * h
        return self.layers * layer + self.vocab * h * (1 if self.tied else 2) + h


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of each part of one training process's peak."""

    state: int
    activations: int
    logits: int
    micro_batch_tokens: int
    chunk_tokens: int

    @property
    def peak(self) -> int:
        return self.state + self.activations + self.logits

    def describe(self) -> str:
        return (f"~{self.peak / GIB:.1f} GiB peak per training process: {self.state / GIB:.1f} GiB weights, "
                f"gradients and optimizer (fp32), {self.activations / GIB:.1f} GiB activations of a "
                f"{self.micro_batch_tokens}-token micro-batch, {self.logits / GIB:.2f} GiB for the logprob head (a "
                f"{self.chunk_tokens}-token chunk of logits, the head's gradient, the final hidden states)")


def estimate_trainer_memory(
    shape: ModelShape, micro_batch_tokens: int, *, bf16_mixed: bool = False, activation_checkpointing: bool = False,
    logprob_chunk_tokens: int | None = None, reference_bytes_per_param: int = 0,
) -> MemoryEstimate:
    """The estimate above for a micro-batch of ``micro_batch_tokens`` tokens."""
    b = 2 if bf16_mixed else 4
    p = shape.parameters
    state = 16 * p + (2 * p if bf16_mixed else 0) + reference_bytes_per_param * p
    h, t = shape.hidden, micro_batch_tokens
    per_layer = b * (2 * h + 3 * shape.query + 3 * shape.kv + 4 * shape.ffn) + 8 * h
    if activation_checkpointing:
        activations = t * (shape.layers * 4 * h + per_layer)
    else:
        activations = t * shape.layers * per_layer
    if logprob_chunk_tokens == 0:
        chunk, logits = t, 3 * 4 * t * shape.vocab
    else:
        chunk = min(t, logprob_chunk_tokens or auto_chunk_tokens(shape.vocab))
        # one fp32 chunk worked in place (plus the bf16 matmul output under autocast), and the head's fp32
        # gradient accumulator
        logits = chunk * shape.vocab * (4 + (2 if bf16_mixed else 0)) + 4 * shape.vocab * h
    logits += t * h * (4 + b)
    return MemoryEstimate(state=state, activations=activations, logits=logits, micro_batch_tokens=t,
                          chunk_tokens=chunk)
