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

import json
from collections.abc import Mapping, Sequence
from typing import Any

from screl.models.tokenizer import CHAR_CHAT_TEMPLATE

__all__ = ["CHAR_CHAT_TEMPLATE", "SpliceError", "chat_prompt_ids", "encode_text", "message_text", "plain_messages",
           "render_chat"]


class SpliceError(ValueError):
    """The conversation's rendering does not extend the tokens of its previous turn."""


def message_text(content: Any) -> str:
    """A message's text: a string, None (""), or OpenAI content parts (their text joined)."""
    if content is None:
        return ""
    if isinstance(content, list):  # OpenAI content parts: the text ones
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def plain_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Each message as chat templates take it: role and text content; an assistant's ``tool_calls`` with their
    arguments as objects (what Hermes/Qwen templates serialize), a tool message's ``tool_call_id`` and ``name``.
    Token-id extras are dropped."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": str(m["role"]), "content": message_text(m.get("content"))}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_template_call(c) for c in m["tool_calls"]]
        for key in ("tool_call_id", "name"):
            if m.get(key) is not None:
                msg[key] = str(m[key])
        out.append(msg)
    return out


def _template_call(call: Mapping[str, Any]) -> dict[str, Any]:
    fn = call.get("function") or {}
    args = fn.get("arguments") or "{}"
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            raise SpliceError(f"tool call {call.get('id')!r}: arguments are not JSON ({args[:80]!r})") from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn.get("name"), "arguments": args}}


def render_chat(tokenizer: Any, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The conversation as text through the tokenizer's chat template (``tools``: chat-completions function
    tools, rendered by the template's own tools section)."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"the tokenizer {type(tokenizer).__name__} has no chat template: chat requests need one "
                         "(use /v1/completions with a rendered prompt instead)")
    kwargs: dict[str, Any] = {"tools": list(tools)} if tools else {}
    return str(tokenizer.apply_chat_template(plain_messages(messages), tokenize=False,
                                             add_generation_prompt=add_generation_prompt, **kwargs))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of ``text`` as is: special tokens written in it are parsed, none are added."""
    return [int(t) for t in tokenizer(text, add_special_tokens=False)["input_ids"]]


_SENTINEL = "\x00screl-reply\x00"


def chat_prompt_ids(tokenizer: Any, messages: Sequence[Mapping[str, Any]],
                    prefix_ids: Sequence[int] | None = None, tools: Sequence[Mapping[str, Any]] | None = None,
                    opener: str = "") -> list[int]:
    """The prompt ids of the conversation's next reply.

    ``prefix_ids`` (the previous turn's prompt + completion, the reply being the last assistant message) are
    kept verbatim. After them come the tokens of what the template renders after that reply: the end of its
    turn (less the stop token the model already sampled) and the messages since. The reply's text itself is
    never re-rendered (nor its tool calls: they are in its sampled tokens), so special or odd tokens the model
    sampled cannot change the past. ``tools`` go to the template; ``opener`` (the start of a tool call that
    ``tool_choice`` forces) follows the generation prompt.
    """
    if not prefix_ids:
        return encode_text(tokenizer, render_chat(tokenizer, messages, True, tools) + opener)
    replies = [i for i, m in enumerate(messages) if m.get("role") == "assistant"]
    if not replies:
        raise SpliceError("past tokens were given but the conversation has no assistant message to splice them at")
    last = replies[-1]
    stand_in = [*messages[:last], {"role": "assistant", "content": _SENTINEL}, *messages[last + 1:]]
    head = render_chat(tokenizer, stand_in[:last + 1], False, tools)
    full = render_chat(tokenizer, stand_in, True, tools)
    if _SENTINEL not in head or not full.startswith(head):
        raise SpliceError("the chat template renders the earlier turns differently once the conversation goes on "
                          "(it rewrites past messages), so the past tokens cannot be kept verbatim")
    tail = head[head.rindex(_SENTINEL) + len(_SENTINEL):]  # the end of the reply's turn
    stop = str(tokenizer.decode([int(prefix_ids[-1])], skip_special_tokens=False))
    if stop and tail.startswith(stop):  # the model sampled it already
        tail = tail[len(stop):]
    return [int(t) for t in prefix_ids] + encode_text(tokenizer, tail + full[len(head):] + opener)
