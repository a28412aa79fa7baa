"""Generation: the engine protocol and the torch engine (Ray workers build on these).

``TorchGenerationEngine`` imports lazily (it pulls in transformers).
"""

from typing import TYPE_CHECKING, Any

from screl.rollout.engine import (
    EngineOptions,
    FinishReason,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    SamplingParams,
)

if TYPE_CHECKING:
    from screl.rollout.torch_engine import TorchGenerationEngine


def __getattr__(name: str) -> Any:
    if name == "TorchGenerationEngine":
        from screl.rollout.torch_engine import TorchGenerationEngine

        return TorchGenerationEngine
    raise AttributeError(f"module 'screl.rollout' has no attribute {name!r}")


__all__ = [
    "EngineOptions",
    "FinishReason",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "PauseMode",
    "SamplingParams",
    "TorchGenerationEngine",
]
