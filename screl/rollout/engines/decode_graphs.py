"""The continuous path's decode step at fixed shapes, captured as CUDA graphs (``backend_args.cuda_graphs``).

A decode step of ``hi`` slots over ``keys`` key positions is launch-bound on a GPU: hundreds of small kernels a
token for a small model. :class:`DecodeGraphs` runs it at bucketed shapes, ``rows`` the next power of two at or
above ``hi`` (at most the cache's slots) and ``keys`` the next power of two at or above the step's longest row (at
least :data:`MIN_KEYS`, at most ``max_len``), so a few shapes cover a whole run, and on CUDA it captures each shape
once as a ``torch.cuda.CUDAGraph`` and replays it: one launch a step. The inputs (each slot's fed token and
position) are copied into static buffers before a replay and the logits come out of a static buffer, so a step reads
nothing from the host and syncs nothing; everything a step depends on per row is a device tensor (the positions,
from which the attention's key-length bias is built inside the step).

The extra rows of a bucket (slots ``hi .. rows - 1``, free) decode junk at their own positions: the writes land in
free slots, past anything a row reads before it writes it, as the unbucketed step's free slots below ``hi`` already
do (:mod:`.continuous`). The extra keys are masked by the length bias.

A graph holds the addresses of the tensors it was captured on. The weights are updated in place by a refit, so
graphs survive refits; a KV cache freed and made again (a stand-down) or a colocated engine's cast copy re-allocated
gets new addresses, so the graphs are dropped and captured again when :meth:`SlotForward.storage` changes.

On a CPU there is nothing to capture (``cuda_graphs: auto`` is off there) and the step runs eagerly at the exact
shapes; ``bucketed`` runs it eagerly at the bucketed shapes (what the graphs replay), so CPU tests check the padded
shapes' tokens against the exact ones.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from screl.rollout.engines.kv_cache import SlotKVCache

MIN_KEYS = 128
"""The smallest key bucket: shorter rows attend over 128 positions (the extra ones masked)."""

GRAPH_SETTINGS: tuple[str | bool, ...] = ("auto", True, False)
"""``backend_args.cuda_graphs``: ``auto`` captures on CUDA devices only; ``true`` refuses a device without CUDA
(booleans, not on/off: YAML reads those as booleans)."""


def bucket(n: int, cap: int, floor: int = 1) -> int:
    """The next power of two at or above ``n`` (at least ``floor``), capped at ``cap``."""
    b = max(floor, 1 << max(0, n - 1).bit_length())
    return min(b, cap)


def graphs_enabled(setting: str | bool, device: torch.device) -> bool:
    """Whether decode steps are captured: ``auto`` on CUDA, ``true`` (CUDA only, else an error), ``false``."""
    if not any(setting is s or setting == s and isinstance(s, str) for s in GRAPH_SETTINGS):
        raise ValueError(f"backend_args.cuda_graphs={setting!r}: expected auto, true or false")
    if setting is True and device.type != "cuda":
        raise ValueError(f"backend_args.cuda_graphs=true needs a CUDA device (the engine runs on {device}): set it "
                         "to auto or false")
    return setting is not False and device.type == "cuda"


class DecodeGraphs:
    """Decode steps of a :class:`~.slot_forward.SlotForward` on a :class:`~.kv_cache.SlotKVCache` at bucketed shapes,
    replayed as CUDA graphs where ``capture`` (see the module docstring)."""

    def __init__(self, forward: Any, cache: SlotKVCache, vocab: int, *, capture: bool) -> None:
        self.forward, self.cache, self.capture = forward, cache, capture
        self.bucketed = capture  # the padded shapes; a CPU test may turn them on without capturing
        dev = cache.device
        self.ids = torch.zeros(cache.slots, dtype=torch.long, device=dev)
        self.pos = torch.zeros(cache.slots, dtype=torch.long, device=dev)
        self.vocab = vocab
        self.out: Tensor | None = None  # the captured steps' logits [slots, vocab], made at the first capture
        self.graphs: dict[tuple[int, int], Any] = {}  # (rows, keys) -> its recorded step (replay() runs it)
        self.captures = 0  # shapes captured so far (start-up cost; a figure for logs and tests)
        self._pool: Any = None
        self._storage: tuple[int, ...] | None = None

    def describe(self) -> str:
        if self.capture:
            return (f"decode steps as CUDA graphs, one per (rows, keys) bucket: rows a power of two up to "
                    f"{self.cache.slots}, keys a power of two from {MIN_KEYS} up to {self.cache.shape.max_len}")
        return "decode steps eager (no CUDA graphs" + (", bucketed shapes)" if self.bucketed else ")")

    def shape(self, hi: int, keys: int) -> tuple[int, int]:
        """The (rows, keys) a step of ``hi`` slots and ``keys`` positions runs at."""
        if not self.bucketed:
            return hi, keys
        return (bucket(hi, self.cache.slots),
                bucket(keys, self.cache.shape.max_len, floor=min(MIN_KEYS, self.cache.shape.max_len)))

    def decode(self, feed: Tensor, pos: Tensor, hi: int, keys: int) -> Tensor:
        """Logits ``[hi, vocab]`` of one decode step: slot ``s < hi`` feeds ``feed[s]`` at ``pos[s]``; ``keys`` is
        at least one past the largest position (under the forward context: the caller holds the model lock)."""
        rows, width = self.shape(hi, keys)
        if not self.capture:
            return self.forward.decode(self.cache, feed[:rows], pos[:rows], width)[:hi]
        storage = self.forward.storage(self.cache)
        if storage != self._storage:  # the cache or the weights moved: captured addresses are stale
            self.graphs.clear()
            self._pool, self._storage = None, storage
        self.ids[:rows].copy_(feed[:rows])
        self.pos[:rows].copy_(pos[:rows])
        if self.out is None:
            self.out = torch.zeros(self.cache.slots, self.vocab, dtype=torch.float32, device=self.cache.device)
        graph = self.graphs.get((rows, width))
        if graph is None:
            graph = self.graphs[(rows, width)] = self._capture(rows, width)
        graph.replay()
        assert self.out is not None
        return self.out[:hi]

    def _capture(self, rows: int, width: int) -> Any:
        """The shape's step (the logits land in :attr:`out`), recorded once (:meth:`_record`)."""
        assert self.out is not None
        out = self.out

        def step() -> None:
            out[:rows].copy_(self.forward.decode(self.cache, self.ids[:rows], self.pos[:rows], width))

        self.captures += 1
        return self._record(step)

    def _record(self, step: Any) -> Any:
        """Warm ``step`` up on a side stream (the writes it makes are the step's own, so repeating them is harmless),
        then capture it into the shared memory pool: a ``torch.cuda.CUDAGraph`` whose ``replay()`` runs it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (a refit's copies wait on the model lock, which this holds; a
        # colocated trainer is stood down) does not invalidate the capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            step()
        self._pool = graph.pool()
        return graph

    def drop(self) -> None:
        """Forget the captured graphs and free their memory pool and logits buffer (a stand-down frees the cache
        they point at; the trainer gets the memory back)."""
        self.graphs.clear()
        self._pool, self._storage, self.out = None, None, None
