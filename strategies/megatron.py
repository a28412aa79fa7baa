"""``MegatronStrategy``: Lightning's DDP strategy with Megatron-core tensor/pipeline/data parallelism.

Lightning starts the ranks and the default process group (gloo on CPU, nccl on CUDA) as for DDP; the
strategy then initializes Megatron's ``parallel_state`` on that group. The LightningModule builds its
Megatron model in ``configure_model()`` with ``self.trainer.strategy.build_model()`` (the strategy's
model provider); ``setup()`` wraps every outermost Megatron module of the LightningModule in
Megatron's ``DistributedDataParallel`` in place.

Training, either way:

- *plain Lightning*: ``training_step`` returns a loss; Lightning backpropagates it; before the
  optimizer steps, the strategy finalizes the gradients (data-parallel all-reduce, sequence-parallel
  norm reduction) and hands Megatron's ``main_grad`` buffers to the torch optimizer as ``.grad``;
- *microbatched*: ``training_step`` calls :meth:`MegatronStrategy.forward_backward`, which runs
  Megatron's schedule (a plain loop on CPU) including the backward passes, and returns the detached
  reported loss; the strategy then skips Lightning's backward for that step.

With ``use_distributed_optimizer=True`` the strategy swaps each torch AdamW the LightningModule configured for
megatron-core's ``DistributedOptimizer`` (:mod:`screl.strategies.distributed_optimizer`): the optimizer state is
sharded over data parallel, gradients are reduce-scattered and parameters all-gathered.

Checkpoints are ``dist_checkpointing`` directories (see :mod:`screl.strategies.checkpoint`). Finding,
wrapping and checkpointing the Megatron modules of the LightningModule is in
:mod:`screl.strategies.module_state`; finalizing, clipping and zeroing the gradients around each optimizer step
in :mod:`screl.strategies.gradients` (over the buffer plumbing of :mod:`screl.strategies.grad_buffers`).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch import Trainer
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)
from megatron.core.transformer.module import MegatronModule
from screl.strategies import checkpoint as ckpt
from screl.strategies import launch, weights
from screl.strategies.distributed_optimizer import DistributedAdam
from screl.strategies.gradients import MegatronGradients
from screl.strategies.module_state import (
    load_template,
    module_sharded_state,
    optimizer_index,
    optimizer_modules,
    outermost_megatron_modules,
    set_submodule,
    wrapped_state_dict,
)
from screl.strategies.parallel import ParallelismConfig, initialize_model_parallel
from screl.strategies.provider import UNPADDED_VOCAB_ATTR, GPTModelProvider, ModelProvider
from screl.strategies.schedule import ForwardStep, LossReduction, forward_backward, token_logprobs
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

__all__ = ["MegatronStrategy"]


class MegatronStrategy(launch.FileRendezvous, MegatronGradients, DDPStrategy):
    """Megatron-core TP/PP/CP/DP training under Lightning.

    Args:
        parallelism: Parallel sizes (default: all 1, data parallel over the world).
        model_provider: Builds each rank's model shard in :meth:`build_model` (default:
            :class:`~screl.strategies.GPTModelProvider`; screl's GRPO derives it from its policy).
        ddp_config: Keyword arguments of Megatron's ``DistributedDataParallelConfig``
            (``grad_reduce_in_fp32``, ``overlap_grad_reduce``, ``bucket_size``, ...).
        use_distributed_optimizer: Shard the optimizer state (fp32 main parameters, Adam moments) over data
            parallel with megatron-core's ``DistributedOptimizer``, in place of the torch AdamW the
            LightningModule configures (its hyperparameters carry over). Sets
            ``DistributedDataParallelConfig.use_distributed_optimizer`` too.
        seed: Seed of Megatron's RNG streams (default: Lightning's ``seed_everything`` seed, else 0).
        staging_dir: Local directory for staging checkpoints to and from non-local fsspec URLs
            (default: the system temp directory).
        export_bucket_bytes: Bucket size (local shard bytes) of :meth:`iter_export_weights`.
        process_group_backend, timeout, start_method, accelerator, parallel_devices,
            cluster_environment, checkpoint_io, precision_plugin: as for Lightning's ``DDPStrategy``.
    """

    strategy_name = "megatron"

    def __init__(
        self,
        parallelism: ParallelismConfig | None = None,
        model_provider: GPTModelProvider | Callable[..., MegatronModule] | None = None,
        ddp_config: dict[str, Any] | None = None,
        use_distributed_optimizer: bool = False,
        seed: int | None = None,
        staging_dir: str | None = None,
        export_bucket_bytes: int = weights.DEFAULT_BUCKET_BYTES,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self.parallelism = parallelism or ParallelismConfig()
        self.model_provider: ModelProvider = model_provider or GPTModelProvider()
        self.model_provider_is_default = model_provider is None
        """No provider was given: a LightningModule may replace the default with one matching its policy."""
        self.ddp_config = dict(ddp_config or {})
        given = self.ddp_config.get("use_distributed_optimizer")
        if given is not None and bool(given) != use_distributed_optimizer:
            raise ValueError(
                f"MegatronStrategy: ddp_config.use_distributed_optimizer={given} contradicts "
                f"use_distributed_optimizer={use_distributed_optimizer}; set only the strategy's knob."
            )
        self.use_distributed_optimizer = use_distributed_optimizer
        self.seed = seed if seed is not None else int(os.environ.get("PL_GLOBAL_SEED", 0))
        self.staging_dir = staging_dir
        self.export_bucket_bytes = export_bucket_bytes
        self._wrapped: dict[str, DistributedDataParallel] = {}
        self._backward_done = False
        self._finalized: set[str] = set()
        """Paths of the wrapped modules whose gradients are reduced for the coming optimizer step."""

    # ----------------------------------------------------------------------------------- set-up
    @property
    def on_cpu(self) -> bool:
        """Whether this rank trains on the CPU (the CUDA shim is in place)."""
        return self.root_device.type == "cpu"

    @override
    def setup_environment(self) -> None:
        """Check the sizes, start the process group (as DDP does), then Megatron's ``parallel_state``."""
        self.set_world_ranks()
        self.parallelism.validate(self.world_size)
        if self.root_device.type == "cpu":
            self.parallelism.check_cpu()
        super().setup_environment()
        initialize_model_parallel(self.parallelism, self.seed, cpu=self.on_cpu)

    @property
    def data_parallel_size(self) -> int:
        """Data-parallel replicas (context-parallel ranks excluded)."""
        return parallel_state.get_data_parallel_world_size()

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """Shard data over data-parallel replicas only: tensor/pipeline peers see the same batch."""
        return {
            "num_replicas": parallel_state.get_data_parallel_world_size(),
            "rank": parallel_state.get_data_parallel_rank(),
        }

    def build_model(self, provider: ModelProvider | None = None) -> MegatronModule:
        """This rank's model shard, on this rank's device (call in ``configure_model``).

        ``provider``: build another model than the strategy's (e.g. a critic beside the policy); default: the
        strategy's ``model_provider``.
        """
        if not parallel_state.model_parallel_is_initialized():
            raise RuntimeError(
                "MegatronStrategy.build_model() runs after setup_environment() (in configure_model())."
            )
        module = (provider or self.model_provider)(
            pre_process=parallel_state.is_pipeline_first_stage(),
            post_process=parallel_state.is_pipeline_last_stage(),
        )
        return module.to(self.root_device)

    @override
    def setup(self, trainer: Trainer) -> None:
        """Move the module to the device and, when fitting, wrap its Megatron modules and set up optimizers."""
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            if trainer.gradient_clip_val:
                raise ValueError(
                    f"MegatronStrategy: Trainer(gradient_clip_val={trainer.gradient_clip_val}) clips by a norm that "
                    "ignores tensor parallelism. Call trainer.strategy.clip_gradients(max_norm) instead (manual "
                    "optimization: before opt.step(); automatic: in on_before_optimizer_step)."
                )
            self.wrap_megatron_modules()
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    @override
    def setup_optimizers(self, trainer: Trainer) -> None:
        """The LightningModule's optimizers; with ``use_distributed_optimizer`` each becomes a
        :class:`~screl.strategies.distributed_optimizer.DistributedAdam` over the Megatron modules it updates."""
        super().setup_optimizers(trainer)
        if self.use_distributed_optimizer:
            self.optimizers = [self.distribute_optimizer(opt) for opt in self.optimizers]

    def distribute_optimizer(self, optimizer: Optimizer) -> DistributedAdam:
        """``optimizer`` (a torch AdamW over wrapped Megatron modules) as megatron's distributed optimizer."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        paths = optimizer_modules(optimizer, self._wrapped)
        return DistributedAdam(optimizer, [self._wrapped[p] for p in paths])

    def wrap_megatron_modules(self) -> dict[str, DistributedDataParallel]:
        """Wrap every outermost Megatron module of the LightningModule in Megatron's DDP, in place."""
        module = self.lightning_module
        assert module is not None
        found = [
            (p, m)
            for p, m in outermost_megatron_modules(module)
            if not isinstance(m, DistributedDataParallel)
        ]
        if not found and not self._wrapped:
            raise RuntimeError(
                f"MegatronStrategy found no Megatron module in {type(module).__name__}: build it in "
                "configure_model(), e.g. `self.model = self.trainer.strategy.build_model()`."
            )
        for path, inner in found:
            ddp_config = DistributedDataParallelConfig(
                **{**self.ddp_config, "use_distributed_optimizer": self.use_distributed_optimizer}
            )
            wrapped = DistributedDataParallel(config=inner.config, ddp_config=ddp_config, module=inner)
            wrapped.config.finalize_model_grads_func = finalize_model_grads
            wrapped.config.no_sync_func = wrapped.no_sync
            set_submodule(module, path, wrapped)
            self._wrapped[path] = wrapped
        return dict(self._wrapped)

    @property
    def megatron_modules(self) -> dict[str, MegatronModule]:
        """The LightningModule's outermost Megatron modules (DDP wrappers removed), by path."""
        module = self.lightning_module
        if module is None:
            return {}
        return {
            path: m.module if isinstance(m, DistributedDataParallel) else m
            for path, m in outermost_megatron_modules(module)
        }

    @override
    def teardown(self) -> None:
        """Unwrap the Megatron modules (``parallel_state`` stays initialized), then Lightning's teardown."""
        module = self.lightning_module
        if module is not None:
            for path, wrapped in self._wrapped.items():
                set_submodule(module, path, wrapped.module)
        self._wrapped.clear()
        super().teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Registers no string aliases (``DDPStrategy``'s names stay Lightning's)."""

    # ------------------------------------------------------------------------------- training
    def forward_backward(
        self,
        microbatches: Sequence[Any],
        forward_step: ForwardStep,
        loss_reduction: LossReduction,
        forward_only: bool = False,
        module: str | None = None,
        seq_length: int | None = None,
        micro_batch_size: int | None = None,
    ) -> Tensor:
        """Run ``microbatches`` through a Megatron module with Megatron's schedule (CPU: a plain loop).

        Backward passes and the gradient reduction happen here, so Lightning's own backward is skipped
        for this step. Returns the detached reported loss, the same on every rank. ``module``: the
        path of the Megatron module (default: the only one).
        """
        path = self._path(module)
        if not forward_only and path in self._finalized:
            raise RuntimeError(
                "MegatronStrategy.forward_backward() ran twice before an optimizer step: the second call would "
                "reduce the gradients across data parallel again. Pass all of the step's microbatches to one "
                "call (and keep Trainer(accumulate_grad_batches=1) with it)."
            )
        model = self._module(path)
        loss = forward_backward(
            model, microbatches, forward_step, loss_reduction, forward_only, seq_length, micro_batch_size
        )
        if not forward_only:
            self._backward_done = True
            self._finalized.add(path)
        return loss

    def _path(self, path: str | None) -> str:
        paths = sorted(self.megatron_modules)
        if path is None and len(paths) == 1:
            return paths[0]
        if path not in paths:
            raise ValueError(f"Name one Megatron module of this LightningModule: {paths} (got {path!r}).")
        return path

    def _module(self, path: str | None) -> nn.Module:
        """The module to run: the DDP wrapper when fitting, else the bare Megatron module."""
        path = self._path(path)
        return self._wrapped[path] if path in self._wrapped else self.megatron_modules[path]

    def token_logprobs(self, logits: Tensor, labels: Tensor, module: str | None = None) -> Tensor:
        """:func:`~screl.strategies.schedule.token_logprobs` with the module's vocabulary layout."""
        inner = self.megatron_modules[self._path(module)]
        return token_logprobs(
            logits,
            labels,
            vocab_size=getattr(inner, UNPADDED_VOCAB_ATTR, None),
            vocab_parallel=bool(getattr(inner, "parallel_output", True)),
        )

    # ------------------------------------------------------------------------------- weights
    def iter_export_weights(
        self, module: str | None = None, naming: weights.Naming = "hf"
    ) -> Iterator[dict[str, Tensor]]:
        """Full weights in Hugging Face naming, bucket by bucket, on every rank (all ranks must consume all)."""
        inner = self.megatron_modules[self._path(module)]
        return weights.iter_export_buckets(inner, self.export_bucket_bytes, naming)

    def export_weights(self, module: str | None = None, naming: weights.Naming = "hf") -> dict[str, Tensor]:
        """All full weights in one dict, on every rank (a collective: call it on every rank)."""
        out: dict[str, Tensor] = {}
        for bucket in self.iter_export_weights(module, naming):
            out.update(bucket)
        return out

    # ---------------------------------------------------------------------------- checkpoints
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        """Load after ``setup()``: the sharded template needs the model and optimizers."""
        return True

    def _module_sharded_state(self) -> dict[str, Any]:
        module = self.lightning_module
        assert module is not None
        return module_sharded_state(module, self.megatron_modules)

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The LightningModule's state: Megatron modules as ``ShardedTensor`` s, the rest as plain values."""
        if not self.megatron_modules:
            return super().lightning_module_state_dict()
        return self._module_sharded_state()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The optimizer's state with parameter-shaped entries sharded like their parameters."""
        if isinstance(optimizer, LightningOptimizer):
            optimizer = optimizer._optimizer
        if isinstance(optimizer, DistributedAdam):
            return optimizer.sharded_state(self._module_sharded_state())
        index = optimizer_index(self.optimizers, optimizer)
        return ckpt.optimizer_sharded_state(
            optimizer, self._module_sharded_state(), prefix=f"optimizer.{index}"
        )

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: _PATH, storage_options: Any | None = None
    ) -> None:
        """Save with ``dist_checkpointing`` from every rank (``filepath`` becomes a directory)."""
        if storage_options is not None:
            raise TypeError("MegatronStrategy.save_checkpoint() takes no storage_options.")
        ckpt.save_checkpoint(
            checkpoint,
            str(filepath),
            self.staging_dir,
            node_leader=self.local_rank == 0,
            barrier=self._barrier,
        )

    def _barrier(self) -> None:
        self.barrier("MegatronStrategy.checkpoint")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """Load a sharded checkpoint at this rank's sharding (any tensor-parallel size it was saved at)."""

        def template(common: Mapping[str, Any]) -> dict[str, Any]:
            return load_template(common, self._module_sharded_state(), self.optimizers)

        return ckpt.load_checkpoint(
            template,
            str(checkpoint_path),
            self.staging_dir,
            node_leader=self.local_rank == 0,
            barrier=self._barrier,
        )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        """Copy loaded weights into the (wrapped) LightningModule."""
        module = self.lightning_module
        assert module is not None
        module.load_state_dict(wrapped_state_dict(checkpoint["state_dict"], self._wrapped), strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Load each optimizer's merged (common + sharded) state."""
        for optimizer, saved in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            inner = getattr(optimizer, "_optimizer", optimizer)
            if isinstance(inner, DistributedAdam):
                inner.load_sharded_state(saved)
                continue
            optimizer.load_state_dict(ckpt.optimizer_state_for_torch(saved))
            _optimizers_to_device([optimizer], self.root_device)

    @override
    def remove_checkpoint(self, filepath: _PATH) -> None:
        """Remove a checkpoint directory (rank 0), local or remote."""
        if self.is_global_zero:
            import fsspec

            fs, path = fsspec.core.url_to_fs(str(filepath))
            if fs.exists(path):
                fs.rm(path, recursive=True)
