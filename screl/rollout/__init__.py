"""Generation: the engine protocol and the torch engine (Ray workers build on these).

``TorchGenerationEngine`` imports lazily (it pulls in transformers).
"""

from typing import TYPE_CHECKING, Any

from screl.rollout.engine import (
    EngineCapabilities,
    EngineOptions,
    FinishReason,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    SamplingParams,
)

if TYPE_CHECKING:
    from screl.rollout.agent import AgentWorkflow
    from screl.rollout.multiturn import MultiTurnWorkflow
    from screl.rollout.torch_engine import TorchGenerationEngine


def __getattr__(name: str) -> Any:
    if name == "TorchGenerationEngine":
        from screl.rollout.torch_engine import TorchGenerationEngine

        return TorchGenerationEngine
    if name == "MultiTurnWorkflow":
        from screl.rollout.multiturn import MultiTurnWorkflow

        return MultiTurnWorkflow
    if name == "AgentWorkflow":
        from screl.rollout.agent import AgentWorkflow

        return AgentWorkflow
    raise AttributeError(f"module 'screl.rollout' has no attribute {name!r}")


__all__ = [
    "AgentWorkflow",
    "EngineCapabilities",
    "EngineOptions",
    "FinishReason",
    "GenerationEngine",
    "GenerationRequest",
    "GenerationResult",
    "MultiTurnWorkflow",
    "PauseMode",
    "SamplingParams",
    "TorchGenerationEngine",
]
