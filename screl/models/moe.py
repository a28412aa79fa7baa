"""Mixture-of-experts policies, and rollout routing replay (R3) on their routers.

:class:`TinyMoECausalLM` is a tiny Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM``) over the character tokenizer,
built in memory from its config (no download): every decoder layer's MLP is a sparse block whose router sends each
token to its top-k of ``num_experts`` experts.

Routing replay: a tiny numeric difference between the engine's forward and the trainer's (bf16 against fp32, another
kernel) can flip a token's top-k choice, and a flipped expert changes that token's logprob far more than rounding
does. :func:`record_routing` captures the experts each router chose, per forward call; :func:`replay_routing` makes
the routers choose given experts instead, their own gate still weighting them (softmax over the router's logits,
taken at the forced experts and renormalized as the model does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from screl.models.spec import PolicySpec, resolve_dtype
from screl.models.tiny import _COMMON
from screl.models.tokenizer import build_char_tokenizer, char_vocab


class TinyMoECausalLM(PolicySpec):
    """A random-init ``Qwen3MoeForCausalLM`` over the character tokenizer.

    Args:
        hidden_size: Model width.
        num_layers: Decoder layers (each with a sparse MLP).
        num_heads: Attention heads.
        num_kv_heads: Key/value heads.
        head_dim: Width of each attention head.
        num_experts: Experts per layer.
        top_k: Experts each token is routed to.
        moe_intermediate_size: Each expert's MLP width.
        max_position_embeddings: Longest prompt + completion.
        seed: Weight-init seed (the global RNG is left untouched).
        dtype: Parameter dtype.
    """

    def __init__(self, hidden_size: int = 64, num_layers: int = 2, num_heads: int = 4, num_kv_heads: int = 2,
                 head_dim: int = 16, num_experts: int = 4, top_k: int = 2, moe_intermediate_size: int = 64,
                 max_position_embeddings: int = 128, seed: int | None = 0, dtype: str = "float32") -> None:
        resolve_dtype(dtype)
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"TinyMoECausalLM: top_k={top_k} must be in [1, num_experts={num_experts}].")
        self.hidden_size, self.num_layers, self.num_heads, self.num_kv_heads = (
            hidden_size, num_layers, num_heads, num_kv_heads)
        self.head_dim, self.num_experts, self.top_k = head_dim, num_experts, top_k
        self.moe_intermediate_size, self.max_position_embeddings = moe_intermediate_size, max_position_embeddings
        self.seed, self.dtype = seed, dtype

    def build_config(self) -> Any:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(  # type: ignore[call-arg]  # head_dim: a config attribute the constructor takes
            vocab_size=len(char_vocab()), hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads, head_dim=self.head_dim,
            num_experts=self.num_experts, num_experts_per_tok=self.top_k,
            moe_intermediate_size=self.moe_intermediate_size, intermediate_size=self.moe_intermediate_size,
            max_position_embeddings=self.max_position_embeddings, decoder_sparse_step=1, norm_topk_prob=True,
            **_COMMON,
        )

    def build_model(self) -> Any:
        from transformers import Qwen3MoeForCausalLM

        cfg = self.build_config()
        with torch.random.fork_rng(devices=[]):
            if self.seed is not None:
                torch.manual_seed(self.seed)
            model = Qwen3MoeForCausalLM(cfg)
            # transformers leaves the router's weight at zero (every expert tied): draw it like the other layers
            with torch.no_grad():
                for router in moe_routers(model):
                    weight: Any = router.weight
                    weight.normal_(0.0, cfg.initializer_range * 10)
        return model.to(dtype=resolve_dtype(self.dtype))  # type: ignore[call-arg]  # transformers' wrapped .to

    def build_tokenizer(self) -> Any:
        return build_char_tokenizer()


def moe_routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's top-k routers, in layer order (modules with ``top_k``, ``num_experts`` and a ``weight``)."""
    return [m for m in model.modules()
            if hasattr(m, "top_k") and hasattr(m, "num_experts") and isinstance(getattr(m, "weight", None), Tensor)]


def _routed(router: Any, hidden: Tensor, forced: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """A router's (logits, weights of its chosen experts, chosen experts); ``forced``: the experts to choose."""
    hidden = hidden.reshape(-1, router.weight.shape[1])
    logits = F.linear(hidden, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    top, index = torch.topk(probs, router.top_k, dim=-1)
    if forced is not None:
        if tuple(forced.shape) != (hidden.shape[0], router.top_k):
            raise ValueError(f"routing replay: the forced experts have shape {tuple(forced.shape)}, the router sees "
                             f"{hidden.shape[0]} tokens x top_k {router.top_k}")
        forced = forced.to(device=logits.device, dtype=torch.long)
        own = (forced < 0).any(-1, keepdim=True)  # a token without recorded experts (-1) keeps the router's choice
        index = torch.where(own, index, forced)
        top = probs.gather(-1, index)
    if getattr(router, "norm_topk_prob", False):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[list[list[Tensor]]]:
    """Within the block, every router appends the experts it chose at each call: ``calls[layer][i]`` is
    ``[tokens, top_k]`` (int64) of the layer's ``i``-th forward call."""
    routers = moe_routers(model)
    calls: list[list[Tensor]] = [[] for _ in routers]
    with _patched(routers, lambda layer, router, hidden: _record(calls[layer], router, hidden)):
        yield calls


def _record(into: list[Tensor], router: Any, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    out = _routed(router, hidden, None)
    into.append(out[2].detach().clone())
    return out


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, forced: Sequence[Tensor]) -> Iterator[None]:
    """Within the block, router ``layer`` chooses the experts ``forced[layer]`` (``[tokens, top_k]``, the tokens of
    the one forward call the block holds, in the order the router sees them) instead of its own top-k; a token whose
    row holds -1 keeps the router's own choice."""
    routers = moe_routers(model)
    if len(forced) != len(routers):
        raise ValueError(f"routing replay: experts for {len(forced)} layer(s), the model routes in {len(routers)}")
    with _patched(routers, lambda layer, router, hidden: _routed(router, hidden, forced[layer])):
        yield


@contextlib.contextmanager
def _patched(routers: list[torch.nn.Module], forward: Any) -> Iterator[None]:
    if any("forward" in vars(r) for r in routers):
        raise RuntimeError("routing is already being recorded or replayed on this model (one block at a time)")
    try:
        for layer, router in enumerate(routers):
            router.forward = (lambda hidden, _l=layer, _r=router: forward(_l, _r, hidden))  # type: ignore[method-assign]
        yield
    finally:
        for router in routers:
            vars(router).pop("forward", None)  # the class's forward again


def replay_rows(model: torch.nn.Module, routing: Tensor) -> contextlib.AbstractContextManager[None]:
    """:func:`replay_routing` for one forward pass over collated rows: ``routing`` is ``[rows, length, layers,
    top_k]`` (a chunk's ``routing``, right-padded with -1) for input ids ``[rows, length]``."""
    rows, length, layers, k = routing.shape
    return replay_routing(model, [routing[:, :, layer].reshape(rows * length, k) for layer in range(layers)])
