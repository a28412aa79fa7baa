"""Model providers: how :class:`~screl.strategies.MegatronStrategy` builds the Megatron model on each rank.

A provider is any callable ``provider(pre_process, post_process) -> MegatronModule`` (Megatron's own
convention), called after ``parallel_state`` is initialized so that each rank builds only its shard.
:class:`GPTModelProvider` is the built-in one: a decoder-only ``GPTModel`` whose defaults match the
Qwen2/Llama layout (RMSNorm, SwiGLU, RoPE, grouped-query attention), so that
:func:`~screl.strategies.weights.export_weights` can name its weights as Hugging Face does;
:meth:`GPTModelProvider.from_hf_config` maps Qwen2/Qwen2.5, Qwen3 and Llama-3.x configs and refuses what it
cannot map (:mod:`screl.strategies.hf_config`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, Protocol

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from screl.strategies.parallel import current_parallelism

__all__ = ["UNPADDED_VOCAB_ATTR", "GPTModelProvider", "ModelProvider", "padded_vocab_size"]

UNPADDED_VOCAB_ATTR = "screl_vocab_size"
"""Attribute a provider may set on the model: the tokenizer's vocabulary size before padding."""

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelProvider(Protocol):
    """Builds this rank's part of the model; ``pre_process``/``post_process``: first/last pipeline stage."""

    def __call__(self, pre_process: bool = True, post_process: bool = True) -> MegatronModule: ...


