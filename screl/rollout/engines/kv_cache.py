"""The continuous decode path's KV cache: one slot per row, sized once per engine from a memory budget.

:class:`SlotKVCache` holds, per decoder layer, a key and a value tensor ``[slots, kv_heads, max_len, head_dim]`` in
the engine's compute dtype (the autocast dtype of a colocated engine, never its fp32 masters). A row takes a free
slot when it joins the batch and hands it back when it leaves; the slot is reused by the next row without freeing
memory. ``slots`` is the smaller of ``max_rows`` and what ``budget_gb`` holds at ``max_len`` positions a slot.
:meth:`SlotKVCache.release` frees the tensors (a colocated engine standing down while the trainer trains) and
:meth:`SlotKVCache.make` re-makes them (its wake); both keep the slot bookkeeping of the rows in flight.

Invariant: slot ``s`` holds ``lengths[s]`` valid positions ``0 .. lengths[s] - 1`` of one row; nothing else is read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class CacheShape:
    """What one slot holds: layers x (key, value) x kv heads x positions x head dim."""

    layers: int
    kv_heads: int
    head_dim: int
    max_len: int
    dtype: torch.dtype

    def slot_bytes(self) -> int:
        """Bytes one slot takes (keys and values of every layer)."""
        item = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.layers * self.kv_heads * self.max_len * self.head_dim * item


def slots_for_budget(shape: CacheShape, budget_gb: float, max_rows: int) -> int:
    """How many slots the cache gets: ``max_rows``, fewer where ``budget_gb`` holds fewer (at least one)."""
    if budget_gb <= 0:
        raise ValueError(f"the KV-cache budget must be > 0 GB (got {budget_gb})")
    if max_rows < 1:
        raise ValueError(f"the continuous decode path needs max_rows >= 1 (got {max_rows})")
    fit = int(budget_gb * 2**30 // shape.slot_bytes())
    if fit < 1:
        raise ValueError(f"a KV-cache budget of {budget_gb} GB holds no slot of {shape.max_len} positions "
                         f"({shape.slot_bytes() / 2**20:.1f} MiB a slot): raise the budget or shorten max_len")
    return min(max_rows, fit)


class SlotKVCache:
    """The slotted KV cache (see the module docstring)."""

    def __init__(self, shape: CacheShape, slots: int, device: torch.device) -> None:
        self.shape, self.slots, self.device = shape, slots, device
        self.k: list[Tensor] = []
        self.v: list[Tensor] = []
        self._free = list(range(slots - 1, -1, -1))  # a stack: the lowest slot is taken first
        self.lengths = [0] * slots  # host mirror of each slot's valid positions (no device read)
        self.make()

    @property
    def allocated(self) -> bool:
        return bool(self.k)

    @property
    def nbytes(self) -> int:
        return self.slots * self.shape.slot_bytes()

    def describe(self) -> str:
        """The start-up line's words for it: size, dtype, slots and positions a slot."""
        return (f"KV cache {self.nbytes / 2**20:.1f} MiB {str(self.shape.dtype).removeprefix('torch.')} on "
                f"{self.device} ({self.slots} slots x {self.shape.max_len} positions, allocated once)")

    def make(self) -> None:
        """Allocate the tensors (at start-up and on a wake); the slot bookkeeping is kept."""
        if self.allocated:
            return
        dims = (self.slots, self.shape.kv_heads, self.shape.max_len, self.shape.head_dim)
        for _ in range(self.shape.layers):
            self.k.append(torch.zeros(dims, dtype=self.shape.dtype, device=self.device))
            self.v.append(torch.zeros(dims, dtype=self.shape.dtype, device=self.device))

    def release(self) -> None:
        """Free the tensors (a stand-down): the rows in their slots re-prefill after :meth:`make`."""
        self.k, self.v = [], []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def take(self) -> int:
        """A free slot for a joining row (empty); ``IndexError`` when none is free."""
        if not self._free:
            raise IndexError("no free KV-cache slot")
        slot = self._free.pop()
        self.lengths[slot] = 0
        return slot

    def give_back(self, slot: int) -> None:
        """A leaving row's slot, free for the next row (its memory stays allocated)."""
        if slot in self._free or not 0 <= slot < self.slots:
            raise ValueError(f"slot {slot} is not taken")
        self.lengths[slot] = 0
        self._free.append(slot)
        self._free.sort(reverse=True)

    def in_use(self) -> int:
        """One past the highest slot taken: decode steps run over slots ``0 .. in_use() - 1`` (a view, no gather)."""
        taken = set(range(self.slots)) - set(self._free)
        return max(taken) + 1 if taken else 0
