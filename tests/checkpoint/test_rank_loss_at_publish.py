"""Several training ranks: rank 0 publishes a bundle, then tells the other ranks through a collective. A rank lost at
that moment fails the collective after the publish; the error must say the bundle was published (a resume uses it),
not that nothing of it was. A failure before the publish still says nothing was published. The callback runs on
its real store and writer; the trainer and the data module are stand-ins with the two calls the save makes."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from screl.callbacks import DataPlaneCheckpoint
from screl.callbacks.checkpoint import CheckpointSaveError

from screl.checkpoint.store import CheckpointStore
from screl.config import CheckpointingConfig


class _RankZero:
    """Global rank 0 of 2: ``_on_rank_zero`` runs ``fn`` here, then the broadcast to rank 1, which fails from call
    ``lost_at`` on (rank 1 is gone) after ``fn`` ran."""

    def __init__(self, lost_at: int) -> None:
        self.calls, self.lost_at, self.runtime = 0, lost_at, object()

    def _on_rank_zero(self, fn: Any) -> Any:
        self.calls += 1
        result = fn()
        if self.calls >= self.lost_at:
            raise RuntimeError("Connection closed by peer [127.0.0.1]:38022")
        return result


def _trainer(lost_at: int = 99) -> Any:
    def save_checkpoint(url: str, weights_only: bool = False) -> None:
        Path(url).parent.mkdir(parents=True, exist_ok=True)  # as Lightning's checkpoint IO does
        Path(url).write_bytes(b"the trainer's state")

    return SimpleNamespace(world_size=2, is_global_zero=True, global_step=2, save_checkpoint=save_checkpoint,
                           callback_metrics={}, datamodule=_RankZero(lost_at))


def _callback(root: Path, fail_publish: bool = False) -> DataPlaneCheckpoint:
    cb = DataPlaneCheckpoint(CheckpointingConfig(enabled=True, checkpoint_dir=str(root), keep_top_k=None))

    def rollout_side(writer: Any, dm: Any, tmp: str, metric: Any) -> None:
        if fail_publish:
            raise OSError(28, "No space left on device")
        writer.commit({"trainer_version": 2, "train_steps": 2})

    cb._write_rollout_side = rollout_side  # type: ignore[method-assign]
    return cb


def test_a_rank_lost_right_after_rank_zero_published_says_the_bundle_is_there(tmp_path: Path) -> None:
    cb = _callback(tmp_path)
    with pytest.raises(CheckpointSaveError, match=r"step_2 was published to .*, but the training ranks failed right "
                                                  r"after: RuntimeError: Connection closed by peer.*resumes from step_2"):
        cb.save(_trainer(lost_at=3), 2)  # the third call: the publish
    latest = CheckpointStore(str(tmp_path)).latest()
    assert latest is not None and latest.step == 2


def test_a_failure_before_the_publish_still_says_nothing_was_published(tmp_path: Path) -> None:
    cb = _callback(tmp_path, fail_publish=True)
    with pytest.raises(CheckpointSaveError, match=r"step_2 could not be saved .*No space left on device.*Nothing of "
                                                  r"it was published"):
        cb.save(_trainer(), 2)
    assert CheckpointStore(str(tmp_path)).latest() is None