def padded_vocab_size(vocab_size: int, divisible_by: int, tensor_parallel_size: int) -> int:
    """Round ``vocab_size`` up to a multiple of ``divisible_by * tensor_parallel_size`` (Megatron's rule)."""
    multiple = divisible_by * tensor_parallel_size
    return -(-vocab_size // multiple) * multiple


def _transformer_engine_available() -> bool:
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


@dataclass
class GPTModelProvider:
    """A ``GPTModel`` with the Qwen2/Llama layout by default; sizes are those of the whole model.

    The parallel sizes come from ``parallel_state``. Weights are initialized on the CPU from the global
    torch RNG, so every tensor-parallel layout of the same seed starts from the same full weights,
    except the gated MLP's ``linear_fc1`` (Megatron splits it per shard): load weights with
    :func:`~screl.strategies.weights.load_hf_weights` or a checkpoint when layouts must agree.
    """

    vocab_size: int = 43
    """Vocabulary size of the tokenizer; the embedding is padded (see ``make_vocab_size_divisible_by``)."""
    hidden_size: int = 64
    """Model width."""
    ffn_hidden_size: int = 128
    """MLP width (per gate/up half when ``gated_linear_unit``)."""
    num_layers: int = 2
    """Decoder layers."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: int | None = 2
    """Key/value heads (grouped-query attention); ``None``: one per query head."""
    kv_channels: int | None = None
    """Width of each attention head (Hugging Face ``head_dim``); ``None``: ``hidden_size // num_attention_heads``."""
    qk_layernorm: bool = False
    """RMSNorm over each query and key head before RoPE (Qwen3's ``q_norm``/``k_norm``)."""
    max_sequence_length: int = 128
    """Longest sequence (prompt + completion)."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Norm layer type."""
    layernorm_epsilon: float = 1e-6
    """Norm epsilon."""
    gated_linear_unit: bool = True
    """SwiGLU MLP (gate and up projections) when true."""
    activation: Literal["silu", "gelu"] = "silu"
    """MLP activation."""
    add_bias_linear: bool = False
    """Biases on the linear layers."""
    add_qkv_bias: bool = True
    """Bias on the query/key/value projection (Qwen2 has one, Llama does not)."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """Position encoding."""
    rotary_base: int = 10000
    """RoPE theta."""
    rope_scaling: bool = False
    """Llama-3.x RoPE scaling (megatron-core fixes low_freq_factor=1, high_freq_factor=4 and
    original_max_position_embeddings=8192)."""
    rope_scaling_factor: float = 8.0
    """Llama-3.x RoPE scaling ``factor`` (used when ``rope_scaling``)."""
    share_embeddings_and_output_weights: bool = True
    """Tie the output layer to the input embedding."""
    parallel_output: bool = True
    """Keep logits split over the vocabulary across tensor-parallel ranks (see ``token_logprobs``)."""
    make_vocab_size_divisible_by: int = 8
    """The embedding has a multiple of this times the tensor-parallel size rows."""
    hidden_dropout: float = 0.0
    """Dropout after attention and MLP."""
    attention_dropout: float = 0.0
    """Dropout on attention probabilities."""
    params_dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Parameter dtype."""
    calculate_per_token_loss: bool = False
    """Loss functions return ``(loss_sum, num_tokens, metrics)`` and gradients are divided by the global
    token count (Megatron's per-token loss); else ``(loss, metrics)`` averaged over microbatches and ranks."""
    layer_spec: Literal["auto", "local", "transformer_engine"] = "auto"
    """``auto``: Transformer Engine's spec when it is installed and CUDA is available, else the local one."""
    seed: int | None = 0
    """Seed for the weight init (the global RNG is restored afterwards); ``None`` uses the global RNG."""
    recompute_granularity: Literal["full", "selective"] | None = None
    """Activation checkpointing: ``full`` recomputes whole layers in the backward pass (needs
    ``recompute_method`` and ``recompute_num_layers``), ``selective`` only the core attention; ``None``: off."""
    recompute_method: Literal["uniform", "block"] | None = None
    """With ``full``: ``uniform`` checkpoints every ``recompute_num_layers`` layers as a unit, ``block`` the first
    ``recompute_num_layers`` layers of each pipeline stage."""
    recompute_num_layers: int | None = None
    """With ``full``: layers per unit (``uniform``) or per stage (``block``); must be unset with ``selective``."""

    def __post_init__(self) -> None:
        if self.activation not in ("silu", "gelu"):
            raise ValueError(f"GPTModelProvider(activation={self.activation!r}) must be 'silu' or 'gelu'.")
        if self.params_dtype not in _DTYPES:
            raise ValueError(
                f"GPTModelProvider(params_dtype={self.params_dtype!r}) must be one of {sorted(_DTYPES)}."
            )
        self._check_recompute()

    def _check_recompute(self) -> None:
        granularity, method, layers = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        given = f"recompute_granularity={granularity!r}, recompute_method={method!r}, recompute_num_layers={layers!r}"
        if granularity not in (None, "full", "selective"):
            raise ValueError(f"GPTModelProvider({given}): recompute_granularity must be None, 'full' or 'selective'.")
        if method not in (None, "uniform", "block"):
            raise ValueError(f"GPTModelProvider({given}): recompute_method must be None, 'uniform' or 'block'.")
        if granularity == "full" and (method is None or layers is None or layers < 1):
            raise ValueError(f"GPTModelProvider({given}): 'full' recompute needs recompute_method ('uniform' or "
                             "'block') and recompute_num_layers >= 1 (e.g. 'uniform' and 1: every layer).")
        if granularity == "selective" and layers is not None:
            raise ValueError(f"GPTModelProvider({given}): 'selective' recompute needs recompute_num_layers unset.")
        if granularity is None and (method is not None or layers is not None):
            raise ValueError(f"GPTModelProvider({given}): recompute_method and recompute_num_layers need "
                             "recompute_granularity='full'.")

    @classmethod
    def from_hf_config(cls, hf_config: Any, **overrides: Any) -> GPTModelProvider:
        """A provider building the same network as a Hugging Face ``Qwen2Config``, ``Qwen3Config`` or
        ``LlamaConfig`` (transformers 5.x); ``overrides`` set the other fields (dtype, recompute, ...).

        Raises:
            ValueError: the config has a field that changes the network and is not mapped (another RoPE type,
                sliding-window layers, experts, another activation, ...); the message names each field, its
                value and the fix. See :mod:`screl.strategies.hf_config`.
        """
        from screl.strategies.hf_config import provider_kwargs

        kwargs = provider_kwargs(hf_config)
        kwargs.update(overrides)
        return cls(**kwargs)

    def transformer_config(self) -> TransformerConfig:
        """The ``TransformerConfig`` for the current ``parallel_state``."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        return TransformerConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            ffn_hidden_size=self.ffn_hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_query_groups=self.num_query_groups,
            kv_channels=self.kv_channels,
            qk_layernorm=self.qk_layernorm,
            normalization=self.normalization,
            layernorm_epsilon=self.layernorm_epsilon,
            gated_linear_unit=self.gated_linear_unit,
            activation_func=F.silu if self.activation == "silu" else F.gelu,
            add_bias_linear=self.add_bias_linear,
            add_qkv_bias=self.add_qkv_bias,
            hidden_dropout=self.hidden_dropout,
            attention_dropout=self.attention_dropout,
            params_dtype=_DTYPES[self.params_dtype],
            bf16=self.params_dtype == "bfloat16",
            fp16=self.params_dtype == "float16",
            calculate_per_token_loss=self.calculate_per_token_loss,
            recompute_granularity=self.recompute_granularity,
            recompute_method=self.recompute_method,
            recompute_num_layers=self.recompute_num_layers,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=parallel_state.get_context_parallel_world_size(),
            expert_model_parallel_size=parallel_state.get_expert_model_parallel_world_size(),
            sequence_parallel=tp > 1 and self._sequence_parallel(),
            use_cpu_initialization=True,
            pipeline_dtype=_DTYPES[self.params_dtype] if pp > 1 else None,
        )

    @staticmethod
    def _sequence_parallel() -> bool:
        cfg = current_parallelism()
        return bool(cfg is not None and cfg.sequence_parallel)

    def layer_spec_for(self, config: TransformerConfig) -> ModuleSpec:
        """The transformer layer spec (``layer_spec``)."""
        use_te = self.layer_spec == "transformer_engine" or (
            self.layer_spec == "auto" and _transformer_engine_available()
        )
        if use_te:
            from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

            return get_gpt_layer_with_transformer_engine_spec(qk_layernorm=self.qk_layernorm)
        return get_gpt_layer_local_spec(normalization=self.normalization, qk_layernorm=self.qk_layernorm)

    def padded_vocab_size(self) -> int:
        """The embedding's row count for the current tensor-parallel size."""
        tp = parallel_state.get_tensor_model_parallel_world_size()
        return padded_vocab_size(self.vocab_size, self.make_vocab_size_divisible_by, tp)

    def __call__(self, pre_process: bool = True, post_process: bool = True) -> GPTModel:
        """Build this rank's ``GPTModel`` shard (on the CPU; the strategy moves it)."""
        config = self.transformer_config()
        with torch.random.fork_rng(devices=[]):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            model = GPTModel(
                config=config,
                transformer_layer_spec=self.layer_spec_for(config),
                vocab_size=self.padded_vocab_size(),
                max_sequence_length=self.max_sequence_length,
                pre_process=pre_process,
                post_process=post_process,
                parallel_output=self.parallel_output,
                share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
                position_embedding_type=self.position_embedding_type,
                rotary_base=self.rotary_base,
                rope_scaling=self.rope_scaling,
                rope_scaling_factor=self.rope_scaling_factor,
            )
        setattr(model, UNPADDED_VOCAB_ATTR, self.vocab_size)
        return model
