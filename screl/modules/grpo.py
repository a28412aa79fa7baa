"""The GRPO LightningModule: the clipped surrogate of group-relative advantages, over the chunked step.

The advantages are the group estimator's (``grpo.adv_estimator``, computed with the rows); the step streams as chunks
of whole groups and takes one optimizer step per RL step (:mod:`screl.modules.chunked`); what GRPO shares with PPO
and Distill (policy, optimizer and schedule, compute adapter, logging) is :mod:`screl.modules.policy_gradient`'s.
"""

from __future__ import annotations

from typing import Any, Literal

from torch import Tensor
from typing_extensions import override

from screl.algos import PolicyLoss
from screl.config import GRPOConfig, from_dict
from screl.models import PolicySpec
from screl.models.logprobs import token_logprobs
from screl.modules.chunk import (  # noqa: F401  (the names tests and tools import from here)
    ACCELERATOR_MICRO_BATCH_TOKENS,
    CPU_MICRO_BATCH_TOKENS,
    Chunk,
)
from screl.modules.chunked import ChunkedPolicyGradient
from screl.modules.masks import whole_row_on_policy
from screl.modules.optim import OptimSettings
from screl.modules.policy_gradient import HALF_DTYPES, master_copy

__all__ = ["GRPO", "HALF_DTYPES", "master_copy", "token_logprobs", "whole_row_on_policy"]


class GRPO(ChunkedPolicyGradient):
    """Group Relative Policy Optimization with importance-sampling correction for async rollouts.

    Args:
        policy: The policy spec (``screl.models.TinyCausalLM``, ``screl.models.HFCausalLM``, ...).
        loss_fn: The policy loss: a :class:`~screl.algos.PolicyLoss` (``screl.algos.ClippedPGLoss`` with its
            ``init_args``), or the name of a registered one (``screl.algos.register_policy_loss``, built with its
            defaults); None: ``clipped`` (``ClippedPGLoss()``).
        learning_rate: The policy optimizer's peak learning rate (1e-6 by default: safe for a pretrained model).
        weight_decay: The optimizer's weight decay.
        max_grad_norm: Clip the gradient norm before each optimizer step (None: no clipping).
        micro_batch_size: Rows per forward/backward inside a chunk (None: by ``micro_batch_tokens``).
        train_global_batch_size: Rows per optimizer step; must equal num_prompts_per_step x
            num_generations_per_prompt (None: derived).
        temperature: Sampling temperature of generation (linked from ``data.init_args.generation``).
        behaviour_logprobs: The behaviour policy of tokens the trainer's current version generated: ``trainer``
            (its own recomputed logprobs: their IS weight is exactly 1, engine numerics ignored) or ``engine``
            (the logprobs the engine reported: the engine/trainer mismatch is corrected like staleness).
        algo: The ``grpo`` block (linked by the CLI).
        micro_batch_tokens: Without ``micro_batch_size``, split a chunk evenly into micro-batches of at most this
            many tokens (rows x padded length; gradients accumulate over them, the update is the same). None:
            automatic, ``CPU_MICRO_BATCH_TOKENS`` on a CPU (a forward's activations then stay in cache: 512 rows of
            68 tokens train in 4.3 s instead of 10.1 s, see ``bench/README.md``) and ``ACCELERATOR_MICRO_BATCH_TOKENS``
            on an accelerator; 0: the whole chunk.
        logprob_chunk_tokens: The output layer and log-softmax run over chunks of this many tokens, recomputed in
            the backward pass, so no ``[tokens, vocabulary]`` logits are held (:mod:`screl.models.logprobs`).
            None: automatic (``2**25`` logits a chunk: 220 tokens at a 152k vocabulary); 0: full logits (for a
            model whose head is not a plain linear layer). Under ``MegatronStrategy`` the logits are
            vocabulary-parallel instead (never gathered).
        activation_checkpointing: Recompute activations in the backward pass instead of keeping them: ``full``
            (or true) checkpoints every decoder layer (Hugging Face's gradient checkpointing; Megatron's
            ``recompute_granularity: full``), ``selective`` only the attention core (Megatron only); false: off.
        routing_replay: A mixture-of-experts policy: the trainer routes every token to the experts the engine chose
            (recorded in the rows), so a routing flip between the engine's numerics and the trainer's never changes a
            token's logprob (:mod:`screl.modules.routing_replay`, docs/moe.md). Torch engine only.
        optimizer: The optimizer's class path (built with ``lr`` and ``weight_decay``).
        lr_scheduler: ``constant``, ``linear`` or ``cosine`` (decaying to 0 at the run's last step: the block's
            ``max_num_steps`` or ``trainer.max_steps``), after the warmup; stepped once per RL step.
        warmup_steps: The learning rate ramps linearly over this many RL steps (``(n + 1) / warmup_steps`` of it at
            step ``n``).
        warmup_ratio: Or over this fraction of the run's steps (rounded up); set one of the two.
        lora: Train LoRA adapters instead of the full policy (``{r: 16, alpha: 32, dropout: 0, target_modules:
            all-linear, use_rslora: false}``, or ``{peft: {class_path: peft.LoraConfig, init_args: {...}}}``;
            :mod:`screl.models.lora`, docs/lora.md): the trainer's copy only (the engines get merged weights),
            the base frozen in the spec's dtype, the optimizer over the adapters, checkpoints of the adapters.
            Not under ``MegatronStrategy``. None: full fine-tuning.

    Precision: the trainer's parameters and the optimizer state are fp32 whatever the policy spec's ``dtype``
    (master weights); set ``trainer.precision: bf16-mixed`` for bf16 compute. The refit sends the spec's dtype,
    cast from the masters. ``trainer.precision: bf16-true`` (bf16 parameters, no master copy) is refused.
    """

    def __init__(
        self,
        policy: PolicySpec,
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
        routing_replay: bool = False,
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
            activation_checkpointing=activation_checkpointing, micro_batch_tokens=micro_batch_tokens,
            routing_replay=routing_replay, lora=lora,
        )

    @override
    def _objective(self, batch: dict[str, Any], chunk: Chunk, sl: slice, curr: Tensor, prev: Tensor, gen: Tensor,
                   ref: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of rows ``sl``: each row's group advantage on every one of its tokens."""
        adv_tok = chunk.advantages[sl, None].expand_as(curr)
        loss, metrics = self.loss_fn(
            curr, prev, gen, adv_tok, chunk.token_mask[sl], chunk.sample_mask[sl], reference_logprobs=ref,
            global_normalizer=chunk.valid_tokens if self.loss_fn.token_level_loss else None,
        )
        return loss, metrics
