"""A chunked step (GRPO, Distill) under pipeline parallelism: its micro-batches through ``MegatronStrategy.forward_backward``.

With ``pipeline_model_parallel_size > 1`` each rank holds a few layers: the first stage embeds the tokens, the
last one computes the logits, and activations travel between them. So the loss cannot be a plain call of the
model: the strategy's schedule (Megatron's on GPU, a gloo point-to-point loop on CPU) runs every micro-batch
forward and backward through the stages. The last stage computes the loss exactly as the unpipelined path does,
scaled so the gradients are the same; its metrics are then sent to every stage, so rank 0 (the first stage)
logs them.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def pipelined_chunk(module: Any, batch: dict[str, Any], chunk: Any) -> tuple[Tensor, dict[str, list[Tensor]]]:
    """``ChunkedPolicyGradient._backward_chunk`` (GRPO, Distill) under PP > 1: the chunk's loss (summed over data-parallel shards) and the
    metrics of each micro-batch, on every rank."""
    from megatron.core import parallel_state

    from screl.modules.megatron_policy import megatron_logprobs_of, require_right_padding

    strategy = module.compute.strategy  # a MegatronCompute: only it pipelines
    mb = module.micro_batch_size or max(chunk.rows, 1)
    slices = [slice(lo, min(chunk.rows, lo + mb)) for lo in range(0, chunk.rows, mb)]
    # Megatron divides each micro-batch's loss by their number: undo it, the loss is already scaled to the chunk
    scale = chunk.chunk_groups / chunk.step_groups * module.compute.grad_scale(batch) * len(slices)
    metrics_acc: dict[str, list[Tensor]] = {}

    class _Reduction:
        def forward(self, sl: slice, logits: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
            curr = megatron_logprobs_of(strategy, logits, batch["input_ids"][sl], module.temperature)
            loss, metrics = module._loss_of(batch, chunk, sl, curr)
            for k, v in metrics.items():
                metrics_acc.setdefault(k, []).append(v.detach().float())
            return loss * scale, {"loss": loss.detach()}

        def reduce(self, values: list[dict[str, Tensor]]) -> Tensor:
            return torch.stack([v["loss"] for v in values]).sum()

    def forward_step(model: torch.nn.Module, sl: slice) -> Tensor:
        ids = batch["input_ids"][sl]
        require_right_padding(batch["attention_mask"][sl])
        return model(ids, torch.arange(ids.shape[1], device=ids.device).expand_as(ids), None)  # type: ignore[no-any-return]

    if not strategy.on_cpu and chunk.rows % mb:  # Megatron's GPU schedule sends fixed-shape activations
        raise ValueError(
            f"pipeline parallelism on GPU needs whole micro-batches: the chunk's {chunk.rows} rows are not a multiple "
            f"of model.init_args.micro_batch_size={mb}; make micro_batch_size divide the rows per chunk")
    loss_total = strategy.forward_backward(slices, forward_step, _Reduction(),
                                           seq_length=int(batch["input_ids"].shape[1]), micro_batch_size=mb)
    shards = int(batch.get("dp_shards", 1))
    if shards > 1:  # the schedule reports the mean over data-parallel ranks; the chunk's loss is their sum
        loss_total = loss_total * shards
    group = parallel_state.get_pipeline_model_parallel_group()
    box = [metrics_acc]
    torch.distributed.broadcast_object_list(box, src=torch.distributed.get_process_group_ranks(group)[-1],
                                            group=group)
    return loss_total, box[0]
