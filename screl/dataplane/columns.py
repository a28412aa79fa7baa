"""Rollout rows <-> TransferQueue columns (pure torch / tensordict: no Ray, no TQ client).

A per-sample 0-d tensor becomes one regular ``(B,)`` column; per-sample tensors of one or more dims travel
as one regular ``(B, ...)`` column when their shapes agree, else as a jagged nested tensor (only the first
dim may vary). Reading splits a column back into per-sample dense CPU tensors.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from tensordict import TensorDict

from screl.dataplane.errors import DataPlaneError

Column = torch.Tensor | Sequence[torch.Tensor]


def to_column(name: str, value: Column, n: int) -> torch.Tensor:
    """Per-sample values of one field -> a TQ column: regular ``(B,)`` or jagged ``(B, j, ...)``."""
    if isinstance(value, torch.Tensor):
        if value.is_nested:
            if value.size(0) != n:
                raise ValueError(f"field {name!r}: nested tensor holds {value.size(0)} samples, keys {n}.")
            return value.detach().cpu()
        if value.dim() == 0 or value.shape[0] != n:
            raise ValueError(
                f"field {name!r}: tensor of shape {tuple(value.shape)} does not start with {n} (keys)."
            )
        samples = list(value.detach().cpu().unbind(0))
    else:
        samples = list(value)
        if len(samples) != n:
            raise ValueError(f"field {name!r}: {len(samples)} values for {n} keys.")
        if not all(isinstance(t, torch.Tensor) for t in samples):
            raise TypeError(f"field {name!r}: every per-sample value must be a torch.Tensor.")
        samples = [t.detach().cpu() for t in samples]
    dtypes = {t.dtype for t in samples}
    if len(dtypes) != 1:
        raise TypeError(f"field {name!r}: mixed dtypes {sorted(map(str, dtypes))}.")
    shapes = {tuple(t.shape) for t in samples}
    if len(shapes) == 1:  # regular (B, ...): one buffer, one ZMQ frame, no nested-tensor bookkeeping
        return torch.stack(samples)
    dims = {len(shape) for shape in shapes}
    if 0 in dims or len(dims) != 1 or len({shape[1:] for shape in shapes}) != 1:
        raise ValueError(
            f"field {name!r}: per-sample shapes {[tuple(t.shape) for t in samples]} differ beyond the first "
            f"dim (only the first dim may vary; all samples must be 0-d or all >= 1-d)."
        )
    # jagged: built from one concatenated buffer and its offsets (``nested_tensor(list)`` costs ~10x more)
    lengths = torch.tensor([0] + [t.shape[0] for t in samples], dtype=torch.int64)
    return torch.nested.nested_tensor_from_jagged(torch.cat(samples), offsets=lengths.cumsum(0))


def to_batch(keys: Sequence[str], rows: Mapping[str, Column]) -> TensorDict:
    return TensorDict(
        {name: to_column(name, v, len(keys)) for name, v in rows.items()}, batch_size=[len(keys)]
    )


def check_keys(keys: Sequence[str]) -> list[str]:
    keys = list(keys)
    if not keys:
        raise ValueError("keys must not be empty.")
    if not all(isinstance(k, str) and k for k in keys):
        raise TypeError("keys must be non-empty strings.")
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"duplicate keys: {dup[:8]}.")
    return keys


def from_batch(td: TensorDict, keys: list[str], fields: list[str]) -> dict[str, list[torch.Tensor]]:
    out: dict[str, list[torch.Tensor]] = {}
    for f in fields:
        v = td.get(f)
        if not isinstance(v, torch.Tensor):
            raise DataPlaneError(f"field {f!r} came back as {type(v).__name__}, not a tensor.")
        out[f] = column_samples(v.cpu())
    return out


def column_samples(column: torch.Tensor) -> list[torch.Tensor]:
    """A TQ column -> its per-sample tensors (views): a jagged column is split in one op, not unbound
    through the nested-tensor dispatch (~10x slower)."""
    if not column.is_nested:
        return list(column.unbind(0))
    values, offsets = getattr(column, "_values", None), getattr(column, "_offsets", None)
    if column.layout == torch.jagged and getattr(column, "_lengths", 0) is None and values is not None \
            and offsets is not None:
        # the private buffers: the public values()/offsets() go through the nested-tensor dispatch too
        return list(values.split_with_sizes(offsets.diff().tolist()))
    return list(column.unbind())
