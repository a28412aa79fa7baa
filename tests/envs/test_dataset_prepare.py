"""Counting prompt tokens at start-up: texts too short to be over any limit are not tokenized, and the bound that
decides it is never below the real count."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from screl.envs.dataset_prepare import (
    TextCounter,
    ascii_bound_slack,
    column_token_counts,
    token_bound,
    token_bounds,
    token_counts,
)
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


def _bpe_tokenizer() -> Any:
    """A small byte-level BPE as a transformers fast tokenizer (trained here: no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.train_from_iterator(["natalia sold 48 clips in april and half as many in may"] * 20,
                           trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<eos>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>", eos_token="<eos>")


TEXTS = ["natalia sold clips", "ünïcödé 漢字 in may <eos> and", " ", "half as many " * 40] * 50


def test_the_backend_counts_what_the_tokenizer_counts_in_every_batch_in_order() -> None:
    tok = _bpe_tokenizer()
    expected = [len(ids) for ids in tok(TEXTS, add_special_tokens=False)["input_ids"]]
    counter = TextCounter(tok)
    batches = [TEXTS[i:i + 7] for i in range(0, len(TEXTS), 7)]  # 29 batches: the thread pool's queue fills
    assert counter.counts(batches) == expected
    assert counter.backend is tok.backend_tokenizer  # the Rust backend counted the batches after the first


class _Prefixing:
    """A tokenizer wrapper that adds text before every prompt: its backend alone would count less."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.backend_tokenizer = inner, inner.backend_tokenizer

    def __call__(self, texts: list[str], add_special_tokens: bool = False) -> Any:
        return self.inner(["natalia sold " + t for t in texts], add_special_tokens=add_special_tokens)


def test_a_backend_that_counts_otherwise_than_its_tokenizer_is_not_used() -> None:
    tok = _Prefixing(_bpe_tokenizer())
    counter = TextCounter(tok)
    counts = counter.counts([TEXTS[:10], TEXTS[10:30]])
    assert counter.backend is None
    assert counts == [len(ids) for ids in tok(TEXTS[:30])["input_ids"]]


def test_the_column_wide_bound_is_the_bound_of_each_text() -> None:
    import pyarrow as pa

    texts = ["1+1=", "ünïcödé 漢字", "", None, "a" * 300]
    column = pa.chunked_array([texts[:2], texts[2:]])
    assert list(token_bounds(column)) == [token_bound(t or "") for t in texts]  # a null: as an empty text


def _metaspace_tokenizer() -> Any:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE(unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.Metaspace()
    tk.train_from_iterator(["natalia sold 48 clips"] * 10, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="<unk>")


def test_one_token_a_byte_bounds_ascii_only_where_the_tokenizer_adds_nothing() -> None:
    import pyarrow as pa

    bpe = _bpe_tokenizer()
    assert ascii_bound_slack(bpe) == 0
    bpe.backend_tokenizer.pre_tokenizer = __import__("tokenizers").pre_tokenizers.ByteLevel(add_prefix_space=True)
    assert ascii_bound_slack(bpe) == 1  # the prefix space
    assert ascii_bound_slack(_metaspace_tokenizer()) is None  # a word-start marker: two a byte
    assert ascii_bound_slack(build_char_tokenizer()) == 0  # one token a character
    column = pa.chunked_array([["natalia sold", "ünï", None]])
    assert list(token_bounds(column, 1)) == [13, token_bound("ünï"), 1]  # ASCII (and null): bytes + slack


def _read(texts: list[str]) -> Any:
    return lambda rows: [[texts[int(r)] for r in rows]]


@pytest.mark.parametrize("wrap", [False, True])
def test_column_counts_never_undercount_and_count_exactly_what_may_be_over(wrap: bool) -> None:
    import pyarrow as pa

    rng = np.random.default_rng(0)
    words = ["natalia", "sold", "48", "clips", "ünï", "漢字", "half", "as", "many", "in", "may", "?"]
    texts = [" ".join(rng.choice(words, size=rng.integers(1, 30))) for _ in range(600)]
    tok = _Prefixing(_bpe_tokenizer()) if wrap else _bpe_tokenizer()  # the wrapper adds 2-3 tokens to each text
    exact = np.asarray([len(ids) for ids in tok(texts, add_special_tokens=False)["input_ids"]])
    rows = np.arange(len(texts))
    column = pa.chunked_array([texts])
    counts = column_token_counts(tok, column, rows, 40, _read(texts))
    # the wrapper counts otherwise than its backend: two tokens a byte for every text; else one a byte for ASCII
    bounds = token_bounds(column) if wrap else token_bounds(column, 0)
    within = bounds <= 40  # cannot be over the limit: the bound stands for the count, the text is not tokenized
    assert np.array_equal(counts[within], bounds[within]) and np.array_equal(counts[~within], exact[~within])
    assert (counts >= exact).all() or wrap  # a bound, or the count itself: never less than the tokenizer counts
    assert within.sum() > (token_bounds(column) <= 40).sum() or wrap  # one a byte skipped more texts
