"""Generation backends by name or class path (``data.init_args.generation.backend``).

A backend is a class implementing :class:`~screl.rollout.engines.protocol.GenerationEngine`; each generation
worker builds one with ``Backend.from_options(policy, EngineOptions(...))``. ``torch`` names the built-in engine;
any ``package.module.Class`` names your own (docs/extending.md shows one). A class path whose module moved
(:mod:`screl.rollout.moved`) is refused with its new home.
"""

from __future__ import annotations

import importlib
from typing import Any

from screl.rollout.engines.protocol import EngineCapabilities, EngineOptions, GenerationEngine
from screl.rollout.moved import refuse_moved

KEY = "data.init_args.generation.backend"

#: Built-in backend names and the classes they stand for.
BUILTIN_BACKENDS = {
    "torch": "screl.rollout.engines.torch_engine.TorchGenerationEngine",
    "vllm": "screl.rollout.engines.vllm_engine.VLLMGenerationEngine",
    "megatron": "screl.rollout.engines.megatron_engine.MegatronGenerationEngine",
}

_REQUIRED = ("from_options", "generate", "update_weights", "set_version", "abort", "pause", "resume", "version")


def resolve_backend(name: str) -> type:
    """The engine class ``name`` stands for; ``ValueError`` names the config key and the fix."""
    refuse_moved(name, KEY)
    target = BUILTIN_BACKENDS.get(name, name)
    module_name, _, class_name = target.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(
            f"{KEY}={name!r} is neither a built-in backend ({sorted(BUILTIN_BACKENDS)}) nor an importable "
            f"class 'package.module.Class' ({type(err).__name__}: {err})"
        ) from err
    missing = [m for m in _REQUIRED if not hasattr(cls, m)]
    if not isinstance(cls, type) or missing:
        raise ValueError(f"{KEY}={name!r} does not implement the GenerationEngine protocol: missing {missing}")
    return cls


def engine_capabilities(name: str) -> EngineCapabilities:
    """What the engine ``name`` (a built-in name or a class path) declares it can do; an engine class that
    declares nothing gets :class:`EngineCapabilities`' defaults. ``ValueError`` as :func:`resolve_backend`."""
    declared = getattr(resolve_backend(name), "capabilities", None)
    if declared is None:
        return EngineCapabilities()
    if not isinstance(declared, EngineCapabilities):
        raise ValueError(f"{KEY}={name!r}: its `capabilities` is a {type(declared).__name__}, not an "
                         "screl.rollout.EngineCapabilities")
    return declared


def engine_title(name: str) -> str:
    """How messages name the engine: the built-in name, or the class's own name."""
    return name if name in BUILTIN_BACKENDS else name.replace(":", ".").rsplit(".", 1)[-1]


def build_engine(name: str, policy: Any, options: EngineOptions) -> GenerationEngine:
    """Build the worker's engine from its backend name (or class path)."""
    cls: Any = resolve_backend(name)
    engine: GenerationEngine = cls.from_options(policy, options)
    return engine
