"""The chunked step GRPO and Distill train with: one RL step = one optimizer step, assembled from one or more chunks.

The train dataloader (``RolloutDataModule``) yields *chunks* of whole prompt groups; a step may be streamed as
several chunks (``async_rl.min_groups_for_streaming_train`` < ``num_prompts_per_step``). Gradients accumulate over a
step's chunks and the optimizer steps on the chunk marked ``last_chunk``, so optimization is manual.

Because the policy changes only at the end of a step, the logprobs of the current parameters *are* the step-start
("old"/proximal) logprobs: ``prev_logprobs = curr_logprobs.detach()`` exactly, and the importance-sampling weight
``exp(prev - gen)`` corrects for the behaviour policy that generated each token. Tokens that the current weight
version generated (their recorded version equals the trainer version) are on-policy by construction: their behaviour
logprobs are taken to be the trainer's, so their IS weight is exactly 1; ``train/logprob_mismatch`` reports how far
engine and trainer numerics differ on them, over the rows the current version generated from their first token.

What a micro-batch's loss is (``_objective``) is the algorithm's: GRPO's clipped surrogate of the group advantages,
Distill's teachers' per-token advantages.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.modules.chunk import Chunk, chunk_means, chunk_tensors, micro_rows
from screl.modules.masks import AllFilteredStepError, behaviour, whole_row_on_policy
from screl.modules.policy_gradient import PolicyGradientModule

log = logging.getLogger(__name__)

__all__ = ["ChunkedPolicyGradient"]


class ChunkedPolicyGradient(PolicyGradientModule):
    """A policy-gradient module whose step streams as chunks of whole groups (GRPO, Distill); a subclass says what a
    micro-batch's loss is in :meth:`_objective`."""

    _step_trained_rows = 0.0
    """Rows of the open step that the loss sees (``sample_mask``)."""
    _warned_advantage = False

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if batch.get("done"):  # the controller has no more steps: the trainer stops after this
            return torch.zeros((), device=self.device)
        t0 = time.perf_counter()
        if self._step_started is None:
            self._step_started = t0
        opt = self.optimizers()
        assert not isinstance(opt, list), f"{type(self).__name__} configures exactly one optimizer"
        rows = batch["input_ids"].shape[0]
        chunk = self._chunk_tensors(batch)
        self._step_trained_rows += float(chunk.sample_mask.sum())
        loss_total, metrics_acc = self._backward_chunk(batch, chunk)
        metrics_acc["advantage_abs_max"] = [chunk.advantages.abs().max()]
        stepped = bool(batch["last_chunk"])
        if stepped:
            trained, self._step_trained_rows = self._step_trained_rows_everywhere(batch), 0.0
            if trained == 0:
                raise AllFilteredStepError(int(batch["trainer_version"]), batch)
        grad_norm = self._optimizer_step(opt) if stepped else None
        means = chunk_means(batch, self.compute, self.device)  # every replica: a collective when sharded
        if rows > 0:
            self._log_chunk(batch, loss_total, metrics_acc, t0, stepped, grad_norm, means)
        return loss_total

    def _step_trained_rows_everywhere(self, batch: dict[str, Any]) -> float:
        """Rows of the step the loss saw, over every data-parallel shard (all ranks then agree to raise)."""
        return float(self.compute.sum_over_shards(torch.tensor(self._step_trained_rows, device=self.device), batch))

    def _chunk_tensors(self, batch: dict[str, Any]) -> Chunk:
        """The chunk's masks, advantages and loss normalizers (:func:`screl.modules.chunk.chunk_tensors`)."""
        chunk = chunk_tensors(batch, self.algo, self.device)
        self._watch_advantages(chunk.advantages, int(batch["trainer_version"]))
        self.last_advantages = chunk.advantages.detach()  # screl.callbacks.Completions logs them beside the text
        return chunk

    def _watch_advantages(self, advantages: Tensor, step: int) -> None:
        """Warn once when an advantage blows up (near-tied leave-one-out siblings), naming the fixes."""
        limit = self.algo.adv_estimator.warn_abs_advantage
        peak = float(advantages.abs().max()) if advantages.numel() else 0.0
        if peak > limit and not self._warned_advantage:
            self._warned_advantage = True
            log.warning("screl: step %d has an advantage of magnitude %.1f (> adv_estimator.warn_abs_advantage = "
                        "%g): the siblings it was normalized against nearly tie, and the step follows that one "
                        "sample. Bound it with grpo.adv_estimator.std_floor (e.g. 0.1) or "
                        "use_leave_one_out_baseline: false; train/advantage_abs_max logs it every step.",
                        step, peak, limit)

    def _backward_chunk(self, batch: dict[str, Any], chunk: Chunk) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """Backpropagate the chunk micro-batch by micro-batch; returns its loss (summed over the data-parallel
        shards of the chunk) and each micro-batch's metrics."""
        if self.compute.pipelined:  # no rank holds every layer: the strategy's schedule runs the micro-batches
            from screl.modules.pipelined import pipelined_chunk

            return pipelined_chunk(self, batch, chunk)
        grad_scale = self.compute.grad_scale(batch)
        mb = self._micro_rows(chunk.rows, int(batch["input_ids"].shape[1]))
        loss_total = torch.zeros((), device=self.device)
        metrics_acc: dict[str, list[Tensor]] = {}
        for lo in range(0, chunk.rows, mb):
            sl = slice(lo, min(chunk.rows, lo + mb))
            loss, metrics = self._micro_batch_loss(batch, chunk, sl)
            # A step streamed as several chunks: each chunk carries its share of the step's groups.
            if grad_scale == 1.0:
                self.manual_backward(loss * (chunk.chunk_groups / chunk.step_groups))
            else:
                self.manual_backward(loss * (chunk.chunk_groups / chunk.step_groups) * grad_scale)
            loss_total = loss_total + loss.detach()
            for k, v in metrics.items():
                metrics_acc.setdefault(k, []).append(v.detach().float())
        return self.compute.sum_over_shards(loss_total, batch), metrics_acc  # the whole chunk's loss

    def _micro_rows(self, rows: int, width: int) -> int:
        """Rows per micro-batch of a chunk of ``rows`` x ``width`` tokens (:func:`screl.modules.chunk.micro_rows`)."""
        return micro_rows(rows, width, self.micro_batch_size, self.micro_batch_tokens, self.device)

    def _micro_batch_loss(self, batch: dict[str, Any], chunk: Chunk, sl: slice) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of rows ``sl`` (scaled to the chunk) and its metrics, with ``logprob_mismatch``
        over the on-policy tokens."""
        return self._loss_of(batch, chunk, sl, self.compute.chunk_logprobs(self, batch, sl))

    def _loss_of(self, batch: dict[str, Any], chunk: Chunk, sl: slice, curr: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """:meth:`_micro_batch_loss` from the rows' current logprobs ``curr``."""
        ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
        prev = curr.detach()
        on_policy = batch["token_versions"][sl] == int(batch["trainer_version"])
        gen = behaviour(prev, batch["generation_logprobs"][sl], on_policy, self.behaviour_logprobs)
        ref = self.reference_logprobs(ids, attention, batch, sl) if self.has_reference else None
        loss, metrics = self._objective(batch, chunk, sl, curr, prev, gen, ref)
        if not self.loss_fn.token_level_loss:
            loss = loss * (sl.stop - sl.start) / chunk.chunk_rows
        entropy = self.compute.last_entropy
        if entropy is not None:  # the policy's entropy over the trained tokens (no gradient: a figure)
            mask = chunk.token_mask[sl].to(entropy.dtype)
            metrics["entropy"] = (entropy * mask).sum() / mask.sum().clamp(min=1.0)
        on_mask = whole_row_on_policy(batch["token_versions"][sl], chunk.token_mask[sl], int(batch["trainer_version"]))
        if on_mask.any():
            metrics["logprob_mismatch"] = (batch["generation_logprobs"][sl].float() - prev).abs()[on_mask].max()
        return loss, metrics

    def _objective(self, batch: dict[str, Any], chunk: Chunk, sl: slice, curr: Tensor, prev: Tensor, gen: Tensor,
                   ref: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """The loss of rows ``sl`` from their current, step-start and behaviour logprobs (and the reference's)."""
        raise NotImplementedError(f"{type(self).__name__} must define _objective")

    def _optimizer_step(self, opt: LightningOptimizer) -> Tensor | None:
        """Clip (tensor-parallel aware under Megatron), step and zero the gradients, move the schedule; returns
        the norm clipped."""
        grad_norm = self.compute.clip(self, self.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        self._step_policy_schedule(opt)
        return grad_norm
