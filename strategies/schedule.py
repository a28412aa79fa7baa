"""Microbatched forward/backward over a Megatron model and the loss reduction across TP/PP/DP.

The step protocol follows NeMo 2.0's: ``forward_step(model, batch) -> output`` runs the model on one
microbatch, :class:`LossReduction` turns ``(batch, output)`` into the loss to backpropagate and
detached values to report (``forward``), then folds the microbatches' values into one number
(``reduce``). On CUDA, Megatron's own schedule (``get_forward_backward_func``: 1F1B when pipelined)
drives it; on the CPU, where those schedules allocate CUDA tensors, a plain loop over the same
``forward_step``/``backward_step`` does, pipelined over gloo point-to-point sends when PP > 1.

Loss scaling follows Megatron: a ``(loss, values)`` result is averaged over microbatches (the loop
divides by their number) and over data-parallel ranks (the gradient all-reduce averages); a
``(loss_sum, num_tokens, values)`` result needs ``calculate_per_token_loss`` in the model config and
divides the gradients by the token count summed over microbatches and data-parallel ranks. Every
tensor-parallel rank computes the same loss; gradients of replicated weights need no extra reduction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.pipeline_parallel import get_forward_backward_func
from megatron.core.pipeline_parallel.schedules import backward_step, forward_step
from megatron.core.utils import get_model_config, get_model_type
from torch import Tensor, nn

__all__ = ["ForwardStep", "LossReduction", "forward_backward", "reduce_reported_loss", "token_logprobs"]

LossResult = tuple[Tensor, dict[str, Tensor]] | tuple[Tensor, Tensor, dict[str, Tensor]]


class ForwardStep(Protocol):
    """Run the model on one microbatch."""

    def __call__(self, model: nn.Module, batch: Any) -> Any: ...


class LossReduction(Protocol):
    """Per-microbatch loss (``forward``) and the reported value over microbatches (``reduce``)."""

    def forward(self, batch: Any, output: Any) -> LossResult:
        """``(loss, values)`` or ``(loss_sum, num_tokens, values)``; ``values``: detached tensors to report."""
        ...

    def reduce(self, values: list[dict[str, Tensor]]) -> Tensor | tuple[Tensor, Tensor]:
        """This rank's reported loss from every microbatch's ``values`` (last pipeline stage only).

        A tensor is averaged over data-parallel ranks; a ``(numerator, denominator)`` pair is summed
        over them and divided (a token-weighted mean over the global batch).
        """
        ...


def _cpu_forward_backward(
    forward_step_func: Callable[[Iterator[Any], nn.Module], tuple[Any, Callable[[Any], LossResult]]],
    data_iterator: Iterator[Any],
    model: nn.Module,
    num_microbatches: int,
    forward_only: bool,
) -> list[Any]:
    """``forward_backward_no_pipelining`` of megatron-core 0.16.1 without its CUDA token counter."""
    config = get_model_config(model)
    model_type = get_model_type(model)
    no_sync = config.no_sync_func or contextlib.nullcontext
    store: list[Any] = []
    total_tokens = torch.zeros([], dtype=torch.int)
    cp_size = parallel_state.get_context_parallel_world_size()

    def one(i: int) -> None:
        nonlocal total_tokens
        output, num_tokens = forward_step(
            forward_step_func,
            data_iterator,
            model,
            num_microbatches,
            None,
            store,
            config,
            cp_size,
            is_first_microbatch=i == 0,
            current_microbatch=i,
        )
        total_tokens = total_tokens + num_tokens
        if not forward_only:
            backward_step(None, output, None, model_type, config)

    with no_sync():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)
    if not forward_only and config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
    return store


def _send(tensor: Tensor, dst: int, with_shape: bool) -> None:
    if with_shape:
        dist.send(torch.tensor(tensor.shape, dtype=torch.int64), dst)
    dist.send(tensor.detach().contiguous(), dst)


def _recv(src: int, dtype: torch.dtype, shape: torch.Size | None = None) -> Tensor:
    if shape is None:  # activations: [sequence, micro-batch, hidden], lengths vary by micro-batch
        dims = torch.empty(3, dtype=torch.int64)
        dist.recv(dims, src)
        shape = torch.Size(dims.tolist())
    out = torch.empty(shape, dtype=dtype)
    dist.recv(out, src)
    return out


def _cpu_pipeline_forward_backward(
    forward_step_func: Callable[[Iterator[Any], nn.Module], tuple[Any, Callable[[Any], LossResult]]],
    data_iterator: Iterator[Any],
    model: nn.Module,
    num_microbatches: int,
    forward_only: bool,
) -> list[Any]:
    """A pipelined schedule on the CPU (megatron-core's allocate CUDA tensors): every micro-batch forward through
    the stages, activations sent point to point (gloo) with their shape, then every backward in the same order
    (GPipe's fill-drain order, where Megatron's 1F1B interleaves them to bound activation memory; the gradients
    are the same). Micro-batches may differ in length."""
    config = get_model_config(model)
    model_type = get_model_type(model)
    first, last = parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage()
    prev = None if first else parallel_state.get_pipeline_model_parallel_prev_rank()
    nxt = None if last else parallel_state.get_pipeline_model_parallel_next_rank()
    dtype = config.pipeline_dtype or torch.float32
    cp_size = parallel_state.get_context_parallel_world_size()
    no_sync = config.no_sync_func or contextlib.nullcontext
    store: list[Any] = []
    inputs: list[Tensor | None] = []
    outputs: list[Any] = []
    total_tokens = torch.zeros([], dtype=torch.int)
    with no_sync():
        for i in range(num_microbatches):
            x = None if prev is None else _recv(prev, dtype).requires_grad_(not forward_only)
            out, tokens = forward_step(forward_step_func, data_iterator, model, num_microbatches, x, store, config,
                                       cp_size, is_first_microbatch=i == 0, current_microbatch=i, is_last_stage=last)
            total_tokens = total_tokens + tokens
            if nxt is not None:
                _send(out, nxt, with_shape=True)
            if not forward_only:
                inputs.append(x)
                outputs.append(out)
    if forward_only:
        return store
    for i in range(num_microbatches):
        with no_sync() if i < num_microbatches - 1 else contextlib.nullcontext():
            grad = None if nxt is None else _recv(nxt, dtype, outputs[i].shape)
            input_grad = backward_step(inputs[i], outputs[i], grad, model_type, config)
        if prev is not None:
            _send(input_grad, prev, with_shape=False)
    if config.finalize_model_grads_func is not None:
        config.finalize_model_grads_func([model], total_tokens if config.calculate_per_token_loss else None)
    return store


def _scalable(result: LossResult) -> LossResult:
    """Megatron scales the loss in place: give it a copy, so reported values that alias it stay intact."""
    return (result[0].clone(), *result[1:])  # type: ignore[return-value]


def forward_backward(
    model: nn.Module,
    microbatches: Sequence[Any],
    forward_step_fn: ForwardStep,
    loss_reduction: LossReduction,
    forward_only: bool = False,
    seq_length: int | None = None,
    micro_batch_size: int | None = None,
) -> Tensor:
    """Run every microbatch forward (and backward unless ``forward_only``), then finalize the gradients.

    ``model``: the Megatron-DDP-wrapped module (its config's ``finalize_model_grads_func`` does the
    data-parallel reduction). ``seq_length``/``micro_batch_size``: the activation shape pipeline
    stages exchange (needed only when pipelined). Returns :func:`reduce_reported_loss` of
    ``loss_reduction.reduce``: the same scalar on every rank.
    """
    if not microbatches:
        raise ValueError("forward_backward() needs at least one microbatch.")
    data = iter(microbatches)

    def step_func(data_iterator: Iterator[Any], module: nn.Module) -> tuple[Any, Callable[[Any], LossResult]]:
        batch = next(data_iterator)
        output = forward_step_fn(module, batch)
        return output, lambda out: _scalable(loss_reduction.forward(batch, out))

    pp = parallel_state.get_pipeline_model_parallel_world_size()
    device = next(model.parameters()).device
    if device.type == "cpu":
        run = _cpu_pipeline_forward_backward if pp > 1 else _cpu_forward_backward
        store = run(step_func, data, model, len(microbatches), forward_only)
    else:
        if pp > 1 and (seq_length is None or micro_batch_size is None):
            raise ValueError(
                "forward_backward() with pipeline parallelism needs seq_length and micro_batch_size."
            )
        store = get_forward_backward_func()(
            forward_step_func=step_func,
            data_iterator=data,
            model=[model],
            num_microbatches=len(microbatches),
            seq_length=seq_length or 0,
            micro_batch_size=micro_batch_size or 0,
            forward_only=forward_only,
        )
    local = loss_reduction.reduce(store) if parallel_state.is_pipeline_last_stage() else None
    return reduce_reported_loss(local, device)


def reduce_reported_loss(local: Tensor | tuple[Tensor, Tensor] | None, device: torch.device) -> Tensor:
    """Broadcast the last pipeline stage's value to every stage, then reduce it over data parallel.

    ``local``: a value (averaged over data-parallel ranks) or a ``(numerator, denominator)`` pair
    (both summed, then divided); ``None`` on stages other than the last.
    """
    pair = torch.zeros(2, dtype=torch.float32, device=device)
    if isinstance(local, tuple):
        pair = torch.stack([t.detach().float().reshape(()) for t in local]).to(device)
    elif local is not None:
        pair = torch.stack([local.detach().float().reshape(()).to(device), torch.ones((), device=device)])
    if parallel_state.get_pipeline_model_parallel_world_size() > 1:
        group = parallel_state.get_pipeline_model_parallel_group()
        dist.broadcast(pair, src=dist.get_process_group_ranks(group)[-1], group=group)
    dp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(pair, group=dp_group)
    return pair[0] / pair[1]


def token_logprobs(
    logits: Tensor, labels: Tensor, vocab_size: int | None = None, vocab_parallel: bool = True
) -> Tensor:
    """Log-probability of each label under ``logits``, with padded vocabulary entries excluded.

    ``logits``: ``[..., V_local]``, split over tensor-parallel ranks when ``vocab_parallel`` (a
    ``GPTModel`` built with ``parallel_output=True``), else the full padded vocabulary. ``vocab_size``:
    the tokenizer's size; entries at or beyond it are masked out of the softmax, as the generation
    engine never sees them. Differentiable; the same values on every tensor-parallel rank.
    """
    tp = parallel_state.get_tensor_model_parallel_world_size() if vocab_parallel else 1
    rank = parallel_state.get_tensor_model_parallel_rank() if vocab_parallel else 0
    part = logits.shape[-1]
    logits = logits.float()
    if vocab_size is not None and vocab_size < part * tp:
        ids = torch.arange(rank * part, (rank + 1) * part, device=logits.device)
        logits = logits.masked_fill(ids >= vocab_size, torch.finfo(logits.dtype).min)
    else:
        logits = logits.clone()
    if tp == 1:
        return torch.log_softmax(logits, dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)
