"""screl's Lightning strategies: Megatron-core parallelism (TP/PP/CP/DP) and data-parallel DDP.

``trainer.strategy: {class_path: screl.strategies.MegatronStrategy, init_args: {parallelism: {...}}}``
(``docs/megatron.md``), or ``{class_path: screl.strategies.DDPStrategy}`` (``docs/scaling.md``).

The names load on first use (PEP 562): a DDP run does not import megatron-core.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from screl._lazy import lazy_exports

if TYPE_CHECKING:
    from screl.strategies.ddp import DDPStrategy
    from screl.strategies.megatron import MegatronStrategy
    from screl.strategies.parallel import ParallelismConfig
    from screl.strategies.provider import GPTModelProvider, ModelProvider
    from screl.strategies.schedule import ForwardStep, LossReduction, token_logprobs
    from screl.strategies.value import MegatronValueModel
    from screl.strategies.weights import export_weights, iter_export_buckets, load_hf_weights

_WHERE = {
    "DDPStrategy": "ddp",
    "MegatronStrategy": "megatron",
    "ParallelismConfig": "parallel",
    "GPTModelProvider": "provider", "ModelProvider": "provider",
    "ForwardStep": "schedule", "LossReduction": "schedule", "token_logprobs": "schedule",
    "MegatronValueModel": "value",
    "export_weights": "weights", "iter_export_buckets": "weights", "load_hf_weights": "weights",
}

__all__ = [
    "DDPStrategy",
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


__getattr__, __dir__ = lazy_exports(__name__, _WHERE, globals())
