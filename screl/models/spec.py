"""Policy specs: small picklable descriptions from which any process builds the same model and tokenizer.

The trainer (LightningModule) and every generation worker build from the same spec, so they hold the
same architecture; workers then receive the trainer's weights. A spec holds only plain values, so it
pickles across Ray and fits a jsonargparse config (``policy: {class_path: screl.models.TinyCausalLM}``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # annotations only: a process that never builds a model need not import transformers
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str) -> torch.dtype:
    """Map ``"float32" | "bfloat16" | "float16"`` to a torch dtype."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported. Expected one of {sorted(_DTYPES)}.")
    return _DTYPES[dtype]


class PolicySpec(ABC):
    """A causal LM policy: ``build_model()`` and ``build_tokenizer()``, deterministic and picklable."""

    is_vlm = False
    """A vision-language policy (:class:`screl.models.vision.VisionPolicy`): its prompts carry images."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra arguments of the tokenizer's chat template wherever a prompt is rendered with it (``HFCausalLM``'s
    ``chat_template_kwargs``, e.g. ``{enable_thinking: false}`` for Qwen3)."""

    @abstractmethod
    def build_model(self) -> PreTrainedModel:
        """Build the model (on CPU). Seeded specs build identical weights every call."""

    @abstractmethod
    def build_tokenizer(self) -> PreTrainedTokenizerBase:
        """Build the tokenizer that goes with the model."""

    def build_config(self) -> Any:
        """The model's Hugging Face config without loading weights (``screl check``'s memory estimate reads it),
        or None when this spec cannot tell its architecture without loading the model."""
        return None

    def model_dir(self) -> str | None:
        """The local folder holding the checkpoint this spec loads (an engine that loads from disk reads it), or
        None for a spec built in memory."""
        return None

    def prompt_token_ids(self, tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
        """The tokens a prompt's text is generated from. Default: the text as is, no special tokens; an instruct
        model's spec wraps it in the tokenizer's chat template."""
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])

    def _fields(self) -> dict[str, Any]:
        """The spec's settings (its identity: repr, equality, the run's fingerprint); ``_``-prefixed attributes are
        where this process found them (a resolved cache folder, a built processor), not settings."""
        return {k: v for k, v in vars(self).items() if not k.startswith("_")}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self._fields().items())
        return f"{type(self).__name__}({args})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and self._fields() == other._fields()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, tuple(sorted((k, repr(v)) for k, v in self._fields().items()))))


def chat_prompt_text(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                     chat_template_kwargs: dict[str, Any] | None = None) -> str:
    """A chat as the prompt text an instruct model reads: the tokenizer's chat template over ``messages``, with the
    generation prompt that opens the assistant's turn (``chat_template_kwargs``: the template's extra arguments)."""
    return str(tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                             **(chat_template_kwargs or {})))


def chat_prompt_token_ids(tokenizer: PreTrainedTokenizerBase, text: str, system_prompt: str | None = None,
                          chat_template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """A prompt as an instruct model reads it: a user turn (after ``system_prompt``, if any) in the tokenizer's chat
    template, with the generation prompt that opens the assistant's turn (``chat_template_kwargs``: the template's
    extra arguments, e.g. ``{"enable_thinking": False}``)."""
    messages = [{"role": "user", "content": text}]
    if system_prompt is not None:
        messages.insert(0, {"role": "system", "content": system_prompt})
    ids: Any = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                             **(chat_template_kwargs or {}))
    if hasattr(ids, "keys"):  # a BatchEncoding (transformers >= 5)
        ids = ids["input_ids"]
    return [int(t) for t in ids]
