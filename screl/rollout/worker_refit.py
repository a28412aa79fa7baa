"""How a generation worker (:class:`screl.rollout.worker.GenerationWorker`) loads a new weight version into its
engine: the buckets (state-dict pieces, or ObjectRefs to them) streamed one at a time to an engine that takes them
so (``streams_weight_buckets``: the torch and vLLM engines), else merged into one state dict (the
``GenerationEngine`` protocol's).

Invariant: a streaming refit never holds more than one bucket (each ObjectRef is fetched when the engine draws it
and released once loaded), and the deadlines' clock stands still for the whole refit.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import ray

from screl.rollout.deadlines import PausableClock
from screl.rollout.engines.buckets import bucket_from_wire, merge_buckets

__all__ = ["fetched_lazily", "refit"]


async def refit(engine: Any, weights: list[Any], version: int, clock: PausableClock, *, streams: bool,
                drain: bool) -> None:
    """Load ``weights`` into ``engine`` as ``version``, streamed (``streams``) or merged. ``clock`` stands still
    meanwhile; with ``drain`` (the drain gate) the requests in flight finish under the old weights first, and new
    ones wait until the refit ends."""
    loop = asyncio.get_running_loop()
    state: Any
    if streams:
        state = fetched_lazily(weights, loop)
    else:
        state = merge_buckets([bucket_from_wire(await w if isinstance(w, ray.ObjectRef) else w) for w in weights])
    clock.pause()
    try:
        if drain:
            await loop.run_in_executor(None, engine.pause, "wait")
        try:
            await loop.run_in_executor(None, engine.update_weights, state, version)
        finally:
            if drain:
                engine.resume()
    finally:
        clock.resume()


async def _fetch(ref: Any) -> Any:
    return await ref


def fetched_lazily(weights: list[Any], loop: asyncio.AbstractEventLoop) -> Iterator[Any]:
    """The buckets of ``weights`` for an engine's thread: an ObjectRef is awaited on the worker's event loop when
    the engine draws it (``map`` keeps no reference to a bucket it has handed out)."""
    def get(w: Any) -> Any:
        if isinstance(w, ray.ObjectRef):
            return bucket_from_wire(asyncio.run_coroutine_threadsafe(_fetch(w), loop).result())
        return bucket_from_wire(w)

    return map(get, weights)
