"""Which prompts validation uses: ``data.init_args.val_task`` first, else the task's ``val_prompts()``; none is an
error before anything starts."""

from __future__ import annotations

import pytest

from screl import RolloutDataModule
from screl.envs import Addition, CountLetter, HeldOut


def test_a_val_task_block_wins_over_the_tasks_own_held_out_prompts() -> None:
    dm = RolloutDataModule(task=CountLetter(holdout=10), val_task=Addition(), run={"grpo": {"val_period": 2}})
    assert isinstance(dm.val_task, Addition) and len(dm.val_task.prompts()) == 100


def test_the_tasks_held_out_prompts_are_used_and_never_trained() -> None:
    task = CountLetter(holdout=10)
    dm = RolloutDataModule(task=task, run={"grpo": {"val_at_end": True}})
    assert isinstance(dm.val_task, HeldOut)
    held = {p.prompt_id for p in dm.val_task.prompts()}
    assert len(held) == 10 and not held & {p.prompt_id for p in task.prompts()}
    assert RolloutDataModule(task=task, run={"grpo": {}}).val_task is None, "validation off: nothing is held"


def test_validation_without_held_out_prompts_fails_naming_the_keys() -> None:
    with pytest.raises(ValueError, match=r"grpo.val_period=5.*no held-out prompts: give data.init_args.val_task"):
        RolloutDataModule(task=CountLetter(), run={"grpo": {"val_period": 5}})
