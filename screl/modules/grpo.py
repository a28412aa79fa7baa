"""The GRPO LightningModule: one RL step = one optimizer step, assembled from one or more chunks.

The train dataloader (``RolloutDataModule``) yields *chunks* of whole prompt groups; a step may be
streamed as several chunks (``async_rl.min_groups_for_streaming_train`` < ``num_prompts_per_step``).
Gradients accumulate over a step's chunks and the optimizer steps on the chunk marked ``last_chunk``,
so optimization is manual.

Because the policy changes only at the end of a step, the logprobs of the current parameters *are*
the step-start ("old"/proximal) logprobs: ``prev_logprobs = curr_logprobs.detach()`` exactly, and the
importance-sampling weight ``exp(prev - gen)`` corrects for the behaviour policy that generated each
token. Tokens that the current weight version generated (their recorded version equals the trainer
version) are on-policy by construction: their behaviour logprobs are taken to be the trainer's, so
their IS weight is exactly 1; ``train/logprob_mismatch`` reports how far engine and trainer numerics
differ on them, over the rows the current version generated from their first token.

Under ``trainer.strategy: screl.strategies.MegatronStrategy`` the policy is a Megatron-core ``GPTModel``
built in ``configure_model`` (this rank's shard, loaded from the policy spec's Hugging Face weights);
logprobs come from vocabulary-parallel logits, gradients are clipped by their tensor-parallel-aware
norm and ``export_weights()`` gathers full Hugging Face-named weights (a collective: every rank calls
it). A reference policy (KL) stays a replicated Hugging Face model.
"""

from __future__ import annotations

import copy
import logging
import sys
import time
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.algos import ClippedPGLoss, get_adv_estimator
from screl.config import GRPOConfig, from_dict
from screl.models import PolicySpec
from screl.modules.logprobs import token_logprobs
from screl.modules.masks import (
    AllFilteredStepError,
    behaviour,
    loss_sample_mask,
    mask_metrics,
    whole_row_on_policy,
)
from screl.modules.megatron_policy import fit_provider_to_policy, megatron_token_logprobs
from screl.modules.routing_replay import check_routing_replay, replayed
from screl.modules.step_log import BatchMetrics
from screl.modules.vision_inputs import vision_forward_inputs
from screl.modules.weight_export import WeightExport
from screl.rollout.rows import ROUTING_SCHEMA, ROW_SCHEMA, VISION_SCHEMA, RowSchema

log = logging.getLogger(__name__)

CPU_MICRO_BATCH_TOKENS = 4096
"""The automatic micro-batch size on a CPU, in tokens (``GRPO(micro_batch_tokens=None)``)."""

ACCELERATOR_MICRO_BATCH_TOKENS = 8192
"""The automatic micro-batch size on an accelerator, in tokens: a token budget, never the whole chunk (a real
step of 64 rows x 1.2k tokens in one forward needs its activations for all 77k tokens at once). ``screl check``
prints the memory this takes for the configured model."""

HALF_DTYPES = (torch.bfloat16, torch.float16)


_M = TypeVar("_M", bound=torch.nn.Module)


def master_copy(model: _M) -> _M:
    """The trainer's copy of a policy: fp32 parameters (the master weights the optimizer updates and keeps its
    fp32 state for), whatever dtype the spec loads; compute runs in bf16 under ``trainer.precision:
    bf16-mixed``, and a refit casts back to the engine's dtype (:meth:`GRPO.iter_export_weights`)."""
    if any(p.dtype in HALF_DTYPES for p in model.parameters()):
        model = model.float()
    return model


