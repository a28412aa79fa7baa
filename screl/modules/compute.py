"""The compute adapters: how a module's policy (and critic) run on the trainer's strategy, chosen once.

GRPO, PPO and Distill say *what* to compute; a :class:`PolicyCompute` says *how*, on one compute path:
:class:`HFCompute` for Hugging Face models under Lightning's own strategies (one process, ``DDPStrategy``), and
:class:`~screl.modules.megatron_compute.MegatronCompute` for this rank's Megatron-core shards under
``MegatronStrategy``. An adapter holds every op whose code differs between the two: logprobs and values, gradient
clipping, sums over the data-parallel shards, the loss scale that undoes a gradient average, an update outside
Lightning's step, the weights a refit exports.

Invariant: a module holds exactly one adapter, ``module.compute``: an :class:`HFCompute` from construction (its
models are Hugging Face models until Lightning configures it), the strategy's from ``configure_model`` on
(:func:`~screl.modules.megatron_compute.compute_for`). An adapter holds no parameters and no model (it is handed the module's current ones), so
it never enters a checkpoint; the algorithms ask it what it can do (``sharded``, ``pipelined``), never its type.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any

import torch
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.strategies import DDPStrategy
from torch import Tensor
from typing_extensions import override

from screl.models.logprobs import chunked_token_logprobs, token_logprobs
from screl.models.lora import hf_state_items
from screl.modules.routing_replay import replayed
from screl.modules.vision_inputs import vision_forward_inputs
from screl.rollout.engines.buckets import iter_buckets

POLICY, CRITIC = "model", "critic"
"""The policy's and the critic's paths in a module (their Megatron modules' names under MegatronStrategy)."""

SYNC_BUCKET_NUMEL = 2**24
"""Gradient elements per all-reduce when PPO sums gradients over DDP replicas itself (64 MiB of fp32)."""

Cast = Callable[[Tensor], Tensor]


class PolicyCompute(ABC):
    """One compute path: the ops the algorithms call where the Hugging Face and the Megatron code differ.

    ``module`` arguments are the LightningModule (its ``model``, ``critic``, ``temperature``, ...); ``path`` names
    one of its models (:data:`POLICY`, :data:`CRITIC`); ``batch`` is the chunk, whose ``dp_shards`` says over how
    many data-parallel replicas its rows are spread.
    """

    last_entropy: Tensor | None = None
    """The policy's entropy per position of the last :meth:`chunk_logprobs` call, where the path computes it."""

    @property
    def sharded(self) -> bool:
        """The models are this rank's shards (the output layer too: no full-vocabulary rows on a rank)."""
        return False

    @property
    def pipelined(self) -> bool:
        """The layers are split into pipeline stages: a chunk runs through the strategy's schedule."""
        return False

    @property
    def reducer_sums(self) -> bool:
        """The strategy's gradient reduction sums over the data-parallel replicas rather than averaging."""
        return False

    def dp_group(self) -> Any:
        """The process group of the data-parallel replicas (None: the whole world)."""
        return None

    def sum_over_shards(self, value: Tensor, batch: dict[str, Any]) -> Tensor:
        """``value`` summed (in place) over the data-parallel replicas holding shards of this chunk; as is when the
        chunk was not sharded. Every replica calls it, one with no rows too."""
        if int(batch.get("dp_shards", 1)) <= 1:
            return value
        torch.distributed.all_reduce(value, group=self.dp_group())
        return value

    def row_offset(self, batch: dict[str, Any], rows: int, device: torch.device) -> int:
        """The chunk's row index of this replica's first row: the rows of the replicas before it (``shard_groups``
        hands out contiguous runs of groups in replica order)."""
        shards = int(batch.get("dp_shards", 1))
        if shards <= 1:
            return 0
        group = self.dp_group()
        counts = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(shards)]
        torch.distributed.all_gather(counts, torch.tensor([rows], device=device), group=group)
        rank = torch.distributed.get_rank(group)
        return int(sum(int(c) for c in counts[:rank]))

    def grad_scale(self, batch: dict[str, Any]) -> float:
        """The loss scale that undoes the strategy's data-parallel gradient average when each replica trained a
        shard of the chunk.

        ``batch["dp_shards"]`` replicas each hold whole groups of the chunk and normalize by the whole chunk
        (``chunk_rows``, ``chunk_valid_tokens``), so their gradients must be summed; torch's and Megatron's DDP
        average them (Megatron sums only with ``calculate_per_token_loss``)."""
        shards = int(batch.get("dp_shards", 1))
        if shards <= 1 or self.reducer_sums:
            return 1.0
        return float(shards)

    @abstractmethod
    def policy_model(self, model: torch.nn.Module, activation_checkpointing: str | None) -> torch.nn.Module:
        """The policy this path trains, made from the module's Hugging Face ``model`` (``configure_model``)."""

    @abstractmethod
    def actor_critic(self, model: torch.nn.Module, critic: torch.nn.Module, activation_checkpointing: str | None,
                     trainer: Any) -> tuple[torch.nn.Module, Any]:
        """PPO's policy and critic on this path, made from the module's Hugging Face ones (``configure_model``)."""

    @abstractmethod
    def chunk_logprobs(self, module: Any, batch: dict[str, Any], sl: slice) -> Tensor:
        """The policy's ``[rows, len - 1]`` next-token logprobs of the chunk's rows ``sl`` (GRPO's micro-batch)."""

    @abstractmethod
    def row_logprobs(self, module: Any, ids: Tensor, attention: Tensor) -> Tensor:
        """The policy's ``[rows, len - 1]`` next-token logprobs of plain text rows (PPO's, beside a critic)."""

    @abstractmethod
    def values(self, module: Any, ids: Tensor, attention: Tensor) -> Tensor:
        """The critic's ``[rows, len - 1]`` values, aligned with ``token_mask``."""

    def clip(self, module: Any, max_norm: float | None, path: str | None = None) -> Tensor | None:
        """:meth:`clip_gradients`, or None where ``max_norm`` is None (no clipping)."""
        return None if max_norm is None else self.clip_gradients(module, max_norm, path)

    @abstractmethod
    def clip_gradients(self, module: Any, max_norm: float, path: str | None = None) -> Tensor:
        """Clip the gradients of model ``path`` (None: the policy, GRPO's only model); returns the norm before."""

    @abstractmethod
    def own_gradient_sync(self, trainer: Any) -> None:
        """Leave the gradients' data-parallel reduction to :meth:`sum_grads` (PPO), where the strategy's would do it."""

    @abstractmethod
    def sum_grads(self, module: Any, path: str, batch: dict[str, Any]) -> None:
        """Sum model ``path``'s gradients over the data-parallel replicas, where the strategy does not (PPO)."""

    @abstractmethod
    def sum_grads_scale(self, batch: dict[str, Any]) -> float:
        """The loss scale that goes with :meth:`sum_grads`: its gradients must come out summed over the shards."""

    @abstractmethod
    def uncounted_step(self, opt: LightningOptimizer, path: str) -> None:
        """An optimizer update of model ``path`` outside Lightning's step (so ``global_step`` does not count it)."""

    @abstractmethod
    def export_buckets(self, model: torch.nn.Module, path: str | None, bucket_bytes: int, naming: str,
                       cast: Cast) -> Iterator[dict[str, Tensor]]:
        """The full weights of model ``path`` (None: all) on CPU, cast by ``cast``, bucket by bucket (a refit)."""

    @abstractmethod
    def export_state(self, module: Any, path: str) -> dict[str, Tensor]:
        """Model ``path``'s full weights on CPU in its Hugging Face naming (PPO's critic)."""


