"""The optimizer and learning-rate schedule of a module: ``optimizer`` by class path, warmup, then a schedule.

``lr_factor`` is the schedule, a pure function of the optimizer steps taken (``torch.optim.lr_scheduler.LambdaLR``
multiplies the learning rate by it): over ``warmup`` steps the rate ramps linearly, ``(n + 1) / warmup`` at step
``n`` (the first update already moves), then stays (``constant``) or decays to 0 at step ``total``, linearly or along
a half cosine (Hugging Face's ``get_linear_schedule_with_warmup`` / ``get_cosine_schedule_with_warmup`` after the
warmup). The modules step their schedules themselves (optimization is manual: Lightning steps none).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["SCHEDULES", "OptimSettings", "lr_factor"]

SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, warmup: int, total: int | None, schedule: str) -> float:
    """The learning-rate multiplier of the update after ``step`` earlier ones."""
    if step < warmup:
        return (step + 1) / warmup
    if schedule == "constant":
        return 1.0
    assert total is not None, "a decaying schedule needs the run's length"
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def _optimizer_class(path: str) -> type[torch.optim.Optimizer]:
    module, _, name = path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name) if module else None
    except (ImportError, AttributeError):
        cls = None
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise ValueError(f"model.init_args.optimizer={path!r}: not an importable torch.optim.Optimizer class "
                         "(e.g. torch.optim.AdamW, torch.optim.SGD)")
    return cls


class OptimSettings:
    """A module's optimizer and schedule arguments, checked when the module is built (each error names its key)."""

    def __init__(self, optimizer: str, lr_scheduler: str, warmup_steps: int, warmup_ratio: float) -> None:
        if lr_scheduler not in SCHEDULES:
            raise ValueError(f"model.init_args.lr_scheduler={lr_scheduler!r}: expected one of {SCHEDULES}")
        if warmup_steps < 0:
            raise ValueError(f"model.init_args.warmup_steps={warmup_steps}: must be >= 0")
        if not 0.0 <= warmup_ratio < 1.0:
            raise ValueError(f"model.init_args.warmup_ratio={warmup_ratio}: must be in [0, 1)")
        if warmup_steps and warmup_ratio:
            raise ValueError(f"model.init_args.warmup_steps={warmup_steps} and warmup_ratio={warmup_ratio}: set "
                             "one of them (the other 0)")
        self.optimizer_class = _optimizer_class(optimizer)
        self.lr_scheduler, self.warmup_steps, self.warmup_ratio = lr_scheduler, warmup_steps, warmup_ratio

    @property
    def needs_length(self) -> bool:
        """Whether the schedule depends on the run's number of steps."""
        return self.lr_scheduler != "constant" or self.warmup_ratio > 0.0

    def optimizer(self, params: Iterable[Any], lr: float, weight_decay: float, strategy: Any) -> torch.optim.Optimizer:
        """The optimizer over ``params``; refused when the strategy replaces it with an Adam of its own."""
        if getattr(strategy, "use_distributed_optimizer", False) and not issubclass(self.optimizer_class,
                                                                                   torch.optim.Adam):
            raise ValueError(f"model.init_args.optimizer={self.optimizer_class.__module__}."
                             f"{self.optimizer_class.__name__}: MegatronStrategy(use_distributed_optimizer=True) "
                             "runs megatron's distributed Adam; use torch.optim.AdamW or turn it off")
        cls: Any = self.optimizer_class  # a torch optimizer taking lr and weight_decay (Optimizer itself takes neither)
        built: torch.optim.Optimizer = cls(params, lr=lr, weight_decay=weight_decay)
        return built

    def schedule(self, optimizer: torch.optim.Optimizer, total: int | None) -> dict[str, Any]:
        """Lightning's ``lr_scheduler`` entry for ``optimizer`` (interval: step) over a run of ``total`` steps."""
        if self.needs_length and not total:
            raise ValueError(f"model.init_args.lr_scheduler={self.lr_scheduler!r} with warmup_ratio="
                             f"{self.warmup_ratio} needs the run's length: set the algorithm block's max_num_steps "
                             "or trainer.max_steps")
        warmup = self.warmup_steps or (math.ceil(self.warmup_ratio * total) if total else 0)
        fn: Callable[[int], float] = lambda n: lr_factor(n, warmup, total, self.lr_scheduler)  # noqa: E731
        return {"scheduler": torch.optim.lr_scheduler.LambdaLR(optimizer, fn), "interval": "step"}
