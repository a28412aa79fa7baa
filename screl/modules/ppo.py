"""The PPO LightningModule: a policy and a critic, GAE advantages, policy and critic epochs per RL step.

One RL step is one chunk of ``num_prompts_per_step x num_generations_per_prompt`` rows (PPO requires
``min_groups_for_streaming_train == num_prompts_per_step``). Per step:

1. **value stage** (no grad): the critic's values, the policy's logprobs before any update (the ``prev``
   of every epoch's ratio) and, with ``ppo.reward_kl_coef``, the reference policy's;
2. **GAE** over token rewards (the sequence reward on the last completion token, minus the KL penalty);
3. ``critic_ppo_epochs`` critic epochs, then ``ppo_epochs`` policy epochs, over that same batch; each epoch is
   ``ppo.num_minibatches`` optimizer updates (see *Minibatches*).

Importance-sampling correction is GRPO's: a token sampled by an older policy (its ``token_versions`` entry
is below the trainer's version) carries its generation logprob as the behaviour policy.

**Critic warmup** (``ppo.policy_training_start_step: N``): steps ``0 .. N-1`` train the critic only; the
policy is neither updated nor refit (``refit_due`` is False, so no ``refit`` event), and the sampler's
lookahead follows ``warmup_lookahead_versions`` (see ``screl.data.samplers.lookahead_schedule``).

``trainer.global_step`` counts RL steps, as for GRPO: every update but the step's last goes through the
plain torch optimizer, the last through Lightning's (which counts it).

**Minibatches** (``ppo.num_minibatches: k``): every epoch, policy and critic alike, shuffles the step's ``N`` rows
with a permutation seeded by the run's seed (``seed_everything``), the step (``trainer_version``), the model and the
epoch (:func:`minibatch_permutation`), cuts it into ``k`` minibatches of ``N / k`` rows and takes one optimizer
update per minibatch. A minibatch's token-level loss is normalized by its own valid tokens (a sequence-level loss
by its rows), as in every PPO implementation, so each update is the mean over its minibatch. ``k = 1`` is one
unshuffled full-batch update per epoch. A minibatch larger than ``micro_batch_size`` still accumulates gradients
over micro-batches.

**Data parallelism** (``screl.strategies.DDPStrategy``, or ``MegatronStrategy`` with a data-parallel size above 1):
each replica holds a contiguous shard of the step's whole groups (``RolloutDataModule``). Every reduction a step
needs runs over the replicas: GAE whitening's mean and variance, each minibatch's valid-token (or row) count, the
logged losses, and the gradients (summed: each replica's loss is already divided by the global count). The
permutation is the same on every replica; each takes the rows of every global minibatch that its shard holds
(possibly none), so a step at DP = n equals the one-process step up to float summation order. Under a plain DDP
PPO reduces the gradients itself, once per update and for the updated model only (DDP's reducer, which expects
every parameter of the LightningModule in every backward pass, is switched off: a critic update leaves the
policy without gradients).

Under ``trainer.strategy: screl.strategies.MegatronStrategy`` (tensor and data parallelism)
``configure_model`` swaps the policy for this rank's Megatron shard exactly as GRPO does, and the critic for a
``screl.strategies.MegatronValueModel``: a second ``GPTModel`` shard built from the value spec's Hugging Face
config and weights, whose final-normed hidden states feed the (replicated) value head. Policy logprobs come
from vocabulary-parallel logits; each optimizer's gradients are clipped by their tensor-parallel-aware norm,
its own module's only; ``export_weights()`` gathers the policy (never the critic) for the refit.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override

from screl.algos import ClippedPGLoss, ClippedValueLoss, get_adv_estimator, terminal_token_rewards
from screl.config import PPOConfig, from_dict
from screl.models import PolicySpec, ValueModel
from screl.modules.grpo import GRPO, master_copy, token_logprobs
from screl.modules.masks import AllFilteredStepError, behaviour, loss_sample_mask
from screl.modules.megatron_policy import ARCH_FIELDS
from screl.modules.warm_start import load_critic_weights

log = logging.getLogger(__name__)

POLICY, CRITIC = "model", "critic"
"""The policy's and the critic's paths in the module (their Megatron modules' names under MegatronStrategy)."""

_SYNC_BUCKET_NUMEL = 2**24
"""Gradient elements per all-reduce when PPO sums gradients over DDP replicas itself (64 MiB of fp32)."""


def _right_padded_positions(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Positions ``0 .. len - 1`` for a Megatron forward; rows must be right-padded (as ``collate_chunk`` makes
    them), so that under the causal mask the real tokens' outputs equal the unpadded ones."""
    mask = attention_mask.bool()
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("PPO under MegatronStrategy needs right-padded rows (attention_mask 1...1 0...0); "
                         "got a row with padding before a real token")
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def _check_megatron_layout(strategy: Any) -> None:
    """PPO under MegatronStrategy: tensor and data parallelism only, for now (every problem named at once)."""
    par = strategy.parallelism
    bad = []
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


def minibatch_permutation(seed: int, step: int, model: str, epoch: int, rows: int) -> Tensor:
    """The order of a step's ``rows`` in one epoch of ``model`` (``policy`` or ``critic``) with minibatches.

    A function of its arguments only (a BLAKE2 digest of them seeds a CPU generator), so every data-parallel
    replica draws the same permutation and a resumed run repeats it."""
    digest = hashlib.blake2b(f"screl-ppo:{seed}:{step}:{model}:{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randperm(rows, generator=generator)


def shard_minibatches(order: Tensor, num_minibatches: int, offset: int, local_rows: int) -> list[Tensor]:
    """Each global minibatch's rows that one shard holds, as indices into the shard, in ``order``'s order.

    ``order``: the step's global row order (a permutation of ``0 .. N - 1``, ``N`` divisible by
    ``num_minibatches``); the shard holds global rows ``offset .. offset + local_rows - 1``. Minibatch ``j`` is
    ``order[j * N / k : (j + 1) * N / k]``; a shard may hold none of its rows (an empty index tensor)."""
    rows = order.numel()
    if rows % num_minibatches:
        raise ValueError(f"ppo.num_minibatches={num_minibatches}: a step of {rows} rows does not split into "
                         f"{num_minibatches} equal minibatches; set it to a divisor of {rows}")
    size = rows // num_minibatches
    out = []
    for j in range(num_minibatches):
        part = order[j * size:(j + 1) * size]
        out.append(part[(part >= offset) & (part < offset + local_rows)] - offset)
    return out


@dataclass(frozen=True)
class _StepData:
    """What every epoch of one RL step shares (all detached): this replica's rows of the step."""

    input_ids: Tensor
    attention_mask: Tensor
    token_mask: Tensor
    sample_mask: Tensor
    valid_tokens: Tensor
    """The step's (a minibatch's) valid tokens over every replica, at least 1: the token-level loss normalizer."""
    old_values: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    returns: Tensor
    global_rows: int
    """Rows of the whole step (of a minibatch: of the whole minibatch), over every replica."""
    row_offset: int
    """The step's row index of this replica's first row."""

    @property
    def rows(self) -> int:
        """This replica's rows."""
        return int(self.input_ids.shape[0])

    def take(self, rows: Tensor) -> _StepData:
        """The same data restricted to ``rows`` (indices into this replica's rows), in that order."""
        per_row = ("input_ids", "attention_mask", "token_mask", "sample_mask", "old_values", "old_logprobs",
                   "behaviour_logprobs", "advantages", "returns")
        return dataclasses.replace(self, **{k: getattr(self, k)[rows] for k in per_row})


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
        train_global_batch_size: The step's rows (None: derived); a policy update takes ``1 / ppo.num_minibatches``
            of them.
        value_train_global_batch_size: The step's rows (None: derived); a critic update takes
            ``1 / ppo.num_minibatches`` of them.
        temperature: Sampling temperature (linked from generation).
        behaviour_logprobs: ``trainer`` or ``engine``: see :class:`~screl.modules.GRPO`.
        algo: The ``ppo`` block (linked by the CLI).
        logprob_chunk_tokens: Chunked logprobs, as GRPO's (:class:`~screl.modules.GRPO`).
        activation_checkpointing: As GRPO's; a Hugging Face critic's trunk is checkpointed the same way.

    Precision as GRPO's: the policy and the critic train fp32 master weights whatever their specs' dtype.
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
        logprob_chunk_tokens: int | None = None,
        activation_checkpointing: bool | Literal["full", "selective"] = False,
    ) -> None:
        super().__init__(policy, loss_fn=loss_fn, learning_rate=learning_rate, weight_decay=weight_decay,
                         max_grad_norm=max_grad_norm, micro_batch_size=micro_batch_size,
                         train_global_batch_size=train_global_batch_size, temperature=temperature,
                         behaviour_logprobs=behaviour_logprobs, logprob_chunk_tokens=logprob_chunk_tokens,
                         activation_checkpointing=activation_checkpointing)
        if value is None:
            raise ValueError("model.init_args.value: a PPO run needs a critic spec (e.g. the policy's spec)")
        self.ppo: PPOConfig = algo if isinstance(algo, PPOConfig) else from_dict(PPOConfig, algo)
        rows, k = self.ppo.num_prompts_per_step * self.ppo.num_generations_per_prompt, self.ppo.num_minibatches
        if k < 1 or rows % k:
            raise ValueError(f"ppo.num_minibatches={k}: must be >= 1 and divide the step's num_prompts_per_step x "
                             f"num_generations_per_prompt = {rows} rows")
        self.algo = self.ppo
        self.critic: Any = master_copy(ValueModel(value))  # fp32 masters, as the policy's
        self._enable_activation_checkpointing(self.critic.trunk)
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
        if (strategy is None and trainer is not None and trainer.world_size > 1
                and not isinstance(trainer.strategy, DDPStrategy)):
            raise ValueError(f"trainer.strategy: PPO over {trainer.world_size} processes needs "
                             "screl.strategies.DDPStrategy (data parallel) or screl.strategies.MegatronStrategy, got "
                             f"{type(trainer.strategy).__name__}")
        if strategy is None or self._megatron_strategy is not None:
            return
        _check_megatron_layout(strategy)
        super().configure_model()
        from screl.strategies import MegatronValueModel

        hf_critic = self.critic
        trunk = strategy.build_model(_critic_provider(strategy, hf_critic.trunk))
        self.critic = MegatronValueModel.from_hf(trunk, hf_critic.trunk.state_dict(), hf_critic.head)

    @override
    def iter_export_weights(self, bucket_bytes: int = 64 * 2**20, naming: str = "hf") -> Iterator[dict[str, Tensor]]:
        """The policy's weights for the refit (never the critic's); see ``GRPO.iter_export_weights``."""
        yield from self._export_module(POLICY if self._megatron_strategy is not None else None, bucket_bytes, naming)

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
            return token_logprobs(self.model, ids, attention, self.temperature, self.logprob_chunk_tokens)
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
        self._own_gradient_sync()
        t0 = time.perf_counter()
        self._step_started = t0
        opts: Any = self.optimizers()
        policy_opt, critic_opt = opts
        data = self._value_stage(batch, policy_opt)
        if float(self._sum_over_shards(data.sample_mask.sum(), batch)) == 0:  # nothing for the critic or the policy
            raise AllFilteredStepError(int(batch["trainer_version"]), batch)
        train_policy = int(batch["trainer_version"]) >= self.ppo.policy_training_start_step
        updates_before = dict(self.update_counts)
        critic_metrics = self._critic_epochs(batch, data, critic_opt, last_update=not train_policy)
        policy_loss, policy_metrics = torch.zeros((), device=self.device), dict[str, list[Tensor]]()
        if train_policy:
            policy_loss, policy_metrics = self._policy_epochs(batch, data, policy_opt)
        self.refit_due = train_policy
        step_updates = {k: self.update_counts[k] - updates_before[k] for k in self.update_counts}
        self._log_step(batch, data, policy_loss, policy_metrics, critic_metrics, train_policy, step_updates, t0)
        return policy_loss

    def _own_gradient_sync(self) -> None:
        """Under Lightning's DDP: switch DDP's reducer off, PPO sums its gradients itself (:meth:`_sum_grads`).

        The reducer all-reduces a bucket once every parameter in it has a gradient, and fails the next backward
        pass when some never got one; a PPO backward pass reaches the policy or the critic, never both."""
        trainer = self._trainer
        model = getattr(trainer.strategy, "model", None) if trainer is not None else None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.require_backward_grad_sync = False

    def _slices(self, rows: int) -> list[slice]:
        mb = self.micro_batch_size or max(rows, 1)
        return [slice(lo, min(rows, lo + mb)) for lo in range(0, rows, mb)]

    def _row_offset(self, batch: dict[str, Any], rows: int) -> int:
        """The step's row index of this replica's first row: the rows of the replicas before it (``shard_groups``
        hands out contiguous runs of groups in replica order)."""
        shards = int(batch.get("dp_shards", 1))
        if shards <= 1:
            return 0
        group = None
        if self._megatron_strategy is not None:
            from megatron.core import parallel_state

            group = parallel_state.get_data_parallel_group()
        counts = [torch.zeros(1, dtype=torch.long, device=self.device) for _ in range(shards)]
        torch.distributed.all_gather(counts, torch.tensor([rows], device=self.device), group=group)
        rank = torch.distributed.get_rank(group)
        return int(sum(int(c) for c in counts[:rank]))

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
            ref = torch.cat([token_logprobs(self.reference, ids[s], attention[s], self.temperature,
                                            self.logprob_chunk_tokens) for s in slices])
            kl = old_lp - ref
        rewards = terminal_token_rewards(batch["rewards"].float(), mask, kl, self.ppo.reward_kl_coef)
        est = self.ppo.adv_estimator
        adv, ret = get_adv_estimator(est.name).fn(rewards, values, mask, est)
        if est.whiten_advantages:
            adv = self._whiten(adv, mask.bool(), batch)
        rows = int(ids.shape[0])
        return _StepData(input_ids=ids, attention_mask=attention, token_mask=token_mask, sample_mask=sample_mask,
                         valid_tokens=self._sum_over_shards(mask.sum(), batch).clamp_min(1.0), old_values=values,
                         old_logprobs=old_lp, behaviour_logprobs=behaviour_lp, advantages=adv, returns=ret,
                         global_rows=int(batch.get("chunk_rows", rows)), row_offset=self._row_offset(batch, rows))

    def _whiten(self, adv: Tensor, valid: Tensor, batch: dict[str, Any], eps: float = 1e-8) -> Tensor:
        """``screl.algos.masked_whiten`` (the same operations) with the mean and the population variance taken
        over every replica's valid tokens."""
        m = valid.to(adv.dtype)
        x = torch.where(valid, adv, torch.zeros_like(adv))
        count = self._sum_over_shards(m.sum(), batch).clamp(min=1.0)
        mean = self._sum_over_shards((x * m).sum(), batch) / count
        var = self._sum_over_shards((((x - mean) * m) ** 2).sum(), batch) / count
        return ((x - mean) * torch.rsqrt(var + eps)) * m

    def _minibatches(self, batch: dict[str, Any], data: _StepData, model: str, epoch: int) -> list[_StepData]:
        """One epoch's minibatches of this replica's rows, each with its global valid-token and row counts.

        ``num_minibatches: 1``: the step itself, unshuffled. Otherwise the seeded permutation
        (:func:`minibatch_permutation`) cut into equal parts, each replica keeping its shard's rows of every part
        (:func:`shard_minibatches`)."""
        k = self.ppo.num_minibatches
        if k == 1:
            return [data]
        seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
        order = minibatch_permutation(seed, int(batch["trainer_version"]), model, epoch, data.global_rows)
        parts = shard_minibatches(order, k, data.row_offset, data.rows)
        mask = data.token_mask * data.sample_mask[:, None]
        valid = self._sum_over_shards(torch.stack([mask[rows].sum() for rows in parts]), batch).clamp_min(1.0)
        return [dataclasses.replace(data.take(rows), valid_tokens=valid[j], global_rows=data.global_rows // k)
                for j, rows in enumerate(parts)]

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
        """``critic_ppo_epochs`` epochs of ``num_minibatches`` updates; the metrics are those of the first epoch
        (the fit to new data): its mean minibatch loss (over every replica) and its micro-batches' other metrics."""
        first: dict[str, list[Tensor]] = {}
        epochs, k = self.ppo.critic_ppo_epochs, self.ppo.num_minibatches
        scale = self._loss_scale(batch)
        for epoch in range(epochs):
            for j, mb in enumerate(self._minibatches(batch, data, "critic", epoch)):
                for sl in self._slices(mb.rows):
                    values = self._values(mb.input_ids[sl], mb.attention_mask[sl])
                    loss, metrics = self.value_loss_fn(values, mb.old_values[sl], mb.returns[sl], mb.token_mask[sl],
                                                       mb.sample_mask[sl], global_normalizer=mb.valid_tokens)
                    self.manual_backward(loss if scale == 1.0 else loss * scale)
                    if epoch == 0:
                        for key, v in metrics.items():
                            first.setdefault(key, []).append(v.detach())
                self._sum_grads(CRITIC, batch)
                norm = self._clip(CRITIC, self.value_max_grad_norm)
                if epoch == 0 and norm is not None:
                    first.setdefault("grad_norm", []).append(norm.detach())
                self._update(opt, "critic", counted=last_update and epoch == epochs - 1 and j == k - 1)
                scheduler = self.lr_schedulers()
                assert scheduler is not None and not isinstance(scheduler, list)
                scheduler.step()
        out = {key: torch.stack(v).mean() for key, v in first.items() if key != "value_loss"}
        losses = first.get("value_loss", [])
        value_loss = torch.stack(losses).sum() if losses else torch.zeros((), device=self.device)
        out["value_loss"] = self._sum_over_shards(value_loss, batch) / k
        return out

    def _policy_epochs(
        self, batch: dict[str, Any], data: _StepData, opt: LightningOptimizer
    ) -> tuple[Tensor, dict[str, list[Tensor]]]:
        """``ppo_epochs`` epochs of ``num_minibatches`` policy updates against the pre-update logprobs; returns the
        last epoch's mean minibatch loss (over every replica) and its micro-batches' metrics."""
        epochs, k = self.ppo.ppo_epochs, self.ppo.num_minibatches
        scale = self._loss_scale(batch)
        loss_total, metrics_acc = torch.zeros((), device=self.device), dict[str, list[Tensor]]()
        for epoch in range(epochs):
            loss_total, metrics_acc = torch.zeros((), device=self.device), {}
            for j, mb in enumerate(self._minibatches(batch, data, "policy", epoch)):
                for sl in self._slices(mb.rows):
                    loss, metrics = self._policy_loss(mb, sl)
                    self.manual_backward(loss if scale == 1.0 else loss * scale)
                    loss_total = loss_total + loss.detach()
                    for key, v in metrics.items():
                        metrics_acc.setdefault(key, []).append(v.detach().float())
                self._sum_grads(POLICY, batch)
                norm = self._clip(POLICY, self.max_grad_norm)
                if norm is not None:
                    metrics_acc.setdefault("grad_norm", []).append(norm.detach().float())
                self._update(opt, "policy", counted=epoch == epochs - 1 and j == k - 1)
        loss_total = self._sum_over_shards(loss_total, batch)
        return (loss_total if k == 1 else loss_total / k), metrics_acc

    def _policy_loss(self, mb: _StepData, sl: slice) -> tuple[Tensor, dict[str, Tensor]]:
        """The policy loss of the minibatch's rows ``sl``, normalized by the whole minibatch (its valid tokens
        over every replica; a sequence-level loss by its rows)."""
        ids, attention = mb.input_ids[sl], mb.attention_mask[sl]
        curr = self._logprobs(ids, attention)
        ref = None
        if self.loss_fn.requires_reference_logprobs:
            assert self.reference is not None
            with torch.no_grad():
                ref = token_logprobs(self.reference, ids, attention, self.temperature, self.logprob_chunk_tokens)
        loss, metrics = self.loss_fn(
            curr, mb.old_logprobs[sl], mb.behaviour_logprobs[sl], mb.advantages[sl], mb.token_mask[sl],
            mb.sample_mask[sl], reference_logprobs=ref,
            global_normalizer=mb.valid_tokens if self.loss_fn.token_level_loss else None,
        )
        if not self.loss_fn.token_level_loss:
            loss = loss * (sl.stop - sl.start) / mb.global_rows
        return loss, metrics

    def _loss_scale(self, batch: dict[str, Any]) -> float:
        """Undo Megatron's data-parallel gradient average (``GRPO._grad_scale``); under a plain DDP PPO sums the
        gradients itself (:meth:`_sum_grads`), so 1."""
        return self._grad_scale(batch) if self._megatron_strategy is not None else 1.0

    def _sum_grads(self, path: str, batch: dict[str, Any]) -> None:
        """Under a plain DDP with a sharded step: sum the gradients of the policy or the critic (``path``) over the
        replicas, in flat buckets of one dtype (a replica that held no row of the minibatch adds zeros). Megatron
        reduces its gradient buffers itself (``finalize_gradients``)."""
        if self._megatron_strategy is not None or int(batch.get("dp_shards", 1)) <= 1:
            return
        params = [p for p in self.get_submodule(path).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[Tensor] = []
        for i, p in enumerate(params):
            assert p.grad is not None
            bucket.append(p.grad)
            last = i == len(params) - 1
            if last or params[i + 1].dtype != p.dtype or sum(g.numel() for g in bucket) >= _SYNC_BUCKET_NUMEL:
                flat = torch._utils._flatten_dense_tensors(bucket)
                torch.distributed.all_reduce(flat)
                for grad, summed in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                    grad.copy_(summed)
                bucket = []

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
        critic_metrics: dict[str, Tensor], train_policy: bool, step_updates: dict[str, int], t0: float,
    ) -> None:
        """Stage the step's metrics; the advantage and return statistics are this replica's rows'."""
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
            "train/policy_updates": float(step_updates["policy"]),
            "train/critic_updates": float(step_updates["critic"]),
        })
        self.stage_metrics(logs)
        self._log_chunk(batch, policy_loss, policy_metrics, t0, stepped=True)
