"""A refit bucket's way through vLLM's ``collective_rpc``: cut into raw-byte pieces, put back together.

:func:`bucket_pieces` lays a bucket's tensors end to end and cuts the bytes into pieces of at most
:data:`RPC_PIECE_BYTES` (the first piece carries the names, dtypes, shapes and sizes); :class:`BucketAssembler`, in
vLLM's worker (:class:`~screl.rollout.engines.vllm_worker.ScrelWorkerExtension`), fills one flat buffer per bucket
from them and hands back the bucket's tensors once its last piece is in.

Invariant: the tensors come back bit for bit (names, dtypes, shapes, values); pieces must arrive in order, and a
new bucket may not begin before the last one is whole.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

#: Bytes of tensor data per ``collective_rpc`` of a refit. Every process on the way (vLLM's EngineCore relays the
#: call to its worker process) copies a call's payload a few times, so pieces, not whole buckets, bound that.
RPC_PIECE_BYTES = 16 * 2**20


def bucket_pieces(bucket: Mapping[str, torch.Tensor],
                  piece_bytes: int = RPC_PIECE_BYTES) -> Iterator[tuple[list[Any] | None, int, bytes]]:
    """A bucket as ``screl_refit_piece`` arguments: ``(meta, offset, data)`` pieces of at most ``piece_bytes`` of
    the bucket's tensors laid end to end; the first piece carries ``meta`` (names, dtype names, shapes, byte
    sizes), the others None. Each piece is copied out of the tensors only when drawn."""
    flats = [(name, t.detach().to("cpu").contiguous()) for name, t in bucket.items()]
    meta: list[Any] = [[n for n, _ in flats], [str(t.dtype).removeprefix("torch.") for _, t in flats],
                       [list(t.shape) for _, t in flats], [t.numel() * t.element_size() for _, t in flats]]
    views = [t.reshape(-1).view(torch.uint8).numpy().data if t.numel() else memoryview(b"") for _, t in flats]
    total = sum(meta[3])
    offset = 0
    while True:
        end = min(total, offset + piece_bytes)
        parts, pos = [], 0
        for view in views:  # the slices of [offset, end) in each tensor
            lo, hi = max(offset, pos), min(end, pos + len(view))
            if lo < hi:
                parts.append(view[lo - pos:hi - pos])
            pos += len(view)
        yield (meta if offset == 0 else None), offset, b"".join(parts)
        offset = end
        if offset >= total:
            return


class BucketAssembler:
    """The receiving end of :func:`bucket_pieces`: one flat buffer per bucket, filled piece by piece; the whole
    bucket's tensors (views of that buffer) once the last piece is in."""

    def __init__(self) -> None:
        self._meta: list[Any] | None = None
        self._buf: torch.Tensor | None = None
        self._filled = 0

    def feed(self, meta: list[Any] | None, offset: int, data: bytes) -> list[tuple[str, torch.Tensor]] | None:
        if meta is not None:
            if self._meta is not None:
                raise RuntimeError("refit: a new bucket began before the last one was whole")
            self._meta, self._buf, self._filled = meta, torch.empty(sum(meta[3]), dtype=torch.uint8), 0
        if self._meta is None or self._buf is None or offset != self._filled:
            raise RuntimeError(f"refit: a piece at byte {offset} out of order (expected {self._filled})")
        if len(data):
            with warnings.catch_warnings():  # read-only bytes: only read here
                warnings.simplefilter("ignore", UserWarning)
                self._buf[offset:offset + len(data)] = torch.frombuffer(data, dtype=torch.uint8)
        self._filled += len(data)
        if self._filled < self._buf.numel():
            return None
        (names, dtypes, shapes, sizes), buf = self._meta, self._buf
        self._meta, self._buf = None, None
        out, pos = [], 0
        for name, dtype, shape, size in zip(names, dtypes, shapes, sizes, strict=True):
            torch_dtype = getattr(torch, dtype)
            raw = buf[pos:pos + size]
            if pos % torch_dtype.itemsize:  # a view must start at a multiple of its element size
                raw = raw.clone()
            out.append((name, raw.view(torch_dtype).reshape(shape)))
            pos += size
        return out
