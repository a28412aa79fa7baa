"""The replacement reserve: spare prompts held back from the dataloader to refill the slot of a dropped group.

With ``async_rl.rollout_failure.on_dropped_prompt: replace`` a step keeps its full size when one of its groups
is dropped (filtered by dynamic sampling, or dropped after its retries): the slot is handed a spare prompt,
stamped for the same step. The reserve fills ahead of need, one whole dataloader batch at a time (the batch
structure, and so the sampler's dispatch cursor, stays that of the dataloader), whenever it holds fewer than
``replacement_reserve_prompts`` spares; the first batch is always admitted. A replacement keeps the dropped
group's target step (None under a sampler that does not stamp: there it keeps the count of groups the
sampler's gate expects, which a drop would otherwise leave short for good).
When the dataloader is exhausted, the spares left are admitted as whole steps; fewer than a step's worth are
released unused at the end (a ``drop`` with reason ``reserve_unused`` each), so the log accounts for every prompt.

Pure, like the core: no Ray, no clock. Its state is the checkpoint's ``replacement_reserve.pt``.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any

from screl.data.events import DropEvent, SpareEvent


@dataclass(frozen=True)
class ReservePolicy:
    """``on_dropped_prompt == "replace"``, ``replacement_reserve_prompts`` and ``max_replacement_attempts``."""

    enabled: bool = False
    size: int = 1
    max_per_slot: int = 1


class ReplacementReserve:
    """Spare ``(prompt_id, epoch)`` pairs, in the order they were held back (the oldest is used first)."""

    def __init__(self, policy: ReservePolicy) -> None:
        self.policy = policy
        self.spares: collections.deque[tuple[int, int]] = collections.deque()
        self.started = False
        """Whether a batch was admitted (the reserve fills only after the first)."""

    def __len__(self) -> int:
        return len(self.spares)

    def wants_batch(self) -> bool:
        """Whether the next dataloader batch should be held back rather than admitted."""
        return self.policy.enabled and self.started and len(self.spares) < self.policy.size

    def hold(self, batch: list[int], epoch: int, trainer_version: int) -> SpareEvent:
        self.spares.extend((pid, epoch) for pid in batch)
        return SpareEvent(trainer_version=trainer_version, prompt_ids=tuple(batch),
                          extra={"epoch": epoch, "reserve": len(self.spares)})

    def can_replace(self, replacements_so_far: int) -> bool:
        """Whether a slot already refilled ``replacements_so_far`` times gets another spare."""
        return self.policy.enabled and bool(self.spares) and replacements_so_far < self.policy.max_per_slot

    def take(self) -> tuple[int, int]:
        return self.spares.popleft()

    def take_batch(self, size: int) -> list[tuple[int, int]] | None:
        """A whole step's worth of spares (the dataloader is exhausted), or None if fewer are held."""
        if not self.policy.enabled or len(self.spares) < size:
            return None
        return [self.spares.popleft() for _ in range(size)]

    def release(self) -> list[DropEvent]:
        """The end of the run: every spare still held is dropped unused."""
        events = [DropEvent(reason="reserve_unused", prompt_id=pid, extra={"epoch": epoch})
                  for pid, epoch in self.spares]
        self.spares.clear()
        return events

    def state_dict(self) -> dict[str, Any]:
        return {"spares": [[pid, epoch] for pid, epoch in self.spares], "started": self.started}

    def load_state_dict(self, state: dict[str, Any] | list[Any]) -> None:
        """Load :meth:`state_dict` (an empty list: a checkpoint written before the reserve existed)."""
        if isinstance(state, list):
            if state:
                raise ValueError(f"replacement_reserve holds {len(state)} entries in an unknown layout: the "
                                 "checkpoint is corrupt or from another screl version")
            state = {"spares": [], "started": False}
        self.spares = collections.deque((int(pid), int(epoch)) for pid, epoch in state["spares"])
        self.started = bool(state["started"])
