"""Shared by the export tests: a fixed batch, logits of a model on it, a folder's model."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

PROBE = "count the a in banana"


def probe_ids(tokenizer: Any) -> Tensor:
    ids = tokenizer(PROBE, add_special_tokens=False)["input_ids"]
    return torch.tensor([ids], dtype=torch.long)


@torch.no_grad()
def logits_of(model: Any, ids: Tensor) -> Tensor:
    was = model.training
    model.eval()
    out = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    model.train(was)
    return out


def load_folder(path: str) -> tuple[Any, Any]:
    """The folder's model (``AutoModelForCausalLM``) and tokenizer: ``AutoTokenizer``'s, unless the export noted that
    another class tokenizes as the run did (the character tokenizer under a Qwen2 config)."""
    import json
    import os

    from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedTokenizerFast

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with open(os.path.join(path, "screl_export.json")) as f:
        noted = "tokenizer_note" in json.load(f)
    return model, (PreTrainedTokenizerFast if noted else AutoTokenizer).from_pretrained(path)
