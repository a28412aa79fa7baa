"""The torch engine's batch state and sampling (:mod:`screl.rollout.engines.torch_engine`'s request loop).

A :class:`Row` is one request's decode state (its tokens, logprobs, per-token versions, finish); a :class:`Batch`
holds the tensors of the rows decoded together: their sampling parameters, their uniforms and the KV-cache state.
:func:`sample_step` draws one token for every unfinished row by inverse CDF of its filtered distribution, and
records its logprob (``log_softmax(logits / T)``), weight version and finish.

Invariant: a row's tokens depend on its seed, prompt and weights only, never on its batch mates: each row draws
from its own ``torch.Generator`` (seeded by ``SamplingParams.seed``), and every mask and filter is per row.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

import torch

from screl.rollout.engines.protocol import FinishReason, GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.engines.routing import RoutingRecorder
from screl.rollout.engines.stop_tokens import StopTokens


@dataclass
class Row:
    """Decode state of one request."""

    req: GenerationRequest
    uniforms: torch.Tensor
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    start_version: int | None = None
    stop_token: int | None = None
    routing: torch.Tensor | None = None  # [positions, MoE layers, top_k]: see screl.rollout.engines.routing

    @property
    def sampling(self) -> SamplingParams:
        return self.req.sampling


@dataclass
class Batch:
    """Per-batch tensors of the sampling parameters and the KV-cache state."""

    temps: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_new: torch.Tensor
    stop_mask: torch.Tensor
    uniforms: torch.Tensor  # [rows, steps]: each row's draws, padded with its last
    cache: Any = None
    static: Any = None  # the static-cache path's decoder (StaticDecoder, or the Megatron engine's)
    attn: torch.Tensor | None = None
    next_pos: torch.Tensor | None = None
    dropped: bool = False  # the KV cache was freed in a stand-down: re-prefill before the next step
    rope_delta: torch.Tensor | None = None  # a vision-language model: each row's multimodal rotary offset [rows, 1]
    filtered: bool = True  # some row has a top-k or top-p (needs_filter): else the filter is skipped, no sync


def check_prompt(req: GenerationRequest, vocab_size: int) -> None:
    """Refuse an empty prompt, or one with token ids outside the vocabulary."""
    if len(req.prompt_token_ids) == 0:
        raise ValueError(f"generate: request {req.request_id!r} has an empty prompt.")
    bad = [t for t in req.prompt_token_ids if not 0 <= int(t) < vocab_size]
    if bad:
        raise ValueError(
            f"generate: request {req.request_id!r} has token ids outside the vocabulary: {bad[:5]}."
        )


def refuse_images(req: GenerationRequest, vision: bool, model: Any) -> None:
    """Refuse a request that carries images when the model has no vision tower."""
    if req.vision is not None and not vision:
        raise ValueError(f"generate: request {req.request_id!r} carries images, and {type(model).__name__} "
                         "has no vision tower (use a vision-language policy: screl.models.HFVisionLM)")


def new_row(req: GenerationRequest, stops: StopTokens, seed_rng: random.Random,
            routing: RoutingRecorder | None) -> Row:
    """A checked request's row: its uniforms from its own generator (seeded by its seed, else by ``seed_rng``)."""
    sp = req.sampling
    seed = sp.seed if sp.seed is not None else seed_rng.getrandbits(63)
    gen = torch.Generator().manual_seed(seed)
    uniforms = torch.rand(sp.max_new_tokens, generator=gen, dtype=torch.float64)
    stop = stops.for_request(sp.stop_token_ids, sp.ignore_eos)
    record = routing.empty(len(req.prompt_token_ids) + sp.max_new_tokens) if routing else None
    return Row(req=req, uniforms=uniforms, stop_ids=stop, routing=record)


def batch_params(rows: list[Row], dev: torch.device, n_vocab: int) -> Batch:
    """The sampling-parameter tensors of ``rows`` on ``dev`` (no KV cache yet)."""
    stop_mask = torch.zeros(len(rows), n_vocab, dtype=torch.bool)
    for i, r in enumerate(rows):
        ids = [t for t in r.stop_ids if 0 <= t < n_vocab]
        stop_mask[i, ids] = True
    steps = max(len(r.uniforms) for r in rows)
    uniforms = torch.stack([torch.cat([r.uniforms, r.uniforms[-1:].expand(steps - len(r.uniforms))])
                            for r in rows]).to(dev)
    return Batch(
        uniforms=uniforms,
        temps=torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=dev),
        top_p=torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=dev),
        top_k=torch.tensor([r.sampling.top_k or n_vocab for r in rows], dtype=torch.long, device=dev),
        min_new=torch.tensor([r.sampling.min_new_tokens for r in rows], dtype=torch.long, device=dev),
        stop_mask=stop_mask.to(dev),
        filtered=needs_filter(rows, n_vocab),
    )


