"""The core's prompt table: lookups, order and keys as a dict of ``CorePrompt`` gave them, a few bytes a prompt,
and the epoch's order shuffled once an epoch (not for every batch)."""

from __future__ import annotations

import random

import pytest
from _core_driver import Driver, P, make_core

from screl.data import core_admission
from screl.data.core_types import CorePrompt
from screl.data.prompt_table import PromptTable


def _prompts(n: int, seed: int = 0) -> list[CorePrompt]:
    rng = random.Random(seed)
    ids = rng.sample(range(10 * n), n)  # unsorted, gaps
    return [CorePrompt(pid, rng.choice([None, "gsm8k", "math"]), rng.choice([None, "calc"]),
                       rng.choice([None, f"train/{pid:07d}", f"ünï/{pid}"])) for pid in ids]


def test_every_prompt_reads_back_as_it_was_given_in_the_tasks_order() -> None:
    prompts = _prompts(2000)
    table = PromptTable(iter(prompts))
    assert len(table) == len(prompts) and list(table) == [p.prompt_id for p in prompts]
    assert all(table[p.prompt_id] == p for p in prompts)
    absent = next(i for i in range(10**6) if i not in {p.prompt_id for p in prompts})
    assert absent not in table and prompts[7].prompt_id in table
    with pytest.raises(KeyError, match=str(absent)):
        table[absent]


def test_a_repeated_prompt_id_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match="prompt id 4 appears twice"):
        PromptTable([CorePrompt(4), CorePrompt(5), CorePrompt(4, "math")])


def test_the_table_holds_a_few_bytes_a_prompt_besides_its_keys_text() -> None:
    prompts = _prompts(100_000, seed=1)
    table = PromptTable(prompts)
    key_bytes = sum(len(p.key.encode()) for p in prompts if p.key is not None)
    assert table.nbytes() - key_bytes <= 42 * len(prompts)  # ids 8 + order 8 + sorted 8 + codes 4 + 4 + offsets 8 + 1


def test_the_epochs_order_is_shuffled_once_an_epoch_and_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    d = Driver(make_core(prompts=12, epochs=3))
    expected = {e: core_admission.epoch_order(d.core, e) for e in range(3)}
    calls: list[int] = []
    real = core_admission.epoch_order
    monkeypatch.setattr(core_admission, "epoch_order", lambda state, epoch: calls.append(epoch) or real(state, epoch))
    for _ in range(100):
        d.pump()
        d.seal_all()
        while d.train():
            pass
        if d.core.finished:
            break
    assert d.core.finished and d.error is None
    admitted = [pid for e in d.events if e.name == "admit" for pid in e.prompt_ids]
    assert admitted == [pid for e in range(3) for pid in expected[e][:len(expected[e]) // P * P]]
    assert calls == [0, 1, 2]
