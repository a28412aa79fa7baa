"""Copying a refit's buckets into a model's tensors in place (the torch engine's ``update_weights``)."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import torch


def check_bucket(bucket: Mapping[str, torch.Tensor], names: Mapping[str, torch.Tensor], given: set[str]) -> None:
    """Refuse a refit bucket before any of it is copied: a name not in the model, a name an earlier bucket
    gave, or a shape that differs from the model's."""
    unexpected = sorted(set(bucket) - set(names))
    if unexpected:
        raise KeyError(f"update_weights: keys not in the model: {unexpected[:5]} ({len(unexpected)} in all).")
    twice = sorted(set(bucket) & given)
    if twice:
        raise ValueError(f"update_weights: weight buckets overlap on {twice[:5]}")
    shapes = [f"{k}: {tuple(t.shape)} != {tuple(names[k].shape)}" for k, t in bucket.items()
              if t.shape != names[k].shape]
    if shapes:
        raise ValueError(f"update_weights: shape mismatch (given != model): {shapes[:5]}.")


def copy_bucket(bucket: Mapping[str, torch.Tensor], names: Mapping[str, torch.Tensor], given: set[str],
                 loaded: set[int]) -> int:
    """Check one refit bucket, then copy it into the model's tensors in place; returns how many it held."""
    check_bucket(bucket, names, given)
    for k, t in bucket.items():
        copy_serial(names[k], t)
        loaded.add(id(names[k]))
    given.update(bucket)
    return len(bucket)


def copy_serial(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src)`` without an OpenMP parallel region when both are CPU tensors of one dtype.

    Weight updates run on a thread other than the decode thread. With libgomp, every thread that enters a
    parallel region gets its own team of helper threads; once the process has more OpenMP threads than
    cores, libgomp stops spinning and every decode step pays for waking its helpers (measured: a 2-thread
    generation of 64 x 64 tokens went from 0.49 s to 0.81 s after one ``copy_`` on another thread). A
    numpy copy is a plain memcpy on the calling thread.
    """
    as_int = _SAME_SIZE_INT.get(dst.dtype.itemsize)
    if (
        dst.device.type != "cpu" or src.device.type != "cpu" or dst.dtype != src.dtype or as_int is None
        or not dst.is_contiguous() or dst.shape != src.shape
    ):
        dst.copy_(src)
        return
    np.copyto(dst.view(as_int).numpy(), src.contiguous().view(as_int).numpy())


_SAME_SIZE_INT = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
