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
- **logits** of one logprob chunk of ``C`` tokens (:mod:`screl.models.logprobs`): ``4 C V`` bytes (one fp32
  buffer worked in place; ``+ 2 C V`` for the bf16 matmul output under autocast), the head's fp32 gradient
  accumulator ``4 V h``, and the final hidden states ``T h (4 + b)``.
  With ``logprob_chunk_tokens: 0`` the chunk is the whole micro-batch, about three fp32 ``T x V`` tensors.

An estimate, not a measurement: ``bench/memory.py`` measures the real peak (CPU RSS, or
``torch.cuda.max_memory_allocated``) and ``docs/real-scale.md`` compares the two.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from screl.models.logprobs import auto_chunk_tokens

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
        if hasattr(config, "get_text_config"):  # a vision-language model: its language model (the tower is small)
            config = config.get_text_config()
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
    logprob_chunk_tokens: int | None = None, reference_bytes_per_param: int = 0, tensor_parallel: int = 1,
    pipeline_parallel: int = 1, optimizer_shards: int = 1, megatron: bool = False,
) -> MemoryEstimate:
    """The estimate above for a micro-batch of ``micro_batch_tokens`` tokens.

    Under ``MegatronStrategy`` (``megatron``) one rank holds ``1 / (tensor_parallel x pipeline_parallel)`` of the
    weights, gradients and (``optimizer_shards``: the data-parallel size with ``use_distributed_optimizer``) a further
    share of the AdamW state; the tensor-parallel parts of the activations and the logits split ``tensor_parallel``
    ways, and the logits are vocabulary-parallel over the whole micro-batch rather than chunked.
    """
    b = 2 if bf16_mixed else 4
    tp, shards = max(1, tensor_parallel), max(1, tensor_parallel) * max(1, pipeline_parallel)
    p = shape.parameters // shards
    state = 8 * p + 8 * p // max(1, optimizer_shards) + (2 * p if bf16_mixed else 0) + reference_bytes_per_param * p
    h, t = shape.hidden, micro_batch_tokens
    layers = -(-shape.layers // max(1, pipeline_parallel))
    per_layer = b * (2 * h + (3 * shape.query + 3 * shape.kv + 4 * shape.ffn) // tp) + 8 * h
    if activation_checkpointing:
        activations = t * (layers * 4 * h + per_layer)
    else:
        activations = t * layers * per_layer
    if megatron:
        chunk, logits = t, 3 * 4 * t * shape.vocab // tp
    elif logprob_chunk_tokens == 0:
        chunk, logits = t, 3 * 4 * t * shape.vocab
    else:
        chunk = min(t, logprob_chunk_tokens or auto_chunk_tokens(shape.vocab))
        # one fp32 chunk worked in place (plus the bf16 matmul output under autocast), and the head's fp32
        # gradient accumulator
        logits = chunk * shape.vocab * (4 + (2 if bf16_mixed else 0)) + 4 * shape.vocab * h
    logits += t * h * (4 + b)
    return MemoryEstimate(state=state, activations=activations, logits=logits, micro_batch_tokens=t,
                          chunk_tokens=chunk)


def _get(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return default
        node = node[part]
    return node


def config_estimate(cfg: Mapping[str, Any]) -> tuple[MemoryEstimate | None, str]:
    """The estimate for a whole screl config (the parsed YAML with defaults): the policy's shape from its spec's
    ``build_config()`` (no weights loaded), the micro-batch budget, precision, checkpointing, a KL reference and
    the Megatron layout. Returns the estimate and a note (why there is none, or what the budget is)."""
    import importlib

    from screl.modules.chunk import ACCELERATOR_MICRO_BATCH_TOKENS, CPU_MICRO_BATCH_TOKENS

    args = _get(cfg, "model.init_args", {}) or {}
    policy = args.get("policy") or {}
    try:
        module, _, name = str(policy.get("class_path", "")).rpartition(".")
        spec = getattr(importlib.import_module(module), name)(**(policy.get("init_args") or {}))
        hf_config = spec.build_config()
    except (ImportError, AttributeError, TypeError, ValueError, OSError) as err:
        return None, f"no estimate (model.init_args.policy: {err})"
    if hf_config is None:
        return None, "no estimate (the policy spec cannot tell its shape before loading the model)"
    trainer = cfg.get("trainer") or {}
    on_cpu = str(trainer.get("accelerator") or "auto") == "cpu"
    budget = args.get("micro_batch_tokens")
    if budget is None:
        budget = CPU_MICRO_BATCH_TOKENS if on_cpu else ACCELERATOR_MICRO_BATCH_TOKENS
    algo = cfg.get("grpo") or cfg.get("ppo") or {}
    rows = int(algo.get("num_prompts_per_step", 8)) * int(algo.get("num_generations_per_prompt", 4))
    whole = rows * int((_get(cfg, "data.init_args.generation", {}) or {}).get("max_new_tokens", 16))
    loss = args.get("loss_fn") or {}
    reference = 0
    if float((loss.get("init_args", loss) or {}).get("reference_policy_kl_penalty", 0) or 0) > 0:
        reference = 2 if str(getattr(spec, "dtype", "float32")) in ("bfloat16", "float16") else 4
    strategy = trainer.get("strategy")
    strategy_args = (strategy.get("init_args") or {}) if isinstance(strategy, Mapping) else {}
    megatron = isinstance(strategy, Mapping) and str(strategy.get("class_path", "")).endswith("MegatronStrategy")
    par = strategy_args.get("parallelism") or {}
    tp = int(par.get("tensor_model_parallel_size", 1)) if megatron else 1
    pp = int(par.get("pipeline_model_parallel_size", 1)) if megatron else 1
    devices = trainer.get("devices")
    dp = max(1, (devices if isinstance(devices, int) else 1) * int(trainer.get("num_nodes") or 1) // (tp * pp))
    estimate = estimate_trainer_memory(
        ModelShape.from_hf_config(hf_config), budget if budget > 0 else whole,
        bf16_mixed=str(trainer.get("precision")) in ("bf16-mixed", "bf16"),
        activation_checkpointing=args.get("activation_checkpointing") not in (None, False),
        logprob_chunk_tokens=args.get("logprob_chunk_tokens"), reference_bytes_per_param=reference,
        megatron=megatron, tensor_parallel=tp, pipeline_parallel=pp,
        optimizer_shards=dp if megatron and strategy_args.get("use_distributed_optimizer") else 1,
    )
    where = "CPU" if on_cpu else "accelerator"
    note = "" if budget > 0 else f" (micro_batch_tokens 0: the whole chunk, >= {whole} tokens)"
    return estimate, f"{note}; micro-batch budget for the {where} (model.init_args.micro_batch_tokens)"
