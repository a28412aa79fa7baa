"""The torch engine's static-cache decode path for Qwen2- and Llama-style Hugging Face models (docs/generation.md,
"The torch backend's decode path").

On a CPU a small model's decode step is mostly Python and dispatch: Hugging Face's forward makes ~30 module calls,
a ``torch.cat`` per layer per step into its ``DynamicCache`` and a new mask every step (~1.1 ms a step for the
77k-parameter tiny model, most of it not arithmetic). :class:`StaticDecoder` runs the same network on the same
parameter tensors (a refit that copies into the model is seen at once) with a KV cache preallocated per batch and
written in place, the rotary table computed once per batch, one validity buffer sliced per step and turned into an
additive attention bias once a forward pass (not a boolean mask SDPA converts in every layer), decode steps'
grouped-query attention folded into the query axis (no KV copy), and the layers called as functions.

Invariant: its logits equal Hugging Face's to fp32 round-off (``tests/rollout/test_static_decode.py``).
:func:`static_decode_support` says which models it runs; the engine uses it when ``backend_args.decode`` is
``auto`` (its log says which path runs) or ``static`` (an unsupported model is then an error naming the key).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from screl.rollout.engines.sdpa_attention import additive_bias, decode_attention

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")


def static_decode_support(model: Any) -> str | None:
    """None when :class:`StaticDecoder` can run ``model``, else why not (one line)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return f"model_type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} (only silu)"
    layer_types = getattr(config, "layer_types", None) or []
    if getattr(config, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
        return "sliding-window attention"
    inner = getattr(model, "model", None)
    if inner is None or not all(hasattr(inner, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} does not have the model.embed_tokens/layers/norm/rotary_emb layout"
    if getattr(model, "lm_head", None) is None:
        return f"{type(model).__name__} has no lm_head"
    if getattr(inner.rotary_emb, "rope_type", "default") == "dynamic":
        return "dynamic RoPE (its table depends on the sequence length)"
    return None


STATIC_ATTENTION_PATH = ("sdpa with an additive bias built once a forward pass, no boolean mask (prefill: [rows, 1, W, "
                         "W] causal and padding, enable_gqa; decode: [rows, 1, 1, keys] padding, GQA folded into the "
                         "query axis, no KV copy); a left-padded batch needs the bias, so the flash kernel cannot take "
                         "it: the continuous path is the GPU's")
"""The start-up line's words for the static path's attention."""


@dataclass
class _Layer:
    """One decoder layer's tensors (the model's own parameters, not copies)."""

    ln1: Tensor
    ln1_eps: float
    wq: Tensor
    bq: Tensor | None
    wk: Tensor
    bk: Tensor | None
    wv: Tensor
    bv: Tensor | None
    wo: Tensor
    bo: Tensor | None
    ln2: Tensor
    ln2_eps: float
    w_gate: Tensor
    w_up: Tensor
    w_down: Tensor
    q_norm: Tensor | None = None  # Qwen3: an RMSNorm over each head's query and key, before the rotary embedding
    k_norm: Tensor | None = None
    qk_eps: float = 1e-6

    def qk(self, q: Tensor, k: Tensor) -> tuple[Tensor, Tensor]:
        """``q``/``k`` ``[rows, n, heads, head_dim]`` after the layer's per-head norms (Qwen3; others: as given)."""
        if self.q_norm is None or self.k_norm is None:
            return q, k
        return _rms_norm(q, self.q_norm, self.qk_eps), _rms_norm(k, self.k_norm, self.qk_eps)


class StaticDecoder:
    """Prefill and decode of a Qwen2/Llama-style model over one batch, with a static KV cache.

    ``start`` prefills left-padded sequences (allocating the cache for ``capacity`` positions); ``step``
    decodes one token per row. Both return the last position's logits, as float32.
    """

    def __init__(self, model: Any) -> None:
        why = static_decode_support(model)
        if why is not None:
            raise ValueError(f"the static-cache decode path cannot run this model: {why}")
        self.model = model
        cfg = model.config
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.scale = self.head_dim ** -0.5
        inner = model.model
        self.embed = inner.embed_tokens.weight
        self.norm, self.norm_eps = inner.norm.weight, float(inner.norm.variance_epsilon)
        self.lm_head_w = model.lm_head.weight
        self.lm_head_b = getattr(model.lm_head, "bias", None)
        self.rotary = inner.rotary_emb
        self.layers = [self._layer(layer) for layer in inner.layers]
        self._k: list[Tensor] = []
        self._v: list[Tensor] = []
        self._valid: Tensor | None = None  # [rows, capacity]: key positions that hold a real token
        self._cos: Tensor | None = None
        self._sin: Tensor | None = None
        self._pos: Tensor | None = None  # next position id per row
        self._len = 0  # cache slots filled (same for every row: rows are left-padded)

    @staticmethod
    def _layer(layer: Any) -> _Layer:
        att, mlp = layer.self_attn, layer.mlp
        return _Layer(
            ln1=layer.input_layernorm.weight, ln1_eps=float(layer.input_layernorm.variance_epsilon),
            wq=att.q_proj.weight, bq=att.q_proj.bias, wk=att.k_proj.weight, bk=att.k_proj.bias,
            wv=att.v_proj.weight, bv=att.v_proj.bias, wo=att.o_proj.weight, bo=att.o_proj.bias,
            ln2=layer.post_attention_layernorm.weight, ln2_eps=float(layer.post_attention_layernorm.variance_epsilon),
            w_gate=mlp.gate_proj.weight, w_up=mlp.up_proj.weight, w_down=mlp.down_proj.weight,
            **_qk_norms(att),
        )

    @torch.inference_mode()
    def start(self, ids: Tensor, attention_mask: Tensor, capacity: int) -> Tensor:
        """Prefill ``ids`` ``[rows, width]`` (left-padded, ``attention_mask`` 1 on real tokens) and make room for
        ``capacity`` positions in all; returns the last position's logits ``[rows, vocab]``."""
        rows, width = ids.shape
        if capacity < width:
            raise ValueError(f"capacity {capacity} is shorter than the prompts ({width})")
        dev, dtype = self.embed.device, self.embed.dtype
        shape = (rows, self.num_kv_heads, capacity, self.head_dim)
        self._k = [torch.empty(shape, device=dev, dtype=dtype) for _ in self.layers]
        self._v = [torch.empty(shape, device=dev, dtype=dtype) for _ in self.layers]
        valid = torch.zeros((rows, capacity), dtype=torch.bool, device=dev)
        valid[:, :width] = attention_mask.bool()
        self._valid = valid
        positions = torch.arange(capacity, device=dev)[None, :]
        cos, sin = self.rotary(self.embed[:1][None], positions)
        self._cos, self._sin = cos[0], sin[0]  # [capacity, head_dim]
        pos = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        self._pos = attention_mask.long().sum(-1)
        causal = torch.ones((width, width), dtype=torch.bool, device=dev).tril()
        mask = causal[None] & valid[:, None, :width]
        mask |= torch.eye(width, dtype=torch.bool, device=dev)[None]  # a pad query attends to itself: no NaN
        self._len = 0
        return self._forward(ids, pos, mask[:, None])

    @torch.inference_mode()
    def step(self, ids: Tensor) -> Tensor:
        """Decode one token per row (``ids`` ``[rows]``); returns the logits ``[rows, vocab]``."""
        assert self._valid is not None and self._pos is not None, "start() first"
        if self._len >= self._valid.shape[1]:
            raise RuntimeError(f"the static KV cache is full ({self._len} positions)")
        self._valid[:, self._len] = True
        pos = self._pos[:, None]
        self._pos = self._pos + 1
        mask = self._valid[:, None, None, : self._len + 1]
        return self._forward(ids[:, None], pos, mask)

    def _forward(self, ids: Tensor, pos: Tensor, mask: Tensor) -> Tensor:
        assert self._cos is not None and self._sin is not None
        rows, n = ids.shape
        start, end = self._len, self._len + n
        h = F.embedding(ids, self.embed)
        # once a forward, not in every layer (SDPA would turn a boolean mask into this bias at each call)
        bias = additive_bias(mask, self._k[0].dtype)
        cos = self._cos[pos][:, None]  # [rows, 1, n, head_dim]
        sin = self._sin[pos][:, None]
        half = self.head_dim // 2
        width = self.num_heads * self.head_dim
        for i, L in enumerate(self.layers):
            x = _rms_norm(h, L.ln1, L.ln1_eps)
            q, k = L.qk(F.linear(x, L.wq, L.bq).view(rows, n, self.num_heads, self.head_dim),
                        F.linear(x, L.wk, L.bk).view(rows, n, self.num_kv_heads, self.head_dim))
            q, k = q.transpose(1, 2), k.transpose(1, 2)
            v = F.linear(x, L.wv, L.bv).view(rows, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + torch.cat((-q[..., half:], q[..., :half]), dim=-1) * sin
            k = k * cos + torch.cat((-k[..., half:], k[..., :half]), dim=-1) * sin
            self._k[i][:, :, start:end] = k
            self._v[i][:, :, start:end] = v
            if n == 1:  # a decode step: each KV head's query group folded into the query axis (no KV repeat)
                att = decode_attention(q, self._k[i][:, :, :end], self._v[i][:, :, :end], bias, self.scale)
            else:
                att = F.scaled_dot_product_attention(
                    q, self._k[i][:, :, :end], self._v[i][:, :, :end], attn_mask=bias, scale=self.scale,
                    enable_gqa=self.num_kv_heads != self.num_heads,
                )
            h = h + F.linear(att.transpose(1, 2).reshape(rows, n, width), L.wo, L.bo)
            x = _rms_norm(h, L.ln2, L.ln2_eps)
            h = h + F.linear(F.silu(F.linear(x, L.w_gate)) * F.linear(x, L.w_up), L.w_down)
        self._len = end
        last = _rms_norm(h[:, -1], self.norm, self.norm_eps)
        return F.linear(last, self.lm_head_w, self.lm_head_b).float()


def _qk_norms(att: Any) -> dict[str, Any]:
    """A Qwen3 attention's per-head query and key norms (``q_norm``, ``k_norm``); none for other layouts."""
    q_norm, k_norm = getattr(att, "q_norm", None), getattr(att, "k_norm", None)
    if q_norm is None or k_norm is None:
        return {}
    return {"q_norm": q_norm.weight, "k_norm": k_norm.weight, "qk_eps": float(q_norm.variance_epsilon)}


def _rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's RMSNorm: the statistics in float32, the result cast back before the weight."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)
