"""screl: asynchronous single-controller RL post-training (GRPO, PPO) on PyTorch Lightning.

Heavy pieces (the LightningModules, the DataModule) import lazily so that ``import screl`` and
``screl check`` stay fast.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "Distill": "screl.modules.distill",
    "GRPO": "screl.modules.grpo",
    "PPO": "screl.modules.ppo",
    "RolloutDataModule": "screl.datamodule",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'screl' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = ["GRPO", "PPO", "Distill", "RolloutDataModule", "__version__"]
