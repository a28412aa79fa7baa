"""A tiny sequence classifier (random Llama) and the repo's tiny tokenizer, saved with ``save_pretrained``."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForSequenceClassification

from screl.models import TinyCausalLM


def save_classifier(path: Path, num_labels: int = 1, seed: int = 0) -> LlamaForSequenceClassification:
    """A random tiny Llama sequence classifier and the repo's tiny tokenizer, saved in ``path``."""
    tok = TinyCausalLM().build_tokenizer()
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
                      num_labels=num_labels, pad_token_id=tok.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForSequenceClassification(cfg).eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model
