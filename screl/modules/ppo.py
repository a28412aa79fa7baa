"""The PPO LightningModule: a policy and a critic, GAE advantages, policy and critic epochs per RL step.

One RL step is one chunk of ``num_prompts_per_step x num_generations_per_prompt`` rows (PPO requires
``min_groups_for_streaming_train == num_prompts_per_step``). Per step: (1) the **value stage** (no grad): the critic's
values, the policy's logprobs before any update (the ``prev`` of every epoch's ratio) and, with ``ppo.reward_kl_coef``,
the reference policy's; (2) **GAE** over token rewards (the sequence reward on the last completion token, minus the KL
penalty); (3) ``critic_ppo_epochs`` critic epochs, then ``ppo_epochs`` policy epochs over that same batch, each
``ppo.num_minibatches`` optimizer updates (:mod:`screl.modules.ppo_step`). Importance-sampling correction is
GRPO's (the shared :class:`~screl.modules.policy_gradient.PolicyGradientModule` holds the policy, its loss, the
optimizers' settings and the logging).

**Critic warmup** (``ppo.policy_training_start_step: N``): steps ``0 .. N-1`` train the critic only; the policy is
neither updated nor refit (``refit_due`` is False), and the sampler's lookahead follows ``warmup_lookahead_versions``.
``trainer.global_step`` counts RL steps: every update but the step's last goes through the plain torch optimizer.

Invariant, under data parallelism (``DDPStrategy``, or ``MegatronStrategy`` with a data-parallel size above 1): every
reduction a step needs (GAE whitening, each minibatch's valid tokens, the logged losses, the summed gradients) runs
over the replicas, each holding a contiguous shard of the step's whole groups, so a step at DP = n equals the
one-process step up to float summation order. How each op runs on the strategy is the compute adapter's
(:mod:`screl.modules.compute`; the Megatron critic: :mod:`screl.modules.megatron_compute`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.algos import ClippedValueLoss, PolicyLoss, get_adv_estimator, terminal_token_rewards
from screl.config import PPOConfig
from screl.models import PolicySpec, ValueModel
from screl.modules.compute import CRITIC, POLICY, enable_activation_checkpointing
from screl.modules.masks import AllFilteredStepError, behaviour, loss_sample_mask
from screl.modules.megatron_compute import check_actor_critic_layout, right_padded_positions
from screl.modules.optim import OptimSettings
from screl.modules.policy_gradient import PolicyGradientModule, master_copy
from screl.modules.ppo_step import StepData, checked_ppo_config, epoch_minibatches, whiten_over_shards
from screl.modules.warm_start import load_critic_weights

log = logging.getLogger(__name__)

# the names tests/strategies/test_ppo_megatron.py imports from here
_check_megatron_layout, _right_padded_positions = check_actor_critic_layout, right_padded_positions


class PPO(PolicyGradientModule):
    """PPO on the single controller.

    Args:
        policy: The policy spec.
        value: The critic's spec: a causal LM whose last hidden states feed a scalar value head
            (``screl.models.ValueModel``); it may differ from the policy.
        value_loss_fn: The critic loss (``screl.algos.ClippedValueLoss``).
        loss_fn: The policy loss.
        learning_rate: The policy optimizer's peak learning rate (1e-6 by default).
        value_learning_rate: The critic optimizer's learning rate.
        value_lr_warmup_steps: The critic's learning rate ramps linearly over this many critic updates.
        weight_decay: Weight decay (both optimizers).
        max_grad_norm: Clip the policy's gradient norm (None: no clipping).
        value_max_grad_norm: Clip the critic's gradient norm (None: no clipping).
        micro_batch_size: Rows per forward/backward (None: the whole step).
        offload_optimizer_for_logprob: Move the policy optimizer's state off the accelerator while the value
            stage runs (on CPU there is nothing to move).
        train_global_batch_size: The step's rows (None: derived); a policy update takes ``1 / ppo.num_minibatches``
            of them.
        value_train_global_batch_size: The step's rows (None: derived); a critic update takes
            ``1 / ppo.num_minibatches`` of them.
        temperature: Sampling temperature (linked from generation).
        behaviour_logprobs: ``trainer`` or ``engine``: see :class:`~screl.modules.GRPO`.
        algo: The ``ppo`` block (linked by the CLI).
        logprob_chunk_tokens: Chunked logprobs, as GRPO's (:class:`~screl.modules.GRPO`).
        activation_checkpointing: As GRPO's; a Hugging Face critic's trunk is checkpointed the same way.
        optimizer: Both optimizers' class path (AdamW by default).
        lr_scheduler, warmup_steps, warmup_ratio: The policy's schedule, as GRPO's, stepped once per RL step that
            trains the policy (over the steps after ``ppo.policy_training_start_step``); the critic's is
            ``value_lr_warmup_steps``.
        lora: LoRA adapters on the policy, as GRPO's (:class:`~screl.modules.GRPO`); the critic trains in full.

    Precision as GRPO's: the policy and the critic train fp32 master weights whatever their specs' dtype.
    """

    def __init__(
        self,
        policy: PolicySpec,
        value: PolicySpec | None = None,
        value_loss_fn: ClippedValueLoss | None = None,
        loss_fn: PolicyLoss | str | None = None,
        learning_rate: float = 1e-6,
        value_learning_rate: float = 1e-3,
        value_lr_warmup_steps: int = 0,
        weight_decay: float = 0.0,
        max_grad_norm: float | None = 1.0,
        value_max_grad_norm: float | None = 1.0,
        micro_batch_size: int | None = None,
        offload_optimizer_for_logprob: bool = True,
        train_global_batch_size: int | None = None,
        value_train_global_batch_size: int | None = None,
        temperature: float = 1.0,
        behaviour_logprobs: Literal["trainer", "engine"] = "trainer",
        algo: dict[str, Any] | None = None,
        logprob_chunk_tokens: int | None = None,
        activation_checkpointing: bool | Literal["full", "selective"] = False,
        optimizer: str = "torch.optim.AdamW",
        lr_scheduler: Literal["constant", "linear", "cosine"] = "constant",
        warmup_steps: int = 0,
        warmup_ratio: float = 0.0,
        lora: dict[str, Any] | None = None,
    ) -> None:
        if value is None:
            raise ValueError("model.init_args.value: a PPO run needs a critic spec (e.g. the policy's spec)")
        self.ppo: PPOConfig = checked_ppo_config(algo)  # also self.algo, GRPO's step settings included
        super().__init__(
            policy, self.ppo, OptimSettings(optimizer, lr_scheduler, warmup_steps, warmup_ratio),
            loss_fn=loss_fn, learning_rate=learning_rate, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
            micro_batch_size=micro_batch_size, train_global_batch_size=train_global_batch_size,
            temperature=temperature, behaviour_logprobs=behaviour_logprobs, logprob_chunk_tokens=logprob_chunk_tokens,
            activation_checkpointing=activation_checkpointing, lora=lora,
        )
        self._build_critic(value, value_loss_fn)
        self.value_learning_rate = value_learning_rate
        self.value_lr_warmup_steps = value_lr_warmup_steps
        self.value_max_grad_norm = value_max_grad_norm
        self.offload_optimizer_for_logprob = offload_optimizer_for_logprob
        self.value_train_global_batch_size = value_train_global_batch_size
        if self.ppo.reward_kl_coef > 0 and not self.has_reference:
            self._make_reference()
        self.refit_due = True
        """Whether the step just trained changed the policy (WeightSync refits only then)."""
        self.update_counts = {"policy": 0, "critic": 0}
        """Policy and critic optimizer updates so far (kept in checkpoints)."""
        self._said_nothing_to_offload = False

    def _build_critic(self, value: PolicySpec, value_loss_fn: ClippedValueLoss | None) -> None:
        """The critic's fp32 master copy (as the policy's), seeded from ``ppo.warm_start_value_checkpoint`` if set."""
        self.critic: Any = master_copy(ValueModel(value))
        """``ValueModel``; under MegatronStrategy a ``MegatronValueModel`` (see ``configure_model``)."""
        enable_activation_checkpointing(self.critic.trunk, self.activation_checkpointing)
        self.value_loss_fn = value_loss_fn if value_loss_fn is not None else ClippedValueLoss()
        if self.ppo.warm_start_value_checkpoint:
            load_critic_weights(self.critic, self.ppo.warm_start_value_checkpoint, self.ppo.warm_start_storage_options)

    @override
    def configure_model(self) -> None:
        """Choose the strategy's compute adapter and let it make the policy and the critic it trains (under
        ``MegatronStrategy`` this rank's shards of both, holding the Hugging Face weights they had)."""
        if self.compute.sharded:  # a later fit: the models are this rank's shards already
            return
        compute = self._strategy_compute()
        self.model, self.critic = compute.actor_critic(self.model, self.critic, self.activation_checkpointing,
                                                       self._trainer)
        self.compute = compute

    @override
    def iter_export_weights(self, bucket_bytes: int = 64 * 2**20, naming: str = "hf") -> Iterator[dict[str, Tensor]]:
        """The policy's weights for the refit (never the critic's); see ``WeightExport.iter_export_weights``."""
        yield from self._export_module(POLICY, bucket_bytes, naming)

    def export_critic_weights(self) -> dict[str, Tensor]:
        """The critic's full weights on CPU in ``ValueModel``'s naming (under MegatronStrategy a collective)."""
        return self.compute.export_state(self, CRITIC)

    @override
    def configure_optimizers(self) -> Any:
        """The policy's and the critic's optimizers (``optimizer``); the critic's schedule (listed first, as in
        checkpoints written before the policy had one) warms up over ``value_lr_warmup_steps`` critic updates, the
        policy's follows ``lr_scheduler`` and its warmup once per RL step that trains the policy (the run's steps
        after the critic warmup, ``ppo.policy_training_start_step``)."""
        policy_opt = self._optimizer(self.model, self.learning_rate)
        critic_opt = self._optimizer(self.critic, self.value_learning_rate)
        warmup = max(0, self.value_lr_warmup_steps)
        critic = torch.optim.lr_scheduler.LambdaLR(critic_opt, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0)
        steps = self.run_steps()
        policy = self.optim.schedule(policy_opt, max(1, steps - self.ppo.policy_training_start_step) if steps else None)
        return [policy_opt, critic_opt], [{"scheduler": critic, "interval": "step"}, policy]

    # -- the step ------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if batch.get("done"):
            return torch.zeros((), device=self.device)
        if not batch["last_chunk"]:
            raise RuntimeError("PPO trains one full step per chunk: set async_rl.min_groups_for_streaming_train "
                               "to ppo.num_prompts_per_step")
        self.compute.own_gradient_sync(self._trainer)
        t0 = time.perf_counter()
        self._step_started = t0
        opts: Any = self.optimizers()
        policy_opt, critic_opt = opts
        data = self._value_stage(batch, policy_opt)
        if float(self.compute.sum_over_shards(data.sample_mask.sum(), batch)) == 0:  # nothing for the critic or the policy
            raise AllFilteredStepError(int(batch["trainer_version"]), batch)
        train_policy = int(batch["trainer_version"]) >= self.ppo.policy_training_start_step
        updates_before = dict(self.update_counts)
        critic_metrics = self._critic_epochs(batch, data, critic_opt, last_update=not train_policy)
        policy_loss, policy_metrics = torch.zeros((), device=self.device), dict[str, list[Tensor]]()
        if train_policy:
            policy_loss, policy_metrics = self._policy_epochs(batch, data, policy_opt)
        self.refit_due = train_policy
        if train_policy:
            self._step_policy_schedule(policy_opt)
        step_updates = {k: self.update_counts[k] - updates_before[k] for k in self.update_counts}
        self._log_step(batch, data, policy_loss, policy_metrics, critic_metrics, train_policy, step_updates, t0)
        return policy_loss

    def _slices(self, rows: int) -> list[slice]:
        mb = self.micro_batch_size or max(rows, 1)
        return [slice(lo, min(rows, lo + mb)) for lo in range(0, rows, mb)]

    @torch.no_grad()
    def _value_stage(self, batch: dict[str, Any], policy_opt: LightningOptimizer) -> StepData:
        """Critic values, pre-update policy (and reference) logprobs, token rewards, GAE."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        token_mask, sample_mask = batch["token_mask"].float(), loss_sample_mask(batch, self.ppo.overlong_filtering)
        self._offload(policy_opt, "cpu")
        slices = self._slices(ids.shape[0])
        values = torch.cat([self.compute.values(self, ids[s], attention[s]) for s in slices])
        old_lp = torch.cat([self.compute.row_logprobs(self, ids[s], attention[s]) for s in slices])
        self._offload(policy_opt, self.device)
        on_policy = batch["token_versions"] == int(batch["trainer_version"])
        behaviour_lp = behaviour(old_lp, batch["generation_logprobs"], on_policy, self.behaviour_logprobs)
        mask = token_mask * sample_mask[:, None]
        kl = None
        if self.ppo.reward_kl_coef > 0:
            ref = torch.cat([self.reference_logprobs(ids[s], attention[s]) for s in slices])
            kl = old_lp - ref
        rewards = terminal_token_rewards(batch["rewards"].float(), mask, kl, self.ppo.reward_kl_coef)
        est = self.ppo.adv_estimator
        adv, ret = get_adv_estimator(est.name).fn(rewards, values, mask, est)
        if est.whiten_advantages:
            adv = whiten_over_shards(adv, mask.bool(), batch, self.compute)
        self.last_advantages = adv.detach()  # per token: screl.callbacks.Completions logs their mean per row
        rows = int(ids.shape[0])
        return StepData(input_ids=ids, attention_mask=attention, token_mask=token_mask, sample_mask=sample_mask,
                        valid_tokens=self.compute.sum_over_shards(mask.sum(), batch).clamp_min(1.0), old_values=values,
                        old_logprobs=old_lp, behaviour_logprobs=behaviour_lp, advantages=adv, returns=ret,
                        global_rows=int(batch.get("chunk_rows", rows)),
                        row_offset=self.compute.row_offset(batch, rows, self.device))

    def _offload(self, opt: LightningOptimizer, device: str | torch.device) -> None:
        """Move the policy optimizer's state to ``device`` (``offload_optimizer_for_logprob``)."""
        if not self.offload_optimizer_for_logprob:
            return
        if self.device.type == "cpu":
            if not self._said_nothing_to_offload:
                log.info("screl: offload_optimizer_for_logprob: training on CPU, nothing to offload")
                self._said_nothing_to_offload = True
            return
        for state in opt.optimizer.state.values():
            for k, v in state.items():
                if isinstance(v, Tensor) and v.dim() > 0:
                    state[k] = v.to(device, non_blocking=True)

    def _critic_epochs(
        self, batch: dict[str, Any], data: StepData, opt: LightningOptimizer, last_update: bool
    ) -> dict[str, Tensor]:
        """``critic_ppo_epochs`` epochs of ``num_minibatches`` updates; the metrics are those of the first epoch
        (the fit to new data): its mean minibatch loss (over every replica) and its micro-batches' other metrics."""
        first: dict[str, list[Tensor]] = {}
        epochs, k = self.ppo.critic_ppo_epochs, self.ppo.num_minibatches
        scale = self.compute.sum_grads_scale(batch)
        for epoch in range(epochs):
            for j, mb in enumerate(epoch_minibatches(batch, data, "critic", epoch, k, self.compute)):
                for sl in self._slices(mb.rows):
                    values = self.compute.values(self, mb.input_ids[sl], mb.attention_mask[sl])
                    loss, metrics = self.value_loss_fn(values, mb.old_values[sl], mb.returns[sl], mb.token_mask[sl],
                                                       mb.sample_mask[sl], global_normalizer=mb.valid_tokens)
                    self.manual_backward(loss if scale == 1.0 else loss * scale)
                    if epoch == 0:
                        for key, v in metrics.items():
                            first.setdefault(key, []).append(v.detach())
                self.compute.sum_grads(self, CRITIC, batch)
                norm = self.compute.clip(self, self.value_max_grad_norm, CRITIC)  # its own module's norm only
                if epoch == 0 and norm is not None:
                    first.setdefault("grad_norm", []).append(norm.detach())
                self._update(opt, "critic", counted=last_update and epoch == epochs - 1 and j == k - 1)
                schedules = self.lr_schedulers()
                assert isinstance(schedules, list), "PPO configures the critic's and the policy's schedules"
                critic_schedule: Any = schedules[0]
                critic_schedule.step()
        out = {key: torch.stack(v).mean() for key, v in first.items() if key != "value_loss"}
        losses = first.get("value_loss", [])
        value_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        out["value_loss"] = self.compute.sum_over_shards(value_loss, batch) / k
        return out

    def _policy_epochs(
        self, batch: dict[str, Any], data: StepData, opt: LightningOptimizer
    ) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """``ppo_epochs`` epochs of ``num_minibatches`` policy updates against the pre-update logprobs; returns the
        last epoch's mean minibatch loss (over every replica) and its micro-batches' metrics."""
        epochs, k = self.ppo.ppo_epochs, self.ppo.num_minibatches
        scale = self.compute.sum_grads_scale(batch)
        loss_total, metrics_acc = torch.zeros((), device=self.device), dict[str, list[Tensor]]()
        for epoch in range(epochs):
            loss_total, metrics_acc = torch.zeros((), device=self.device), {}
            for j, mb in enumerate(epoch_minibatches(batch, data, "policy", epoch, k, self.compute)):
                for sl in self._slices(mb.rows):
                    loss, metrics = self._policy_loss(mb, sl)
                    self.manual_backward(loss if scale == 1.0 else loss * scale)
                    loss_total = loss_total + loss.detach()
                    for key, v in metrics.items():
                        metrics_acc.setdefault(key, []).append(v.detach().float())
                self.compute.sum_grads(self, POLICY, batch)
                norm = self.compute.clip(self, self.max_grad_norm, POLICY)
                if norm is not None:
                    metrics_acc.setdefault("grad_norm", []).append(norm.detach().float())
                self._update(opt, "policy", counted=epoch == epochs - 1 and j == k - 1)
        loss_total = self.compute.sum_over_shards(loss_total, batch)
        return (loss_total if k == 1 else loss_total / k), metrics_acc

    def _policy_loss(self, mb: StepData, sl: slice) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of the minibatch's rows ``sl``, normalized by the whole minibatch (its valid tokens
        over every replica; a sequence-level loss by its rows)."""
        ids, attention = mb.input_ids[sl], mb.attention_mask[sl]
        curr = self.compute.row_logprobs(self, ids, attention)
        ref = None
        if self.loss_fn.requires_reference_logprobs:
            ref = self.reference_logprobs(ids, attention)
        loss, metrics = self.loss_fn(
            curr, mb.old_logprobs[sl], mb.behaviour_logprobs[sl], mb.advantages[sl], mb.token_mask[sl],
            mb.sample_mask[sl], reference_logprobs=ref,
            global_normalizer=mb.valid_tokens if self.loss_fn.token_level_loss else None,
        )
        if not self.loss_fn.token_level_loss:
            loss = loss * (sl.stop - sl.start) / mb.global_rows
        return loss, metrics

    def _update(self, opt: LightningOptimizer, kind: str, counted: bool) -> None:
        """One optimizer update of the policy or the critic (``kind``); only the step's last goes through Lightning
        (``global_step`` = RL steps), the others through the adapter (``compute.uncounted_step``)."""
        if counted:
            opt.step()
        else:
            self.compute.uncounted_step(opt, POLICY if kind == "policy" else CRITIC)
        opt.zero_grad(set_to_none=True)
        self.update_counts[kind] += 1

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)
        checkpoint["ppo_update_counts"] = dict(self.update_counts)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        self.update_counts = dict(checkpoint.get("ppo_update_counts", self.update_counts))

    def _log_step(
        self, batch: dict[str, Any], data: StepData, policy_loss: Tensor, policy_metrics: dict[str, list[Tensor]],
        critic_metrics: dict[str, Tensor], train_policy: bool, step_updates: dict[str, int], t0: float,
    ) -> None:
        """Stage the step's metrics; the advantage and return statistics are this replica's rows'."""
        logs: dict[str, Any] = {f"critic/{k}": v for k, v in critic_metrics.items()}
        logs.update(data.stats())
        logs.update({
            "ppo/policy_frozen": float(not train_policy),
            "ppo/policy_updates": float(self.update_counts["policy"]),
            "ppo/critic_updates": float(self.update_counts["critic"]),
            "train/policy_updates": float(step_updates["policy"]),
            "train/critic_updates": float(step_updates["critic"]),
        })
        self.stage_metrics(logs)
        self._log_chunk(batch, policy_loss, policy_metrics, t0, stepped=True)
