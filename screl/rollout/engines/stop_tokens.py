"""Where a completion stops: one rule, applied by every generation engine (docs/generation.md, "Where a completion
stops").

A completion stops at the first sampled token in the union of the tokenizer's EOS, every id of the model's
``generation_config.eos_token_id`` (an int or a list; the model config's when the generation config has none) and
the chat template's end-of-turn token (the special token it writes right after an assistant turn's content, plus
any of :data:`END_OF_TURN_NAMES` that is in the vocabulary and in the template's source), plus the request's own
``SamplingParams.stop_token_ids``. ``ignore_eos`` drops the rule's ids and keeps the request's. The stop token is
the completion's last token, and the result says which rule fired (``GenerationResult.stop_token_id``,
``GenerationResult.stop_kind``).

Invariant: the torch and vLLM engines stop on the same tokens. The vLLM engine passes these ids as
``stop_token_ids`` and points vLLM's ``generation_config`` at an empty one of its own, so a
``generation_config.json`` in the engine's model directory changes nothing.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

StopKind = Literal["eos", "generation_config", "end_of_turn", "request"]
"""Which rule a stop token belongs to (checked in this order when an id is in several)."""

END_OF_TURN_NAMES: tuple[str, ...] = (
    "<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<end_of_turn>", "<|end|>", "<|end_of_turn|>", "<|eot|>",
)
"""End-of-turn tokens of common chat templates (ChatML/Qwen, Llama-3, Gemma, Phi-3, ...): one counts when it is in
the vocabulary and its name occurs in the tokenizer's chat template."""

_PROBE = "zqx"
"""Assistant content rendered to find what the template writes after it (plain letters: any vocabulary has them)."""


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (int(value),)
    return tuple(sorted({int(v) for v in value}))


@dataclass(frozen=True)
class StopTokens:
    """The stop ids of one model, by rule (see the module docstring)."""

    eos: tuple[int, ...] = ()
    """The tokenizer's EOS (none or one)."""
    generation_config: tuple[int, ...] = ()
    """``generation_config.eos_token_id`` (else the model config's)."""
    end_of_turn: tuple[int, ...] = ()
    """The chat template's end-of-turn tokens."""

    @property
    def ids(self) -> frozenset[int]:
        """Every id of the rule."""
        return frozenset(self.eos) | frozenset(self.generation_config) | frozenset(self.end_of_turn)

    def for_request(self, stop_token_ids: Iterable[int] = (), ignore_eos: bool = False) -> frozenset[int]:
        """What one request stops on: its own ``stop_token_ids``, plus the rule's ids unless ``ignore_eos``."""
        own = frozenset(int(t) for t in stop_token_ids)
        return own if ignore_eos else own | self.ids

    def kind(self, token_id: int, ignore_eos: bool = False) -> StopKind:
        """Which rule ``token_id`` stopped a completion by (``request``: none of the model's, or the request
        ignored them, so its own ``stop_token_ids``)."""
        if ignore_eos:
            return "request"
        for name in ("eos", "generation_config", "end_of_turn"):
            if token_id in getattr(self, name):
                return name  # type: ignore[return-value]
        return "request"


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    """The chat template's end-of-turn token ids (empty without a chat template).

    Two ways, united: render a user turn and an assistant turn and take the token right after the assistant's
    content when it is a special token; and every name of :data:`END_OF_TURN_NAMES` that the template's source
    mentions and the vocabulary holds."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return ()
    found: set[int] = set()
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    special |= {int(i) for i, t in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items()
                if getattr(t, "special", False)}
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "a"}, {"role": "assistant", "content": _PROBE}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot render this conversation: the names alone decide
        text = None
    if isinstance(text, str) and _PROBE in text:
        rest = text[text.rindex(_PROBE) + len(_PROBE):].lstrip()
        after = list(tokenizer(rest, add_special_tokens=False)["input_ids"]) if rest else []
        if after and int(after[0]) in special:
            found.add(int(after[0]))
    sources = template.values() if isinstance(template, dict) else [template]
    vocab = tokenizer.get_vocab()
    for name in END_OF_TURN_NAMES:
        if name in vocab and any(name in str(s) for s in sources):
            found.add(int(vocab[name]))
    return tuple(sorted(found))


def stop_tokens(tokenizer: Any, generation_config: Any = None, model_config: Any = None) -> StopTokens:
    """The rule's ids for a model: its tokenizer, its ``GenerationConfig`` (or None) and its config (or None)."""
    gen_eos = getattr(generation_config, "eos_token_id", None)
    if gen_eos is None:
        gen_eos = getattr(model_config, "eos_token_id", None)
    eos = tokenizer.eos_token_id
    return StopTokens(eos=_ids(eos), generation_config=_ids(gen_eos), end_of_turn=end_of_turn_ids(tokenizer))


def load_generation_config(path: str) -> Any:
    """The ``GenerationConfig`` of a checkpoint directory as transformers would give the loaded model: its
    ``generation_config.json``, else one derived from its ``config.json``, else None."""
    from transformers import AutoConfig, GenerationConfig

    if os.path.isfile(os.path.join(path, "generation_config.json")):
        return GenerationConfig.from_pretrained(path, local_files_only=True)
    if os.path.isfile(os.path.join(path, "config.json")):
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(path, local_files_only=True))
    return None
