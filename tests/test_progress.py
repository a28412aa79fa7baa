"""The RL-step progress bar's total: the smallest of trainer.max_steps, max_num_steps and epochs x batches."""

from __future__ import annotations

from types import SimpleNamespace

import lightning as L
from screl.callbacks.progress import rl_steps_total

from screl.config import RunConfig
from screl.envs import CountLetter


def _trainer(max_steps: int, **algo: int) -> SimpleNamespace:
    run = RunConfig.from_dict({"grpo": {"num_prompts_per_step": 8, **algo}})
    return SimpleNamespace(max_steps=max_steps, datamodule=SimpleNamespace(run=run, task=CountLetter()))


def test_the_total_is_the_first_bound_the_run_hits() -> None:
    assert rl_steps_total(L.Trainer(max_steps=7, logger=False)) == 7  # no datamodule yet: the trainer's bound
    assert rl_steps_total(_trainer(-1, max_num_epochs=2)) == 2 * (100 // 8)  # 100 prompts, 8 per step
    assert rl_steps_total(_trainer(60, max_num_epochs=10, max_num_steps=40)) == 40
    assert rl_steps_total(_trainer(30, max_num_epochs=10, max_num_steps=40)) == 30
    assert rl_steps_total(SimpleNamespace(max_steps=-1, datamodule=None)) is None
