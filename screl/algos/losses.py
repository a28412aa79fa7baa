"""Policy and value losses for GRPO/PPO, with importance-sampling correction for async rollouts.

Each loss is an ``nn.Module`` that owns its hyperparameters and is chosen by ``class_path``. ``forward``
takes tensors only and returns ``(loss, metrics)``; metrics are detached scalars with plain names (the
LightningModule adds the ``train/`` prefix).

Tensors are next-token aligned by the caller: ``logprobs[b, t]`` is the log-probability of token ``t``
of row ``b``, and ``token_mask[b, t]`` says whether that token is trained on. Shapes: ``B`` rows,
``T`` positions.
"""

from __future__ import annotations

import math
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

__all__ = ["ClippedPGLoss", "ClippedValueLoss", "KLEstimator", "PolicyLoss", "kl_estimate"]

KLEstimator = Literal["k1", "k2", "k3"]
_KL_ESTIMATORS = ("k1", "k2", "k3")
_IS_LEVELS = ("token", "sequence")
_IS_MODES = ("truncate", "mask")
_QUANTILES = (0.1, 0.5, 0.9)


class PolicyLoss(Protocol):
    """What a GRPO/PPO LightningModule calls; :class:`ClippedPGLoss` is the built-in one."""

    @property
    def requires_reference_logprobs(self) -> bool: ...

    def __call__(
        self,
        curr_logprobs: Tensor,
        prev_logprobs: Tensor,
        generation_logprobs: Tensor,
        advantages: Tensor,
        token_mask: Tensor,
        sample_mask: Tensor | None = None,
        reference_logprobs: Tensor | None = None,
        global_normalizer: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]: ...


def kl_estimate(
    logprobs: Tensor,
    ref_logprobs: Tensor,
    estimator: KLEstimator = "k3",
    input_clamp: float = 20.0,
    output_clamp: float | None = 10.0,
) -> Tensor:
    """Per-token estimate of ``KL(pi || pi_ref)`` from tokens sampled from ``pi`` (Schulman, "Approximating
    KL divergence", 2020).

    With ``x = logpi_ref - logpi`` clamped to ``[-input_clamp, input_clamp]``: ``k1 = -x``,
    ``k2 = x^2 / 2``, ``k3 = exp(x) - 1 - x``; the result is clamped to ``[-output_clamp, output_clamp]``.
    Clamped entries get zero gradient.

    Args:
        logprobs: ``[B, T]`` log-probabilities under ``pi``.
        ref_logprobs: ``[B, T]`` log-probabilities under ``pi_ref``.
        estimator: ``"k1"``, ``"k2"`` or ``"k3"``.
        input_clamp: bound on ``|x|``.
        output_clamp: bound on the estimate; ``None`` disables it.
    """
    x = (ref_logprobs - logprobs).clamp(-input_clamp, input_clamp)
    if estimator == "k1":
        kl = -x
    elif estimator == "k2":
        kl = 0.5 * x * x
    elif estimator == "k3":
        kl = torch.expm1(x) - x
    else:
        raise ValueError(f"`kl_estimate(estimator={estimator!r})` is invalid. Use one of {_KL_ESTIMATORS}.")
    return kl if output_clamp is None else kl.clamp(-output_clamp, output_clamp)


