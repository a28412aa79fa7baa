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
Megatron) is GRPO's, inherited.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor

from screl.algos import ClippedPGLoss, ReverseKLDistillLoss
from screl.config_distill import DistillationConfig
from screl.models import PolicySpec
from screl.modules.grpo import GRPO, _Chunk
from screl.rollout.rows import RowSchema


class Distill(GRPO):
    """On-policy distillation of ``policy`` toward one or several teachers (routed by the prompt's ``task_source``).

    Args:
        policy: The student's policy spec.
        distillation: The teachers, their routing and the reward mix (:class:`screl.config_distill.DistillationConfig`).
        loss_fn: The clipped surrogate the distillation advantages go through (``ClippedPGLoss``: its clip, IS
            correction and aggregation); None uses its defaults.

    The other arguments are :class:`screl.GRPO`'s.
    """

    def __init__(
        self,
        policy: PolicySpec,
        distillation: DistillationConfig,
        loss_fn: ClippedPGLoss | None = None,
        learning_rate: float = 3e-3,
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
    ) -> None:
        super().__init__(
            policy, loss_fn=loss_fn, learning_rate=learning_rate, weight_decay=weight_decay,
            max_grad_norm=max_grad_norm, micro_batch_size=micro_batch_size,
            train_global_batch_size=train_global_batch_size, temperature=temperature,
            behaviour_logprobs=behaviour_logprobs, algo=algo, micro_batch_tokens=micro_batch_tokens,
            logprob_chunk_tokens=logprob_chunk_tokens, activation_checkpointing=activation_checkpointing,
        )
        self.distillation = DistillationConfig.coerce(distillation)
        problems = self.distillation.problems()
        if problems:
            raise ValueError("; ".join(f"{key} = {value!r}: {why}. Fix: {fix}" for key, value, why, fix in problems))
        self.distill_loss = ReverseKLDistillLoss(self.loss_fn, self.distillation.reward_weight,
                                                 self.distillation.kl_coef)

    @property
    def row_schema(self) -> RowSchema:
        """The rows this module trains on: the standard fields and ``teacher_logprobs`` (the data module reads it)."""
        from screl.rollout.teachers import DISTILL_SCHEMA

        return DISTILL_SCHEMA

    def _objective(self, batch: dict[str, Any], chunk: _Chunk, sl: slice, curr: Tensor, prev: Tensor, gen: Tensor,
                   ref: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        if "teacher_logprobs" not in batch:
            raise RuntimeError("screl.Distill got a chunk without teacher_logprobs: its rows were written by workers "
                               "started without the teachers (model.init_args.distillation); restart the run")
        return self.distill_loss(  # type: ignore[no-any-return]
            curr, prev, gen, batch["teacher_logprobs"][sl].to(curr.dtype), chunk.token_mask[sl],
            chunk.sample_mask[sl], reward_advantages=chunk.advantages[sl], reference_logprobs=ref,
            global_normalizer=chunk.valid_tokens if self.loss_fn.token_level_loss else None,
        )
