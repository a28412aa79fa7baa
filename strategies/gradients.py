"""The gradients of :class:`~screl.strategies.MegatronStrategy`'s wrapped modules, from backward to the step.

Megatron's DDP wrappers accumulate each gradient in a ``main_grad`` buffer. Before an optimizer steps, the
strategy reduces the buffers of the modules it updates across data parallel (``finalize_model_grads``) and, for
a torch optimizer, aliases them as ``.grad``; after the step it zeroes them. The norm and the clipping count
each tensor-/pipeline-parallel shard once (a distributed optimizer's shards through its own norm).

Invariant: a module's gradients are reduced across data parallel at most once between two optimizer steps
(``_finalized`` holds the paths reduced since their buffers were last zeroed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
from screl.strategies import grad_buffers
from screl.strategies.distributed_optimizer import DistributedAdam
from screl.strategies.module_state import optimizer_modules
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch.strategies import DDPStrategy as _Base
else:
    _Base = object

__all__ = ["MegatronGradients"]


class MegatronGradients(_Base):
    """Mixin of :class:`~screl.strategies.MegatronStrategy` (listed before ``DDPStrategy``): finalize, measure,
    clip and zero the wrapped Megatron modules' gradients around each optimizer step."""

    _wrapped: dict[str, DistributedDataParallel]
    _finalized: set[str]
    _backward_done: bool
    use_distributed_optimizer: bool

    @override
    def backward(
        self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any
    ) -> Tensor:
        """Lightning's backward, unless :meth:`forward_backward` already ran this step's backward passes."""
        if self._backward_done:
            self._backward_done = False
            return closure_loss
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    def _selected(self, modules: Sequence[str] | None) -> dict[str, DistributedDataParallel]:
        """The wrapped modules at ``modules`` (paths in the LightningModule); ``None``: all of them."""
        if modules is None:
            return dict(self._wrapped)
        unknown = [m for m in modules if m not in self._wrapped]
        if unknown:
            raise ValueError(f"MegatronStrategy: no wrapped Megatron module at {unknown} ({sorted(self._wrapped)}).")
        return {m: self._wrapped[m] for m in modules}

    def finalize_gradients(self, modules: Sequence[str] | None = None) -> None:
        """Reduce gradients across data parallel (once per step) and expose ``main_grad`` as ``.grad``.

        ``modules``: the paths of the Megatron modules to finalize (default: all); each is reduced on its own.
        """
        chosen = self._selected(modules)
        for path, wrapped in chosen.items():
            if path not in self._finalized:
                finalize_model_grads([wrapped])
                self._finalized.add(path)
        if not self.use_distributed_optimizer:  # a distributed optimizer reads its shard of main_grad itself
            grad_buffers.expose_grads(chosen.values())

    def _distributed_optimizers(self, paths: Sequence[str]) -> list[DistributedAdam]:
        """The distributed optimizers updating the modules at ``paths``, which must be all of theirs."""
        chosen = {id(self._wrapped[p]) for p in paths}
        found = [
            opt for opt in (getattr(o, "_optimizer", o) for o in self.optimizers)
            if isinstance(opt, DistributedAdam) and any(id(m) in chosen for m in opt.modules)
        ]
        covered = {id(m) for opt in found for m in opt.modules}
        if covered != chosen:
            raise ValueError(
                f"MegatronStrategy(use_distributed_optimizer=True): the gradients of {sorted(paths)} are sharded by "
                "optimizers that also update other modules (or by none); name all of an optimizer's modules."
            )
        return found

    def grad_norm(self, modules: Sequence[str] | None = None) -> Tensor:
        """The global L2 norm of the finalized gradients (each shard counted once across TP and PP)."""
        self.finalize_gradients(modules)
        if self.use_distributed_optimizer:  # only this rank's shard of each gradient is reduced
            norms = [opt.grad_norm() for opt in self._distributed_optimizers(list(self._selected(modules)))]
            return torch.tensor(sum(n * n for n in norms) ** 0.5, dtype=torch.float32, device=self.root_device)
        return grad_buffers.global_grad_norm(self._selected(modules).values(), self.root_device)

    def clip_gradients(self, max_norm: float, modules: Sequence[str] | None = None) -> Tensor:
        """Scale the finalized gradients so their global norm is at most ``max_norm``; returns the norm before.

        Use this rather than ``Trainer(gradient_clip_val=...)`` (whose norm ignores tensor parallelism):
        in manual optimization before ``opt.step()``, else in ``on_before_optimizer_step``. ``modules``: clip
        these Megatron modules' gradients by their joint norm (default: all of them), e.g. ``["critic"]``.
        """
        norm = self.grad_norm(modules)
        coef = max_norm / (float(norm) + 1e-6)
        if coef < 1.0:
            chosen = self._selected(modules).values()
            grad_buffers.scale_grads_(chosen, coef)
            if not self.use_distributed_optimizer:
                grad_buffers.expose_grads(chosen)
        return norm

    def zero_grad_buffers(self, modules: Sequence[str] | None = None) -> None:
        """Zero Megatron's gradient buffers and drop the ``.grad`` aliases (of ``modules``; default: all)."""
        chosen = self._selected(modules)
        grad_buffers.zero_grad_buffers(chosen.values())
        self._finalized.difference_update(chosen)
        self._backward_done = False

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer | LightningOptimizer,
        closure: Callable[[], Any],
        model: LightningModule | nn.Module | None = None,
        **kwargs: Any,
    ) -> Any:
        """Run the closure, finalize the gradients of the modules ``optimizer`` updates, step, then zero their
        gradient buffers (a second optimizer's modules, e.g. a critic's, keep theirs)."""
        paths = optimizer_modules(optimizer, self._wrapped)

        def closure_then_finalize() -> Any:
            result = closure()
            self.finalize_gradients(paths)
            return result

        output = super().optimizer_step(optimizer, closure_then_finalize, model, **kwargs)  # type: ignore[arg-type]
        self.zero_grad_buffers(paths)
        return output
