"""Counting prompt tokens at start-up: texts too short to be over any limit are not tokenized, and the bound that
decides it is never below the real count."""

from __future__ import annotations

from typing import Any

import numpy as np

from screl.envs.dataset_prepare import token_bound, token_counts
from screl.models import TinyCausalLM, build_char_tokenizer


class _Counting:
    """A tokenizer that records which texts it was asked to encode."""

    def __init__(self) -> None:
        self.inner, self.seen = build_char_tokenizer(), []  # type: ignore[var-annotated]

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> Any:
        self.seen.extend(texts)
        return self.inner(texts, add_special_tokens=add_special_tokens)


def test_only_texts_that_could_be_over_the_limit_are_tokenized() -> None:
    texts = ["1+1=", "what is 12 plus 30?" * 4, "a b"]
    tok = _Counting()
    counts = token_counts(TinyCausalLM(), tok, [texts], len(texts), bound=20)
    assert tok.seen == [texts[1]]  # 4 and 3 characters: at most 9 and 7 tokens, within 20
    assert counts[1] == len(texts[1])  # the character tokenizer: one token a character
    assert list(counts[[0, 2]]) == [token_bound(texts[0]), token_bound(texts[2])] and all(counts[[0, 2]] <= 20)
    everything = token_counts(TinyCausalLM(), _Counting(), [texts], len(texts))
    assert list(everything) == [len(t) for t in texts]  # no bound: every text counted


def test_the_bound_holds_for_subword_and_byte_fallback_tokenizers() -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tk = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=False))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()  # SentencePiece's word-start marker, the bound's worst case
    tk.train_from_iterator(["one two three 1 2 3"] * 10, trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"]))
    for text in ["1 2 3 4 5 6 7 8 9", "ünïcödé 漢字 1", "three two one", " "]:
        n = len(tk.encode(text).ids)
        assert n <= token_bound(text), (text, n, token_bound(text))
    assert np.array_equal(token_counts(TinyCausalLM(), _Counting(), [["ab"]], 1, bound=1), [2])
