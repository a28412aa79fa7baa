"""The Megatron compute path: a module's policy (and PPO's critic) as this rank's Megatron-core shards.

Under ``trainer.strategy: screl.strategies.MegatronStrategy`` ``configure_model`` replaces the Hugging Face policy by a
``GPTModel`` shard loaded with the same weights (the generation workers start from the same spec), and PPO's critic
by a ``screl.strategies.MegatronValueModel``: a second ``GPTModel`` shard of the value spec, whose final-normed hidden
states feed the (replicated) value head. Logprobs come from vocabulary-parallel logits (never gathered), gradients
are clipped by their tensor-parallel-aware norm (each shard counted once; PPO's per optimizer, its own module's only),
sums run over Megatron's data-parallel group, and ``export_weights()`` gathers full Hugging Face-named weights (a
collective: every rank calls it). A reference policy (KL) stays a replicated Hugging Face model.

Invariant: Megatron's own gradient buffers reduce the gradients (``finalize_gradients``); this path only undoes their
average where a chunk's loss is already normalized by the whole chunk.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from torch import Tensor
from typing_extensions import override

from screl.modules.compute import POLICY, Cast, HFCompute, PolicyCompute
from screl.modules.megatron_policy import ARCH_FIELDS, fit_provider_to_policy, megatron_token_logprobs


def right_padded_positions(input_ids: Tensor, attention_mask: Tensor) -> Tensor:
    """Positions ``0 .. len - 1`` for a Megatron forward; rows must be right-padded (as ``collate_chunk`` makes
    them), so that under the causal mask the real tokens' outputs equal the unpadded ones."""
    mask = attention_mask.bool()
    if mask.shape[1] > 1 and bool((mask[:, 1:] & ~mask[:, :-1]).any()):
        raise ValueError("PPO under MegatronStrategy needs right-padded rows (attention_mask 1...1 0...0); "
                         "got a row with padding before a real token")
    return torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)


def check_actor_critic_layout(strategy: Any) -> None:
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


def critic_provider(strategy: Any, hf_trunk: torch.nn.Module) -> Any:
    """The critic trunk's ``GPTModelProvider``: the value spec's architecture, the policy provider's other knobs
    (layer spec, vocabulary padding, seed, ...)."""
    from screl.strategies import GPTModelProvider

    dtype = str(next(hf_trunk.parameters()).dtype).removeprefix("torch.")
    arch = GPTModelProvider.from_hf_config(hf_trunk.config, params_dtype=dtype)
    policy = strategy.model_provider
    if not isinstance(policy, GPTModelProvider):
        return arch
    return dataclasses.replace(policy, params_dtype=dtype, **{k: getattr(arch, k) for k in ARCH_FIELDS})


class MegatronCompute(PolicyCompute):
    """This rank's Megatron-core shards under ``MegatronStrategy`` (``strategy``)."""

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy

    @property
    @override
    def sharded(self) -> bool:
        return True

    @property
    @override
    def pipelined(self) -> bool:
        return self.strategy.parallelism.pipeline_model_parallel_size > 1  # type: ignore[no-any-return]

    @property
    @override
    def reducer_sums(self) -> bool:
        return bool(getattr(self.strategy.model_provider, "calculate_per_token_loss", False))

    @override
    def dp_group(self) -> Any:
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_group()

    @override
    def policy_model(self, model: torch.nn.Module, activation_checkpointing: str | None) -> torch.nn.Module:
        from screl.strategies import load_hf_weights

        fit_provider_to_policy(self.strategy, model, recompute_granularity=activation_checkpointing)
        shard = self.strategy.build_model()
        load_hf_weights(shard, model.state_dict())
        return shard  # type: ignore[no-any-return]

    @override
    def actor_critic(self, model: torch.nn.Module, critic: torch.nn.Module, activation_checkpointing: str | None,
                     trainer: Any) -> tuple[torch.nn.Module, Any]:
        """Both keep the Hugging Face weights they had (a warm-started critic's included)."""
        from screl.strategies import MegatronValueModel

        check_actor_critic_layout(self.strategy)
        policy = self.policy_model(model, activation_checkpointing)
        hf: Any = critic
        trunk = self.strategy.build_model(critic_provider(self.strategy, hf.trunk))
        return policy, MegatronValueModel.from_hf(trunk, hf.trunk.state_dict(), hf.head)

    @override
    def chunk_logprobs(self, module: Any, batch: dict[str, Any], sl: slice) -> Tensor:
        ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
        return megatron_token_logprobs(self.strategy, module.model, ids, attention, module.temperature)

    @override
    def row_logprobs(self, module: Any, ids: Tensor, attention: Tensor) -> Tensor:
        logits = module.model(ids, right_padded_positions(ids, attention), None)[:, :-1]
        if module.temperature != 1.0:
            logits = logits.float() / module.temperature
        return self.strategy.token_logprobs(logits, ids[:, 1:], POLICY)  # type: ignore[no-any-return]

    @override
    def values(self, module: Any, ids: Tensor, attention: Tensor) -> Tensor:
        return module.critic(ids, right_padded_positions(ids, attention), None)[:, :-1]  # type: ignore[no-any-return]

    @override
    def clip_gradients(self, module: Any, max_norm: float, path: str | None = None) -> Tensor:
        if path is None:
            return self.strategy.clip_gradients(max_norm)  # type: ignore[no-any-return]
        return self.strategy.clip_gradients(max_norm, modules=[path])  # type: ignore[no-any-return]

    @override
    def own_gradient_sync(self, trainer: Any) -> None:
        return  # Megatron's DDP reduces its gradient buffers only when finalize_gradients asks: nothing to switch off

    @override
    def sum_grads(self, module: Any, path: str, batch: dict[str, Any]) -> None:
        return  # Megatron reduces its gradient buffers itself (finalize_gradients)

    @override
    def sum_grads_scale(self, batch: dict[str, Any]) -> float:
        return self.grad_scale(batch)  # undo the buffers' data-parallel average

    @override
    def uncounted_step(self, opt: LightningOptimizer, path: str) -> None:
        # Lightning's step reduces and zeroes the optimizer's module's gradient buffers; this one does it itself
        self.strategy.finalize_gradients([path])
        opt.optimizer.step()
        self.strategy.zero_grad_buffers([path])

    @override
    def export_buckets(self, model: torch.nn.Module, path: str | None, bucket_bytes: int, naming: str,
                       cast: Cast) -> Iterator[dict[str, Tensor]]:
        # the strategy's own bucketing (export_bucket_bytes): a collective every rank consumes to the end
        for bucket in self.strategy.iter_export_weights(path, naming=naming):
            yield {k: cast(v.detach().to("cpu")) for k, v in bucket.items()}

    @override
    def export_state(self, module: Any, path: str) -> dict[str, Tensor]:
        return self.strategy.megatron_modules[path].export_hf_state()  # type: ignore[no-any-return]


def compute_for(trainer: Any) -> PolicyCompute:
    """The adapter of the trainer's strategy: Megatron's under ``MegatronStrategy``, else Hugging Face's. Checked
    without importing megatron: a run whose strategy is Megatron's has imported it already."""
    megatron = sys.modules.get("screl.strategies.megatron")
    strategy = trainer.strategy if trainer is not None else None
    if megatron is not None and isinstance(strategy, megatron.MegatronStrategy):
        return MegatronCompute(strategy)
    return HFCompute()
