"""A tiny Qwen2 causal LM built from config with the in-memory character tokenizer (no download)."""

from __future__ import annotations

from typing import Any, Literal

import torch
import transformers  # its model classes load on first use: `screl check` resolves this spec without Qwen2's modeling

from screl.models.spec import PolicySpec, resolve_dtype
from screl.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_char_tokenizer, char_vocab

_COMMON: dict[str, Any] = dict(
    tie_word_embeddings=True, pad_token_id=PAD_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, bos_token_id=BOS_TOKEN_ID
)
MODEL_SCALES: dict[str, dict[str, Any]] = {
    # Exactly the TRL benchmark peer's MODEL_KWARGS / SMALL_KWARGS (bench/trl_peer.py).
    "tiny": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        **_COMMON,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=256,
        **_COMMON,
    ),
}


class TinyCausalLM(PolicySpec):
    """A random-init ``Qwen2ForCausalLM`` over the character tokenizer.

    Args:
        scale: Base size: ``"tiny"`` (hidden 64, 2 layers, ~77k params) or ``"small"`` (hidden 256,
            4 layers); both equal the TRL peer's models. Explicit sizes below override single fields.
        hidden_size: Model width (default: from ``scale``).
        intermediate_size: MLP width (default: from ``scale``).
        num_layers: Number of decoder layers (default: from ``scale``).
        num_heads: Attention heads (default: from ``scale``).
        num_kv_heads: Key/value heads, a divisor of ``num_heads`` (default: from ``scale``).
        max_position_embeddings: Longest prompt + completion (default: from ``scale``).
        seed: Seed for the weight init; the same seed gives the same weights in every process
            (the global RNG is left untouched). ``None`` draws from the global torch RNG.
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
    """

    def __init__(
        self,
        scale: Literal["tiny", "small"] = "tiny",
        hidden_size: int | None = None,
        intermediate_size: int | None = None,
        num_layers: int | None = None,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        max_position_embeddings: int | None = None,
        seed: int | None = 0,
        dtype: str = "float32",
    ) -> None:
        if scale not in MODEL_SCALES:
            raise ValueError(
                f"TinyCausalLM(scale={scale!r}) is not a known scale. Expected one of {sorted(MODEL_SCALES)}."
            )
        resolve_dtype(dtype)
        self.scale = scale
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.max_position_embeddings = max_position_embeddings
        self.seed = seed
        self.dtype = dtype
        self._check(self.config_kwargs())

    def config_kwargs(self) -> dict[str, Any]:
        """The ``Qwen2Config`` keyword arguments (without ``vocab_size``)."""
        kw = dict(MODEL_SCALES[self.scale])
        overrides = {
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "max_position_embeddings": self.max_position_embeddings,
        }
        kw.update({k: v for k, v in overrides.items() if v is not None})
        return kw

    @staticmethod
    def _check(kw: dict[str, Any]) -> None:
        for key in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "max_position_embeddings",
        ):
            if kw[key] < 1:
                raise ValueError(f"TinyCausalLM: {key}={kw[key]} must be >= 1.")
        if kw["hidden_size"] % kw["num_attention_heads"]:
            raise ValueError(
                f"TinyCausalLM: hidden_size={kw['hidden_size']} must be divisible by "
                f"num_heads={kw['num_attention_heads']}."
            )
        if kw["num_attention_heads"] % kw["num_key_value_heads"]:
            raise ValueError(
                f"TinyCausalLM: num_heads={kw['num_attention_heads']} must be divisible by "
                f"num_kv_heads={kw['num_key_value_heads']}."
            )

    def build_config(self) -> transformers.Qwen2Config:
        """The model config, vocabulary size taken from the character tokenizer."""
        return transformers.Qwen2Config(vocab_size=len(char_vocab()), **self.config_kwargs())

    def build_model(self) -> transformers.Qwen2ForCausalLM:
        """Build the model on CPU, seeded without disturbing the global RNG when ``seed`` is set."""
        cfg = self.build_config()
        if self.seed is None:
            model = transformers.Qwen2ForCausalLM(cfg)
        else:
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(self.seed)
                model = transformers.Qwen2ForCausalLM(cfg)
        return model.to(dtype=resolve_dtype(self.dtype))  # type: ignore[call-arg]  # transformers' wrapped .to

    def build_tokenizer(self) -> transformers.PreTrainedTokenizerFast:
        """The in-memory character tokenizer."""
        return build_char_tokenizer()
