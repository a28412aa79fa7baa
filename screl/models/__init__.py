"""Policy specs (model + tokenizer builders) shared by the trainer and the generation workers.

The names load on first use (PEP 562): a process that needs only :class:`PolicySpec`, like the controller actor,
does not import Hugging Face transformers (about a CPU-second per process start).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from screl._lazy import lazy_exports

if TYPE_CHECKING:
    from screl.models.hf import HFCausalLM
    from screl.models.moe import TinyMoECausalLM
    from screl.models.shape_twin import ShapeTwin, shrink_config
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
    from screl.models.vision import HFVisionLM, TinyVisionLM
    from screl.models.vision_inputs import VisionInputs

_WHERE = {
    "HFCausalLM": "hf",
    "TinyMoECausalLM": "moe",
    "ShapeTwin": "shape_twin", "shrink_config": "shape_twin",
    "SmolLM2": "smollm2", "convert_gguf": "smollm2", "smollm2_gguf": "smollm2",
    "PolicySpec": "spec", "resolve_dtype": "spec",
    "MODEL_SCALES": "tiny", "TinyCausalLM": "tiny",
    "BOS_TOKEN_ID": "tokenizer", "CHARS": "tokenizer", "EOS_TOKEN_ID": "tokenizer", "PAD_TOKEN_ID": "tokenizer",
    "SPECIAL_TOKENS": "tokenizer", "build_char_tokenizer": "tokenizer", "char_vocab": "tokenizer",
    "ValueModel": "value", "critic_state": "value",
    "HFVisionLM": "vision", "TinyVisionLM": "vision", "VisionInputs": "vision_inputs",
}

__all__ = [
    "BOS_TOKEN_ID",
    "CHARS",
    "EOS_TOKEN_ID",
    "MODEL_SCALES",
    "PAD_TOKEN_ID",
    "SPECIAL_TOKENS",
    "HFCausalLM",
    "HFVisionLM",
    "ShapeTwin",
    "SmolLM2",
    "PolicySpec",
    "TinyCausalLM",
    "TinyMoECausalLM",
    "TinyVisionLM",
    "ValueModel",
    "VisionInputs",
    "build_char_tokenizer",
    "char_vocab",
    "convert_gguf",
    "critic_state",
    "resolve_dtype",
    "shrink_config",
    "smollm2_gguf",
]


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
