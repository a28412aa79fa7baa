"""A GRPO chunk: the tensors its micro-batches share, its split into micro-batches, and the figures it logs.

The train dataloader yields a step as one or more chunks of whole prompt groups; under data parallelism each
replica holds a shard of a chunk. Invariant: a chunk's loss normalizers (its rows, its valid tokens) are the whole
chunk's, so the gradients summed over the replicas and the micro-batches are the chunk's: the micro-batch split
sets the memory a forward needs, never the update.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from screl.algos import get_adv_estimator
from screl.config import GRPOConfig
from screl.modules.masks import loss_sample_mask, mask_metrics

if TYPE_CHECKING:
    from screl.modules.compute import PolicyCompute

CPU_MICRO_BATCH_TOKENS = 4096
"""The automatic micro-batch size on a CPU, in tokens (``GRPO(micro_batch_tokens=None)``)."""

ACCELERATOR_MICRO_BATCH_TOKENS = 8192
"""The automatic micro-batch size on an accelerator, in tokens: a token budget, never the whole chunk (a real
step of 64 rows x 1.2k tokens in one forward needs its activations for all 77k tokens at once). ``screl check``
prints the memory this takes for the configured model."""


@dataclass(frozen=True)
class Chunk:
    """What every micro-batch of a chunk shares: its size, masks, advantages and loss normalizers."""

    rows: int
    chunk_rows: int
    chunk_groups: int
    step_groups: int
    sample_mask: Tensor
    token_mask: Tensor
    advantages: Tensor
    valid_tokens: Tensor


def chunk_tensors(batch: dict[str, Any], algo: GRPOConfig, device: torch.device) -> Chunk:
    """The chunk's masks, advantages and loss normalizers, shared by all of its micro-batches."""
    rows = batch["input_ids"].shape[0]
    # rows of the whole chunk: a data-parallel replica holds a shard of it (RolloutDataModule)
    chunk_rows = int(batch.get("chunk_rows", rows))
    group_size = algo.num_generations_per_prompt
    sample_mask = loss_sample_mask(batch, algo.overlong_filtering)
    token_mask = batch["token_mask"].float()
    # every row stays in its group's baseline: a masked row's reward still says how hard the prompt is
    estimator = get_adv_estimator(algo.adv_estimator.name)
    advantages = estimator.fn(batch["rewards"].float(), group_size, algo.adv_estimator)
    valid_tokens = (token_mask * sample_mask[:, None]).sum().clamp_min(1.0)
    if "chunk_valid_tokens" in batch:
        valid_tokens = torch.as_tensor(float(batch["chunk_valid_tokens"]), device=device).clamp_min(1.0)
    return Chunk(
        rows=rows, chunk_rows=chunk_rows, chunk_groups=chunk_rows // group_size,
        step_groups=int(batch["step_groups"]), sample_mask=sample_mask, token_mask=token_mask,
        advantages=advantages, valid_tokens=valid_tokens,
    )


def micro_rows(rows: int, width: int, micro_batch_size: int | None, micro_batch_tokens: int | None,
               device: torch.device) -> int:
    """Rows per micro-batch of a chunk of ``rows`` x ``width`` tokens (``GRPO``'s ``micro_batch_size``,
    ``micro_batch_tokens``)."""
    if micro_batch_size:
        return micro_batch_size
    budget = micro_batch_tokens
    if budget is None:
        budget = CPU_MICRO_BATCH_TOKENS if device.type == "cpu" else ACCELERATOR_MICRO_BATCH_TOKENS
    if budget <= 0 or rows * width <= budget:
        return max(rows, 1)
    parts = -(-rows // max(1, budget // width))  # as few micro-batches as keep each within the budget
    return -(-rows // parts)  # ... with the rows spread evenly over them


def chunk_means(batch: dict[str, Any], compute: PolicyCompute, device: torch.device) -> dict[str, Tensor]:
    """``reward``, ``staleness`` and ``train/response_length`` over the whole chunk: summed over the data-parallel
    replicas that each hold a shard of it (one all-reduce of four numbers), so rank 0 logs the chunk's means,
    not its own shard's. Every replica calls it, a replica with no rows too."""
    version, dev = int(batch["trainer_version"]), device
    sums = torch.stack([
        batch["rewards"].float().sum().to(dev), (version - batch["start_weight"]).float().sum().to(dev),
        batch["token_mask"].float().sum().to(dev), torch.tensor(float(batch["input_ids"].shape[0]), device=dev),
    ])
    sums = compute.sum_over_shards(sums, batch)
    rows = sums[3].clamp(min=1.0)
    return {"reward": sums[0] / rows, "staleness": sums[1] / rows, "train/response_length": sums[2] / rows}


def chunk_logs(
    batch: dict[str, Any], loss: Tensor, metrics: dict[str, list[Tensor]], means: dict[str, Tensor],
    overlong_filtering: bool, grad_norm: Tensor | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The chunk's progress-bar figures and its other figures: ``means`` are the whole chunk's, the rest this
    replica's shard's (a micro-batch metric ending in ``max`` by its maximum, the others by their mean)."""
    staleness = (int(batch["trainer_version"]) - batch["start_weight"]).float()
    bar: dict[str, Any] = {"reward": means["reward"], "staleness": means["staleness"]}
    logs: dict[str, Any] = {
        "train/loss": loss,
        "train/response_length": means["train/response_length"],
        "train/staleness_max": staleness.max(),
        **mask_metrics(batch, overlong_filtering),
    }
    if grad_norm is not None:
        logs["train/grad_norm"] = grad_norm
    for key in ("buffer_fill", "inflight", "wait_s", "generation_s", "filtered", "replaced", "engine_busy_s",
                "engine_tokens"):
        if key in batch:
            (bar if key in ("buffer_fill", "inflight") else logs)[f"rollout/{key}"] = float(batch[key])
    for k, vs in metrics.items():
        stacked = torch.stack(vs)
        logs[f"train/{k}"] = stacked.max() if k.endswith("max") or k == "logprob_mismatch" else stacked.mean()
    return bar, logs
