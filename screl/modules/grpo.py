"""The GRPO LightningModule: one RL step = one optimizer step, assembled from one or more chunks.

The train dataloader (``RolloutDataModule``) yields *chunks* of whole prompt groups; a step may be streamed as
several chunks (``async_rl.min_groups_for_streaming_train`` < ``num_prompts_per_step``). Gradients accumulate over a
step's chunks and the optimizer steps on the chunk marked ``last_chunk``, so optimization is manual.

Because the policy changes only at the end of a step, the logprobs of the current parameters *are* the step-start
("old"/proximal) logprobs: ``prev_logprobs = curr_logprobs.detach()`` exactly, and the importance-sampling weight
``exp(prev - gen)`` corrects for the behaviour policy that generated each token. Tokens that the current weight
version generated (their recorded version equals the trainer version) are on-policy by construction: their behaviour
logprobs are taken to be the trainer's, so their IS weight is exactly 1; ``train/logprob_mismatch`` reports how far
engine and trainer numerics differ on them, over the rows the current version generated from their first token.

How the policy computes (Hugging Face models, or Megatron shards) is the compute adapter's, ``self.compute``
(:mod:`screl.modules.compute`), chosen once from the strategy in ``configure_model``.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Literal, TypeVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.algos import ClippedPGLoss
from screl.config import GRPOConfig, from_dict
from screl.models import PolicySpec
from screl.modules.chunk import (  # noqa: F401  (the constants: memory_plan and tests import them from here)
    ACCELERATOR_MICRO_BATCH_TOKENS,
    CPU_MICRO_BATCH_TOKENS,
    Chunk,
    chunk_logs,
    chunk_means,
    chunk_tensors,
    micro_rows,
)
from screl.modules.compute import HFCompute, PolicyCompute, enable_activation_checkpointing
from screl.modules.logprobs import token_logprobs
from screl.modules.masks import AllFilteredStepError, behaviour, whole_row_on_policy
from screl.modules.megatron_compute import compute_for
from screl.modules.routing_replay import check_routing_replay
from screl.modules.step_log import BatchMetrics
from screl.modules.vision_inputs import vision_forward_inputs
from screl.modules.weight_export import WeightExport
from screl.rollout.rows import ROUTING_SCHEMA, ROW_SCHEMA, VISION_SCHEMA, RowSchema

log = logging.getLogger(__name__)

HALF_DTYPES = (torch.bfloat16, torch.float16)


_M = TypeVar("_M", bound=torch.nn.Module)


def master_copy(model: _M) -> _M:
    """The trainer's copy of a policy: fp32 parameters (the master weights the optimizer updates and keeps its
    fp32 state for), whatever dtype the spec loads; compute runs in bf16 under ``trainer.precision:
    bf16-mixed``, and a refit casts back to the engine's dtype (:meth:`GRPO.iter_export_weights`)."""
    if any(p.dtype in HALF_DTYPES for p in model.parameters()):
        model = model.float()
    return model


def _check_arguments(micro_batch_tokens: int | None, logprob_chunk_tokens: int | None,
                     activation_checkpointing: bool | str, behaviour_logprobs: str) -> str | None:
    """``GRPO``'s argument checks (each error names its key); returns the ``activation_checkpointing`` mode:
    ``full`` (or true), ``selective``, or None (false)."""
    if micro_batch_tokens is not None and micro_batch_tokens < 0:
        raise ValueError(f"model.init_args.micro_batch_tokens={micro_batch_tokens}: must be >= 0 (0: the whole "
                         "chunk) or null (automatic)")
    if logprob_chunk_tokens is not None and logprob_chunk_tokens < 0:
        raise ValueError(f"model.init_args.logprob_chunk_tokens={logprob_chunk_tokens}: must be >= 0 (0: full "
                         "logits) or null (automatic)")
    if activation_checkpointing not in (True, False, "full", "selective"):
        raise ValueError(f"model.init_args.activation_checkpointing={activation_checkpointing!r}: expected "
                         "false, true, 'full' or 'selective'")
    if behaviour_logprobs not in ("trainer", "engine"):
        raise ValueError(f"model.init_args.behaviour_logprobs={behaviour_logprobs!r}: expected 'trainer' or "
                         "'engine'")
    return "full" if activation_checkpointing is True else activation_checkpointing or None


