"""The model summary without Lightning's FLOPs column and total.

Lightning 2.6 counts FLOPs only through ``LightningModule.example_input_array``; screl's modules take rollout
batches, not one example input, so every run printed ``Total FLOPs: 0`` and a column of zeros. This summary
prints the same table (name, type, parameters, mode) and totals without them; nothing else changes
(``trainer.enable_model_summary: false`` still turns it off).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary as _LightningModelSummary
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from typing_extensions import override

DROPPED_COLUMNS = ("FLOPs",)


def summary_text(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                 model_size: float, total_training_modes: dict[str, int]) -> str:
    """The table and its totals, the FLOPs column and total left out."""
    columns = [(name, [str(v) for v in values]) for name, values in summary_data if name not in DROPPED_COLUMNS]
    columns.insert(0, (" ", [str(i) for i in range(len(columns[0][1]) if columns else 0)]))
    widths = [max([len(name), *map(len, values)]) for name, values in columns]
    header = " | ".join(name.ljust(w) for (name, _), w in zip(columns, widths, strict=True))
    lines = [header, "-" * len(header)]
    for row in zip(*(values for _, values in columns), strict=True):
        lines.append(" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)))
    lines += [
        "-" * len(header),
        f"{get_human_readable_count(trainable_parameters):<10} Trainable params",
        f"{get_human_readable_count(total_parameters - trainable_parameters):<10} Non-trainable params",
        f"{get_human_readable_count(total_parameters):<10} Total params",
        f"{get_formatted_model_size(model_size):<10} Total estimated model params size (MB)",
        f"{total_training_modes.get('train', 0):<10} Modules in train mode",
        f"{total_training_modes.get('eval', 0):<10} Modules in eval mode",
    ]
    return "\n".join(lines)


class ModelSummary(_LightningModelSummary):
    """Lightning's :class:`~lightning.pytorch.callbacks.ModelSummary` without the FLOPs column and total
    (``screl fit`` puts it in place of the summary Lightning adds)."""

    @staticmethod
    @override
    def summarize(summary_data: list[tuple[str, list[str]]], total_parameters: int, trainable_parameters: int,
                  model_size: float, total_training_modes: dict[str, int], total_flops: int = 0,
                  **summarize_kwargs: Any) -> None:
        rank_zero_info("\n" + summary_text(summary_data, total_parameters, trainable_parameters, model_size,
                                           total_training_modes))
