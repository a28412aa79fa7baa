"""A character-level tokenizer built in memory (no download), identical to the TRL benchmark peer's (plus a
chat template of its own, which tokenizes nothing differently)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>")
"""Special tokens, ids 0, 1, 2."""
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"
"""Ordinary characters, ids 3.. in this order."""
PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID = 0, 1, 2
CHAR_CHAT_TEMPLATE = (
    "<bos>{% if tools %}tools{% for t in tools %} {{ (t['function'] if t['function'] is defined else t)['name'] }}"
    "{% endfor %}<eos>{% endif %}"
    "{% for m in messages %}{{ m['role'] }} {{ m['content'] }}"
    "{% for c in m['tool_calls'] or [] %}={% if tools and tools | length > 1 %}{{ c['function']['name'] }} "
    "{% endif %}{{ c['function']['arguments'].values() | join(' ') }}{% endfor %}<eos>{% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)
"""The chat template: ``<bos>``, then ``tools <name> <name><eos>`` when the request offers tools, then
``<role> <content><eos>`` per message (an assistant's tool calls as the compact parser reads them,
``=<arguments>``), then ``assistant `` for the reply (roles and contents must keep to ``CHARS``: other
characters become ``<pad>``)."""


def char_vocab() -> dict[str, int]:
    """The vocabulary: special tokens first, then ``CHARS``."""
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    for c in CHARS:
        vocab[c] = len(vocab)
    return vocab


def build_char_tokenizer() -> PreTrainedTokenizerFast:
    """WordLevel over single characters, unknown -> ``<pad>``; decoding fuses characters back together."""
    tk = Tokenizer(models.WordLevel(vocab=char_vocab(), unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tk.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
    tokenizer.chat_template = CHAR_CHAT_TEMPLATE  # chat requests and multi-turn rollouts (screl.rollout.workflows.chat)
    return tokenizer
