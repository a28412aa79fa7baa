"""Generation backends by name or class path (``data.init_args.generation.backend``).

A backend is a class implementing :class:`~screl.rollout.engine.GenerationEngine`; each generation worker
builds one with ``Backend.from_options(policy, EngineOptions(...))``. ``torch`` names the built-in engine; any
``package.module.Class`` names your own (docs/extending.md shows one).
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from screl.rollout.engine import EngineCapabilities, EngineOptions, GenerationEngine

KEY = "data.init_args.generation.backend"

#: Built-in backend names and the classes they stand for.
BUILTIN_BACKENDS = {
    "torch": "screl.rollout.torch_engine.TorchGenerationEngine",
    "vllm": "screl.rollout.vllm_engine.VLLMGenerationEngine",
    "megatron": "screl.rollout.megatron_engine.MegatronGenerationEngine",
}

_REQUIRED = ("from_options", "generate", "update_weights", "set_version", "abort", "pause", "resume", "version")


def resolve_backend(name: str) -> type:
    """The engine class ``name`` stands for; ``ValueError`` names the config key and the fix."""
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


def iter_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Group named tensors into CPU buckets of about ``bucket_bytes`` each (a tensor larger than a bucket
    travels alone), copying one bucket at a time: a refit never holds a second full copy of the weights."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = t.detach().to("cpu", copy=True)
        size += nbytes
    if bucket:
        yield bucket


#: What an engine's ``update_weights`` takes: one state dict, or its buckets (an iterable of state-dict pieces,
#: consumed once, lazily: the worker streams a refit's buckets from the object store one at a time).
WeightBuckets = Mapping[str, torch.Tensor] | Iterable[Mapping[str, torch.Tensor]]


def as_buckets(weights: WeightBuckets) -> Iterator[Mapping[str, torch.Tensor]]:
    """The buckets of ``weights``: a state dict is one bucket, an iterable of buckets is drawn from lazily (the
    returned iterator keeps no reference to a bucket it has handed out)."""
    if isinstance(weights, Mapping):
        return iter((weights,))
    return map(_checked_bucket, weights)


def _checked_bucket(bucket: Any) -> Mapping[str, torch.Tensor]:
    if not isinstance(bucket, Mapping):
        raise TypeError(f"a weight bucket must be a mapping of names to tensors, got {type(bucket).__name__}")
    return bucket


def bucket_nbytes(bucket: Mapping[str, torch.Tensor]) -> int:
    """The bytes a bucket's tensors hold."""
    return sum(t.numel() * t.element_size() for t in bucket.values())


@dataclass(frozen=True)
class WireBucket:
    """A refit bucket as it travels through Ray's object store: each tensor's bytes as a numpy array, which Ray
    hands back as a read-only view of the store's shared memory (torch tensors come back as private copies)."""

    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    arrays: list[np.ndarray]


def bucket_to_wire(bucket: Mapping[str, torch.Tensor]) -> WireBucket:
    """``bucket`` for ``ray.put`` (views of its CPU tensors: no copy here)."""
    tensors = [(k, t.detach().to("cpu").contiguous()) for k, t in bucket.items()]
    return WireBucket([k for k, _ in tensors], [str(t.dtype).removeprefix("torch.") for _, t in tensors],
                      [list(t.shape) for _, t in tensors], [t.reshape(-1).view(torch.uint8).numpy() for _, t in tensors])


def bucket_from_wire(obj: Any) -> Mapping[str, torch.Tensor]:
    """The tensors of a :class:`WireBucket`, viewing its arrays (read-only: only to be copied from); any other
    bucket as it is."""
    if not isinstance(obj, WireBucket):
        return obj  # type: ignore[no-any-return]
    out: dict[str, torch.Tensor] = {}
    with warnings.catch_warnings():  # the store's memory is read-only; the engines only read it
        warnings.simplefilter("ignore", UserWarning)
        for name, dtype, shape, array in zip(obj.names, obj.dtypes, obj.shapes, obj.arrays, strict=True):
            out[name] = torch.from_numpy(array).view(getattr(torch, dtype)).reshape(shape)
    return out


def merge_buckets(buckets: Iterable[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One state dict from its buckets; a name in two buckets is an error (a bucketing bug would otherwise
    load whichever came last)."""
    merged: dict[str, torch.Tensor] = {}
    for bucket in buckets:
        twice = sorted(set(bucket) & set(merged))
        if twice:
            raise ValueError(f"weight buckets overlap on {twice[:5]}")
        merged.update(bucket)
    return merged
