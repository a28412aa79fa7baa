"""Megatron's gradient buffers, as :class:`~screl.strategies.MegatronStrategy` hands them to a torch optimizer.

Megatron's ``DistributedDataParallel`` accumulates each parameter's gradient in its ``main_grad`` buffer
(reduced across data parallel by ``finalize_model_grads``); a torch optimizer reads ``.grad``. These helpers
alias the buffers as ``.grad``, take their global norm (each tensor-/pipeline-parallel shard counted once),
scale and zero them. Each takes the strategy's wrapped modules.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel
from megatron.core.tensor_parallel import param_is_not_tensor_parallel_duplicate
from megatron.core.transformer.module import param_is_not_shared
from torch import Tensor, nn

__all__ = ["expose_grads", "global_grad_norm", "main_grads", "scale_grads_", "zero_grad_buffers"]


def main_grads(wrapped: Iterable[DistributedDataParallel]) -> Iterator[tuple[nn.Parameter, Tensor]]:
    """Each trainable parameter with its Megatron gradient buffer (``main_grad``)."""
    for module in wrapped:
        for p in module.module.parameters():
            grad = getattr(p, "main_grad", None)
            if p.requires_grad and grad is not None:
                yield p, grad


def expose_grads(wrapped: Iterable[DistributedDataParallel]) -> None:
    """Alias each ``main_grad`` as the parameter's ``.grad`` (cast to the parameter's dtype if needed)."""
    for p, grad in main_grads(wrapped):
        p.grad = grad if grad.dtype == p.dtype else grad.to(p.dtype)


def global_grad_norm(wrapped: Iterable[DistributedDataParallel], device: torch.device) -> Tensor:
    """The global L2 norm of the gradient buffers (each shard counted once across TP and PP)."""
    squares = torch.zeros((), dtype=torch.float32, device=device)
    for p, grad in main_grads(wrapped):
        if param_is_not_shared(p) and param_is_not_tensor_parallel_duplicate(p):
            squares = squares + grad.float().pow(2).sum()
    group = parallel_state.get_model_parallel_group()
    if torch.distributed.get_world_size(group) > 1:
        torch.distributed.all_reduce(squares, group=group)
    return squares.sqrt()


def scale_grads_(wrapped: Iterable[DistributedDataParallel], coef: float) -> None:
    """Multiply every gradient buffer by ``coef`` in place."""
    for _, grad in main_grads(wrapped):
        grad.mul_(coef)


def zero_grad_buffers(wrapped: Iterable[DistributedDataParallel]) -> None:
    """Zero Megatron's gradient buffers and drop the ``.grad`` aliases."""
    for module in wrapped:
        module.zero_grad_buffer()
        for p in module.module.parameters():
            p.grad = None
