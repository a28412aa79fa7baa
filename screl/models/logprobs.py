"""Next-token logprobs of a Hugging Face causal LM without ``[tokens, vocabulary]`` logits.

A real policy has a vocabulary of 128k-152k tokens: the logits of 64 rows x 1.2k tokens alone are 47 GB in
fp32, and a plain ``log_softmax`` plus autograd keeps about three such tensors. :func:`chunked_token_logprobs`
runs the trunk once, then the output layer, the temperature, the log-softmax and the gather over chunks of
tokens; the backward pass recomputes each chunk's logits from the saved hidden states, so the peak is one
chunk's logits (``chunk_tokens x vocabulary``) whatever the batch. The values and gradients are those of the
full computation up to fp32 round-off (``tests/test_logprobs.py``).

``logprob_chunk_tokens`` (on ``GRPO``/``PPO``) sets the chunk: ``None`` sizes it automatically from the
vocabulary (:func:`auto_chunk_tokens`), ``0`` turns chunking off (full logits, for models whose output layer is
not a plain linear head).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor

AUTO_CHUNK_ELEMENTS = 2**25
"""The automatic chunk holds at most this many logits (128 MiB in fp32): 220 tokens at a 152k vocabulary."""

_HEAD_MODIFIERS = ("final_logit_softcapping", "logit_scale", "output_multiplier_scale", "logits_scaling")
"""Config fields of model families whose logits are not ``hidden @ head.T``: refused by the chunked path."""


def auto_chunk_tokens(vocab_size: int) -> int:
    """The automatic chunk: as many tokens as keep one chunk's fp32 logits within ``AUTO_CHUNK_ELEMENTS``."""
    return max(16, AUTO_CHUNK_ELEMENTS // max(vocab_size, 1))


class _ChunkedLogProb(torch.autograd.Function):
    """``logp[n] = log_softmax(hidden[n] @ weight.T / T)[labels[n]]`` chunk by chunk, recomputed in backward."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any, hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float, chunk: int,
        mm_dtype: torch.dtype, entropy_out: Tensor | None,
    ) -> Tensor:
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        w = weight.to(mm_dtype)
        for lo in range(0, n, chunk):
            hi = min(n, lo + chunk)
            # one [chunk, vocabulary] buffer, worked in place: logits -> z = logits - max -> exp(z)
            z = (hidden[lo:hi].to(mm_dtype) @ w.T).float()
            if temperature != 1.0:
                z.div_(temperature)
            label_logit = z.gather(-1, labels[lo:hi, None]).squeeze(-1)
            peak = z.amax(-1)
            z.sub_(peak[:, None])
            if entropy_out is not None:  # H = log S - sum(exp(z) z) / S, with S = sum(exp(z))
                p_z = z.exp()
                total = p_z.sum(-1)
                entropy_out[lo:hi] = total.log() - (p_z.mul_(z)).sum(-1) / total
                del p_z
            else:
                total = z.exp_().sum(-1)
            lse[lo:hi] = peak + total.log()
            logp[lo:hi] = label_logit - lse[lo:hi]
            del z
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.temperature, ctx.chunk, ctx.mm_dtype = temperature, chunk, mm_dtype
        return logp

    @staticmethod
    def backward(ctx: Any, grad_logp: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, labels, lse = ctx.saved_tensors
        temperature, chunk, mm_dtype = ctx.temperature, ctx.chunk, ctx.mm_dtype
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        w = weight.to(mm_dtype)
        g_all = grad_logp.float() / temperature
        for lo in range(0, hidden.shape[0], chunk):
            hi = min(hidden.shape[0], lo + chunk)
            h = hidden[lo:hi].to(mm_dtype)
            logits = (h @ w.T).float()
            if temperature != 1.0:
                logits.div_(temperature)
            # d logp / d logits = onehot(label) - softmax, times the incoming gradient over T (in place)
            probs = logits.sub_(lse[lo:hi, None]).exp_()
            g = g_all[lo:hi, None]
            dlogits = probs.mul_(-g)
            dlogits.scatter_add_(-1, labels[lo:hi, None], g)
            d = dlogits.to(mm_dtype)
            if grad_hidden is not None:
                grad_hidden[lo:hi] = (d @ w).to(hidden.dtype)
            if grad_weight is not None:
                if d.dtype == torch.float32:
                    grad_weight.addmm_(d.T, h)  # accumulated in place: no [vocabulary, hidden] temporary
                else:
                    grad_weight.add_((d.T @ h).float())
            del logits, probs, dlogits, d
        return (grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None,
                None, None, None, None, None)


def chunked_logprobs_of_hidden(
    hidden: Tensor, weight: Tensor, labels: Tensor, temperature: float = 1.0, chunk_tokens: int | None = None,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Logprobs ``[*labels.shape]`` (fp32) of ``labels`` under ``hidden @ weight.T / temperature``, in chunks.

    ``hidden``: ``[..., H]`` final hidden states; ``weight``: ``[V, H]`` the output layer. With ``with_entropy``
    also the policy's entropy per position (no gradient). The matmul runs in the autocast dtype when autocast is
    on, else in the wider of the two dtypes; the softmax always in fp32.
    """
    shape = labels.shape
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    chunk = chunk_tokens or auto_chunk_tokens(weight.shape[0])
    device_type = hidden.device.type
    if torch.is_autocast_enabled(device_type):
        mm_dtype = torch.get_autocast_dtype(device_type)
    else:
        mm_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    entropy = torch.empty(flat_y.shape[0], dtype=torch.float32, device=hidden.device) if with_entropy else None
    with torch.autocast(device_type, enabled=False):
        logp = _ChunkedLogProb.apply(flat_h, weight, flat_y, float(temperature), int(chunk), mm_dtype, entropy)
    return logp.reshape(shape), entropy.reshape(shape) if entropy is not None else None


def chunked_top_k_of_hidden(hidden: Tensor, weight: Tensor, k: int, temperature: float = 1.0,
                            chunk_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """The ``k`` most likely next tokens at each of ``hidden`` ``[N, H]``'s positions under ``hidden @ weight.T /
    temperature``, and their logprobs: ``(logprobs fp32 [N, k], ids int64 [N, k])``, chunk by chunk (one chunk's
    logits at a time, no gradient); ``k`` is capped at the vocabulary."""
    chunk = chunk_tokens or auto_chunk_tokens(weight.shape[0])
    k = min(k, weight.shape[0])
    mm_dtype = torch.promote_types(hidden.dtype, weight.dtype)
    top_lp = torch.empty(hidden.shape[0], k, dtype=torch.float32, device=hidden.device)
    top_ids = torch.empty(hidden.shape[0], k, dtype=torch.long, device=hidden.device)
    with torch.no_grad():
        for lo in range(0, hidden.shape[0], chunk):
            logits = (hidden[lo:lo + chunk].to(mm_dtype) @ weight.to(mm_dtype).T).float()
            if temperature != 1.0:
                logits = logits / temperature
            top_lp[lo:lo + chunk], top_ids[lo:lo + chunk] = torch.log_softmax(logits, dim=-1).topk(k, dim=-1)
    return top_lp, top_ids


def output_head(model: torch.nn.Module) -> torch.nn.Linear:
    """The model's output layer, when its logits are exactly ``hidden @ weight.T``; else a ``ValueError`` naming
    ``logprob_chunk_tokens: 0`` (full logits) as the way out."""
    getter: Any = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    config = getattr(model, "config", None)
    modifiers = [f for f in _HEAD_MODIFIERS if getattr(config, f, None) not in (None, 1.0)]
    if not isinstance(head, torch.nn.Linear) or head.bias is not None or modifiers:
        why = (f"its config sets {', '.join(modifiers)}" if modifiers
               else f"its output layer is {type(head).__name__}, not a bias-free torch.nn.Linear")
        raise ValueError(
            f"chunked logprobs need logits = hidden @ lm_head.weight.T, and {type(model).__name__} differs: {why}. "
            "Set model.init_args.logprob_chunk_tokens: 0 to compute full logits for this model"
        )
    return head


def chunked_token_logprobs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float,
    chunk_tokens: int | None = None, with_entropy: bool = False, inputs: Mapping[str, Tensor] | None = None,
) -> tuple[Tensor, Tensor | None]:
    """:func:`screl.modules.grpo.token_logprobs` without full-vocabulary logits: ``[rows, len - 1]`` logprobs
    (and the entropy per position with ``with_entropy``)."""
    head = output_head(model)
    trunk: Any = model.base_model
    hidden = trunk(input_ids=input_ids, attention_mask=attention_mask, **(inputs or {})).last_hidden_state[:, :-1]
    return chunked_logprobs_of_hidden(hidden, head.weight, input_ids[:, 1:], temperature, chunk_tokens,
                                      with_entropy)


def token_logprobs(
    model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float,
    chunk_tokens: int | None = None, inputs: Mapping[str, Tensor] | None = None,
) -> Tensor:
    """Logprob of each next token under the temperature-scaled policy: shape ``[rows, len - 1]``.

    ``inputs``: further forward inputs (a vision-language policy's position ids, pixel values and image grids:
    :mod:`screl.modules.vision_inputs`).

    ``chunk_tokens``: the output layer and the log-softmax run over chunks of this many tokens and are recomputed
    in the backward pass, so no ``[tokens, vocabulary]`` logits are ever held (:mod:`screl.models.logprobs`);
    None sizes the chunk from the vocabulary; 0 computes the full logits (:func:`full_token_logprobs`).
    """
    if chunk_tokens == 0:
        return full_token_logprobs(model, input_ids, attention_mask, temperature, inputs)
    return chunked_token_logprobs(model, input_ids, attention_mask, temperature, chunk_tokens, inputs=inputs)[0]


def full_token_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, temperature: float,
                        inputs: Mapping[str, Tensor] | None = None) -> Tensor:
    """:func:`token_logprobs` through the model's full logits (``logprob_chunk_tokens: 0``): about three
    ``[tokens, vocabulary]`` fp32 tensors live at once."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask, **(inputs or {})).logits[:, :-1].float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
