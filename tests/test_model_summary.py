"""``screl fit``'s model summary: Lightning's table and totals without the FLOPs column and ``Total FLOPs: 0``
(Lightning counts FLOPs only from ``example_input_array``, which rollout batches do not have)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from lightning.pytorch.callbacks import ModelSummary as LightningModelSummary
from lightning.pytorch.callbacks import RichModelSummary
from screl.callbacks import ModelSummary

from screl.cli import ScrelCLI

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("extra", [[], ["--trainer.callbacks+=lightning.pytorch.callbacks.RichModelSummary",
                                        "--trainer.callbacks.max_depth=2"]])
def test_the_cli_summary_has_no_flops(extra: list[str], caplog: pytest.LogCaptureFixture) -> None:
    cli = ScrelCLI(args=["--config", str(ROOT / "configs" / "grpo_tiny.yaml"), *extra], run=False)
    summaries = [cb for cb in cli.trainer.callbacks if isinstance(cb, LightningModelSummary)]
    assert [type(cb) for cb in summaries] == [ModelSummary]  # Lightning's own (plain or rich) replaced
    assert not any(type(cb) is RichModelSummary for cb in cli.trainer.callbacks)
    assert summaries[0]._max_depth == (2 if extra else 1)
    with caplog.at_level(logging.INFO):
        summaries[0].on_fit_start(cli.trainer, cli.model)
    text = caplog.text
    assert "FLOPs" not in text
    assert "model" in text and "Trainable params" in text and "Modules in train mode" in text
    params = sum(p.numel() for p in cli.model.parameters())
    assert f"{params / 1e3:.1f} K" in text or f"{params / 1e6:.1f} M" in text


def test_no_summary_when_it_is_turned_off() -> None:
    cli = ScrelCLI(args=["--config", str(ROOT / "configs" / "grpo_tiny.yaml"), "--trainer.enable_model_summary",
                         "false"], run=False)
    assert not any(isinstance(cb, LightningModelSummary) for cb in cli.trainer.callbacks)
