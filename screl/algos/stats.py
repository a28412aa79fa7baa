"""Masked reductions over ``[B, T]`` token tensors and statistics of importance-sampling weights, shared by
the policy and value losses (pure torch)."""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = ["QUANTILES", "interpolated_quantiles", "masked_mean", "masked_var", "valid_mask", "weight_stats"]

#: The IS-weight quantiles reported (as ``is_weight_p10`` ...).
QUANTILES = (0.1, 0.5, 0.9)


def valid_mask(token_mask: Tensor, sample_mask: Tensor | None, shape: torch.Size) -> Tensor:
    """The ``[B, T]`` bool mask of trained tokens in kept rows (ValueError on a shape mismatch)."""
    if token_mask.shape != shape:
        raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; expected {tuple(shape)}.")
    mask = token_mask.bool()
    if sample_mask is not None:
        if sample_mask.shape != shape[:1]:
            raise ValueError(f"sample_mask has shape {tuple(sample_mask.shape)}; expected ({shape[0]},).")
        mask = mask & sample_mask.bool()[:, None]
    return mask


def masked_mean(x: Tensor, m: Tensor) -> Tensor:
    """Detached mean of ``x`` over ``m`` (0 when ``m`` is empty)."""
    return ((x * m).sum() / m.sum().clamp(min=1.0)).detach()


def masked_var(x: Tensor, m: Tensor) -> Tensor:
    """Detached (biased) variance of ``x`` over ``m``."""
    mean = masked_mean(x, m)
    return masked_mean((x - mean) ** 2, m)


def weight_stats(log_w: Tensor) -> dict[str, Tensor]:
    """Statistics of the raw IS weights ``exp(log_w)`` over a 1-D set of valid units (tokens or rows).

    Non-finite log-weights count as weight 0. An empty set gives zeros. ESS is computed on weights
    rescaled by their max, so it stays finite when a weight overflows.
    """
    log_w = log_w.detach()
    names = ["is_weight_mean", "is_weight_min", "is_weight_max", "is_ess"]
    names += [f"is_weight_p{round(q * 100)}" for q in QUANTILES]
    if log_w.numel() == 0:
        return {name: log_w.new_zeros(()) for name in names}
    log_w = torch.where(torch.isfinite(log_w), log_w, torch.full_like(log_w, -math.inf))
    w = torch.exp(log_w)
    scaled = torch.exp(log_w - log_w.max()) if torch.isfinite(log_w.max()) else torch.zeros_like(w)
    denom = scaled.numel() * (scaled * scaled).sum()
    ess = torch.where(denom > 0, scaled.sum() ** 2 / denom.clamp(min=torch.finfo(w.dtype).tiny), 0.0)
    stats = {"is_weight_mean": w.mean(), "is_weight_min": w.min(), "is_weight_max": w.max(), "is_ess": ess}
    for q, value in zip(QUANTILES, interpolated_quantiles(w, QUANTILES), strict=True):
        stats[f"is_weight_p{round(q * 100)}"] = value
    return stats


def interpolated_quantiles(x: Tensor, qs: tuple[float, ...]) -> list[Tensor]:
    """Linear-interpolation quantiles (as ``torch.quantile``) without its input-size limit."""
    s, _ = torch.sort(x)
    out = []
    for q in qs:
        pos = q * (s.numel() - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out
