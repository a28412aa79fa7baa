"""The text of streamed replies while they are generated: what a stream may send before a reply is done.

The policy server asks the generation worker for each in-flight request's tokens so far
(``GenerationWorker.partial_tokens``, from engines that declare ``streams_tokens``) every ``POLL_S`` seconds, and
:class:`LiveText` turns them into text deltas that the finished reply's text is sure to begin with:

- the last token so far is held back (it may be a stop token, whose text the reply drops);
- a character split across tokens waits for its last byte (no trailing U+FFFD);
- the text stops at a stop string (``stop``), and a tail that may be the start of one waits;
- a reply that may hold tool calls (the request has tools and its ``tool_choice`` is not ``none``) sends nothing
  before it is done: the parser reads the whole reply to find the calls.

Invariant: the deltas sent for a reply, joined, are a prefix of its final text (``sent``); the stream's closing
chunks carry the rest (:func:`rest`). A reply whose text so far does not extend what was sent (a tokenizer whose
decoding of a prefix is not a prefix of the decoding) sends nothing more until it is done.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from screl.envs.base import decode_completion

__all__ = ["POLL_S", "LiveText", "rest"]

POLL_S = 0.05
"""Seconds between two reads of the in-flight tokens of a stream."""


class LiveText:
    """Deltas of ``n`` replies' text as their tokens come (see the module docstring)."""

    def __init__(self, tokenizer: Any, n: int, stops: Sequence[str], live: bool) -> None:
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]
        self.sent = [""] * n
        self.live = [live] * n
        self._seen = [0] * n  # tokens of each reply the last read had

    @property
    def any_live(self) -> bool:
        return any(self.live)

    def update(self, i: int, tokens: Sequence[int]) -> str:
        """The new text of reply ``i`` given its tokens so far ("" when nothing new is safe to send)."""
        if not self.live[i] or len(tokens) <= self._seen[i]:
            return ""
        self._seen[i] = len(tokens)
        text = decode_completion(self.tokenizer, list(tokens[:-1])).rstrip("\ufffd")
        hits = [text.find(s) for s in self.stops if s in text]
        if hits:
            text, self.live[i] = text[: min(hits)], False  # the reply ends at the stop string
        else:
            text = text[: len(text) - max((_overlap(text, s) for s in self.stops), default=0)]
        if not text.startswith(self.sent[i]):
            self.live[i] = False
            return ""
        delta, self.sent[i] = text[len(self.sent[i]):], text
        return delta

    async def follow(self, worker: Any, request_ids: Sequence[str],
                     done: asyncio.Future[Any]) -> AsyncIterator[tuple[int, str]]:
        """``(reply index, delta)`` while ``done`` (the generation) runs, reading ``worker``'s in-flight tokens."""
        while not done.done():
            await asyncio.wait({done}, timeout=POLL_S)
            if done.done() or not self.any_live:
                continue
            partial = await worker.partial_tokens.remote(list(request_ids))
            if partial is None:  # the engine cannot tell: the text comes when the replies are done
                self.live = [False] * len(self.live)
                continue
            for i, rid in enumerate(request_ids):
                delta = self.update(i, partial.get(rid, ()))
                if delta:
                    yield i, delta


def rest(sent: str, final: str) -> str:
    """What the closing chunk of a reply carries: its final text after what was sent already."""
    return final[len(sent):] if final.startswith(sent) else final


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (shorter than ``stop``)."""
    for k in range(min(len(text), len(stop) - 1), 0, -1):
        if text.endswith(stop[:k]):
            return k
    return 0
