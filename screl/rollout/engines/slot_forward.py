"""The continuous decode path's forward passes over a Qwen2- or Llama-style model's own parameters, into and out of
a :class:`~screl.rollout.engines.kv_cache.SlotKVCache`.

The network is :mod:`.static_decode`'s (the same layer tensors, RMSNorm and rotary table, so a refit that copies
into the model is seen at once); what differs is the cache and the attention (:mod:`.sdpa_attention`):
:meth:`SlotForward.prefill` runs one row's sequence (or a chunk of it) into its slot, :meth:`SlotForward.decode` one
token for every slot ``0 .. hi - 1`` at its own position (a view of the slots, no gather).

Invariant: both return fp32 logits of each row's last position, equal to Hugging Face's forward to fp32 round-off
(``tests/rollout/test_continuous.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from screl.rollout.engines.kv_cache import CacheShape, SlotKVCache
from screl.rollout.engines.sdpa_attention import (
    chunk_attention,
    decode_attention,
    length_bias,
    prefill_attention,
)
from screl.rollout.engines.static_decode import StaticDecoder, _Layer, _rms_norm

Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]


class SlotForward:
    """Prefill and decode steps of ``model`` on a slotted KV cache (see the module docstring)."""

    def __init__(self, model: Any) -> None:
        self.net = StaticDecoder(model)  # checks the model's layout; its layer tensors are the model's own
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        self._copy = getattr(model, "screl_decode_copy", None)  # a colocated engine's cast copy (DecodeCopy)

    def ready(self) -> None:
        """Before the forwards of a call, and after a wake: a colocated engine's cast copy of the trainer's
        weights is cast again where it was freed (a stand-down) or the masters changed (an optimizer step)."""
        if self._copy is not None:
            self._copy.ensure()

    def storage(self, cache: SlotKVCache) -> tuple[int, ...]:
        """Addresses a captured decode step reads (:mod:`.decode_graphs`): the cache's, and the weights' (a colocated
        engine's cast copy is allocated again after a stand-down; a refit copies in place and moves none)."""
        n = self.net
        return (cache.k[0].data_ptr(), n.embed.data_ptr(), n.layers[0].wq.data_ptr(), n.lm_head_w.data_ptr())

    def cache_shape(self, max_len: int, dtype: torch.dtype) -> CacheShape:
        n = self.net
        return CacheShape(layers=len(n.layers), kv_heads=n.num_kv_heads, head_dim=n.head_dim, max_len=max_len,
                          dtype=dtype)

    def _rope(self, max_len: int) -> tuple[Tensor, Tensor]:
        if self._cos is None or self._cos.shape[0] < max_len:
            positions = torch.arange(max_len, device=self.net.embed.device)[None, :]
            cos, sin = self.net.rotary(self.net.embed[:1][None], positions)
            self._cos, self._sin = cos[0], sin[0]
        assert self._sin is not None
        return self._cos, self._sin

    def prefill(self, cache: SlotKVCache, slot: int, ids: Tensor, start: int = 0) -> Tensor:
        """Forward ``ids`` ``[n]``, a row's positions ``start .. start + n - 1``, into ``slot`` (the positions before
        ``start`` are in the slot already); logits ``[vocab]`` of its last position."""
        n = ids.shape[0]
        end = start + n
        cos, sin = self._rope(cache.shape.max_len)

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = (t.to(cache.shape.dtype) for t in (q, k, v))  # the rotary table may have promoted them
            cache.k[i][slot, :, start:end] = k[0]
            cache.v[i][slot, :, start:end] = v[0]
            if start == 0:
                return prefill_attention(q, k, v, self.net.scale)
            return chunk_attention(q, cache.k[i][slot:slot + 1, :, :end], cache.v[i][slot:slot + 1, :, :end],
                                   self.net.scale)

        cache.lengths[slot] = end
        return self._run(ids[None], cos[start:end][None, None], sin[start:end][None, None], attend)[0]

    def decode(self, cache: SlotKVCache, ids: Tensor, pos: Tensor, keys: int) -> Tensor:
        """One token a slot: ``ids`` and ``pos`` ``[hi]`` (each slot's token and its position), ``keys`` at least
        one past the largest position; logits ``[hi, vocab]``. Slots that hold no live row decode junk at their
        position (never read: their position is rewritten by the next prefill or ignored)."""
        hi = ids.shape[0]
        cos, sin = self._rope(cache.shape.max_len)
        rows = torch.arange(hi, device=ids.device)
        bias = length_bias(pos + 1, keys, cache.shape.dtype)

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            q, k, v = (t.to(cache.shape.dtype) for t in (q, k, v))
            cache.k[i][rows, :, pos] = k[:, :, 0]
            cache.v[i][rows, :, pos] = v[:, :, 0]
            return decode_attention(q, cache.k[i][:hi, :, :keys], cache.v[i][:hi, :, :keys], bias, self.net.scale)

        return self._run(ids[:, None], cos[pos][:, None, None], sin[pos][:, None, None], attend)

    def _run(self, ids: Tensor, cos: Tensor, sin: Tensor, attend: Attend) -> Tensor:
        n_ = self.net
        rows, n = ids.shape
        h = F.embedding(ids, n_.embed)
        width = n_.num_heads * n_.head_dim
        for i, L in enumerate(n_.layers):
            x = _rms_norm(h, L.ln1, L.ln1_eps)
            q, k, v = self._qkv(x, L, cos, sin)
            att = attend(i, q, k, v)
            h = h + F.linear(att.transpose(1, 2).reshape(rows, n, width), L.wo, L.bo)
            x = _rms_norm(h, L.ln2, L.ln2_eps)
            h = h + F.linear(F.silu(F.linear(x, L.w_gate)) * F.linear(x, L.w_up), L.w_down)
        last = _rms_norm(h[:, -1], n_.norm, n_.norm_eps)
        return F.linear(last, n_.lm_head_w, n_.lm_head_b).float()

    def _qkv(self, x: Tensor, L: _Layer, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        n_ = self.net
        rows, n, _ = x.shape
        half = n_.head_dim // 2
        q, k = L.qk(F.linear(x, L.wq, L.bq).view(rows, n, n_.num_heads, n_.head_dim),
                    F.linear(x, L.wk, L.bk).view(rows, n, n_.num_kv_heads, n_.head_dim))
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = F.linear(x, L.wv, L.bv).view(rows, n, n_.num_kv_heads, n_.head_dim).transpose(1, 2)
        q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
        k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
        return q, k, v