def sample_step(rows: list[Row], batch: Batch, logits: torch.Tensor, version: int, vocab_size: int,
                banned: torch.Tensor | None) -> None:
    """Sample one token for every unfinished row and record logprob, version and finish (``banned``: tokens
    never sampled)."""
    step = len(next(r for r in rows if r.finish is None).tokens)
    u = batch.uniforms[:, min(step, batch.uniforms.shape[1] - 1)]
    tokens, tok_logp = draw(logits, batch, u, step, banned, batch.filtered)
    for r, t, lp in zip(rows, tokens.tolist(), tok_logp.tolist(), strict=True):
        if r.finish is not None:
            continue
        r.tokens.append(t)
        r.logprobs.append(lp)
        r.versions.append(version)
        if t in r.stop_ids and len(r.tokens) > r.sampling.min_new_tokens:
            r.finish, r.stop_token = "stop", t
        elif len(r.tokens) >= r.sampling.max_new_tokens:
            r.finish = "length"


def row_result(r: Row, end_version: int, stops: StopTokens) -> GenerationResult:
    """A row's result (an unfinished row is an abort; its start version, if it never started, ``end_version``)."""
    return GenerationResult(
        request_id=r.req.request_id,
        prompt_token_ids=[int(t) for t in r.req.prompt_token_ids],
        token_ids=r.tokens,
        logprobs=r.logprobs,
        finish_reason=r.finish or "abort",
        weight_versions=r.versions,
        start_version=r.start_version if r.start_version is not None else end_version,
        end_version=end_version,
        stop_token_id=r.stop_token if r.finish == "stop" else None,
        stop_kind=(stops.kind(r.stop_token, r.sampling.ignore_eos)
                   if r.finish == "stop" and r.stop_token is not None else None),
        routing=(r.routing[: len(r.req.prompt_token_ids) + len(r.tokens)].clone()
                 if r.routing is not None else None),
        vision=r.req.vision,
    )


def draw(logits: torch.Tensor, params: Any, u: torch.Tensor, step: int | torch.Tensor, banned: torch.Tensor | None,
         filtered: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's token by inverse CDF at its uniform ``u`` of its filtered distribution, and the token's logprob
    (``log_softmax(logits / T)``), both on the logits' device (no host sync). ``params``: the rows' ``temps``,
    ``top_k``, ``top_p``, ``min_new`` and ``stop_mask`` tensors; ``step``: the tokens each row has (stop tokens are
    masked below ``min_new``); ``filtered``: some row has a top-k or top-p (decided on the host, not by a sync)."""
    vocab_size = logits.shape[-1]
    greedy = params.temps == 0
    scaled = logits / torch.where(greedy, torch.ones_like(params.temps), params.temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    proc = scaled.masked_fill(params.stop_mask & (step < params.min_new)[:, None], float("-inf"))
    if banned is not None:
        proc = proc.masked_fill(banned, float("-inf"))
    if filtered:
        proc = filter_top_k_top_p(proc, params.top_k, params.top_p)
    probs = torch.softmax(proc, dim=-1).double()
    cdf = probs.cumsum(dim=-1)
    target = ((1.0 - u) * cdf[:, -1])[:, None]
    sampled = torch.searchsorted(cdf, target).squeeze(1).clamp(max=vocab_size - 1)
    tokens = torch.where(greedy, proc.argmax(dim=-1), sampled)
    return tokens, logp.gather(1, tokens[:, None]).squeeze(1)


def needs_filter(rows: list[Row], vocab_size: int) -> bool:
    """Whether any row has a top-k below the vocabulary or a top-p below 1 (from the host's parameters)."""
    return any((r.sampling.top_k or vocab_size) < vocab_size or r.sampling.top_p < 1 for r in rows)


def filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus (no host sync: the caller
    skips it when no row filters, :func:`needs_filter`)."""
    n_vocab = logits.shape[-1]
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(n_vocab, device=logits.device)[None, :]
    drop_sorted = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted |= (mass_before >= top_p[:, None]) & (ranks > 0)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
