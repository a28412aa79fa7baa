"""What :meth:`screl.envs.DatasetTask.prepare` does with the prompt texts once the run's policy is known: count each
prompt's tokens once (batched through the tokenizer when the policy reads the text as is), drop the ones over
``max_prompt_tokens``, and refuse one that fills the model's whole context."""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

import numpy as np

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


def _as_is_counts(tokenizer: Any, texts: list[str], bound: int | None) -> list[int]:
    """Token counts of texts read as they are; a text whose :func:`token_bound` is within ``bound`` is not
    tokenized (it cannot be over any limit that matters): its bound stands for its count."""
    counts = [token_bound(t) for t in texts]
    todo = [i for i, c in enumerate(counts) if bound is None or c > bound]
    if todo:
        encoded = tokenizer([texts[i] for i in todo], add_special_tokens=False)["input_ids"]
        for i, ids in zip(todo, encoded, strict=True):
            counts[i] = len(ids)
    return counts


def token_counts(policy: PolicySpec, tokenizer: Any, batches: Iterable[list[str]], total: int,
                 bound: int | None = None) -> np.ndarray:
    """Each prompt's length in tokens as the model sees it (``policy.prompt_token_ids``), counted once; a policy
    that reads the text as is (the default) is counted a batch at a time by the tokenizer, skipping the texts too
    short to matter: with ``bound`` (the smallest limit checked), a text whose :func:`token_bound` is within it
    gets that bound as its count (an over-estimate, still within every limit)."""
    from screl.models.spec import PolicySpec

    as_is = type(policy).prompt_token_ids is PolicySpec.prompt_token_ids
    counts = np.empty(total, dtype=np.int64)
    done = 0
    for texts in batches:
        if as_is:
            lengths = _as_is_counts(tokenizer, texts, bound)
        else:
            lengths = [len(policy.prompt_token_ids(tokenizer, text)) for text in texts]
        counts[done:done + len(texts)] = lengths
        done += len(texts)
    assert done == total, f"counted {done} prompts of {total}"
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
