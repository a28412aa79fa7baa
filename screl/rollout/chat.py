"""Chat prompts that never re-tokenize the past: templates from the tokenizer, and the token-exact splice.

A conversation's next prompt is rendered with the tokenizer's chat template. When the earlier turns' tokens
are known (``prefix_ids``: the last turn's prompt + completion, as the engine saw and sampled them), they are
kept verbatim and only the text the template adds after them is tokenized: re-tokenizing the decoded past
could merge or split tokens differently, and the training row would then hold tokens the model never
sampled. The splice needs a template that renders the earlier turns the same way as the conversation goes
on; one that rewrites them (dropping past reasoning, say) gets :class:`SpliceError` instead of a silent
re-tokenization.

The tiny character tokenizer has no template of its own upstream; :data:`CHAR_CHAT_TEMPLATE` is its
(``<bos>``, then ``<role> <content><eos>`` per message, then ``assistant `` for the reply).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from screl.models.tokenizer import CHAR_CHAT_TEMPLATE

__all__ = ["CHAR_CHAT_TEMPLATE", "SpliceError", "chat_prompt_ids", "encode_text", "plain_messages",
           "render_chat"]



class SpliceError(ValueError):
    """The conversation's rendering does not extend the tokens of its previous turn."""


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Role and text content of each message (token-id extras dropped; list content joined)."""
    out = []
    for m in messages:
        content = m.get("content") or ""
        if isinstance(content, list):  # OpenAI content parts: the text ones
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        out.append({"role": str(m["role"]), "content": str(content)})
    return out


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True) -> str:
    """The conversation as text through the tokenizer's chat template."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat template: chat requests need one "
                         "(use /v1/completions with a rendered prompt instead)")
    return str(tokenizer.apply_chat_template(plain_messages(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as is: special tokens written in it are parsed, none are added."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


_SENTINEL = "\x00screl-reply\x00"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    prefix_ids: Sequence[int] | None = None) -> list[int]:
    """The prompt ids of the conversation's next reply.

    ``prefix_ids`` (the previous turn's prompt + completion, the reply being the last assistant message) are
    kept verbatim. After them come the tokens of what the template renders after that reply: the end of its
    turn (less the stop token the model already sampled) and the messages since. The reply's text itself is
    never re-rendered, so special or odd tokens the model sampled cannot change the past.
    """
    if not prefix_ids:
        return encode_text(tokenizer, render_chat(tokenizer, messages, add_generation_prompt=True))
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not replies:
        raise SpliceError("past tokens were given but the conversation has no assistant message to splice them at")
    last = replies[-1]
    stand_in = [*plain_messages(messages[:last]), {"role": "assistant", "content": _SENTINEL},
                *plain_messages(messages[last + 1:])]
    head = render_chat(tokenizer, stand_in[:last + 1], add_generation_prompt=False)
    full = render_chat(tokenizer, stand_in, add_generation_prompt=True)
    if _SENTINEL not in head or not full.startswith(head):
        raise SpliceError("the chat template renders the earlier turns differently once the conversation goes on "
                          "(it rewrites past messages), so the past tokens cannot be kept verbatim")
    tail = head[head.rindex(_SENTINEL) + len(_SENTINEL):]  # the end of the reply's turn
    stop = str(tokenizer.decode([int(prefix_ids[-1])], skip_special_tokens=False))
    if stop and tail.startswith(stop):  # the model sampled it already
        tail = tail[len(stop):]
    return [int(t) for t in prefix_ids] + encode_text(tokenizer, tail + full[len(head):])
