"""A generation engine from outside screl, named in configs by its class path (``tests.engine_plugins.X``)."""

from __future__ import annotations

from screl.rollout import EngineCapabilities
from screl.rollout.engines.torch_engine import TorchGenerationEngine


class PlainEngine(TorchGenerationEngine):
    """The torch engine's decode declaring only the defaults: no colocation, no images, no MoE routing records, no
    streamed refits (the worker merges a refit's buckets into one state dict), and no whole-call batches (the
    controller sends each group in its own call)."""

    capabilities = EngineCapabilities()
