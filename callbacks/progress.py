"""``rl_progress_bar()``: Lightning's progress bar counting RL steps, with a total and an ETA.

A screl run's batches are training chunks of an open-ended stream, so Lightning's own bar reads
``Epoch 0/0 12/--`` with no total. This one counts ``trainer.global_step`` (RL steps, also after a resume)
against the run's last step (the smallest of ``trainer.max_steps``, ``max_num_steps`` and epochs x batches),
is labelled ``RL steps``, shows its rate in steps/s and drops ``v_num``. The metrics the modules put on the bar
stay, the rollout side's under short names: ``reward``, ``staleness``, ``buffer`` (rows waiting in the buffer)
and ``inflight`` (rollouts being generated). Rich when it is installed (Lightning's own default), else tqdm.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar
from lightning.pytorch.utilities.imports import _RICH_AVAILABLE
from rich.progress import ProgressColumn, Task
from rich.style import Style
from rich.text import Text
from typing_extensions import override

LABEL = "RL steps"
#: The bar's short names of the rollout side's metrics (metrics.csv keeps the full ones).
SHORT_NAMES = {"rollout/buffer_fill": "buffer", "rollout/inflight": "inflight"}


def rl_steps_total(trainer: Trainer) -> int | None:
    """The step the run ends at, or None when nothing bounds it."""
    bounds = [trainer.max_steps] if trainer.max_steps and trainer.max_steps > 0 else []
    dm: Any = getattr(trainer, "datamodule", None)
    run, task = getattr(dm, "run", None), getattr(dm, "task", None)
    if run is not None:
        algo = run.algo
        if algo.max_num_steps:
            bounds.append(int(algo.max_num_steps))
        if task is not None:
            bounds.append(int(algo.max_num_epochs) * (len(task.prompts()) // int(algo.num_prompts_per_step)))
    return min(bounds) if bounds else None


class _RLStepsTotal:
    """The train bar's total is the run's last RL step; Lightning's tqdm and rich bars both read this property."""

    trainer: Trainer

    @property
    def total_train_batches(self) -> int | float:
        total = rl_steps_total(self.trainer)
        return total if total is not None else super().total_train_batches  # type: ignore[misc]

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        metrics = dict(super().get_metrics(trainer, pl_module))  # type: ignore[misc]
        metrics.pop("v_num", None)
        return {SHORT_NAMES.get(k, k): v for k, v in metrics.items()}


class StepsPerSecondColumn(ProgressColumn):
    """The bar's rate in RL steps per second (Lightning's column says ``it/s``)."""

    def __init__(self, style: str | Style) -> None:
        self.style = style
        super().__init__()

    @override
    def render(self, task: Task) -> Text:
        return Text(f"{task.speed or 0.0:.2f} steps/s", style=self.style)


class RichRLProgressBar(_RLStepsTotal, RichProgressBar):
    """Rich progress over RL steps (see the module docstring)."""

    @override
    def _get_train_description(self, current_epoch: int) -> str:
        return LABEL

    @override
    def configure_columns(self, trainer: Trainer) -> list[Any]:
        columns = super().configure_columns(trainer)
        return [*columns[:-1], StepsPerSecondColumn(style=self.theme.processing_speed)]

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._update(self.train_progress_bar_id, trainer.global_step)
        self.refresh()


class TQDMRLProgressBar(_RLStepsTotal, TQDMProgressBar):
    """tqdm progress over RL steps (see the module docstring)."""

    @override
    def on_train_epoch_start(self, trainer: Trainer, *_: Any) -> None:
        super().on_train_epoch_start(trainer)
        self.train_progress_bar.set_description(LABEL)
        self.train_progress_bar.unit = "step"
        self.train_progress_bar.n = trainer.global_step

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self.train_progress_bar.n = trainer.global_step
        self.train_progress_bar.refresh()


def rl_progress_bar() -> Callback:
    """The RL-step progress bar, rich when installed (as Lightning's default), else tqdm."""
    return RichRLProgressBar() if _RICH_AVAILABLE else TQDMRLProgressBar()
