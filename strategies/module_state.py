"""The Megatron modules inside a LightningModule, as :class:`~screl.strategies.MegatronStrategy` finds, wraps
and checkpoints them: the outermost Megatron modules by path, swapping a submodule for its DDP wrapper, the
module's state with those modules as ``ShardedTensor`` s, and the template a sharded checkpoint loads into (a
distributed optimizer's is megatron's own).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from lightning.pytorch.core.optimizer import LightningOptimizer
from megatron.core.transformer.module import MegatronModule
from screl.strategies import checkpoint as ckpt
from screl.strategies.distributed_optimizer import DistributedAdam, is_distributed_state
from torch import nn
from torch.optim import Optimizer

__all__ = [
    "load_template",
    "module_sharded_state",
    "optimizer_index",
    "optimizer_modules",
    "outermost_megatron_modules",
    "set_submodule",
    "wrapped_state_dict",
]


def outermost_megatron_modules(root: nn.Module) -> list[tuple[str, nn.Module]]:
    """``(path, module)`` of every Megatron module of ``root`` that is not inside another one."""
    found: list[tuple[str, nn.Module]] = []
    for name, module in root.named_modules():
        if (
            name
            and isinstance(module, MegatronModule)
            and not any(name.startswith(p + ".") for p, _ in found)
        ):
            found.append((name, module))
    return found


def set_submodule(root: nn.Module, path: str, value: nn.Module) -> None:
    """Replace the submodule of ``root`` at ``path`` by ``value``."""
    parent_path, _, attr = path.rpartition(".")
    parent = root.get_submodule(parent_path) if parent_path else root
    setattr(parent, attr, value)


def module_sharded_state(module: nn.Module, megatron: Mapping[str, MegatronModule]) -> dict[str, Any]:
    """``module``'s state: its Megatron modules (by path) as sharded state dicts, the rest as plain values."""
    state: dict[str, Any] = {}
    for path, inner in megatron.items():
        state.update(inner.sharded_state_dict(prefix=f"{path}."))
    for key, value in module.state_dict().items():
        if not any(key.startswith(path + ".") for path in megatron):
            state[key] = value
    return state


def wrapped_state_dict(state_dict: Mapping[str, Any], wrapped_paths: Iterable[str]) -> dict[str, Any]:
    """Rename the keys of a loaded (unwrapped) state dict to those of the DDP-wrapped module
    (``<path>.<key>`` -> ``<path>.module.<key>`` for every wrapped path)."""
    paths = list(wrapped_paths)
    state = {}
    for key, value in state_dict.items():
        path = next((p for p in paths if key.startswith(p + ".")), None)
        state[key if path is None else f"{path}.module.{key[len(path) + 1 :]}"] = value
    return state


def load_template(
    common: Mapping[str, Any], model_state: dict[str, Any], optimizers: Sequence[Optimizer | LightningOptimizer]
) -> dict[str, Any]:
    """What a sharded checkpoint loads into: the model's sharded state and, when the checkpoint has optimizer
    states (``common``), each optimizer's template at this rank's sharding."""
    out: dict[str, Any] = {"state_dict": model_state}
    saved_opts = common.get("optimizer_states") or []
    if saved_opts and optimizers:
        out["optimizer_states"] = [
            _optimizer_template(opt._optimizer if isinstance(opt, LightningOptimizer) else opt, model_state, saved, i)
            for i, (opt, saved) in enumerate(zip(optimizers, saved_opts, strict=False))
        ]
    return out


def _optimizer_template(optimizer: Optimizer, model_state: dict[str, Any], saved: Mapping[str, Any], index: int) -> Any:
    """One optimizer's load template: megatron's for a distributed optimizer, else the torch optimizer's."""
    distributed = isinstance(optimizer, DistributedAdam)
    if distributed != is_distributed_state(saved):
        raise ValueError(
            f"Checkpoint optimizer {index} was saved with use_distributed_optimizer={not distributed}; resume with "
            f"MegatronStrategy(use_distributed_optimizer={not distributed}) (the two store the state differently)."
        )
    if isinstance(optimizer, DistributedAdam):
        return optimizer.sharded_state(model_state, is_loading=True)
    return ckpt.optimizer_template(optimizer, model_state, saved, prefix=f"optimizer.{index}")


def optimizer_index(optimizers: Sequence[Any], optimizer: Optimizer) -> int:
    """The position of ``optimizer`` (or of the ``LightningOptimizer`` wrapping it) in ``optimizers``."""
    for i, opt in enumerate(optimizers):
        if opt is optimizer or getattr(opt, "_optimizer", None) is optimizer:
            return i
    raise ValueError("optimizer_state(): the optimizer is not one of this strategy's optimizers.")


def optimizer_modules(optimizer: Optimizer | LightningOptimizer, wrapped: Mapping[str, nn.Module]) -> list[str]:
    """The paths (keys of ``wrapped``) of the modules whose parameters ``optimizer`` updates."""
    inner = optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer
    ids = {id(p) for group in inner.param_groups for p in group["params"]}
    return [path for path, m in wrapped.items() if any(id(p) in ids for p in m.parameters())]
