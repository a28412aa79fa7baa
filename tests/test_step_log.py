"""BatchMetrics: a batch's scalars reach Lightning's loggers in one write, as ``self.log`` would have put them."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from screl.modules.step_log import BatchMetrics


class _Module(L.LightningModule):
    """Stages a loss-like tensor, a float and a progress-bar value per batch; ``via_log`` logs the same keys with
    Lightning's ``self.log`` instead, for comparison."""

    def __init__(self, via_log: bool) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.via_log = via_log
        self.metrics = BatchMetrics()

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        values = {"train/loss": loss.detach(), "train/index": float(batch_idx), "train/sum": batch.sum()}
        if self.via_log:
            self.log_dict(values, batch_size=1)
            self.log("bar", batch.mean(), prog_bar=True, batch_size=1)
        else:
            self.metrics.add(self.trainer, values)
            self.metrics.add(self.trainer, {"bar": batch.mean()}, prog_bar=True)
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if not self.via_log:
            self.metrics.flush(self.trainer)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _LateMetric(L.Callback):
    """A callback that reads the batch's metrics and adds one of its own at the batch's end (as WeightSync does)."""

    def __init__(self) -> None:
        self.seen: list[float] = []

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.seen.append(float(trainer.callback_metrics["train/index"]))
        value = {"late": 10.0 + batch_idx}
        if pl_module.via_log:
            pl_module.log_dict(value, batch_size=1)
        else:
            pl_module.metrics.add(trainer, value)


def _run(tmp_path: Path, via_log: bool, every: int) -> tuple[list[dict[str, str]], _LateMetric, Any]:
    torch.manual_seed(0)
    data = [torch.arange(2.0) + i for i in range(6)]
    late = _LateMetric()
    trainer = L.Trainer(accelerator="cpu", max_epochs=1, log_every_n_steps=every, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[late],
                        logger=CSVLogger(tmp_path, name="m", version=0))
    trainer.fit(_Module(via_log), train_dataloaders=torch.utils.data.DataLoader(data, batch_size=None))
    with (tmp_path / "m" / "version_0" / "metrics.csv").open() as fh:
        return list(csv.DictReader(fh)), late, trainer


@pytest.mark.parametrize("every", [1, 2])
def test_one_row_per_logged_step_equal_to_what_self_log_writes(tmp_path: Path, every: int) -> None:
    fast, late, trainer = _run(tmp_path / "fast", via_log=False, every=every)
    slow, _, slow_trainer = _run(tmp_path / "slow", via_log=True, every=every)
    assert len(fast) == 6 // every
    assert [r["step"] for r in fast] == [r["step"] for r in slow]
    for a, b in zip(fast, slow, strict=True):
        assert set(a) == set(b)
        for key in a:
            assert float(a[key]) == pytest.approx(float(b[key]), rel=1e-6), key
    assert late.seen == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # the batch's own metrics, readable at its end
    assert float(trainer.callback_metrics["late"]) == 15.0
    assert trainer.progress_bar_metrics["bar"] == pytest.approx(slow_trainer.progress_bar_metrics["bar"])


def test_a_tensor_that_is_not_a_scalar_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match="metric 'train/rows' must be a scalar"):
        BatchMetrics().add(None, {"train/rows": torch.ones(3)})


def test_take_converts_every_tensor_at_once_and_empties_the_stage() -> None:
    m = BatchMetrics()
    m.add(None, {"a": torch.tensor(1.5), "b": 2, "c": torch.tensor([0.25], dtype=torch.float16)})
    assert m.take() == {"a": 1.5, "b": 2.0, "c": 0.25}
    assert len(m) == 0 and m.take() == {}