class GRPO(WeightExport, LightningModule):
    """Group Relative Policy Optimization with importance-sampling correction for async rollouts.

    Args:
        policy: The policy spec (``screl.models.TinyCausalLM``, ``screl.models.HFCausalLM``, ...).
        loss_fn: The policy loss (``screl.algos.ClippedPGLoss``); None uses its defaults.
        learning_rate: AdamW learning rate.
        weight_decay: AdamW weight decay.
        max_grad_norm: Clip the gradient norm before each optimizer step (None: no clipping).
        micro_batch_size: Rows per forward/backward inside a chunk (None: by ``micro_batch_tokens``).
        micro_batch_tokens: Without ``micro_batch_size``, split a chunk evenly into micro-batches of at most this
            many tokens (rows x padded length; gradients accumulate over them, the update is the same). None:
            automatic, ``CPU_MICRO_BATCH_TOKENS`` on a CPU (a forward's activations then stay in cache: 512 rows of
            68 tokens train in 4.3 s instead of 10.1 s, see ``bench/README.md``) and ``ACCELERATOR_MICRO_BATCH_TOKENS``
            on an accelerator; 0: the whole chunk.
        train_global_batch_size: Rows per optimizer step; must equal num_prompts_per_step x
            num_generations_per_prompt (None: derived).
        temperature: Sampling temperature of generation (linked from ``data.init_args.generation``).
        behaviour_logprobs: The behaviour policy of tokens the trainer's current version generated: ``trainer``
            (its own recomputed logprobs: their IS weight is exactly 1, engine numerics ignored) or ``engine``
            (the logprobs the engine reported: the engine/trainer mismatch is corrected like staleness).
        algo: The ``grpo`` block (linked by the CLI).
        logprob_chunk_tokens: The output layer and log-softmax run over chunks of this many tokens, recomputed in
            the backward pass, so no ``[tokens, vocabulary]`` logits are held (:mod:`screl.modules.logprobs`).
            None: automatic (``2**25`` logits a chunk: 220 tokens at a 152k vocabulary); 0: full logits (for a
            model whose head is not a plain linear layer). Under ``MegatronStrategy`` the logits are
            vocabulary-parallel instead (never gathered).
        routing_replay: A mixture-of-experts policy: the trainer routes every token to the experts the engine chose
            (recorded in the rows), so a routing flip between the engine's numerics and the trainer's never changes a
            token's logprob (:mod:`screl.modules.routing_replay`, docs/moe.md). Torch engine only.
        activation_checkpointing: Recompute activations in the backward pass instead of keeping them: ``full``
            (or true) checkpoints every decoder layer (Hugging Face's gradient checkpointing; Megatron's
            ``recompute_granularity: full``), ``selective`` only the attention core (Megatron only); false: off.

    Precision: the trainer's parameters and the optimizer state are fp32 whatever the policy spec's ``dtype``
    (master weights); set ``trainer.precision: bf16-mixed`` for bf16 compute. The refit sends the spec's dtype,
    cast from the masters. ``trainer.precision: bf16-true`` (bf16 parameters, no master copy) is refused.
    """

    def __init__(
        self,
        policy: PolicySpec,
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
        routing_replay: bool = False,
    ) -> None:
        super().__init__()
        self.activation_checkpointing = _check_arguments(micro_batch_tokens, logprob_chunk_tokens,
                                                         activation_checkpointing, behaviour_logprobs)
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.behaviour_logprobs = behaviour_logprobs
        self.automatic_optimization = False
        self.policy_spec = policy
        self.compute: PolicyCompute = HFCompute()  # Hugging Face models until configure_model asks the strategy
        # train mode, as Lightning expects (from_pretrained loads in eval mode); the shipped policies have no
        # dropout, so the trainer's logprobs stay the engine's (set a checkpoint's dropout to 0 for the same)
        built = policy.build_model()
        self.engine_dtype = next(built.parameters()).dtype  # what the generation engines hold: refits send it
        self.model = master_copy(built).train()
        enable_activation_checkpointing(self.model, self.activation_checkpointing)
        self.routing_replay = check_routing_replay(routing_replay, self.model, self.activation_checkpointing)
        self.loss_fn = loss_fn if loss_fn is not None else ClippedPGLoss()
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.train_global_batch_size = train_global_batch_size
        self.temperature = temperature
        self.algo: GRPOConfig = from_dict(GRPOConfig, algo) if not isinstance(algo, GRPOConfig) else algo
        self.reference: torch.nn.Module | None = None
        if self.loss_fn.requires_reference_logprobs:
            self.reference = self._frozen_copy()
        self._step_started: float | None = None
        self._step_trained_rows = 0.0  # rows of the open step that the loss sees (sample_mask)
        self._batch_metrics = BatchMetrics()  # this batch's scalars, written once at its end
        self._warned_advantage = False

    @property
    def row_schema(self) -> RowSchema:
        """The rows this module trains on (the data module reads it): with routing replay they carry the routing, for
        a vision-language policy the prompt's images."""
        if self.policy_spec.is_vlm:
            return VISION_SCHEMA
        return ROUTING_SCHEMA if self.routing_replay else ROW_SCHEMA

    def _frozen_copy(self) -> torch.nn.Module:
        """The reference policy: a frozen copy of the initial one, in the engine's dtype (it takes no update, so
        it needs no fp32 master)."""
        return copy.deepcopy(self.model).to(self.engine_dtype).requires_grad_(False).eval()

    @override
    def configure_model(self) -> None:
        """Choose the strategy's compute adapter and let it make the policy it trains (under ``MegatronStrategy``
        this rank's Megatron shard, loaded with the same weights: the generation workers start from the same spec)."""
        if self.compute.sharded:  # a later fit: the models are this rank's shards already
            return
        compute = compute_for(self._trainer)
        self.model = compute.policy_model(self.model, self.activation_checkpointing)
        self.compute = compute

    # -- optimization --------------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)

    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if batch.get("done"):  # the controller has no more steps: the trainer stops after this
            return torch.zeros((), device=self.device)
        t0 = time.perf_counter()
        if self._step_started is None:
            self._step_started = t0
        opt = self.optimizers()
        assert not isinstance(opt, list), "GRPO configures exactly one optimizer"
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
        ref = None
        if self.reference is not None:
            with torch.no_grad():
                ref = token_logprobs(self.reference, ids, attention, self.temperature, self.logprob_chunk_tokens,
                                     vision_forward_inputs(self.reference, batch, sl))
        loss, metrics = self._objective(batch, chunk, sl, curr, prev, gen, ref)
        if not self.loss_fn.token_level_loss:
            loss = loss * (sl.stop - sl.start) / chunk.chunk_rows
        on_mask = whole_row_on_policy(batch["token_versions"][sl], chunk.token_mask[sl], int(batch["trainer_version"]))
        if on_mask.any():
            metrics["logprob_mismatch"] = (batch["generation_logprobs"][sl].float() - prev).abs()[on_mask].max()
        return loss, metrics

    def _objective(self, batch: dict[str, Any], chunk: Chunk, sl: slice, curr: Tensor, prev: Tensor, gen: Tensor,
                   ref: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of rows ``sl`` from their current, step-start and behaviour logprobs (``screl.Distill``
        puts its teachers' per-token advantages here)."""
        adv_tok = chunk.advantages[sl, None].expand_as(curr)
        return self.loss_fn(  # type: ignore[no-any-return]
            curr, prev, gen, adv_tok, chunk.token_mask[sl], chunk.sample_mask[sl], reference_logprobs=ref,
            global_normalizer=chunk.valid_tokens if self.loss_fn.token_level_loss else None,
        )

    def _optimizer_step(self, opt: LightningOptimizer) -> Tensor | None:
        """Clip (tensor-parallel aware under Megatron), step and zero the gradients; returns the norm clipped."""
        grad_norm = self.compute.clip(self, self.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grad_norm

    def _log_chunk(
        self, batch: dict[str, Any], loss: Tensor, metrics: dict[str, list[Tensor]], t0: float, stepped: bool,
        grad_norm: Tensor | None = None, means: dict[str, Tensor] | None = None,
    ) -> None:
        """Stage the chunk's metrics (progress bar, the rest); they are written once at the batch's end. ``means``:
        the whole chunk's (:func:`screl.modules.chunk.chunk_means`); the other figures are this replica's shard's."""
        means = means if means is not None else chunk_means(batch, self.compute, self.device)
        bar, logs = chunk_logs(batch, loss, metrics, means, self.algo.overlong_filtering, grad_norm)
        now = time.perf_counter()
        logs["time/train_chunk_s"] = now - t0
        if stepped and self._step_started is not None:
            logs["time/train_step_s"] = now - self._step_started
            self._step_started = None
        self.stage_metrics(bar, prog_bar=True)
        self.stage_metrics(logs)

    def stage_metrics(self, metrics: dict[str, Any], prog_bar: bool = False) -> None:
        """Add scalars to this batch's metrics (callbacks too: ``WeightSync``'s ``rollout/aborted_stale``): they
        reach the loggers in one write when the batch ends (:mod:`screl.modules.step_log`), not key by key
        through ``self.log``."""
        self._batch_metrics.add(self._trainer, metrics, prog_bar=prog_bar)

    @override
    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.trainer is not None:
            self._batch_metrics.flush(self.trainer)
