"""Attention of the continuous decode path on ``torch.nn.functional.scaled_dot_product_attention``, with grouped
query heads and no copy of the KV heads.

Prefill (:func:`prefill_attention`): one row's sequence from position 0 into its own slot, so ``is_causal=True``
is exact: no mask at all, grouped heads by ``enable_gqa`` (on a GPU the flash kernel takes both, and nothing of
``[rows, heads, W, W]`` is materialised). A prompt longer than the step's prefill budget goes in chunks; a chunk
after the first (:func:`chunk_attention`) attends to the slot's earlier positions and causally within itself:
causal aligned to the lower right (``torch.nn.attention.bias.causal_lower_right``), which the flash and
memory-efficient kernels take as a kernel option, not a mask (the CPU's math path builds it).

Decode (:func:`decode_attention`): one query a row over that row's slot. The query heads that share a KV head are
folded into the query-length axis (``[rows, kv_heads, group, head_dim]``), which is exact for one query position:
SDPA sees as many heads as the KV cache has, so the KV heads are never repeated and ``enable_gqa`` is not needed.
The rows of a step have different lengths and SDPA takes no per-row key lengths, so this one path adds a bias, not
a boolean mask: ``[rows, 1, 1, keys]`` in the compute dtype, 0 on each row's valid positions and -inf past them
(:func:`length_bias`), built once per step on the device from the rows' positions (a CUDA graph's step builds it
inside the graph) and broadcast over heads and the folded group. SDPA would turn a boolean mask into such a bias in
every layer; on a GPU the memory-efficient kernel takes the bias as it is (flash takes none).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

ATTENTION_PATH = ("sdpa (prefill: is_causal, no mask, GQA without a KV copy, later chunks lower-right causal; decode: "
                  "GQA folded into the query axis, no KV copy, a [rows, 1, 1, keys] additive length bias built once "
                  "a step on the device, no boolean mask)")
"""The start-up line's words for the attention path."""


def prefill_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """Causal attention of a sequence that starts at position 0: ``q`` ``[rows, heads, n, d]``, ``k``/``v``
    ``[rows, kv_heads, n, d]``; returns ``[rows, heads, n, d]``."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> Tensor:
    """A prefill chunk of ``n`` positions after ``s - n`` cached ones: ``q`` ``[1, heads, n, d]`` over ``k``/``v``
    ``[1, kv_heads, s, d]`` (the slot's positions up to the chunk's end); query ``i`` sees keys ``0 .. s - n + i``."""
    # imported here: its import imports torch._dynamo (~1 CPU-s), which `screl check` (the engine's capabilities)
    # does without
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale,
                                          enable_gqa=k.shape[1] != q.shape[1])


def decode_attention(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, scale: float) -> Tensor:
    """One query a row: ``q`` ``[rows, heads, 1, d]`` over ``k``/``v`` ``[rows, kv_heads, keys, d]`` (views of the
    slots), ``bias`` ``[rows, 1, 1, keys]`` (:func:`length_bias`); returns ``[rows, heads, 1, d]``."""
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    folded = q.reshape(rows, kv_heads, heads // kv_heads, dim)  # head h uses KV head h // group, as repeat_kv
    out = F.scaled_dot_product_attention(folded, k, v, attn_mask=bias, scale=scale)
    return out.reshape(rows, heads, 1, dim)


def length_bias(lengths: Tensor, keys: int, dtype: torch.dtype) -> Tensor:
    """``[rows, 1, 1, keys]`` in ``dtype``: 0 where key ``j`` of row ``i`` is valid (``j < lengths[i]``), -inf past
    it; on the lengths' device, with no host read."""
    valid = torch.arange(keys, device=lengths.device)[None, :] < lengths[:, None]
    return additive_bias(valid, dtype)[:, None, None, :]


def additive_bias(valid: Tensor, dtype: torch.dtype) -> Tensor:
    """``valid``'s shape in ``dtype``: 0 where it is true, -inf where it is false (what SDPA would make of it as a
    boolean mask at every call)."""
    return torch.where(valid, torch.zeros((), dtype=dtype, device=valid.device), float("-inf"))
