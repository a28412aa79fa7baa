"""What Ray reserves for each generation worker (a plain record: importing it starts nothing and imports no Ray,
so ``screl check``'s plan can read it)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class WorkerResources:
    """What Ray reserves for each generation worker, and how workers spread over nodes."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    spread: bool = False
    """Place workers on different nodes where possible (generation spans several nodes)."""
    custom: Mapping[str, float] = field(default_factory=dict)
    """Custom Ray resources (``generation.resources``): only nodes offering them host a worker."""

    def demand(self) -> dict[str, float]:
        """Every resource one worker needs, by Ray's names (``CPU``, ``GPU``, custom ones)."""
        need = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.custom}
        return {k: float(v) for k, v in need.items() if v}

    def actor_options(self) -> dict[str, Any]:
        opts: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.custom:
            opts["resources"] = dict(self.custom)
        if self.spread:
            opts["scheduling_strategy"] = "SPREAD"
        return opts
