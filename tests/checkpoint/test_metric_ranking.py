"""checkpointing.metric_name: the value a bundle records for ranking, read from the step's logged metrics."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from screl.callbacks import DataPlaneCheckpoint

from screl.config import CheckpointingConfig


def _callback(tmp_path: Path, metric: str | None) -> DataPlaneCheckpoint:
    return DataPlaneCheckpoint(CheckpointingConfig(enabled=True, checkpoint_dir=str(tmp_path), metric_name=metric))


def test_the_step_value_of_the_metric_or_of_its_train_key(tmp_path: Path) -> None:
    trainer = SimpleNamespace(callback_metrics={"reward": torch.tensor(0.25), "train/loss": torch.tensor(1.5)})
    assert _callback(tmp_path, "train:reward")._ranking_metric(trainer, 3) == {  # type: ignore[arg-type]
        "name": "train:reward", "key": "reward", "value": 0.25}
    assert _callback(tmp_path, "train:loss")._ranking_metric(trainer, 3) == {  # type: ignore[arg-type]
        "name": "train:loss", "key": "train/loss", "value": 1.5}
    assert _callback(tmp_path, None)._ranking_metric(trainer, 3) is None  # type: ignore[arg-type]


def test_a_metric_the_step_did_not_log_fails_naming_what_it_did(tmp_path: Path) -> None:
    trainer = SimpleNamespace(callback_metrics={"reward": torch.tensor(0.25)})
    with pytest.raises(ValueError, match=r"metric_name='train:kl': step 4 logged neither 'kl' nor 'train/kl' "
                                         r"\(it logged \['reward'\]\); nothing was saved"):
        _callback(tmp_path, "train:kl")._ranking_metric(trainer, 4)  # type: ignore[arg-type]
