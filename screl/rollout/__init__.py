"""Generation: the Ray workers (:mod:`.worker`) and the rows they write (:mod:`.rows`), above three rooms:
:mod:`.engines` (the engine protocol, the backends, the torch/Megatron/vLLM engines), :mod:`.workflows` (what a
worker does with a sibling) and :mod:`.server` (the OpenAI-compatible policy server); the server builds on the
workflows, the workflows on the engines, never the other way (``lint-imports``). Old module paths from before
the split are refused with their new home (:mod:`.moved`).

The engine protocol's names, ``TorchGenerationEngine``, ``MultiTurnWorkflow`` and ``AgentWorkflow`` are exported
here; the last three import lazily (they pull in transformers).
"""

from typing import TYPE_CHECKING, Any

from screl.rollout.engines.protocol import (
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
    from screl.rollout.engines.torch_engine import TorchGenerationEngine
    from screl.rollout.workflows.agent import AgentWorkflow
    from screl.rollout.workflows.multiturn import MultiTurnWorkflow


def __getattr__(name: str) -> Any:
    if name == "TorchGenerationEngine":
        from screl.rollout.engines.torch_engine import TorchGenerationEngine

        return TorchGenerationEngine
    if name == "MultiTurnWorkflow":
        from screl.rollout.workflows.multiturn import MultiTurnWorkflow

        return MultiTurnWorkflow
    if name == "AgentWorkflow":
        from screl.rollout.workflows.agent import AgentWorkflow

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
