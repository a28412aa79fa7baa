"""A tiny random-init model of a real family's architecture, built from its ``config.json`` alone (no weights).

A recipe's *shape twin* (``tests/e2e/test_recipe_twins.py``) trains the recipe on CPU with the real model replaced
by this spec: the sizes shrink (width, layers, heads, vocabulary), the architecture stays (``model_type`` and so
the family's QKV bias or QK layernorm, the grouped-query ratio, the head width relative to the hidden size,
the MLP ratio, RoPE type, theta and scaling, tied or untied embeddings, norms). The vocabulary is the
in-memory character tokenizer's, so nothing is downloaded.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import transformers  # PreTrainedModel (its modeling code) loads on first use: `screl check` resolves this spec without it
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerBase

from screl.models.spec import PolicySpec, chat_prompt_token_ids, resolve_dtype
from screl.models.tokenizer import BOS_TOKEN_ID, EOS_TOKEN_ID, PAD_TOKEN_ID, build_char_tokenizer, char_vocab

__all__ = ["ShapeTwin", "shrink_config"]

_TOKEN_IDS = {"pad_token_id": PAD_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "bos_token_id": BOS_TOKEN_ID}


def shrink_config(fields: dict[str, Any], head_dim: int = 8, num_kv_heads: int = 2, num_layers: int = 2,
                  max_position_embeddings: int = 256) -> dict[str, Any]:
    """The fields of a real ``config.json``, shrunk: every architecture field kept, the sizes made tiny.

    - heads: ``num_kv_heads`` key/value heads and the source's query-per-KV-head ratio (GQA kept);
    - head width ``head_dim``; the hidden size keeps the source's ``heads x head_dim / hidden`` ratio (Qwen3-0.6B's
      heads are twice as wide as ``hidden / heads``: so are the twin's); ``head_dim`` is written only when the
      source writes it;
    - the MLP keeps the source's ``intermediate / hidden`` ratio (rounded to a multiple of 8);
    - the vocabulary and special token ids are the character tokenizer's;
    - ``max_position_embeddings`` shrinks (RoPE's own parameters, Llama-3's ``original_max_position_embeddings``
      included, are kept as they are).

    Raises:
        ValueError: a size that does not divide (named), or a source config without the fields it needs.
    """
    src = dict(fields)
    for key in ("model_type", "hidden_size", "intermediate_size", "num_attention_heads"):
        if key not in src:
            raise ValueError(f"shrink_config: the source config has no {key!r}")
    heads, kv = int(src["num_attention_heads"]), int(src.get("num_key_value_heads") or src["num_attention_heads"])
    if heads % kv:
        raise ValueError(f"shrink_config: num_key_value_heads={kv} does not divide num_attention_heads={heads}")
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"shrink_config: head_dim={head_dim} must be even and >= 2 (RoPE rotates pairs)")
    src_head_dim = int(src.get("head_dim") or src["hidden_size"] // heads)
    width = src_head_dim * heads / src["hidden_size"]  # 1 unless the heads are wider than hidden / heads
    new_heads = heads // kv * num_kv_heads
    hidden = new_heads * head_dim / width
    if not hidden.is_integer():
        raise ValueError(f"shrink_config: head_dim={head_dim} x {new_heads} heads / {width:g} is not a whole hidden "
                         "size; pick another head_dim")
    inter = max(8, round(src["intermediate_size"] / src["hidden_size"] * hidden / 8) * 8)
    out = dict(src)
    out.update(hidden_size=int(hidden), intermediate_size=int(inter), num_hidden_layers=num_layers,
               num_attention_heads=new_heads, num_key_value_heads=num_kv_heads, vocab_size=len(char_vocab()),
               max_position_embeddings=max_position_embeddings, **_TOKEN_IDS)
    if "head_dim" in src:
        out["head_dim"] = head_dim
    if "max_window_layers" in src:
        out["max_window_layers"] = min(int(src["max_window_layers"]), num_layers)
    if src.get("sliding_window"):
        out["sliding_window"] = max_position_embeddings
    for key in ("_name_or_path", "transformers_version"):
        out.pop(key, None)
    return out


class ShapeTwin(PolicySpec):
    """A random-init model with a real checkpoint's architecture at a tiny size, over the character tokenizer.

    Args:
        config: A ``config.json`` file, or a directory holding one (``configs/recipes/shapes/qwen3-0.6b``).
        head_dim: The twin's head width (the hidden size follows from it: see :func:`shrink_config`).
        num_kv_heads: Key/value heads (query heads keep the source's ratio); a multiple of the tensor-parallel
            size to train it under ``MegatronStrategy``.
        num_layers: Decoder layers.
        max_position_embeddings: Longest prompt + completion.
        chat_template: Generate from each prompt wrapped in the character tokenizer's chat template (as
            ``HFCausalLM(chat_template=True)`` does with the real tokenizer's).
        system_prompt: With ``chat_template``: a system turn first (its characters must be the tokenizer's).
        seed: Weight-init seed: every process builds the same weights (the global RNG is untouched).
        dtype: Parameter dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        vocab_size: The embedding and output rows (None: the character tokenizer's). A larger one gives the real
            family's vocabulary cost (its logits, embedding and output layer: ``151936`` for Qwen2.5) over the same
            tokenizer; ids past the tokenizer's decode as nothing.
    """

    def __init__(self, config: str, head_dim: int = 8, num_kv_heads: int = 2, num_layers: int = 2,
                 max_position_embeddings: int = 256, chat_template: bool = False, system_prompt: str | None = None,
                 seed: int = 0, dtype: str = "float32", vocab_size: int | None = None) -> None:
        resolve_dtype(dtype)
        if vocab_size is not None and vocab_size < len(char_vocab()):
            raise ValueError(f"ShapeTwin: vocab_size={vocab_size} is below the character tokenizer's "
                             f"{len(char_vocab())} ids; leave it null or raise it")
        self.vocab_size = vocab_size
        self.config, self.head_dim, self.num_kv_heads, self.num_layers = config, head_dim, num_kv_heads, num_layers
        self.max_position_embeddings, self.chat_template, self.system_prompt = (
            max_position_embeddings, chat_template, system_prompt)
        self.seed, self.dtype = seed, dtype
        if system_prompt is not None and not chat_template:
            raise ValueError("ShapeTwin: system_prompt needs chat_template: true")
        self.config_fields()  # fail at construction on a missing file or sizes that do not divide

    def _path(self) -> str:
        path = os.path.join(self.config, "config.json") if os.path.isdir(self.config) else self.config
        if not os.path.isfile(path):
            raise FileNotFoundError(f"ShapeTwin: config={self.config!r} is not a config.json file or a directory "
                                    "holding one")
        return path

    def config_fields(self) -> dict[str, Any]:
        """The shrunk config's fields."""
        with open(self._path()) as fh:
            fields = json.load(fh)
        out = shrink_config(fields, self.head_dim, self.num_kv_heads, self.num_layers, self.max_position_embeddings)
        if self.vocab_size is not None:
            out["vocab_size"] = self.vocab_size
        return out

    def build_config(self) -> Any:
        """The twin's Hugging Face config (the source family's class)."""
        fields = self.config_fields()
        return AutoConfig.for_model(fields.pop("model_type"), **fields)

    def build_model(self) -> transformers.PreTrainedModel:
        """The model on CPU, seeded without disturbing the global RNG."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model: transformers.PreTrainedModel = AutoModelForCausalLM.from_config(self.build_config())
        return model.to(dtype=resolve_dtype(self.dtype))  # type: ignore[call-arg]  # transformers' wrapped .to

    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """The in-memory character tokenizer (with its chat template)."""
        return build_char_tokenizer()

    def prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        if not self.chat_template:
            return super().prompt_token_ids(tokenizer, text)
        return chat_prompt_token_ids(tokenizer, text, self.system_prompt)
