"""PPO's clipped value loss for the critic (``ClippedValueLoss``); :mod:`screl.algos.losses` re-exports it."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from screl.algos.stats import masked_mean, masked_var, valid_mask

__all__ = ["ClippedValueLoss"]


class ClippedValueLoss(nn.Module):
    """Clipped value loss for PPO's critic (PPO2 baselines; Schulman et al. 2017).

    ``L = 0.5 * value_coef * sum_t M * max((V - R)^2, (V_old + clip(V - V_old, -eps, eps) - R)^2) / N``
    with ``eps = value_clip``; ``value_clip=None`` gives the plain squared error. ``N`` is the number of
    valid tokens, or ``global_normalizer``.

    Args:
        value_clip: clip range around the old values; ``None`` disables clipping.
        value_coef: scale of the loss.
    """

    def __init__(self, value_clip: float | None = 0.2, value_coef: float = 1.0) -> None:
        super().__init__()
        issues = []
        if value_clip is not None and not value_clip > 0.0:
            issues.append(
                f"`ClippedValueLoss(value_clip={value_clip!r})` is invalid: must be > 0. "
                "Use e.g. 0.2, or None for no clipping."
            )
        if not value_coef > 0.0:
            issues.append(
                f"`ClippedValueLoss(value_coef={value_coef!r})` is invalid: must be > 0. Use e.g. 1.0."
            )
        if issues:
            raise ValueError("\n".join(issues))
        self.value_clip = value_clip
        self.value_coef = value_coef

    def forward(
        self,
        values: Tensor,
        old_values: Tensor,
        returns: Tensor,
        token_mask: Tensor,
        sample_mask: Tensor | None = None,
        global_normalizer: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Compute the loss and its metrics.

        Args:
            values: ``[B, T]`` current critic values, with grad.
            old_values: ``[B, T]`` critic values at the step's start; treated as data.
            returns: ``[B, T]`` targets (e.g. from :func:`~screl.algos.gae_advantages`); treated as data.
            token_mask: ``[B, T]`` bool or 0/1.
            sample_mask: ``[B]`` bool or 0/1; ``None`` keeps every row.
            global_normalizer: divide the summed loss by this instead of the local valid-token count.

        Returns:
            ``(loss, metrics)`` with ``value_loss``, ``vf_clip_fraction`` (tokens where the clipped term
            is the larger one), ``value_mean``, ``returns_mean`` and ``explained_variance``
            (``1 - Var(R - V) / Var(R)`` over valid tokens; 0 when ``Var(R) = 0``).
        """
        mask = valid_mask(token_mask, sample_mask, values.shape)
        zero = torch.zeros_like(values)
        v = torch.where(mask, values, zero)
        v_old = torch.where(mask, old_values.detach(), zero)
        ret = torch.where(mask, returns.detach(), zero)
        m = mask.to(v.dtype)
        err = (v - ret) ** 2
        if self.value_clip is None:
            per_token = err
            clipped = torch.zeros_like(mask)
        else:
            v_clipped = v_old + (v - v_old).clamp(-self.value_clip, self.value_clip)
            err_clipped = (v_clipped - ret) ** 2
            per_token = torch.maximum(err, err_clipped)
            clipped = err_clipped > err
        total = 0.5 * self.value_coef * (per_token * m).sum()
        loss = total / (m.sum().clamp(min=1.0) if global_normalizer is None else global_normalizer)
        vd, rd = v.detach(), ret
        metrics = {
            "value_loss": loss.detach(),
            "vf_clip_fraction": masked_mean(clipped.to(m.dtype), m),
            "value_mean": masked_mean(vd, m),
            "returns_mean": masked_mean(rd, m),
            "explained_variance": _explained_variance(vd, rd, m),
        }
        return loss, metrics


def _explained_variance(values: Tensor, returns: Tensor, m: Tensor) -> Tensor:
    """``1 - Var(R - V) / Var(R)`` over the valid tokens; 0 when ``Var(R) = 0``."""
    var_r = masked_var(returns, m)
    var_resid = masked_var(returns - values, m)
    return torch.where(var_r > 0, 1.0 - var_resid / var_r.clamp(min=torch.finfo(m.dtype).tiny), 0.0)
