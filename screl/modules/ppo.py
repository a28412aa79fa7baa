"""The PPO LightningModule: a policy and a critic, GAE advantages, policy and critic epochs per RL step.

One RL step is one chunk of ``num_prompts_per_step x num_generations_per_prompt`` rows (PPO requires
``min_groups_for_streaming_train == num_prompts_per_step``). Per step:

1. **value stage** (no grad): the critic's values, the policy's logprobs before any update (the ``prev``
   of every epoch's ratio) and, with ``ppo.reward_kl_coef``, the reference policy's;
2. **GAE** over token rewards (the sequence reward on the last completion token, minus the KL penalty);
3. ``critic_ppo_epochs`` critic updates, then ``ppo_epochs`` policy updates, over that same batch.

Importance-sampling correction is GRPO's: a token sampled by an older policy (its ``token_versions`` entry
is below the trainer's version) carries its generation logprob as the behaviour policy.

**Critic warmup** (``ppo.policy_training_start_step: N``): steps ``0 .. N-1`` train the critic only; the
policy is neither updated nor refit (``refit_due`` is False, so no ``refit`` event), and the sampler's
lookahead follows ``warmup_lookahead_versions`` (see ``screl.data.samplers.lookahead_schedule``).

``trainer.global_step`` counts RL steps, as for GRPO: every update but the step's last goes through the
plain torch optimizer, the last through Lightning's (which counts it).

Under ``trainer.strategy: screl.strategies.MegatronStrategy`` (tensor parallelism; data-parallel size 1)
``configure_model`` swaps the policy for this rank's Megatron shard exactly as GRPO does, and the critic for a
``screl.strategies.MegatronValueModel``: a second ``GPTModel`` shard built from the value spec's Hugging Face
config and weights, whose final-normed hidden states feed the (replicated) value head. Policy logprobs come
from vocabulary-parallel logits; each optimizer's gradients are clipped by their tensor-parallel-aware norm,
its own module's only; ``export_weights()`` gathers the policy (never the critic) for the refit.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.algos import ClippedPGLoss, ClippedValueLoss, gae_advantages, terminal_token_rewards
from screl.config import PPOConfig, from_dict
from screl.models import PolicySpec, ValueModel
from screl.modules.grpo import (
    GRPO,
    AllFilteredStepError,
    behaviour,
    loss_sample_mask,
    token_logprobs,
)
from screl.modules.megatron_policy import ARCH_FIELDS
from screl.modules.warm_start import load_critic_weights

log = logging.getLogger(__name__)

POLICY, CRITIC = "model", "critic"
"""The policy's and the critic's paths in the module (their Megatron modules' names under MegatronStrategy)."""


def _right_padded_positions(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Positions ``0 .. len - 1`` for a Megatron forward; rows must be right-padded (as ``collate_chunk`` makes
    them), so that under the causal mask the real tokens' outputs equal the unpadded ones."""
    mask = attention_mask.bool()
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("PPO under MegatronStrategy needs right-padded rows (attention_mask 1...1 0...0); "
                         "got a row with padding before a real token")
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


DP_UNSUPPORTED = "GAE whitening and the loss normalizers are not reduced over data-parallel replicas yet"


def _check_megatron_layout(strategy: Any) -> None:
    """PPO under MegatronStrategy: tensor parallelism only, for now (every problem named at once)."""
    par = strategy.parallelism
    bad = []
    if strategy.data_parallel_size > 1:
        bad.append(f"data-parallel size {strategy.data_parallel_size} ({DP_UNSUPPORTED}: set "
                   "tensor_model_parallel_size to the device count)")
    if par.pipeline_model_parallel_size > 1 or par.context_parallel_size > 1:
        bad.append("pipeline_model_parallel_size or context_parallel_size > 1 (every rank runs the whole sequence "
                   "through the whole model)")
    if par.sequence_parallel:
        bad.append("sequence_parallel (the critic's value head needs the full hidden states)")
    if bad:
        raise ValueError("trainer.strategy.init_args.parallelism: PPO under MegatronStrategy does not support "
                         + "; ".join(bad))


def _critic_provider(strategy: Any, hf_trunk: torch.nn.Module) -> Any:
    """The critic trunk's ``GPTModelProvider``: the value spec's architecture, the policy provider's other knobs
    (layer spec, vocabulary padding, seed, ...)."""
    from screl.strategies import GPTModelProvider

    dtype = str(next(hf_trunk.parameters()).dtype).removeprefix("torch.")
    arch = GPTModelProvider.from_hf_config(hf_trunk.config, params_dtype=dtype)
    policy = strategy.model_provider
    if not isinstance(policy, GPTModelProvider):
        return arch
    return dataclasses.replace(policy, params_dtype=dtype, **{k: getattr(arch, k) for k in ARCH_FIELDS})


@dataclass(frozen=True)
class _StepData:
    """What every epoch of one RL step shares (all detached)."""

    token_mask: Tensor
    sample_mask: Tensor
    valid_tokens: Tensor
    old_values: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    returns: Tensor


class PPO(GRPO):
    """PPO on the single controller.

    Args:
        policy: The policy spec.
        value: The critic's spec: a causal LM whose last hidden states feed a scalar value head
            (``screl.models.ValueModel``); it may differ from the policy.
        value_loss_fn: The critic loss (``screl.algos.ClippedValueLoss``).
        loss_fn: The policy loss.
        learning_rate: Policy AdamW learning rate.
        value_learning_rate: Critic AdamW learning rate.
        value_lr_warmup_steps: The critic's learning rate ramps linearly over this many critic updates.
        weight_decay: AdamW weight decay (both optimizers).
        max_grad_norm: Clip the policy's gradient norm (None: no clipping).
        value_max_grad_norm: Clip the critic's gradient norm (None: no clipping).
        micro_batch_size: Rows per forward/backward (None: the whole step).
        offload_optimizer_for_logprob: Move the policy optimizer's state off the accelerator while the value
            stage runs (on CPU there is nothing to move).
        train_global_batch_size: Rows per policy update: the step's rows (None: derived).
        value_train_global_batch_size: Rows per critic update: the step's rows (None: derived).
        temperature: Sampling temperature (linked from generation).
        behaviour_logprobs: ``trainer`` or ``engine``: see :class:`~screl.modules.GRPO`.
        algo: The ``ppo`` block (linked by the CLI).
    """

    def __init__(
        self,
        policy: PolicySpec,
        value: PolicySpec | None = None,
        value_loss_fn: ClippedValueLoss | None = None,
        loss_fn: ClippedPGLoss | None = None,
        learning_rate: float = 1e-3,
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
    ) -> None:
        super().__init__(policy, loss_fn=loss_fn, learning_rate=learning_rate, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, micro_batch_size=micro_batch_size,
                         train_global_batch_size=train_global_batch_size, temperature=temperature,
                         behaviour_logprobs=behaviour_logprobs)
        if value is None:
            raise ValueError("model.init_args.value: a PPO run needs a critic spec (e.g. the policy's spec)")
        self.ppo: PPOConfig = algo if isinstance(algo, PPOConfig) else from_dict(PPOConfig, algo)
        self.algo = self.ppo
        self.critic: Any = ValueModel(value)
        """``ValueModel``; under MegatronStrategy a ``MegatronValueModel`` (see ``configure_model``)."""
        self.value_loss_fn = value_loss_fn if value_loss_fn is not None else ClippedValueLoss()
        self.value_learning_rate = value_learning_rate
        self.value_lr_warmup_steps = value_lr_warmup_steps
        self.value_max_grad_norm = value_max_grad_norm
        self.offload_optimizer_for_logprob = offload_optimizer_for_logprob
        self.value_train_global_batch_size = value_train_global_batch_size
        if self.ppo.reward_kl_coef > 0 and self.reference is None:
            self.reference = self._frozen_copy()
        self.refit_due = True
        """Whether the step just trained changed the policy (WeightSync refits only then)."""
        self.update_counts = {"policy": 0, "critic": 0}
        """Policy and critic optimizer updates so far (kept in checkpoints)."""
        self._said_nothing_to_offload = False
        if self.ppo.warm_start_value_checkpoint:
            load_critic_weights(self.critic, self.ppo.warm_start_value_checkpoint, self.ppo.warm_start_storage_options)

    @override
    def configure_model(self) -> None:
        """Under ``MegatronStrategy``: the policy becomes this rank's Megatron shard (GRPO's ``configure_model``),
        the critic a Megatron trunk of the value spec with the same value head, both holding the Hugging Face
        weights they had (a warm-started critic's included)."""
        strategy = self._megatron()
        trainer = self._trainer
        if strategy is None and trainer is not None and trainer.world_size > 1:
            raise ValueError(f"trainer.strategy: PPO over {trainer.world_size} data-parallel processes is not "
                             f"supported yet ({DP_UNSUPPORTED}); set trainer.devices: 1, or use MegatronStrategy "
                             "with tensor_model_parallel_size equal to the device count")
        if strategy is None or self._megatron_strategy is not None:
            return
        _check_megatron_layout(strategy)
        super().configure_model()
        from screl.strategies import MegatronValueModel

        hf_critic = self.critic
        trunk = strategy.build_model(_critic_provider(strategy, hf_critic.trunk))
        self.critic = MegatronValueModel.from_hf(trunk, hf_critic.trunk.state_dict(), hf_critic.head)

    @override
    def iter_export_weights(self, bucket_bytes: int = 64 * 2**20) -> Iterator[dict[str, Tensor]]:
        """The policy's weights for the refit (never the critic's); see ``GRPO.iter_export_weights``."""
        if self._megatron_strategy is None:
            yield from super().iter_export_weights(bucket_bytes)
            return
        for bucket in self._megatron_strategy.iter_export_weights(POLICY):
            yield {k: v.detach().to("cpu") for k, v in bucket.items()}

    def export_critic_weights(self) -> dict[str, Tensor]:
        """The critic's full weights on CPU in ``ValueModel``'s naming (under MegatronStrategy a collective)."""
        critic: Any = self.critic
        if self._megatron_strategy is None:
            return {k: v.detach().to("cpu").clone() for k, v in critic.state_dict().items()}
        inner = self._megatron_strategy.megatron_modules[CRITIC]
        return inner.export_hf_state()  # type: ignore[no-any-return]

    def _values(self, ids: Tensor, attention: Tensor) -> Tensor:
        """``[rows, len - 1]`` critic values, aligned with ``token_mask``."""
        if self._megatron_strategy is None:
            return self.critic.token_values(ids, attention)  # type: ignore[no-any-return]
        return self.critic(ids, _right_padded_positions(ids, attention), None)[:, :-1]  # type: ignore[no-any-return]

    def _logprobs(self, ids: Tensor, attention: Tensor) -> Tensor:
        """``[rows, len - 1]`` policy logprobs of the next tokens (vocabulary-parallel under Megatron)."""
        strategy = self._megatron_strategy
        if strategy is None:
            return token_logprobs(self.model, ids, attention, self.temperature)
        logits = self.model(ids, _right_padded_positions(ids, attention), None)[:, :-1]
        if self.temperature != 1.0:
            logits = logits.float() / self.temperature
        return strategy.token_logprobs(logits, ids[:, 1:], POLICY)  # type: ignore[no-any-return]

    def _clip(self, path: str, max_norm: float | None) -> Tensor | None:
        """Clip the gradients of the policy or the critic (``path``), under Megatron by their TP-aware norm;
        returns the norm before clipping (None: no clipping)."""
        if max_norm is None:
            return None
        if self._megatron_strategy is not None:
            return self._megatron_strategy.clip_gradients(max_norm, modules=[path])  # type: ignore[no-any-return]
        return torch.nn.utils.clip_grad_norm_(self.get_submodule(path).parameters(), max_norm)

    @override
    def configure_optimizers(self) -> Any:
        policy_opt = torch.optim.AdamW(self.model.parameters(), lr=self.learning_rate, weight_decay=self.weight_decay)
        critic_opt = torch.optim.AdamW(self.critic.parameters(), lr=self.value_learning_rate,
                                       weight_decay=self.weight_decay)
        warmup = max(0, self.value_lr_warmup_steps)
        schedule = torch.optim.lr_scheduler.LambdaLR(critic_opt, lambda n: min(1.0, (n + 1) / warmup) if warmup else 1.0)
        return [policy_opt, critic_opt], [{"scheduler": schedule, "interval": "step"}]

    # -- the step ------------------------------------------------------------------------------------
    @override
    def training_step(self, batch: dict[str, Any], batch_idx: int) -> Tensor:
        if batch.get("done"):
            return torch.zeros((), device=self.device)
        if not batch["last_chunk"]:
            raise RuntimeError("PPO trains one full step per chunk: set async_rl.min_groups_for_streaming_train "
                               "to ppo.num_prompts_per_step")
        t0 = time.perf_counter()
        self._step_started = t0
        opts: Any = self.optimizers()
        policy_opt, critic_opt = opts
        data = self._value_stage(batch, policy_opt)
        if float(data.sample_mask.sum()) == 0:  # one chunk per step: nothing for the critic or the policy
            raise AllFilteredStepError(int(batch["trainer_version"]), batch)
        train_policy = int(batch["trainer_version"]) >= self.ppo.policy_training_start_step
        critic_metrics = self._critic_epochs(batch, data, critic_opt, last_update=not train_policy)
        policy_loss, policy_metrics = torch.zeros((), device=self.device), dict[str, list[Tensor]]()
        if train_policy:
            policy_loss, policy_metrics = self._policy_epochs(batch, data, policy_opt)
        self.refit_due = train_policy
        self._log_step(batch, data, policy_loss, policy_metrics, critic_metrics, train_policy, t0)
        return policy_loss

    def _slices(self, rows: int) -> list[slice]:
        mb = self.micro_batch_size or max(rows, 1)
        return [slice(lo, min(rows, lo + mb)) for lo in range(0, rows, mb)]

    @torch.no_grad()
    def _value_stage(self, batch: dict[str, Any], policy_opt: LightningOptimizer) -> _StepData:
        """Critic values, pre-update policy (and reference) logprobs, token rewards, GAE."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        token_mask, sample_mask = batch["token_mask"].float(), loss_sample_mask(batch, self.ppo.overlong_filtering)
        self._offload(policy_opt, "cpu")
        slices = self._slices(ids.shape[0])
        values = torch.cat([self._values(ids[s], attention[s]) for s in slices])
        old_lp = torch.cat([self._logprobs(ids[s], attention[s]) for s in slices])
        self._offload(policy_opt, self.device)
        on_policy = batch["token_versions"] == int(batch["trainer_version"])
        behaviour_lp = behaviour(old_lp, batch["generation_logprobs"], on_policy, self.behaviour_logprobs)
        mask = token_mask * sample_mask[:, None]
        kl = None
        if self.ppo.reward_kl_coef > 0:
            assert self.reference is not None
            ref = torch.cat([token_logprobs(self.reference, ids[s], attention[s], self.temperature) for s in slices])
            kl = old_lp - ref
        rewards = terminal_token_rewards(batch["rewards"].float(), mask, kl, self.ppo.reward_kl_coef)
        est = self.ppo.adv_estimator
        adv, ret = gae_advantages(rewards, values, mask, gamma=est.gamma, lam=est.lam, whiten=est.whiten_advantages)
        return _StepData(token_mask=token_mask, sample_mask=sample_mask, valid_tokens=mask.sum().clamp_min(1.0),
                         old_values=values, old_logprobs=old_lp, behaviour_logprobs=behaviour_lp, advantages=adv,
                         returns=ret)

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
        self, batch: dict[str, Any], data: _StepData, opt: LightningOptimizer, last_update: bool
    ) -> dict[str, Tensor]:
        """``critic_ppo_epochs`` updates; the metrics are those of the first epoch (the fit to new data)."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        first: dict[str, list[Tensor]] = {}
        epochs = self.ppo.critic_ppo_epochs
        for epoch in range(epochs):
            for sl in self._slices(ids.shape[0]):
                values = self._values(ids[sl], attention[sl])
                loss, metrics = self.value_loss_fn(values, data.old_values[sl], data.returns[sl], data.token_mask[sl],
                                                   data.sample_mask[sl], global_normalizer=data.valid_tokens)
                self.manual_backward(loss)
                if epoch == 0:
                    for k, v in metrics.items():
                        first.setdefault(k, []).append(v.detach())
            norm = self._clip(CRITIC, self.value_max_grad_norm)
            if epoch == 0 and norm is not None:
                first["grad_norm"] = [norm.detach()]
            self._update(opt, "critic", counted=last_update and epoch == epochs - 1)
            scheduler = self.lr_schedulers()
            assert scheduler is not None and not isinstance(scheduler, list)
            scheduler.step()
        out = {k: torch.stack(v).sum() if k == "value_loss" else torch.stack(v).mean() for k, v in first.items()}
        return out

    def _policy_epochs(
        self, batch: dict[str, Any], data: _StepData, opt: LightningOptimizer
    ) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """``ppo_epochs`` policy updates against the pre-update logprobs; returns the last epoch's loss."""
        ids, attention = batch["input_ids"], batch["attention_mask"]
        rows = ids.shape[0]
        loss_total, metrics_acc = torch.zeros((), device=self.device), dict[str, list[Tensor]]()
        for epoch in range(self.ppo.ppo_epochs):
            loss_total, metrics_acc = torch.zeros((), device=self.device), {}
            for sl in self._slices(rows):
                curr = self._logprobs(ids[sl], attention[sl])
                ref = None
                if self.loss_fn.requires_reference_logprobs:
                    assert self.reference is not None
                    with torch.no_grad():
                        ref = token_logprobs(self.reference, ids[sl], attention[sl], self.temperature)
                loss, metrics = self.loss_fn(
                    curr, data.old_logprobs[sl], data.behaviour_logprobs[sl], data.advantages[sl],
                    data.token_mask[sl], data.sample_mask[sl], reference_logprobs=ref,
                    global_normalizer=data.valid_tokens if self.loss_fn.token_level_loss else None,
                )
                if not self.loss_fn.token_level_loss:
                    loss = loss * (sl.stop - sl.start) / rows
                self.manual_backward(loss)
                loss_total = loss_total + loss.detach()
                for k, v in metrics.items():
                    metrics_acc.setdefault(k, []).append(v.detach().float())
            norm = self._clip(POLICY, self.max_grad_norm)
            if norm is not None:
                metrics_acc["grad_norm"] = [norm.detach().float()]
            self._update(opt, "policy", counted=epoch == self.ppo.ppo_epochs - 1)
        return loss_total, metrics_acc

    def _update(self, opt: LightningOptimizer, kind: str, counted: bool) -> None:
        """One optimizer update; only the step's last goes through Lightning (``global_step`` = RL steps).

        Lightning's step reduces and zeroes Megatron's gradient buffers of the optimizer's module; the plain
        torch step gets the same around it, for that module (``kind``) only.
        """
        megatron, path = self._megatron_strategy, POLICY if kind == "policy" else CRITIC
        if counted:
            opt.step()
        elif megatron is None:
            opt.optimizer.step()
        else:
            megatron.finalize_gradients([path])
            opt.optimizer.step()
            megatron.zero_grad_buffers([path])
        opt.zero_grad(set_to_none=True)
        self.update_counts[kind] += 1

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["ppo_update_counts"] = dict(self.update_counts)

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.update_counts = dict(checkpoint.get("ppo_update_counts", self.update_counts))

    def _log_step(
        self, batch: dict[str, Any], data: _StepData, policy_loss: Tensor, policy_metrics: dict[str, list[Tensor]],
        critic_metrics: dict[str, Tensor], train_policy: bool, t0: float,
    ) -> None:
        mask = (data.token_mask * data.sample_mask[:, None]).bool()
        adv, ret = data.advantages[mask], data.returns[mask]
        logs: dict[str, Any] = {f"critic/{k}": v for k, v in critic_metrics.items()}
        logs.update({
            "ppo/advantages_mean": adv.mean(), "ppo/advantages_std": adv.std() if adv.numel() > 1 else adv.sum() * 0,
            "ppo/advantages_min": adv.min(), "ppo/advantages_max": adv.max(),
            "ppo/returns_mean": ret.mean(), "ppo/returns_std": ret.std() if ret.numel() > 1 else ret.sum() * 0,
            "ppo/policy_frozen": float(not train_policy),
            "ppo/policy_updates": float(self.update_counts["policy"]),
            "ppo/critic_updates": float(self.update_counts["critic"]),
        })
        self.stage_metrics(logs)
        self._log_chunk(batch, policy_loss, policy_metrics, t0, stepped=True)