class ClippedPGLoss(nn.Module):
    """Clipped policy-gradient surrogate (PPO, Schulman et al. 2017, eq. 7) with DAPO's decoupled clip
    (Yu et al. 2025), dual clip (Ye et al. 2020), GSPO sequence ratios (Zheng et al. 2025), a KL penalty
    to a reference policy, and importance-sampling correction for off-policy (async) rollouts.

    Per valid token, with ``rho = exp(logpi - logpi_old)`` and ``A`` the advantage:
    ``l = max(-A rho, -A clip(rho, 1 - ratio_clip_min, 1 + ratio_clip_max))``; with dual clip,
    ``l = min(l, -ratio_clip_c * A)`` where ``A < 0``. With IS correction each term is weighted by the
    detached ``w = exp(logpi_old - logpi_gen)``: ``pi_old`` is the policy at the step's start (whose
    logprobs the trainer recomputes) and ``pi_gen`` the behaviour policy that generated the tokens, so
    ``E_gen[w l] = E_old[l]``. ``is_level="sequence"`` uses the whole-sequence ratio
    ``w = exp(sum_t (logpi_old - logpi_gen))`` for every token of a row. ``is_truncation`` bounds ``w``:
    ``is_mode="truncate"`` clamps it to ``[is_truncation_min, is_truncation]`` (TIS); ``"mask"`` zeroes
    the tokens (or, at sequence level, whole rows) whose weight falls outside (masked IS / icepop).
    Non-finite weights become 0.

    Aggregation: ``token_level_loss`` averages over all valid tokens of the batch; otherwise each row's
    masked token mean is averaged over valid rows. The KL term ``beta * k(logpi, logpi_ref)`` (times
    ``exp(logpi - sg(logpi))``, value 1, which adds the score-function term so that ``k1``/``k3`` give
    unbiased KL gradients on-policy) is reduced the same way and added to the loss; it is not IS-weighted.

    Args:
        ratio_clip_min: ``eps_low``, the lower clip is ``1 - eps_low``; in ``[0, 1)``.
        ratio_clip_max: ``eps_high``, the upper clip is ``1 + eps_high``; ``>= 0``.
        ratio_clip_c: dual-clip constant ``c > 1`` for negative advantages; ``None`` disables it.
        token_level_loss: token mean over the batch (True) or per-sequence mean, then mean (False).
        sequence_level_importance_ratios: GSPO: ``rho = exp(mean_t(logpi - logpi_old))`` per row;
            requires ``token_level_loss=False``.
        reference_policy_kl_penalty: ``beta >= 0``; ``0`` disables the KL term.
        kl_estimator: ``"k1"``, ``"k2"`` or ``"k3"`` (see :func:`kl_estimate`).
        kl_clamp: bound on the per-token KL estimate; ``None`` disables it.
        use_importance_sampling_correction: weight by ``pi_old / pi_gen``; turn on whenever the sampler
            admits stale rollouts.
        is_level: ``"token"`` or ``"sequence"``.
        is_mode: ``"truncate"`` (TIS) or ``"mask"`` (MIS); needs ``is_truncation``.
        is_truncation: upper bound on the IS weight; ``None`` means untruncated.
        is_truncation_min: lower bound on the IS weight (``0`` = none); ``<= is_truncation``.
    """

    # 13 arguments (budget ~8): they are the flat `loss_fn:` YAML keys users already write.
    def __init__(
        self,
        ratio_clip_min: float = 0.2,
        ratio_clip_max: float = 0.2,
        ratio_clip_c: float | None = None,
        token_level_loss: bool = True,
        sequence_level_importance_ratios: bool = False,
        reference_policy_kl_penalty: float = 0.0,
        kl_estimator: KLEstimator = "k3",
        kl_clamp: float | None = 10.0,
        use_importance_sampling_correction: bool = False,
        is_level: Literal["token", "sequence"] = "token",
        is_mode: Literal["truncate", "mask"] = "truncate",
        is_truncation: float | None = None,
        is_truncation_min: float = 0.0,
    ) -> None:
        super().__init__()
        self.ratio_clip_min = ratio_clip_min
        self.ratio_clip_max = ratio_clip_max
        self.ratio_clip_c = ratio_clip_c
        self.token_level_loss = token_level_loss
        self.sequence_level_importance_ratios = sequence_level_importance_ratios
        self.reference_policy_kl_penalty = reference_policy_kl_penalty
        self.kl_estimator: KLEstimator = kl_estimator
        self.kl_clamp = kl_clamp
        self.use_importance_sampling_correction = use_importance_sampling_correction
        self.is_level = is_level
        self.is_mode = is_mode
        self.is_truncation = is_truncation
        self.is_truncation_min = is_truncation_min
        issues = self._issues()
        if issues:
            raise ValueError("\n".join(issues))

    def _issues(self) -> list[str]:
        """Every invalid hyperparameter, each as ``(arg, why, fix)`` in one message line."""
        trunc, lo = self.is_truncation, self.is_truncation_min
        checks = [
            (not 0.0 <= self.ratio_clip_min < 1.0, "ratio_clip_min", "must be in [0, 1)", "Use e.g. 0.2"),
            (not self.ratio_clip_max >= 0.0, "ratio_clip_max", "must be >= 0", "Use e.g. 0.2 or 0.28 (DAPO)"),
            (
                self.ratio_clip_c is not None and not self.ratio_clip_c > 1.0,
                "ratio_clip_c",
                "the dual-clip constant must be > 1",
                "Use e.g. 3.0, or None",
            ),
            (
                self.sequence_level_importance_ratios and self.token_level_loss,
                "sequence_level_importance_ratios",
                "GSPO ratios need per-sequence aggregation",
                "Set token_level_loss=False",
            ),
            (
                not self.reference_policy_kl_penalty >= 0.0,
                "reference_policy_kl_penalty",
                "must be >= 0",
                "Use 0 to disable the KL term",
            ),
            (
                self.kl_estimator not in _KL_ESTIMATORS,
                "kl_estimator",
                "unknown estimator",
                f"Use one of {_KL_ESTIMATORS}",
            ),
            (
                self.kl_clamp is not None and not self.kl_clamp > 0.0,
                "kl_clamp",
                "must be > 0",
                "Use e.g. 10.0, or None for no clamp",
            ),
            (self.is_level not in _IS_LEVELS, "is_level", "unknown level", f"Use one of {_IS_LEVELS}"),
            (self.is_mode not in _IS_MODES, "is_mode", "unknown mode", f"Use one of {_IS_MODES}"),
            (
                trunc is not None and not self.use_importance_sampling_correction,
                "is_truncation",
                "truncation needs IS correction",
                "Set use_importance_sampling_correction=True",
            ),
            (
                trunc is not None and not trunc > 0.0,
                "is_truncation",
                "must be > 0",
                "Use e.g. 2.0, or None for no truncation",
            ),
            (
                self.is_mode == "mask" and trunc is None,
                "is_mode",
                "masked IS needs a threshold",
                "Set is_truncation (e.g. 2.0)",
            ),
            (not lo >= 0.0, "is_truncation_min", "must be >= 0", "Use 0.0 for no lower bound"),
            (
                lo > 0.0 and trunc is None,
                "is_truncation_min",
                "a lower bound needs is_truncation",
                "Set is_truncation",
            ),
            (
                trunc is not None and lo > trunc,
                "is_truncation_min",
                "must be <= is_truncation",
                "Lower it",
            ),
        ]
        return [
            f"`ClippedPGLoss({arg}={getattr(self, arg)!r})` is invalid: {why}. {fix}."
            for failed, arg, why, fix in checks
            if failed
        ]

    @property
    def requires_reference_logprobs(self) -> bool:
        """Whether ``forward`` needs ``reference_logprobs`` (the KL penalty is on)."""
        return self.reference_policy_kl_penalty != 0.0

    def forward(
        self,
        curr_logprobs: Tensor,
        prev_logprobs: Tensor,
        generation_logprobs: Tensor,
        advantages: Tensor,
        token_mask: Tensor,
        sample_mask: Tensor | None = None,
        reference_logprobs: Tensor | None = None,
        global_normalizer: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Compute the loss and its metrics.

        Args:
            curr_logprobs: ``[B, T]`` current policy, with grad.
            prev_logprobs: ``[B, T]`` policy at the step's start (``pi_old``); treated as data.
            generation_logprobs: ``[B, T]`` behaviour policy that sampled the tokens; treated as data.
            advantages: ``[B, T]`` or ``[B]`` (broadcast over tokens).
            token_mask: ``[B, T]`` bool or 0/1.
            sample_mask: ``[B]`` bool or 0/1; ``None`` keeps every row.
            reference_logprobs: ``[B, T]``; required when ``reference_policy_kl_penalty > 0``.
            global_normalizer: divide the summed loss by this instead of the local count of valid tokens
                (token level) or rows (sequence level), e.g. the global count across microbatches and
                data-parallel ranks, so that the per-microbatch losses sum to the global mean.

        Returns:
            ``(loss, metrics)``: a scalar loss (0 with grad when nothing is valid) and detached scalars
            ``policy_loss``; ``clip_fraction`` (valid tokens whose ratio lies outside the clip range);
            ``ratio_mean``; ``gen_kl`` (k3 estimate of ``KL(pi_gen || pi)`` over tokens with finite
            logprobs); ``is_weight_{mean,min,max,p10,p50,p90}`` and ``is_ess`` (normalized effective
            sample size ``(sum w)^2 / (n sum w^2)``) of the raw, untruncated IS weights over the weighting
            units (computed even with the correction off, as a diagnostic); ``num_valid_tokens``; plus
            ``dual_clip_fraction``, ``is_oob_fraction`` (units outside the truncation bounds) and ``kl_ref``
            (mean KL estimate, whenever ``reference_logprobs`` is given) when those apply.
        """
        if self.requires_reference_logprobs and reference_logprobs is None:
            raise ValueError(
                f"ClippedPGLoss(reference_policy_kl_penalty={self.reference_policy_kl_penalty!r}) needs "
                "reference_logprobs in forward: pass them, or set reference_policy_kl_penalty=0."
            )
        mask = _valid_mask(token_mask, sample_mask, curr_logprobs.shape)
        zero = torch.zeros_like(curr_logprobs)
        curr = torch.where(mask, curr_logprobs, zero)
        prev = torch.where(mask, prev_logprobs.detach(), zero)
        gen = torch.where(mask, generation_logprobs.detach(), zero)
        adv = advantages.detach()
        adv = torch.where(mask, adv[:, None].expand_as(curr) if adv.dim() == 1 else adv, zero)
        m = mask.to(curr.dtype)
        row_count = m.sum(-1)  # [B]
        row_valid = row_count > 0

        log_ratio = curr - prev
        if self.sequence_level_importance_ratios:
            log_ratio = ((log_ratio * m).sum(-1) / row_count.clamp(min=1.0))[:, None].expand_as(curr)
        ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        per_token = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        metrics: dict[str, Tensor] = {}
        if self.ratio_clip_c is not None:
            dual = (adv < 0) & (per_token > -self.ratio_clip_c * adv)
            per_token = torch.where(dual, -self.ratio_clip_c * adv, per_token)
            metrics["dual_clip_fraction"] = _masked_mean(dual.to(m.dtype), m)

        weight = self._is_weight(prev - gen, m, row_valid, metrics)
        policy_loss = self._reduce(weight * per_token, m, row_count, global_normalizer)
        loss = policy_loss
        if reference_logprobs is not None:
            ref = torch.where(mask, reference_logprobs.detach(), zero)
            kl = kl_estimate(curr, ref, self.kl_estimator, output_clamp=self.kl_clamp)
            metrics["kl_ref"] = _masked_mean(kl.detach(), m)
            if self.requires_reference_logprobs:
                score = torch.exp(curr - curr.detach())
                kl_loss = self._reduce(score * kl, m, row_count, global_normalizer)
                loss = loss + self.reference_policy_kl_penalty * kl_loss

        outside = (ratio < 1.0 - self.ratio_clip_min) | (ratio > 1.0 + self.ratio_clip_max)
        gen_log_ratio = (curr - gen).detach()
        gen_finite = torch.isfinite(gen_log_ratio)  # a token the behaviour policy "could not" sample
        gen_log_ratio = torch.where(gen_finite, gen_log_ratio, torch.zeros_like(gen_log_ratio))
        metrics.update(
            policy_loss=policy_loss.detach(),
            clip_fraction=_masked_mean(outside.to(m.dtype), m),
            ratio_mean=_masked_mean(ratio.detach(), m),
            gen_kl=_masked_mean(torch.expm1(gen_log_ratio) - gen_log_ratio, m * gen_finite.to(m.dtype)),
            num_valid_tokens=m.sum(),
        )
        return loss, metrics

    def _is_weight(self, log_w: Tensor, m: Tensor, row_valid: Tensor, metrics: dict[str, Tensor]) -> Tensor:
        """Detached IS weight per token (1 when correction is off); records raw-weight statistics.

        Statistics are over the weighting units: valid tokens, or valid rows at sequence level.
        """
        if self.is_level == "sequence":
            row_log_w = (log_w * m).sum(-1)  # [B]
            unit_log_w = row_log_w[row_valid]
            log_w = row_log_w[:, None].expand_as(log_w)
        else:
            unit_log_w = log_w[m.bool()]
        metrics.update(_weight_stats(unit_log_w))
        if not self.use_importance_sampling_correction:
            return torch.ones_like(log_w)
        if self.is_truncation is None:
            weight = torch.exp(log_w)
        else:
            log_hi = math.log(self.is_truncation)
            log_lo = math.log(self.is_truncation_min) if self.is_truncation_min > 0.0 else -math.inf
            if self.is_mode == "truncate":
                weight = torch.exp(log_w.clamp(log_lo, log_hi))
            else:
                inside = (log_w >= log_lo) & (log_w <= log_hi)
                weight = torch.where(inside, torch.exp(log_w), torch.zeros_like(log_w))
            unit_oob = (unit_log_w < log_lo) | (unit_log_w > log_hi) | unit_log_w.isnan()
            metrics["is_oob_fraction"] = unit_oob.to(m.dtype).mean() if unit_oob.numel() else m.new_zeros(())
        finite = torch.isfinite(log_w) & torch.isfinite(weight)
        return torch.where(finite, weight, torch.zeros_like(weight)).detach()

    def _reduce(
        self, per_token: Tensor, m: Tensor, row_count: Tensor, normalizer: float | Tensor | None
    ) -> Tensor:
        if self.token_level_loss:
            total = (per_token * m).sum()
            count = m.sum()
        else:
            row_mean = (per_token * m).sum(-1) / row_count.clamp(min=1.0)
            total = row_mean.sum()  # rows without valid tokens contribute 0
            count = (row_count > 0).to(m.dtype).sum()
        if normalizer is None:
            return total / count.clamp(min=1.0)
        return total / normalizer


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
        mask = _valid_mask(token_mask, sample_mask, values.shape)
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
        var_r = _masked_var(rd, m)
        var_resid = _masked_var(rd - vd, m)
        explained = torch.where(var_r > 0, 1.0 - var_resid / var_r.clamp(min=torch.finfo(m.dtype).tiny), 0.0)
        metrics = {
            "value_loss": loss.detach(),
            "vf_clip_fraction": _masked_mean(clipped.to(m.dtype), m),
            "value_mean": _masked_mean(vd, m),
            "returns_mean": _masked_mean(rd, m),
            "explained_variance": explained,
        }
        return loss, metrics


def _valid_mask(token_mask: Tensor, sample_mask: Tensor | None, shape: torch.Size) -> Tensor:
    if token_mask.shape != shape:
        raise ValueError(f"token_mask has shape {tuple(token_mask.shape)}; expected {tuple(shape)}.")
    mask = token_mask.bool()
    if sample_mask is not None:
        if sample_mask.shape != shape[:1]:
            raise ValueError(f"sample_mask has shape {tuple(sample_mask.shape)}; expected ({shape[0]},).")
        mask = mask & sample_mask.bool()[:, None]
    return mask


def _masked_mean(x: Tensor, m: Tensor) -> Tensor:
    return ((x * m).sum() / m.sum().clamp(min=1.0)).detach()


def _masked_var(x: Tensor, m: Tensor) -> Tensor:
    mean = _masked_mean(x, m)
    return _masked_mean((x - mean) ** 2, m)


def _weight_stats(log_w: Tensor) -> dict[str, Tensor]:
    """Statistics of the raw IS weights ``exp(log_w)`` over a 1-D set of valid units (tokens or rows).

    Non-finite log-weights count as weight 0. An empty set gives zeros. ESS is computed on weights
    rescaled by their max, so it stays finite when a weight overflows.
    """
    log_w = log_w.detach()
    names = ["is_weight_mean", "is_weight_min", "is_weight_max", "is_ess"]
    names += [f"is_weight_p{round(q * 100)}" for q in _QUANTILES]
    if log_w.numel() == 0:
        return {name: log_w.new_zeros(()) for name in names}
    log_w = torch.where(torch.isfinite(log_w), log_w, torch.full_like(log_w, -math.inf))
    w = torch.exp(log_w)
    scaled = torch.exp(log_w - log_w.max()) if torch.isfinite(log_w.max()) else torch.zeros_like(w)
    denom = scaled.numel() * (scaled * scaled).sum()
    ess = torch.where(denom > 0, scaled.sum() ** 2 / denom.clamp(min=torch.finfo(w.dtype).tiny), 0.0)
    stats = {"is_weight_mean": w.mean(), "is_weight_min": w.min(), "is_weight_max": w.max(), "is_ess": ess}
    quantiles = _quantiles(w, _QUANTILES)
    for q, value in zip(_QUANTILES, quantiles, strict=True):
        stats[f"is_weight_p{round(q * 100)}"] = value
    return stats


def _quantiles(x: Tensor, qs: tuple[float, ...]) -> list[Tensor]:
    """Linear-interpolation quantiles (as ``torch.quantile``) without its input-size limit."""
    s, _ = torch.sort(x)
    out = []
    for q in qs:
        pos = q * (s.numel() - 1)
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(s[lo] + (s[hi] - s[lo]) * (pos - lo))
    return out