class HFCompute(PolicyCompute):
    """Hugging Face models under Lightning's own strategies (one process, ``DDPStrategy``): torch's collectives
    over the whole world, torch's gradient clipping, the rows' routing replay and images in the policy's forward.

    Under a plain DDP, PPO reduces the gradients itself (:meth:`sum_grads`), once per update and for the updated
    model only: DDP's reducer expects every parameter of the LightningModule in every backward pass, and a critic
    update leaves the policy without gradients.
    """

    @override
    def policy_model(self, model: torch.nn.Module, activation_checkpointing: str | None) -> torch.nn.Module:
        if activation_checkpointing == "selective":
            raise ValueError("model.init_args.activation_checkpointing: selective recomputes Megatron's attention "
                             "core and needs trainer.strategy: screl.strategies.MegatronStrategy; set it to full "
                             "for this policy")
        return model

    @override
    def actor_critic(self, model: torch.nn.Module, critic: torch.nn.Module, activation_checkpointing: str | None,
                     trainer: Any) -> tuple[torch.nn.Module, Any]:
        if trainer is not None and trainer.world_size > 1 and not isinstance(trainer.strategy, DDPStrategy):
            raise ValueError(f"trainer.strategy: PPO over {trainer.world_size} processes needs "
                             "screl.strategies.DDPStrategy (data parallel) or screl.strategies.MegatronStrategy, got "
                             f"{type(trainer.strategy).__name__}")
        return model, critic

    @override
    def chunk_logprobs(self, module: Any, batch: dict[str, Any], sl: slice) -> Tensor:
        """The rows' logprobs; through the chunked head, the policy's entropy per position too (no gradient, from
        the same softmax), kept in ``last_entropy`` for the step's ``train/entropy``."""
        ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
        inputs = vision_forward_inputs(module.model, batch, sl)
        with replayed(module.routing_replay, module.model, batch, sl):
            if module.logprob_chunk_tokens == 0:
                self.last_entropy = None
                return token_logprobs(module.model, ids, attention, module.temperature, 0, inputs)
            logp, self.last_entropy = chunked_token_logprobs(module.model, ids, attention, module.temperature,
                                                             module.logprob_chunk_tokens, True, inputs)
            return logp

    @override
    def row_logprobs(self, module: Any, ids: Tensor, attention: Tensor) -> Tensor:
        return token_logprobs(module.model, ids, attention, module.temperature, module.logprob_chunk_tokens)

    @override
    def values(self, module: Any, ids: Tensor, attention: Tensor) -> Tensor:
        return module.critic.token_values(ids, attention)  # type: ignore[no-any-return]

    @override
    def clip_gradients(self, module: Any, max_norm: float, path: str | None = None) -> Tensor:
        return torch.nn.utils.clip_grad_norm_(module.get_submodule(path or POLICY).parameters(), max_norm)

    @override
    def own_gradient_sync(self, trainer: Any) -> None:
        """Switch the reducer of Lightning's DDP off: it all-reduces a bucket once every parameter in it has a
        gradient, and fails the next backward pass when some never got one (a PPO backward pass reaches the policy
        or the critic, never both)."""
        model = getattr(trainer.strategy, "model", None) if trainer is not None else None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            model.require_backward_grad_sync = False

    @override
    def sum_grads(self, module: Any, path: str, batch: dict[str, Any]) -> None:
        """In flat buckets of one dtype; a replica that held no row of the minibatch adds zeros."""
        if int(batch.get("dp_shards", 1)) <= 1:
            return
        params = [p for p in module.get_submodule(path).parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[Tensor] = []
        for i, p in enumerate(params):
            assert p.grad is not None
            bucket.append(p.grad)
            last = i == len(params) - 1
            if last or params[i + 1].dtype != p.dtype or sum(g.numel() for g in bucket) >= SYNC_BUCKET_NUMEL:
                flat = torch._utils._flatten_dense_tensors(bucket)
                torch.distributed.all_reduce(flat)
                for grad, summed in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket), strict=True):
                    grad.copy_(summed)
                bucket = []

    @override
    def sum_grads_scale(self, batch: dict[str, Any]) -> float:
        return 1.0  # sum_grads sums: nothing to undo

    @override
    def uncounted_step(self, opt: LightningOptimizer, path: str) -> None:
        opt.optimizer.step()

    @override
    def export_buckets(self, model: torch.nn.Module, path: str | None, bucket_bytes: int, naming: str,
                       cast: Cast) -> Iterator[dict[str, Tensor]]:
        if naming == "megatron":
            raise ValueError("the Megatron engine's weights (data.init_args.generation.backend: megatron) come from a "
                             "policy trained under trainer.strategy: screl.strategies.MegatronStrategy")
        # cast before bucketing: a bucket's bytes are the engine's dtype's; a LoRA policy's weights merged, in the
        # base model's own names (screl.models.lora.hf_state_items)
        yield from iter_buckets(((k, cast(v)) for k, v in hf_state_items(model)), bucket_bytes)

    @override
    def export_state(self, module: Any, path: str) -> dict[str, Tensor]:
        return {k: v.detach().to("cpu").clone() for k, v in module.get_submodule(path).state_dict().items()}


def enable_activation_checkpointing(model: torch.nn.Module, mode: str | None) -> None:
    """``activation_checkpointing: full`` on a Hugging Face model: every decoder layer recomputes its activations
    in the backward pass (non-reentrant; active in training mode only). Megatron's is set on its provider."""
    if mode != "full":  # selective: Megatron's only (MegatronCompute.policy_model)
        return
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(f"model.init_args.activation_checkpointing: {type(model).__name__} does not support "
                         "gradient checkpointing; set it to false")
    hf: Any = model
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5's name (non-reentrant by default)
        hf.activation_checkpointing_enable()
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
