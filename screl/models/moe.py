"""Mixture-of-experts policies, and rollout routing replay (R3) on their routers.

:class:`TinyMoECausalLM` is a tiny Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM``) over the character tokenizer,
built in memory from its config (no download): every decoder layer's MLP is a sparse block whose router sends each
token to its top-k of ``num_experts`` experts.

Routing replay: a tiny numeric difference between the engine's forward and the trainer's (bf16 against fp32, another
kernel) can flip a token's top-k choice, and a flipped expert changes that token's logprob far more than rounding
does. :func:`record_routing` captures the experts each router chose, per forward call; :func:`replay_routing` makes
the routers choose given experts instead, their own gate still weighting them (the router class's own gate, taken at
the forced experts). Replay is exact or refused: only router classes in :data:`REPLAYS`, each with the function that
reproduces its forward op for op (Qwen2-MoE, Qwen3-MoE, OLMoE, Mixtral); :func:`replay_problem` names any other.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
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


ReplayFn = Callable[[Any, Tensor, "Tensor | None"], tuple[Tensor, Tensor, Tensor]]
"""A router class's forward with forced experts: ``(router, hidden, forced)`` to the class forward's ``(logits,
weights of the chosen experts, chosen experts)``; ``forced`` None: the class forward itself, op for op."""


def _choose(probs: Tensor, top_k: int, forced: Tensor | None) -> tuple[Tensor, Tensor]:
    """``torch.topk(probs, top_k)``, or the ``forced`` experts and their probabilities (a row of -1: top-k's)."""
    top, index = torch.topk(probs, top_k, dim=-1)
    if forced is None:
        return top, index
    if tuple(forced.shape) != (probs.shape[0], top_k):
        raise ValueError(f"routing replay: the forced experts have shape {tuple(forced.shape)}, the router sees "
                         f"{probs.shape[0]} tokens x top_k {top_k}")
    forced = forced.to(device=probs.device, dtype=torch.long)
    own = (forced < 0).any(-1, keepdim=True)  # a token without recorded experts (-1) keeps the router's choice
    index = torch.where(own, index, forced)
    return probs.gather(-1, index), index  # forced == top-k's own: gathers the very values top-k returned


def _softmax_topk(router: Any, hidden: Tensor, forced: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``Qwen2MoeTopKRouter`` / ``Qwen3MoeTopKRouter`` / ``OlmoeTopKRouter``: an fp32 softmax over the logits,
    top-k, renormalized only when ``norm_topk_prob``, cast to the logits' dtype."""
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    probs = torch.nn.functional.softmax(logits, dtype=torch.float, dim=-1)
    top, index = _choose(probs, router.top_k, forced)
    if router.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(logits.dtype), index


def _mixtral(router: Any, hidden: Tensor, forced: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """``MixtralTopKRouter``: softmax over the logits cast to fp32, top-k, always renormalized (the class has no
    ``norm_topk_prob``), the weights left in fp32 (the experts cast their product back)."""
    hidden = hidden.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden, router.weight)
    probs = torch.nn.functional.softmax(logits.float(), dim=-1)
    top, index = _choose(probs, router.top_k, forced)
    return logits, top / top.sum(dim=-1, keepdim=True), index


_HF = "transformers.models."
REPLAYS: dict[str, ReplayFn] = {
    _HF + "qwen2_moe.modeling_qwen2_moe.Qwen2MoeTopKRouter": _softmax_topk,
    _HF + "qwen3_moe.modeling_qwen3_moe.Qwen3MoeTopKRouter": _softmax_topk,
    _HF + "olmoe.modeling_olmoe.OlmoeTopKRouter": _softmax_topk,
    _HF + "mixtral.modeling_mixtral.MixtralTopKRouter": _mixtral,
}
"""The routers routing replay supports: the router class (its module and name, exactly: a subclass may route
otherwise) to the function that computes its forward with forced experts. Each entry is proven by
``tests/models/test_moe_replay.py``: replaying a tiny model's own choices gives its own logits bit for bit (fp32).
Any other router is refused (:func:`replay_problem`): a replay that computes another gate would make the engine
and the trainer both run a model that is not the checkpoint's, and the mismatch metric could not see it."""


def _class_path(obj: object) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def replay_problem(model: torch.nn.Module) -> str | None:
    """Why routing replay cannot reproduce ``model``'s routing exactly (naming the router and its MoE block
    class), or None: every router's class is in :data:`REPLAYS` and no block perturbs its input at training."""
    supported = ", ".join(sorted(k.rsplit(".", 1)[1] for k in REPLAYS))
    routers = moe_routers(model)
    if not routers:
        blocks = sorted({type(m).__name__ for m in model.modules() if hasattr(m, "experts")})
        return (f"{type(model).__name__} has no top-k router routing replay knows (MoE blocks: {blocks or 'none'}; "
                f"supported routers: {supported})")
    parent = {id(child): m for m in model.modules() for child in m.children()}
    for router in routers:
        block = parent.get(id(router))
        if _class_path(router) not in REPLAYS:
            return (f"its router {type(router).__name__} (in {type(block).__name__}) computes a gate routing replay "
                    f"does not reproduce exactly (supported routers: {supported})")
        jitter = float(getattr(block, "jitter_noise", 0.0) or 0.0)
        if jitter > 0:
            return (f"{type(block).__name__} multiplies its input by random jitter at training "
                    f"(router_jitter_noise={jitter}): the trainer's forward would not be the engine's")
    return None


def config_replay_problem(config: Any) -> str | None:
    """:func:`replay_problem` of the causal LM a Hugging Face config describes, built on the meta device (no
    memory, no weights); None also when the auto class does not know the config (the trainer checks the model)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError):
        return None
    return replay_problem(model)


def _routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """:func:`moe_routers`, refusing a router class not in :data:`REPLAYS` (the trainer's and ``screl check``'s
    :func:`replay_problem` has said why already; this guards every other caller, at every forward)."""
    routers = moe_routers(model)
    unknown = sorted({type(r).__name__ for r in routers if _class_path(r) not in REPLAYS})
    if unknown:
        raise ValueError(f"routing replay: router {unknown} is not one routing replay reproduces exactly "
                         f"(screl.models.moe.REPLAYS)")
    return routers


@contextlib.contextmanager
def record_routing(model: torch.nn.Module) -> Iterator[list[list[Tensor]]]:
    """Within the block, every router appends the experts it chose at each call: ``calls[layer][i]`` is
    ``[tokens, top_k]`` (int64) of the layer's ``i``-th forward call."""
    routers = _routers(model)
    calls: list[list[Tensor]] = [[] for _ in routers]
    with _patched(routers, lambda layer, router, hidden: _record(calls[layer], router, hidden)):
        yield calls


def _record(into: list[Tensor], router: Any, hidden: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    out = type(router).forward(router, hidden)  # the class's own forward: what is recorded is what it computes
    into.append(out[2].detach().clone())
    return out  # type: ignore[no-any-return]


@contextlib.contextmanager
def replay_routing(model: torch.nn.Module, forced: Sequence[Tensor]) -> Iterator[None]:
    """Within the block, router ``layer`` chooses the experts ``forced[layer]`` (``[tokens, top_k]``, the tokens of
    the one forward call the block holds, in the order the router sees them) instead of its own top-k; a token whose
    row holds -1 keeps the router's own choice."""
    routers = _routers(model)
    if len(forced) != len(routers):
        raise ValueError(f"routing replay: experts for {len(forced)} layer(s), the model routes in {len(routers)}")
    with _patched(routers, lambda layer, r, hidden: REPLAYS[_class_path(r)](r, hidden, forced[layer])):
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
