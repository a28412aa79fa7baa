"""Refit weights in buckets: a state dict cut into pieces of about ``refit_bucket_mb`` (:func:`iter_buckets`), what
an engine's ``update_weights`` takes (:data:`WeightBuckets`), and a bucket's form in Ray's object store
(:class:`WireBucket`)."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


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
