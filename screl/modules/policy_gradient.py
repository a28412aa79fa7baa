"""What GRPO, PPO and Distill share: the policy, its loss, optimizer and schedule, the compute adapter, logging.

:class:`PolicyGradientModule` is their common base (siblings over it, none derived from another): it builds the
policy (fp32 master weights, see :func:`master_copy`), the policy loss (a :class:`~screl.algos.PolicyLoss`, or a
registered loss's name), the frozen reference policy when the loss asks for one, the compute adapter (``self.compute``,
:mod:`screl.modules.compute`, chosen from the strategy in ``configure_model``), the optimizer and learning-rate
schedule (:mod:`screl.modules.optim`), the refit's weight export (:class:`~screl.modules.weight_export.WeightExport`)
and the batch's metrics (written once per batch, :mod:`screl.modules.step_log`). Optimization is manual: each
algorithm's ``training_step`` steps its optimizers and schedules itself.

With ``lora`` (:mod:`screl.models.lora`) the policy is the spec's model, frozen in its dtype, with peft's adapters
injected: they are the only trained parameters (and the optimizer's), the reference policy is the same model with
its adapters off (no copy), a refit sends the merged weights and a checkpoint the adapters
(:mod:`screl.modules.lora`).
"""

from __future__ import annotations

import copy
import time
from collections.abc import Mapping
from contextlib import nullcontext
from typing import Any, Literal, TypeVar

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.algos import PolicyLoss, policy_loss
from screl.config import GRPOConfig
from screl.models import PolicySpec
from screl.models.logprobs import token_logprobs
from screl.models.lora import LoRASettings, adapters_disabled, apply_lora, lora_settings
from screl.modules.chunk import chunk_logs, chunk_means
from screl.modules.compute import HFCompute, PolicyCompute, enable_activation_checkpointing
from screl.modules.lora import MEGATRON_REFUSAL, LoRAHooks
from screl.modules.megatron_compute import compute_for
from screl.modules.optim import OptimSettings
from screl.modules.routing_replay import check_routing_replay
from screl.modules.step_log import BatchMetrics
from screl.modules.vision_inputs import vision_forward_inputs
from screl.modules.weight_export import WeightExport
from screl.rollout.rows import ROUTING_SCHEMA, ROW_SCHEMA, VISION_SCHEMA, RowSchema

__all__ = ["HALF_DTYPES", "PolicyGradientModule", "master_copy"]

HALF_DTYPES = (torch.bfloat16, torch.float16)

_M = TypeVar("_M", bound=torch.nn.Module)


def master_copy(model: _M) -> _M:
    """The trainer's copy of a policy: fp32 parameters (the master weights the optimizer updates and keeps its
    fp32 state for), whatever dtype the spec loads; compute runs in bf16 under ``trainer.precision:
    bf16-mixed``, and a refit casts back to the engine's dtype (:meth:`WeightExport.iter_export_weights`)."""
    if any(p.dtype in HALF_DTYPES for p in model.parameters()):
        model = model.float()
    return model


