"""Megatron-core parallelism (TP/PP/CP/DP) for screl's trainers, as a Lightning strategy.

``trainer.strategy: {class_path: screl.strategies.MegatronStrategy, init_args: {parallelism: {...}}}``;
see ``docs/megatron.md``.
"""

from screl.strategies.megatron import MegatronStrategy
from screl.strategies.parallel import ParallelismConfig
from screl.strategies.provider import GPTModelProvider, ModelProvider
from screl.strategies.schedule import ForwardStep, LossReduction, token_logprobs
from screl.strategies.value import MegatronValueModel
from screl.strategies.weights import export_weights, iter_export_buckets, load_hf_weights

__all__ = [
    "ForwardStep",
    "GPTModelProvider",
    "LossReduction",
    "MegatronStrategy",
    "MegatronValueModel",
    "ModelProvider",
    "ParallelismConfig",
    "export_weights",
    "iter_export_buckets",
    "load_hf_weights",
    "token_logprobs",
]
