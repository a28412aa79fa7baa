"""``screl.Distill``: multi-teacher on-policy distillation, a LightningModule beside ``GRPO`` and ``PPO``.

The student (``policy``) samples exactly as under GRPO (same data module, samplers, async pump, checkpoints); its
``distillation`` block names the teachers, which score every sampled token in Ray workers of their own before the
row is written (:mod:`screl.rollout.teachers`). The loss is :class:`screl.algos.ReverseKLDistillLoss`: per token,
the advantage is ``kl_coef (teacher logprob - student behaviour logprob) + reward_weight x GRPO advantage``, through
``loss_fn``'s clipped surrogate and importance-sampling correction.

Why a module of its own rather than a GRPO option: the teachers change what a row is (``teacher_logprobs``) and what
the objective is (per-token advantages), and they must be started with the rollout side; a ``Distill`` config says
so in its ``class_path``, a GRPO config stays exactly what it was, and ``screl check`` validates the teachers where
they are written (``model.init_args.distillation``). Everything else (optimizer, micro-batching, IS, refits,
Megatron) is shared with GRPO: both are chunked policy-gradient modules (:mod:`screl.modules.chunked`).

With ``distillation.estimator: top_k`` the rows also carry the teacher's top-k tokens and logprobs at each completion
position, and the loss adds the exact reverse KL over them (:func:`screl.algos.top_k_reverse_kl`; with
``kl_direction: forward`` the forward KL, :func:`screl.algos.top_k_forward_kl`) to the clipped surrogate of the reward
advantage alone. The student's logprobs of the k tokens come from the final hidden states
and the output layer's k rows, normalized by the sampled token's logprob (``log pi(v) = (z_v - z_y) / T +
log pi(y)``), so no full-vocabulary logits are held.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from screl.algos import PolicyLoss, ReverseKLDistillLoss
from screl.algos.distill import TOP_K_KL
from screl.algos.stats import masked_mean, valid_mask
from screl.config import GRPOConfig, from_dict
from screl.config_distill import KEY, DistillationConfig
from screl.models import PolicySpec
from screl.models.logprobs import chunked_logprobs_of_hidden, output_head
from screl.modules.chunk import Chunk
from screl.modules.chunked import ChunkedPolicyGradient
from screl.modules.optim import OptimSettings
from screl.modules.routing_replay import replayed
from screl.modules.vision_inputs import vision_forward_inputs
from screl.rollout.rows import RowSchema


class Distill(ChunkedPolicyGradient):
    """On-policy distillation of ``policy`` toward one or several teachers (routed by the prompt's ``task_source``).

    Args:
        policy: The student's policy spec.
        distillation: The teachers, their routing and the reward mix (:class:`screl.config_distill.DistillationConfig`).
        loss_fn: The clipped surrogate the distillation advantages go through (``ClippedPGLoss``: its clip, IS
            correction and aggregation), or a registered policy loss's name; None: ``clipped`` with its defaults.

    The other arguments are :class:`screl.GRPO`'s; the step is GRPO's chunked step (:mod:`screl.modules.chunked`),
    the objective the teachers'.
    """

    def __init__(
        self,
        policy: PolicySpec,
        distillation: DistillationConfig,
        loss_fn: PolicyLoss | str | None = None,
        learning_rate: float = 1e-6,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        micro_batch_size: int | None = None,
        train_global_batch_size: int | None = None,
        temperature: float = 1.0,
        behaviour_logprobs: Literal["trainer", "engine"] = "trainer",
        algo: dict[str, Any] | None = None,
        micro_batch_tokens: int | None = None,
        logprob_chunk_tokens: int | None = None,
        activation_checkpointing: bool | Literal["full", "selective"] = False,
        optimizer: str = "torch.optim.AdamW",
        lr_scheduler: Literal["constant", "linear", "cosine"] = "constant",
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        lora: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(
            policy, from_dict(GRPOConfig, algo) if not isinstance(algo, GRPOConfig) else algo,
            OptimSettings(optimizer, lr_scheduler, warmup_steps, warmup_ratio), loss_fn=loss_fn,
            learning_rate=learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
            micro_batch_size=micro_batch_size, train_global_batch_size=train_global_batch_size,
            temperature=temperature, behaviour_logprobs=behaviour_logprobs, logprob_chunk_tokens=logprob_chunk_tokens,
            activation_checkpointing=activation_checkpointing, micro_batch_tokens=micro_batch_tokens, lora=lora,
        )
        self.distillation = DistillationConfig.coerce(distillation)
        problems = self.distillation.problems()
        if problems:
            raise ValueError("; ".join(f"{key} = {value!r}: {why}. Fix: {fix}" for key, value, why, fix in problems))
        self.distill_loss = ReverseKLDistillLoss(self.loss_fn, self.distillation.reward_weight,
                                                 self.distillation.kl_coef)
        self._student_top: Tensor | None = None  # estimator top_k: the micro-batch's [valid positions, k] logprobs
        if self.distillation.estimator == "top_k":
            output_head(self.model)  # the top-k logits come from the output layer's rows: refuse a model without one

    @property
    def row_schema(self) -> RowSchema:
        """The rows this module trains on: the standard fields and ``teacher_logprobs`` (the data module reads it),
        and with ``estimator: top_k`` the teacher's top-k ids and logprobs."""
        from screl.rollout.teachers import distill_schema

        return distill_schema(self.distillation)

    def _micro_batch_loss(self, batch: dict[str, Any], chunk: Chunk, sl: slice) -> tuple[Tensor, dict[str, Tensor]]:
        if self.distillation.estimator != "top_k":
            return super()._micro_batch_loss(batch, chunk, sl)
        if self.compute.sharded:  # the top-k rows of the output layer are spread over the ranks
            raise RuntimeError(f"{KEY}.estimator: top_k runs under the default strategy and DDPStrategy, not "
                               "MegatronStrategy (its output layer is sharded); use estimator: sampled")
        if "teacher_top_ids" not in batch:
            raise RuntimeError(f"{KEY}.estimator is top_k but the chunk's rows carry no teacher_top_ids: they were "
                               "written by a run with estimator: sampled; restart the run (or resume it with sampled)")
        ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
        head = output_head(self.model)
        with replayed(self.routing_replay, self.model, batch, sl):
            trunk: Any = self.model.base_model
            hidden = trunk(input_ids=ids, attention_mask=attention,
                           **vision_forward_inputs(self.model, batch, sl)).last_hidden_state[:, :-1]
        curr, _ = chunked_logprobs_of_hidden(hidden, head.weight, ids[:, 1:], self.temperature,
                                             self.logprob_chunk_tokens or None)
        mask = valid_mask(chunk.token_mask[sl], chunk.sample_mask[sl], curr.shape)
        h = hidden[mask].float()
        top = batch["teacher_top_ids"][sl][mask].long()
        weight = head.weight
        z_top = torch.einsum("nh,nkh->nk", h, weight[top].float())
        z_tok = (h * weight[ids[:, 1:][mask]].float()).sum(-1)
        self._student_top = (z_top - z_tok[:, None]) / self.temperature + curr[mask][:, None]
        try:
            return self._loss_of(batch, chunk, sl, curr)
        finally:
            self._student_top = None

    def _objective(self, batch: dict[str, Any], chunk: Chunk, sl: slice, curr: Tensor, prev: Tensor, gen: Tensor,
                   ref: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        if self._student_top is not None:
            return self._top_k_objective(batch, chunk, sl, curr, prev, gen, ref, self._student_top)
        if "teacher_logprobs" not in batch:
            raise RuntimeError("screl.Distill got a chunk without teacher_logprobs: its rows were written by workers "
                               "started without the teachers (model.init_args.distillation); restart the run")
        loss, metrics = self.distill_loss(
            curr, prev, gen, batch["teacher_logprobs"][sl].to(curr.dtype), chunk.token_mask[sl],
            chunk.sample_mask[sl], reward_advantages=chunk.advantages[sl], reference_logprobs=ref,
            global_normalizer=chunk.valid_tokens if self.loss_fn.token_level_loss else None,
        )
        return loss, metrics

    def _top_k_objective(self, batch: dict[str, Any], chunk: Chunk, sl: slice, curr: Tensor, prev: Tensor,
                         gen: Tensor, ref: Tensor | None, student_top: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """``estimator: top_k``: the clipped surrogate of ``reward_weight`` x the reward advantage (0 with pure
        distillation: its IS statistics still log) plus ``kl_coef`` x the top-k reverse KL, aggregated as the
        surrogate aggregates (over the chunk's valid tokens, or per row then over the rows)."""
        token_mask, sample_mask = chunk.token_mask[sl], chunk.sample_mask[sl]
        token_level = self.loss_fn.token_level_loss
        adv = (self.distillation.reward_weight * chunk.advantages[sl, None]).expand_as(curr)
        loss, metrics = self.loss_fn(curr, prev, gen, adv, token_mask, sample_mask, reference_logprobs=ref,
                                     global_normalizer=chunk.valid_tokens if token_level else None)
        mask = valid_mask(token_mask, sample_mask, curr.shape)
        kl = TOP_K_KL[self.distillation.kl_direction](student_top, batch["teacher_top_logprobs"][sl][mask])
        if token_level:
            kl_loss = kl.sum() / chunk.valid_tokens
        else:  # per row's mean over its tokens, then the mean over the micro-batch's rows
            per_row = torch.zeros(curr.shape, dtype=kl.dtype, device=kl.device).masked_scatter(mask, kl)
            kl_loss = (per_row.sum(1) / mask.sum(1).clamp_min(1)).sum() / curr.shape[0]
        m = mask.to(curr.dtype)
        metrics[f"{self.distillation.kl_direction}_kl"] = kl.detach().mean() if kl.numel() else kl.detach().sum()
        metrics["teacher_logprob"] = masked_mean(torch.where(mask, batch["teacher_logprobs"][sl].to(curr.dtype),
                                                             torch.zeros_like(curr)), m)
        metrics["teacher_top_k_mass"] = (batch["teacher_top_logprobs"][sl][mask].exp().sum(-1).mean()
                                         if kl.numel() else kl.detach().sum())
        return loss + self.distillation.kl_coef * kl_loss, metrics