def _check_arguments(micro_batch_tokens: int | None, logprob_chunk_tokens: int | None,
                     activation_checkpointing: bool | str, behaviour_logprobs: str) -> str | None:
    """The shared argument checks (each error names its key); returns the ``activation_checkpointing`` mode:
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


class PolicyGradientModule(LoRAHooks, WeightExport, LightningModule):
    """The base of screl's algorithms; the arguments are documented on :class:`~screl.modules.GRPO`.

    ``algo`` is the algorithm's block, already parsed by the algorithm; ``optim`` its optimizer and schedule
    settings (:class:`~screl.modules.optim.OptimSettings`); ``lora`` the ``lora`` block (None: full fine-tuning).
    """

    def __init__(
        self, policy: PolicySpec, algo: GRPOConfig, optim: OptimSettings, *, loss_fn: PolicyLoss | str | None,
        learning_rate: float, weight_decay: float, max_grad_norm: float | None, micro_batch_size: int | None,
        train_global_batch_size: int | None, temperature: float, behaviour_logprobs: Literal["trainer", "engine"],
        logprob_chunk_tokens: int | None, activation_checkpointing: bool | Literal["full", "selective"],
        micro_batch_tokens: int | None = None, routing_replay: bool = False,
        lora: Mapping[str, Any] | LoRASettings | None = None,
    ) -> None:
        super().__init__()
        self.lora: LoRASettings | None = lora_settings(lora)
        self.activation_checkpointing = _check_arguments(micro_batch_tokens, logprob_chunk_tokens,
                                                         activation_checkpointing, behaviour_logprobs)
        self.logprob_chunk_tokens = logprob_chunk_tokens
        self.behaviour_logprobs = behaviour_logprobs
        self.automatic_optimization = False
        self.algo: GRPOConfig = algo
        self.optim = optim
        self._build_policy(policy, routing_replay)
        self.loss_fn: PolicyLoss = policy_loss(loss_fn)
        self.learning_rate = learning_rate
        self.weight_decay = weight_decay
        self.max_grad_norm = max_grad_norm
        self.micro_batch_size = micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.train_global_batch_size = train_global_batch_size
        self.temperature = temperature
        self.reference: torch.nn.Module | None = None
        self._reference_is_base = False  # LoRA: the reference is the policy with its adapters off
        if self.loss_fn.requires_reference_logprobs:
            self._make_reference()
        self._step_started: float | None = None
        self._step_lr: float | None = None  # the policy's learning rate of the step's update (train/lr)
        self._batch_metrics = BatchMetrics()  # this batch's scalars, written once at its end

    def _build_policy(self, policy: PolicySpec, routing_replay: bool) -> None:
        """The policy's fp32 master copy, in train mode as Lightning expects (from_pretrained loads in eval mode;
        the shipped policies have no dropout, so the trainer's logprobs stay the engine's). With ``lora``: the
        spec's model as loaded (frozen: no master copy), its fp32 adapters injected."""
        self.policy_spec = policy
        self.compute: PolicyCompute = HFCompute()  # Hugging Face models until configure_model asks the strategy
        built = policy.build_model()
        self.engine_dtype = next(built.parameters()).dtype  # what the generation engines hold: refits send it
        self.model = (master_copy(built) if self.lora is None else apply_lora(built, self.lora)).train()
        enable_activation_checkpointing(self.model, self.activation_checkpointing)
        self.routing_replay = check_routing_replay(routing_replay, self.model, self.activation_checkpointing)

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

    def _make_reference(self) -> None:
        """The reference policy (the initial one): a frozen copy, or with LoRA the base itself (adapters off)."""
        if self.lora is not None:
            self._reference_is_base = True
        else:
            self.reference = self._frozen_copy()

    @property
    def has_reference(self) -> bool:
        """Whether the module holds a reference policy (the loss or PPO's KL penalty asks for one)."""
        return self.reference is not None or self._reference_is_base

    def reference_logprobs(self, ids: Tensor, attention: Tensor, batch: dict[str, Any] | None = None,
                           sl: slice | None = None) -> Tensor:
        """The reference policy's ``[rows, len - 1]`` next-token logprobs (no gradient); ``batch`` and ``sl``: the
        chunk and rows whose images a vision-language policy reads."""
        model = self.model if self._reference_is_base else self.reference
        assert model is not None, "the module holds no reference policy"
        inputs = vision_forward_inputs(model, batch, sl) if batch is not None and sl is not None else None
        with torch.no_grad(), adapters_disabled(model) if self._reference_is_base else nullcontext():
            return token_logprobs(model, ids, attention, self.temperature, self.logprob_chunk_tokens, inputs)

    @override
    def configure_model(self) -> None:
        """Choose the strategy's compute adapter and let it make the policy it trains (under ``MegatronStrategy``
        this rank's Megatron shard, loaded with the same weights: the generation workers start from the same spec)."""
        if self.compute.sharded:  # a later fit: the models are this rank's shards already
            return
        compute = self._strategy_compute()
        self.model = compute.policy_model(self.model, self.activation_checkpointing)
        self.compute = compute

    def _strategy_compute(self) -> PolicyCompute:
        """The trainer's strategy's compute adapter; LoRA is refused under ``MegatronStrategy``."""
        compute = compute_for(self._trainer)
        if self.lora is not None and compute.sharded:
            raise ValueError(MEGATRON_REFUSAL)
        return compute

    # -- optimization --------------------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> Any:
        """The policy's optimizer (``optimizer``, AdamW by default) and its schedule, stepped once per RL step."""
        opt = self._optimizer(self.model, self.learning_rate)
        return {"optimizer": opt, "lr_scheduler": self.optim.schedule(opt, self.run_steps())}

    def _optimizer(self, module: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        """The optimizer over ``module``'s trained parameters (with LoRA: the adapters only)."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        params = [p for p in module.parameters() if p.requires_grad]
        return self.optim.optimizer(params, lr, self.weight_decay, strategy)

    def run_steps(self) -> int | None:
        """The run's RL steps as far as the module can tell: the least of the block's ``max_num_steps`` and
        ``trainer.max_steps`` that are set (None: neither)."""
        bounds = [self.algo.max_num_steps]
        if self._trainer is not None and self._trainer.max_steps > 0:
            bounds.append(self._trainer.max_steps)
        known = [b for b in bounds if b]
        return min(known) if known else None

    def _policy_schedule(self) -> Any:
        """The policy optimizer's schedule (the only one, or the last one configured)."""
        schedules = self.lr_schedulers()
        return schedules[-1] if isinstance(schedules, list) else schedules

    def _step_policy_schedule(self, opt: LightningOptimizer) -> None:
        """Record the learning rate the step's update used (``train/lr``), then move the schedule one step."""
        self._step_lr = float(opt.optimizer.param_groups[0]["lr"])
        schedule = self._policy_schedule()
        if schedule is not None:
            schedule.step()

    # -- logging -------------------------------------------------------------------------------------
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
        if stepped and self._step_lr is not None:
            logs["train/lr"] = self._step_lr
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
