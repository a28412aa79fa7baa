"""Admission for :class:`~screl.data.core.RolloutCore` (kept apart so the core file stays about its groups): the
dataloader's cursor over shuffled epochs, the batches it holds back as replacement spares, and the sampler's gate
on each batch it admits. Pure, like the core.

The core hands itself in as :class:`AdmissionState`, the fields these functions read and move; they call nothing
of the core's, so this module does not import it.
"""

from __future__ import annotations

import collections
import dataclasses
import random
from typing import Protocol, TypeVar

from screl.data.core_types import CoreSettings, Effects, seed_for
from screl.data.events import AdmitEvent, Event
from screl.data.prompt_table import PromptTable
from screl.data.reserve import ReplacementReserve
from screl.data.samplers import PromptGroupSampler, call_admit

E = TypeVar("E", bound=Event)


class AdmissionState(Protocol):
    """What admission reads and moves of the core's state."""

    settings: CoreSettings
    P: int
    prompts: PromptTable
    batches_per_epoch: int
    epoch: int
    batch_index: int
    trainer_version: int
    sampler: PromptGroupSampler
    reserve: ReplacementReserve
    admitted: collections.deque[tuple[int, int | None, int, int]]
    admission_closed: bool

    @property
    def outstanding(self) -> int: ...

    def epoch_slice(self, epoch: int, start: int, stop: int) -> list[int]: ...


def epoch_order(state: AdmissionState, epoch: int) -> list[int]:
    """The prompt ids of ``epoch`` in the order the dataloader serves them (a seeded shuffle)."""
    order = list(state.prompts)
    random.Random(seed_for(state.settings.seed, "epoch", epoch)).shuffle(order)
    return order


def _loader_open(state: AdmissionState) -> bool:
    """Whether the dataloader has a batch left (moving on to the next epoch when this one is done)."""
    if state.batch_index >= state.batches_per_epoch:
        state.epoch, state.batch_index = state.epoch + 1, 0
    return state.epoch < state.settings.max_num_epochs


def _loader_batch(state: AdmissionState) -> list[int]:
    batch = state.epoch_slice(state.epoch, state.batch_index * state.P, (state.batch_index + 1) * state.P)
    state.batch_index += 1
    return batch


def hold_spares(state: AdmissionState, eff: Effects, drained: bool = False) -> None:
    """Hold dataloader batches back as replacement spares while the reserve is short (``drained``: only
    while it is empty, after a burst of drops took every spare)."""
    def short() -> bool:
        return state.reserve.policy.enabled and not len(state.reserve) if drained else state.reserve.wants_batch()

    while short() and _loader_open(state):
        batch = _loader_batch(state)
        eff.events.append(_with_keys(state, state.reserve.hold(batch, state.epoch, state.trainer_version), batch))


def admit(state: AdmissionState, eff: Effects) -> bool:
    """Admit the next batch: the dataloader's (after holding back batches while the replacement reserve is
    short), or once it is exhausted a step's worth of spares. False: nothing was admitted."""
    hold_spares(state, eff)
    from_loader = _loader_open(state)
    if not from_loader and len(state.reserve) < state.P:
        state.admission_closed = True
        return False
    adm = call_admit(state.sampler, state.trainer_version, outstanding_groups=state.outstanding)
    if not adm.allowed:
        return False
    spares = None if from_loader else state.reserve.take_batch(state.P)
    batch = [(pid, state.epoch) for pid in _loader_batch(state)] if spares is None else spares
    state.reserve.started = True
    state.admitted.extend((pid, adm.target_step, epoch, 0) for pid, epoch in batch)
    ids = [pid for pid, _ in batch]
    eff.events.append(_with_keys(state, AdmitEvent(
        trainer_version=state.trainer_version, step=state.sampler.dispatch_index, target_step=adm.target_step,
        prompt_ids=tuple(ids), extra={"epoch": state.epoch} if spares is None else {"from_reserve": True},
    ), ids))
    return True


def _with_keys(state: AdmissionState, event: E, prompt_ids: list[int]) -> E:
    """The event with the dataset's string ids of its prompts (``prompt_keys``, in order) when they have them."""
    keys = [state.prompts[pid].key for pid in prompt_ids]
    if all(k is None for k in keys):
        return event
    return dataclasses.replace(event, extra={**(event.extra or {}), "prompt_keys": keys})
