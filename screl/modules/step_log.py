"""One logger write per training batch, instead of Lightning's ``self.log`` per key.

Lightning records every ``self.log`` key in its result collection, and each record moves the key's metric
state to the value's device through ``apply_to_collection`` over the metric's attributes: about 0.3 ms a key
on a CPU, ~8 ms for the ~28 diagnostics of a GRPO chunk, against a tiny step's ~13 ms of training. These
metrics are plain per-batch scalars (no epoch reduction, no ``sync_dist``), so :class:`BatchMetrics` keeps
them in a dict, turns the tensors into floats with one stack, and at the batch's end hands them to Lightning's
logger connector in one ``log_metrics`` call: the same loggers, the same step and ``epoch`` keys, one row per
logged step in ``metrics.csv``, and ``log_every_n_steps`` obeyed. ``trainer.callback_metrics`` (and the
progress bar's metrics, for ``prog_bar`` keys) get each value as it is staged, as ``self.log`` gives them, so a
callback's ``on_train_batch_end`` reads the batch's metrics there.

Lightning has no public API for either write, so this reaches into ``trainer._logger_connector``
(``_callback_metrics``, ``_progress_bar_metrics``, ``should_update_logs``, ``log_metrics``). Checked on Lightning
2.6.6 (``constraints.txt``); ``pyproject.toml`` caps Lightning below 2.7 so that an upgrade is a deliberate step,
and ``tests/test_step_log.py`` fails if an upgrade changes any of it (rows, values, ``callback_metrics`` and the
progress bar's metrics against what ``self.log`` gives).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor


class BatchMetrics:
    """The scalars of one training batch, staged by the module and its callbacks, written once by :meth:`flush`."""

    def __init__(self) -> None:
        self._values: dict[str, Tensor | float] = {}

    def add(self, trainer: Any, metrics: Mapping[str, Tensor | float | int], prog_bar: bool = False) -> None:
        """Stage ``metrics`` (0-d tensors or numbers; a later value of a key replaces the earlier one) and show them
        in ``trainer.callback_metrics`` (and the progress bar's, with ``prog_bar``) at once."""
        staged: dict[str, Tensor] = {}
        for key, value in metrics.items():
            if isinstance(value, Tensor):
                if value.numel() != 1:
                    raise ValueError(f"metric {key!r} must be a scalar, got a tensor of shape {tuple(value.shape)}")
                self._values[key] = staged[key] = value.detach().reshape(())
            else:
                self._values[key] = float(value)
                staged[key] = torch.tensor(float(value))
        if trainer is not None:
            connector = trainer._logger_connector
            connector._callback_metrics.update(staged)
            if prog_bar:
                connector._progress_bar_metrics.update({k: float(v) for k, v in staged.items()})

    def __len__(self) -> int:
        return len(self._values)

    def take(self) -> dict[str, float]:
        """The staged values as floats (one device-to-host transfer for all tensors); the stage is empty after."""
        values, self._values = self._values, {}
        tensors = [(k, v) for k, v in values.items() if isinstance(v, Tensor)]
        out = {k: v for k, v in values.items() if not isinstance(v, Tensor)}
        if tensors:
            stacked = torch.stack([v.to(device=tensors[0][1].device, dtype=torch.float64) for _, v in tensors])
            out.update(zip((k for k, _ in tensors), stacked.tolist(), strict=True))
        return {k: out[k] for k in values}

    def flush(self, trainer: Any) -> dict[str, float]:
        """Write the staged values to Lightning's loggers, when ``log_every_n_steps`` says this batch logs.
        Returns the values (empty when nothing was staged)."""
        values = self.take()
        if not values:
            return values
        connector = trainer._logger_connector
        if connector.should_update_logs or trainer.fast_dev_run:
            connector.log_metrics(dict(values))
        return values
