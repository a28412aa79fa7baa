"""Policy specs (model + tokenizer builders) shared by the trainer and the generation workers."""

from screl.models.hf import HFCausalLM
from screl.models.smollm2 import SmolLM2, convert_gguf, smollm2_gguf
from screl.models.spec import PolicySpec, resolve_dtype
from screl.models.tiny import MODEL_SCALES, TinyCausalLM
from screl.models.tokenizer import (
    BOS_TOKEN_ID,
    CHARS,
    EOS_TOKEN_ID,
    PAD_TOKEN_ID,
    SPECIAL_TOKENS,
    build_char_tokenizer,
    char_vocab,
)
from screl.models.value import ValueModel, critic_state

__all__ = [
    "BOS_TOKEN_ID",
    "CHARS",
    "EOS_TOKEN_ID",
    "MODEL_SCALES",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "HFCausalLM",
    "SmolLM2",
    "PolicySpec",
    "TinyCausalLM",
    "ValueModel",
    "build_char_tokenizer",
    "char_vocab",
    "convert_gguf",
    "critic_state",
    "resolve_dtype",
    "smollm2_gguf",
]
