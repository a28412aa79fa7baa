"""What :meth:`screl.envs.DatasetTask.prepare` does with the prompt texts once the run's policy is known: count each
prompt's tokens once (batched through the tokenizer when the policy reads the text as is), drop the ones over
``max_prompt_tokens``, and refuse one that fills the model's whole context."""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from screl.envs.dataset_columns import KEY

if TYPE_CHECKING:
    from screl.models.spec import PolicySpec

log = logging.getLogger(__name__)

MAX_LISTED_IDS = 100


def context_positions(policy: PolicySpec) -> int | None:
    """The model's context (``max_position_embeddings``) when its spec tells it without loading the model."""
    try:
        config = policy.build_config()
    except Exception:  # noqa: BLE001 - a spec that cannot tell: no check here (the engine's own limit applies)
        return None
    value = getattr(config, "max_position_embeddings", None)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def token_bound(text: str) -> int:
    """At most this many tokens, for any tokenizer whose every token covers at least one byte of the text or is a
    lone word-start marker (byte-level BPE, SentencePiece with byte fallback, WordPiece, characters): two per byte."""
    return 2 * len(text.encode("utf-8")) + 1


_KEEPS_ASCII = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Strip", "StripAccents"}
"""Normalizers that never lengthen an ASCII text (ASCII is a fixed point of Unicode normalization)."""
_SPLITS_ONLY = {"ByteLevel", "Split", "Digits", "Punctuation", "Whitespace", "WhitespaceSplit"}
"""Pre-tokenizers that split the text without adding to it (ByteLevel's optional prefix space aside)."""


def _parts(component: Any) -> list[dict[str, Any]]:
    if not component:
        return []
    if component.get("type") == "Sequence":
        return [p for c in component.get("normalizers") or component.get("pretokenizers") or [] for p in _parts(c)]
    return [component]


def ascii_bound_slack(tokenizer: Any) -> int | None:
    """For a fast tokenizer that adds nothing to an ASCII text (its normalizers keep ASCII as it is, its
    pre-tokenizers only split it, each token covers at least one byte): the tokens it can make of an ASCII text
    beyond one a byte (ByteLevel's prefix space: 1, else 0). None: not known, :func:`token_bound` applies."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        spec = json.loads(backend.to_str()) if backend is not None else None
    except Exception:  # noqa: BLE001 - a backend that cannot describe itself: the general bound
        return None
    if not isinstance(spec, dict):
        return None
    normalizers, splits = _parts(spec.get("normalizer")), _parts(spec.get("pre_tokenizer"))
    if any(n.get("type") not in _KEEPS_ASCII for n in normalizers):
        return None
    if any(p.get("type") not in _SPLITS_ONLY for p in splits):
        return None
    return int(any(p.get("type") == "ByteLevel" and p.get("add_prefix_space") for p in splits))


def token_bounds(texts: pa.ChunkedArray, ascii_slack: int | None = None) -> np.ndarray:
    """:func:`token_bound` of every text of a column, computed in Arrow (no Python strings); a null counts 0. With
    ``ascii_slack`` (:func:`ascii_bound_slack`), an ASCII text's bound is its bytes plus that slack."""
    lengths = pc.binary_length(texts)
    nbytes = np.asarray(pc.fill_null(lengths, 0).to_numpy(), dtype=np.int64)
    bounds = 2 * nbytes + 1
    if ascii_slack is not None:  # as many characters as bytes: ASCII
        ascii_ = np.asarray(pc.fill_null(pc.equal(pc.utf8_length(texts), lengths), True)
                            .to_numpy(zero_copy_only=False), dtype=bool)
        bounds[ascii_] = nbytes[ascii_] + ascii_slack
    return bounds


def column_token_counts(tokenizer: Any, texts: pa.ChunkedArray, rows: np.ndarray, bound: int,
                        read: Callable[[np.ndarray], Iterable[list[str]]]) -> np.ndarray:
    """The token counts of the ``rows`` of a text column read as is: bounded column-wide first
    (:func:`token_bounds`; the ASCII bound checked on up to 256 rows spread over them, whose counts also check the
    tokenizer's backend, :class:`TextCounter`); only the rows whose bound is
    over ``bound`` are read (``read(rows)``: their texts, in batches) and counted (:class:`TextCounter`)."""
    slack, counter = ascii_bound_slack(tokenizer), TextCounter(tokenizer)
    counts = token_bounds(texts, slack)[rows]
    sample = np.unique(np.linspace(0, len(rows) - 1, num=min(256, len(rows))).astype(np.int64))
    if slack is not None and sample.size:  # the tokenizer counts as its backend reads, within the bounds
        exact = counter.counts([[t for b in read(rows[sample]) for t in b]])
        if counter.backend is None or any(c > b for c, b in zip(exact, counts[sample].tolist(), strict=True)):
            log.warning("DatasetTask: %s does not count as its backend reads (one token a byte of an ASCII prompt at"
                        " most); every prompt is bounded by two tokens a byte instead", type(tokenizer).__name__)
            counts = token_bounds(texts)[rows]
    over = np.flatnonzero(counts > bound)
    if over.size:
        counts[over] = counter.counts(read(rows[over]))
    return counts


def reads_as_is(policy: PolicySpec) -> bool:
    """Whether the policy reads a prompt's text as it is (``PolicySpec.prompt_token_ids`` not overridden)."""
    from screl.models.spec import PolicySpec

    return type(policy).prompt_token_ids is PolicySpec.prompt_token_ids


