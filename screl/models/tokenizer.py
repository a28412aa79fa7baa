"""A character-level tokenizer built in memory (no download), identical to the TRL benchmark peer's."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<eos>", "<bos>")
"""Special tokens, ids 0, 1, 2."""
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"
"""Ordinary characters, ids 3.. in this order."""
PAD_TOKEN_ID, EOS_TOKEN_ID, BOS_TOKEN_ID = 0, 1, 2


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
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>"
    )
