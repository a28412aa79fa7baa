"""``ParallelismConfig`` and the set-up/tear-down of Megatron's ``parallel_state`` on an existing process group."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from screl.strategies import cpu_shim

__all__ = ["ParallelismConfig", "current_parallelism", "destroy_model_parallel", "initialize_model_parallel"]

_current: ParallelismConfig | None = None


@dataclass
class ParallelismConfig:
    """Megatron parallel sizes. Their product with the data-parallel size is the world size."""

    tensor_model_parallel_size: int = 1
    """Ranks that split each weight matrix."""
    pipeline_model_parallel_size: int = 1
    """Ranks that split the layers into stages (CPU: only 1)."""
    context_parallel_size: int = 1
    """Ranks that split each sequence."""
    expert_model_parallel_size: int = 1
    """Ranks that split the experts of MoE layers."""
    expert_tensor_parallel_size: int | None = None
    """Tensor-parallel size inside experts; ``None``: the tensor-parallel size."""
    data_parallel_size: int | None = None
    """``None``: whatever the world size leaves; else must make the product equal the world size."""
    sequence_parallel: bool = False
    """Split activations along the sequence in the tensor-parallel regions (needs tensor parallel > 1)."""

    def __post_init__(self) -> None:
        sizes = self._sizes()
        bad = [f"{k}={v}" for k, v in sizes.items() if v is not None and v < 1]
        if bad:
            raise ValueError(f"ParallelismConfig: sizes must be >= 1, got {', '.join(bad)}.")

    def _sizes(self) -> dict[str, int | None]:
        return {
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "context_parallel_size": self.context_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_parallel_size,
            "data_parallel_size": self.data_parallel_size,
        }

    @property
    def model_parallel_size(self) -> int:
        """Ranks holding one replica of the model: tensor x pipeline x context parallel."""
        return (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size * self.context_parallel_size
        )

    def check_cpu(self) -> None:
        """Refuse what megatron-core cannot run on the CPU, naming the setting."""
        if self.sequence_parallel:
            raise ValueError(
                "MegatronStrategy: sequence_parallel=True is not supported on CPU (megatron-core's torch norms "
                "reject it; it needs Transformer Engine or Apex norms). Use sequence_parallel=False or a GPU."
            )

    def validate(self, world_size: int) -> int:
        """Check the sizes against ``world_size`` and return the data-parallel size.

        Raises:
            ValueError: naming every size and the world size when they do not fit.
        """
        tp, pp, cp = (
            self.tensor_model_parallel_size,
            self.pipeline_model_parallel_size,
            self.context_parallel_size,
        )
        product = f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp} x context_parallel_size={cp}"
        if self.data_parallel_size is not None:
            total = self.model_parallel_size * self.data_parallel_size
            if total != world_size:
                raise ValueError(
                    f"ParallelismConfig: {product} x data_parallel_size={self.data_parallel_size} = {total}, "
                    f"but the world size is {world_size}: the product must equal the world size."
                )
        elif world_size % self.model_parallel_size:
            raise ValueError(
                f"ParallelismConfig: {product} = {self.model_parallel_size} does not divide the world size "
                f"{world_size}: the world size must be a multiple of it (data parallel = world / product)."
            )
        dp = world_size // self.model_parallel_size
        etp = self.expert_tensor_parallel_size or tp
        expert_block = etp * self.expert_model_parallel_size * pp
        if world_size % expert_block:
            raise ValueError(
                f"ParallelismConfig: expert_tensor_parallel_size={etp} x expert_model_parallel_size="
                f"{self.expert_model_parallel_size} x pipeline_model_parallel_size={pp} = {expert_block} does "
                f"not divide the world size {world_size}."
            )
        if self.sequence_parallel and tp == 1:
            raise ValueError(
                "ParallelismConfig: sequence_parallel=True needs tensor_model_parallel_size > 1, got 1."
            )
        return dp


def current_parallelism() -> ParallelismConfig | None:
    """The config that :func:`initialize_model_parallel` set up in this process, if any."""
    return _current


def initialize_model_parallel(config: ParallelismConfig, seed: int, cpu: bool) -> int:
    """Initialize ``parallel_state`` on the default process group and seed Megatron's RNG streams.

    ``cpu``: install :mod:`~screl.strategies.cpu_shim` and seed the CPU streams. Returns the
    data-parallel size.
    """
    global _current
    if not dist.is_initialized():
        raise RuntimeError("initialize_model_parallel() needs torch.distributed initialized first.")
    dp = config.validate(dist.get_world_size())
    if cpu:
        cpu_shim.apply()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=config.tensor_model_parallel_size,
        pipeline_model_parallel_size=config.pipeline_model_parallel_size,
        context_parallel_size=config.context_parallel_size,
        expert_model_parallel_size=config.expert_model_parallel_size,
        expert_tensor_parallel_size=config.expert_tensor_parallel_size,
    )
    _current = config
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    if cpu:
        cpu_shim.model_parallel_cpu_manual_seed(
            seed,
            tp_rank=tp_rank,
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        )
    else:
        torch.manual_seed(seed)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    return dp


def destroy_model_parallel(remove_shim: bool = True) -> None:
    """Tear down ``parallel_state`` (the process group stays) and, by default, remove the CPU shim."""
    global _current
    parallel_state.destroy_model_parallel()
    _current = None
    if remove_shim:
        cpu_shim.remove()