@dataclass(frozen=True)
class _Chunk:
    """What every micro-batch of a chunk shares: its size, masks, advantages and loss normalizers."""

    rows: int
    chunk_rows: int
    chunk_groups: int
    step_groups: int
    sample_mask: Tensor
    token_mask: Tensor
    advantages: Tensor
    valid_tokens: Tensor


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
        if micro_batch_tokens is not None and micro_batch_tokens < 0:
            raise ValueError(f"model.init_args.micro_batch_tokens={micro_batch_tokens}: must be >= 0 (0: the whole "
                             "chunk) or null (automatic)")
        if logprob_chunk_tokens is not None and logprob_chunk_tokens < 0:
            raise ValueError(f"model.init_args.logprob_chunk_tokens={logprob_chunk_tokens}: must be >= 0 (0: full "
                             "logits) or null (automatic)")
        if activation_checkpointing not in (True, False, "full", "selective"):
            raise ValueError(f"model.init_args.activation_checkpointing={activation_checkpointing!r}: expected "
                             "false, true, 'full' or 'selective'")
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.activation_checkpointing: str | None = (
            "full" if activation_checkpointing is True else activation_checkpointing or None
        )
        if behaviour_logprobs not in ("trainer", "engine"):
            raise ValueError(f"model.init_args.behaviour_logprobs={behaviour_logprobs!r}: expected 'trainer' or "
                             "'engine'")
        self.behaviour_logprobs = behaviour_logprobs
        self.automatic_optimization = False
        self.policy_spec = policy
        # train mode, as Lightning expects (from_pretrained loads in eval mode); the shipped policies have no
        # dropout, so the trainer's logprobs stay the engine's (set a checkpoint's dropout to 0 for the same)
        built = policy.build_model()
        self.engine_dtype = next(built.parameters()).dtype  # what the generation engines hold: refits send it
        self.model = master_copy(built).train()
        self._enable_activation_checkpointing(self.model)
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
        self._megatron_strategy: Any = None  # the MegatronStrategy, once configure_model built its model

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

    def _enable_activation_checkpointing(self, model: torch.nn.Module) -> None:
        """``activation_checkpointing`` on a Hugging Face policy: every decoder layer recomputes its activations in
        the backward pass (non-reentrant; active in training mode only). Megatron's is set on its provider."""
        if self.activation_checkpointing != "full":  # selective: Megatron's only (configure_model)
            return
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(f"model.init_args.activation_checkpointing: {type(model).__name__} does not support "
                             "gradient checkpointing; set it to false")
        hf: Any = model
        if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5's name (non-reentrant by default)
            hf.activation_checkpointing_enable()
        else:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})

    def _megatron(self) -> Any:
        """The ``MegatronStrategy`` training this module, or None (checked without importing megatron)."""
        trainer = self._trainer
        megatron = sys.modules.get("screl.strategies.megatron")
        if trainer is None or megatron is None:
            return None
        strategy = trainer.strategy
        return strategy if isinstance(strategy, megatron.MegatronStrategy) else None

    @override
    def configure_model(self) -> None:
        """Under ``MegatronStrategy``: replace the Hugging Face policy by this rank's Megatron shard of it,
        loaded with the same weights (the generation workers start from the same spec)."""
        strategy = self._megatron()
        if strategy is None and self.activation_checkpointing == "selective":
            raise ValueError("model.init_args.activation_checkpointing: selective recomputes Megatron's attention "
                             "core and needs trainer.strategy: screl.strategies.MegatronStrategy; set it to full "
                             "for this policy")
        if strategy is None or self._megatron_strategy is not None:
            return
        from screl.strategies import load_hf_weights

        hf_model = self.model
        fit_provider_to_policy(strategy, hf_model, recompute_granularity=self.activation_checkpointing)
        model = strategy.build_model()
        load_hf_weights(model, hf_model.state_dict())
        self.model = model
        self._megatron_strategy = strategy

    # -- optimization --------------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)

    def _grad_scale(self, batch: dict[str, Any]) -> float:
        """Undo the data-parallel gradient average when each replica trained a shard of the chunk.

        ``batch["dp_shards"]`` replicas each hold whole groups of the chunk and normalize by the whole
        chunk (``chunk_rows``, ``chunk_valid_tokens``), so their gradients must be summed; torch's and
        Megatron's DDP average them (Megatron sums only with ``calculate_per_token_loss``).
        """
        shards = int(batch.get("dp_shards", 1))
        if shards <= 1:
            return 1.0
        strategy = self._megatron_strategy
        if strategy is not None and bool(getattr(strategy.model_provider, "calculate_per_token_loss", False)):
            return 1.0
        return float(shards)

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
        means = self._chunk_means(batch)  # every replica: a collective when the chunk is sharded
        if rows > 0:
            self._log_chunk(batch, loss_total, metrics_acc, t0, stepped, grad_norm, means)
        return loss_total

    def _chunk_means(self, batch: dict[str, Any]) -> dict[str, Tensor]:
        """``reward``, ``staleness`` and ``train/response_length`` over the whole chunk: summed over the data-parallel
        replicas that each hold a shard of it (one all-reduce of four numbers), so rank 0 logs the chunk's means,
        not its own shard's. Every replica calls it, a replica with no rows too."""
        version, dev = int(batch["trainer_version"]), self.device
        sums = torch.stack([
            batch["rewards"].float().sum().to(dev), (version - batch["start_weight"]).float().sum().to(dev),
            batch["token_mask"].float().sum().to(dev), torch.tensor(float(batch["input_ids"].shape[0]), device=dev),
        ])
        sums = self._sum_over_shards(sums, batch)
        rows = sums[3].clamp(min=1.0)
        return {"reward": sums[0] / rows, "staleness": sums[1] / rows, "train/response_length": sums[2] / rows}

    def _step_trained_rows_everywhere(self, batch: dict[str, Any]) -> float:
        """Rows of the step the loss saw, over every data-parallel shard (all ranks then agree to raise)."""
        return float(self._sum_over_shards(torch.tensor(self._step_trained_rows, device=self.device), batch))

    def _sum_over_shards(self, value: Tensor, batch: dict[str, Any]) -> Tensor:
        """``value`` summed over the data-parallel replicas holding shards of this chunk: Megatron's
        data-parallel group, or the whole world under a plain DDP (as is, when the chunk was not sharded)."""
        if int(batch.get("dp_shards", 1)) <= 1:
            return value
        group = None
        if self._megatron_strategy is not None:
            from megatron.core import parallel_state

            group = parallel_state.get_data_parallel_group()
        torch.distributed.all_reduce(value, group=group)
        return value

    def _chunk_tensors(self, batch: dict[str, Any]) -> _Chunk:
        """The chunk's masks, advantages and loss normalizers, shared by all of its micro-batches."""
        rows = batch["input_ids"].shape[0]
        # rows of the whole chunk: a data-parallel replica holds a shard of it (RolloutDataModule)
        chunk_rows = int(batch.get("chunk_rows", rows))
        group_size = self.algo.num_generations_per_prompt
        sample_mask = loss_sample_mask(batch, self.algo.overlong_filtering)
        token_mask = batch["token_mask"].float()
        # every row stays in its group's baseline: a masked row's reward still says how hard the prompt is
        estimator = get_adv_estimator(self.algo.adv_estimator.name)
        advantages = estimator.fn(batch["rewards"].float(), group_size, self.algo.adv_estimator)
        self._watch_advantages(advantages, int(batch["trainer_version"]))
        valid_tokens = (token_mask * sample_mask[:, None]).sum().clamp_min(1.0)
        if "chunk_valid_tokens" in batch:
            valid_tokens = torch.as_tensor(float(batch["chunk_valid_tokens"]), device=self.device).clamp_min(1.0)
        return _Chunk(
            rows=rows, chunk_rows=chunk_rows, chunk_groups=chunk_rows // group_size,
            step_groups=int(batch["step_groups"]), sample_mask=sample_mask, token_mask=token_mask,
            advantages=advantages, valid_tokens=valid_tokens,
        )

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

    def _backward_chunk(self, batch: dict[str, Any], chunk: _Chunk) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """Backpropagate the chunk micro-batch by micro-batch; returns its loss (summed over the data-parallel
        shards of the chunk) and each micro-batch's metrics."""
        if self._megatron_strategy is not None and self._megatron_strategy.parallelism.pipeline_model_parallel_size > 1:
            from screl.modules.pipelined import pipelined_chunk

            return pipelined_chunk(self, batch, chunk)
        grad_scale = self._grad_scale(batch)
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
        return self._sum_over_shards(loss_total, batch), metrics_acc  # the whole chunk's loss

    def _micro_rows(self, rows: int, width: int) -> int:
        """Rows per micro-batch of a chunk of ``rows`` x ``width`` tokens (see ``micro_batch_size``,
        ``micro_batch_tokens``)."""
        if self.micro_batch_size:
            return self.micro_batch_size
        budget = self.micro_batch_tokens
        if budget is None:
            budget = CPU_MICRO_BATCH_TOKENS if self.device.type == "cpu" else ACCELERATOR_MICRO_BATCH_TOKENS
        if budget <= 0 or rows * width <= budget:
            return max(rows, 1)
        parts = -(-rows // max(1, budget // width))  # as few micro-batches as keep each within the budget
        return -(-rows // parts)  # ... with the rows spread evenly over them

    def _micro_batch_loss(self, batch: dict[str, Any], chunk: _Chunk, sl: slice) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of rows ``sl`` (scaled to the chunk) and its metrics, with ``logprob_mismatch``
        over the on-policy tokens."""
        ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
        megatron = self._megatron_strategy
        if megatron is None:
            with replayed(self.routing_replay, self.model, batch, sl):
                curr = token_logprobs(self.model, ids, attention, self.temperature, self.logprob_chunk_tokens,
                                      vision_forward_inputs(self.model, batch, sl))
        else:
            curr = megatron_token_logprobs(megatron, self.model, ids, attention, self.temperature)
        return self._loss_of(batch, chunk, sl, curr)

    def _loss_of(self, batch: dict[str, Any], chunk: _Chunk, sl: slice, curr: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
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

    def _objective(self, batch: dict[str, Any], chunk: _Chunk, sl: slice, curr: Tensor, prev: Tensor, gen: Tensor,
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
        grad_norm: Tensor | None = None
        if self.max_grad_norm is not None:
            if self._megatron_strategy is not None:  # the norm over tensor-parallel shards, each counted once
                grad_norm = self._megatron_strategy.clip_gradients(self.max_grad_norm)
            else:
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return grad_norm

    def _log_chunk(
        self, batch: dict[str, Any], loss: Tensor, metrics: dict[str, list[Tensor]], t0: float, stepped: bool,
        grad_norm: Tensor | None = None, means: dict[str, Tensor] | None = None,
    ) -> None:
        """Stage the chunk's metrics (progress bar, the rest); they are written once at the batch's end. ``means``:
        the whole chunk's (:meth:`_chunk_means`); the other figures are this replica's shard's."""
        means = means if means is not None else self._chunk_means(batch)
        staleness = (int(batch["trainer_version"]) - batch["start_weight"]).float()
        bar: dict[str, Any] = {"reward": means["reward"], "staleness": means["staleness"]}
        logs: dict[str, Any] = {
            "train/loss": loss,
            "train/response_length": means["train/response_length"],
            "train/staleness_max": staleness.max(),
            **mask_metrics(batch, self.algo.overlong_filtering),
        }
        if grad_norm is not None:
            logs["train/grad_norm"] = grad_norm
        for key in ("buffer_fill", "inflight", "wait_s", "generation_s", "filtered", "replaced"):
            if key in batch:
                (bar if key in ("buffer_fill", "inflight") else logs)[f"rollout/{key}"] = float(batch[key])
        for k, vs in metrics.items():
            stacked = torch.stack(vs)
            logs[f"train/{k}"] = stacked.max() if k.endswith("max") or k == "logprob_mismatch" else stacked.mean()
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