class TextCounter:
    """Token counts of texts read as they are, as ``tokenizer(texts, add_special_tokens=False)`` counts them.

    A fast tokenizer is counted through its Rust backend (``encode_batch_fast``: no offsets, no Python lists of
    ids), in a thread per core (the backend releases the GIL; ``TOKENIZERS_PARALLELISM=false``, which ``screl fit``
    sets, keeps each call on one thread). The first batch is counted both ways: a backend whose counts differ from
    the tokenizer's (a wrapper that adds to the text, say) is not used."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.backend: Any = None  # the Rust backend, once the first batch showed it counts as the tokenizer does
        self._checked = False

    def _slow(self, texts: list[str]) -> list[int]:
        return [len(ids) for ids in self.tokenizer(texts, add_special_tokens=False)["input_ids"]]

    def _fast(self, texts: list[str]) -> list[int]:
        return [len(e) for e in self.backend.encode_batch_fast(texts, add_special_tokens=False)]

    def _first(self, texts: list[str]) -> list[int]:
        """Counted by the tokenizer (which sets its backend as it encodes); its backend kept if it agrees."""
        counts = self._slow(texts)
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if hasattr(backend, "encode_batch_fast"):
            self.backend = backend
            if self._fast(texts) != counts:
                self.backend = None
        self._checked = True
        return counts

    def counts(self, batches: Iterable[list[str]]) -> list[int]:
        """The counts of every text of ``batches``, in order."""
        from concurrent.futures import ThreadPoolExecutor

        from screl.threads import available_cores

        out: list[int] = []
        workers = available_cores()
        pending: deque[Any] = deque()  # at most two batches a thread read ahead: the texts are not all held
        with ThreadPoolExecutor(max_workers=workers) as pool:
            for texts in batches:
                if not self._checked:
                    out.extend(self._first(texts))
                elif self.backend is None:
                    out.extend(self._slow(texts))
                else:
                    pending.append(pool.submit(self._fast, texts))
                    if len(pending) > 2 * workers:
                        out.extend(pending.popleft().result())
            while pending:
                out.extend(pending.popleft().result())
        return out


def token_counts(policy: PolicySpec, tokenizer: Any, batches: Iterable[list[str]], total: int,
                 bound: int | None = None) -> np.ndarray:
    """Each prompt's length in tokens as the model sees it (``policy.prompt_token_ids``), counted once; a policy
    that reads the text as is (the default) is counted a batch at a time by the tokenizer, skipping the texts too
    short to matter: with ``bound`` (the smallest limit checked), a text whose :func:`token_bound` is within it
    gets that bound as its count (an over-estimate, still within every limit)."""
    counts = np.empty(total, dtype=np.int64)
    if not reads_as_is(policy):
        done = 0
        for texts in batches:
            counts[done:done + len(texts)] = [len(policy.prompt_token_ids(tokenizer, text)) for text in texts]
            done += len(texts)
        assert done == total, f"counted {done} prompts of {total}"
        return counts
    todo: list[int] = []
    done = 0

    def over_bound() -> Iterable[list[str]]:
        nonlocal done
        for texts in batches:
            bounds = [token_bound(t) for t in texts]
            counts[done:done + len(texts)] = bounds
            keep = [i for i, b in enumerate(bounds) if bound is None or b > bound]
            todo.extend(done + i for i in keep)
            done += len(texts)
            if keep:
                yield [texts[i] for i in keep]

    counted = TextCounter(tokenizer).counts(over_bound())
    assert done == total, f"counted {done} prompts of {total}"
    counts[todo] = counted
    return counts


def within_limit(counts: np.ndarray, ids: np.ndarray, limit: int, where: str, held_out: bool) -> tuple[np.ndarray,
                                                                                                         dict[str, Any]]:
    """(which prompts are kept, the report's counts); every prompt dropped is refused naming the key."""
    keep = counts <= limit
    if len(counts) and not keep.any():
        which = "held-out prompt" if held_out else "prompt"
        raise ValueError(f"{KEY}.max_prompt_tokens={limit} drops every {which} of {where}, {len(counts)} prompts)"
                         " under the policy's tokenizer; raise it")
    dropped = np.sort(ids[~keep])
    if dropped.size:
        log.warning("DatasetTask: max_prompt_tokens=%d dropped %d of %d prompts of %s)", limit, dropped.size,
                    len(counts), where)
    return keep, {"kept": int(keep.sum()), "dropped": int(dropped.size),
                  "dropped_ids": [int(i) for i in dropped[:MAX_LISTED_IDS]]}


def check_context(counts: np.ndarray, ids: np.ndarray, limit: int, where: str) -> None:
    """A prompt that fills the model's whole context leaves no room to generate: refused before the run starts,
    naming it (the id is the row index without ``id_column``)."""
    over = np.flatnonzero(counts >= limit)
    if over.size:
        k = int(over[0])
        raise ValueError(f"{KEY}: prompt id {int(ids[k])} of {where}) is {int(counts[k])} tokens under the policy's"
                         f" tokenizer, and the model's context is {limit} positions (max_position_embeddings): nothing"
                         f" could be generated. Set {KEY}.max_prompt_tokens to drop such prompts, or shorten it")
