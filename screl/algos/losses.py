"""Policy and value losses for GRPO/PPO, with importance-sampling correction for async rollouts.

Each loss is an ``nn.Module`` that owns its hyperparameters and is chosen by ``class_path`` (a policy loss also by
its registered name, :mod:`screl.algos.policy_loss`). ``forward``
takes tensors only and returns ``(loss, metrics)``; metrics are detached scalars with plain names (the
LightningModule adds the ``train/`` prefix).

Tensors are next-token aligned by the caller: ``logprobs[b, t]`` is the log-probability of token ``t``
of row ``b``, and ``token_mask[b, t]`` says whether that token is trained on. Shapes: ``B`` rows,
``T`` positions.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from screl.algos.policy_loss import PolicyLoss, register_policy_loss
from screl.algos.stats import masked_mean, valid_mask, weight_stats
from screl.algos.value_loss import ClippedValueLoss

__all__ = ["ClippedPGLoss", "ClippedValueLoss", "KLEstimator", "PolicyLoss", "kl_estimate"]

KLEstimator = Literal["k1", "k2", "k3"]
_KL_ESTIMATORS = ("k1", "k2", "k3")
_IS_LEVELS = ("token", "sequence", "geometric")
_PROXIMAL = ("trainer", "behaviour")
_IS_MODES = ("truncate", "mask")
#: One hyperparameter check: ``(failed, argument, why, fix)``.
_Check = tuple[bool, str, str, str]


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


@register_policy_loss("clipped")
class ClippedPGLoss(nn.Module):
    """Clipped policy-gradient surrogate (PPO, Schulman et al. 2017, eq. 7) with DAPO's decoupled clip
    (Yu et al. 2025), dual clip (Ye et al. 2020), GSPO sequence ratios (Zheng et al. 2025), a KL penalty
    to a reference policy, and importance-sampling correction for off-policy (async) rollouts.

    Per valid token, with ``rho = exp(logpi - logpi_prox)`` and ``A`` the advantage:
    ``l = max(-A rho, -A clip(rho, 1 - ratio_clip_min, 1 + ratio_clip_max))``; with dual clip,
    ``l = min(l, -ratio_clip_c * A)`` where ``A < 0``. The proximal policy ``pi_prox`` the ratio is clipped
    against is ``pi_old`` (``proximal_policy="trainer"``), the trainer's policy at the step's start, the step
    that claimed the data (its logprobs the trainer recomputes); or, naive PPO, the behaviour policy ``pi_gen``
    that generated the tokens (``"behaviour"``; no IS weight then). With IS correction each term is weighted
    by the detached ``w = exp(logpi_old - logpi_gen)``, so ``E_gen[w l] = E_old[l]``: decoupled PPO (Hilton
    et al. 2021; AReaL's objective when untruncated). ``is_level="sequence"`` uses the whole-sequence ratio
    ``w = exp(sum_t (logpi_old - logpi_gen))`` for every token of a row, ``"geometric"`` its geometric mean
    over the row's tokens ``w = exp(mean_t (logpi_old - logpi_gen))`` (GSPO-style, does not grow with the
    length). ``is_truncation`` bounds ``w``:
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
        is_level: ``"token"``, ``"sequence"`` (product over the row) or ``"geometric"`` (geometric mean).
        is_mode: ``"truncate"`` (TIS) or ``"mask"`` (MIS); needs ``is_truncation``.
        is_truncation: upper bound on the IS weight; ``None`` means untruncated.
        is_truncation_min: lower bound on the IS weight (``0`` = none); ``<= is_truncation``.
        proximal_policy: ``"trainer"`` (decoupled PPO) or ``"behaviour"`` (naive PPO: clip against
            ``pi_gen``, the baseline that loses accuracy as staleness grows; needs the IS correction off).
    """

    # 14 arguments (budget ~8): they are the flat `loss_fn:` YAML keys users already write.
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
        is_level: Literal["token", "sequence", "geometric"] = "token",
        is_mode: Literal["truncate", "mask"] = "truncate",
        is_truncation: float | None = None,
        is_truncation_min: float = 0.0,
        proximal_policy: Literal["trainer", "behaviour"] = "trainer",
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
        self.proximal_policy = proximal_policy
        issues = self._issues()
        if issues:
            raise ValueError("\n".join(issues))

    def _issues(self) -> list[str]:
        """Every invalid hyperparameter, each as ``(arg, why, fix)`` in one message line."""
        return [
            f"`ClippedPGLoss({arg}={getattr(self, arg)!r})` is invalid: {why}. {fix}."
            for failed, arg, why, fix in self._clip_and_kl_checks() + self._is_checks()
            if failed
        ]

    def _clip_and_kl_checks(self) -> list[_Check]:
        return [
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
        ]

    def _is_checks(self) -> list[_Check]:
        trunc, lo = self.is_truncation, self.is_truncation_min
        return [
            (self.is_level not in _IS_LEVELS, "is_level", "unknown level", f"Use one of {_IS_LEVELS}"),
            (self.is_mode not in _IS_MODES, "is_mode", "unknown mode", f"Use one of {_IS_MODES}"),
            (self.proximal_policy not in _PROXIMAL, "proximal_policy", "unknown proximal policy",
             f"Use one of {_PROXIMAL}"),
            (
                self.proximal_policy == "behaviour" and self.use_importance_sampling_correction,
                "proximal_policy",
                "naive PPO clips against the behaviour policy itself, an IS weight on top would correct twice",
                "Set use_importance_sampling_correction=False, or proximal_policy='trainer' (decoupled PPO)",
            ),
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

    @property
    def requires_reference_logprobs(self) -> bool:
        """Whether ``forward`` needs ``reference_logprobs`` (the KL penalty is on)."""
        return self.reference_policy_kl_penalty != 0.0

    def forward(
        self, curr_logprobs: Tensor, prev_logprobs: Tensor, generation_logprobs: Tensor, advantages: Tensor,
        token_mask: Tensor, sample_mask: Tensor | None = None, reference_logprobs: Tensor | None = None,
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
        self._check_reference(reference_logprobs)
        mask = valid_mask(token_mask, sample_mask, curr_logprobs.shape)
        curr, prev, gen, adv = _masked_inputs(
            mask, curr_logprobs, prev_logprobs, generation_logprobs, advantages
        )
        m = mask.to(curr.dtype)
        row_count = m.sum(-1)  # [B]
        metrics: dict[str, Tensor] = {}
        prox = gen if self.proximal_policy == "behaviour" else prev
        ratio, per_token = self._surrogate(curr, prox, adv, m, row_count, metrics)
        weight = self._is_weight(prev - gen, m, row_count > 0, metrics)
        policy_loss = self._reduce(weight * per_token, m, row_count, global_normalizer)
        loss = policy_loss
        if reference_logprobs is not None:
            loss = self._add_kl(
                loss, curr, reference_logprobs, mask, m, row_count, global_normalizer, metrics
            )
        metrics.update(self._diagnostics(curr, gen, ratio, m, policy_loss))
        return loss, metrics

    def _check_reference(self, reference_logprobs: Tensor | None) -> None:
        if self.requires_reference_logprobs and reference_logprobs is None:
            raise ValueError(
                f"ClippedPGLoss(reference_policy_kl_penalty={self.reference_policy_kl_penalty!r}) needs "
                "reference_logprobs in forward: pass them, or set reference_policy_kl_penalty=0."
            )

    def _surrogate(
        self, curr: Tensor, prev: Tensor, adv: Tensor, m: Tensor, row_count: Tensor,
        metrics: dict[str, Tensor],
    ) -> tuple[Tensor, Tensor]:
        """The ratio to the proximal policy (per token, or GSPO's per row) and the clipped, dual-clipped
        surrogate."""
        log_ratio = curr - prev
        if self.sequence_level_importance_ratios:
            log_ratio = ((log_ratio * m).sum(-1) / row_count.clamp(min=1.0))[:, None].expand_as(curr)
        ratio = torch.exp(log_ratio)
        clipped_ratio = ratio.clamp(1.0 - self.ratio_clip_min, 1.0 + self.ratio_clip_max)
        per_token = torch.maximum(-adv * ratio, -adv * clipped_ratio)
        if self.ratio_clip_c is not None:
            dual = (adv < 0) & (per_token > -self.ratio_clip_c * adv)
            per_token = torch.where(dual, -self.ratio_clip_c * adv, per_token)
            metrics["dual_clip_fraction"] = masked_mean(dual.to(m.dtype), m)
        return ratio, per_token

    def _add_kl(
        self, loss: Tensor, curr: Tensor, reference_logprobs: Tensor, mask: Tensor, m: Tensor,
        row_count: Tensor, normalizer: float | Tensor | None, metrics: dict[str, Tensor],
    ) -> Tensor:
        """Record ``kl_ref``; with the penalty on, add ``beta`` x the score-corrected KL term to ``loss``."""
        ref = torch.where(mask, reference_logprobs.detach(), torch.zeros_like(curr))
        kl = kl_estimate(curr, ref, self.kl_estimator, output_clamp=self.kl_clamp)
        metrics["kl_ref"] = masked_mean(kl.detach(), m)
        if not self.requires_reference_logprobs:
            return loss
        score = torch.exp(curr - curr.detach())
        kl_loss = self._reduce(score * kl, m, row_count, normalizer)
        return loss + self.reference_policy_kl_penalty * kl_loss

    def _diagnostics(
        self, curr: Tensor, gen: Tensor, ratio: Tensor, m: Tensor, policy_loss: Tensor
    ) -> dict[str, Tensor]:
        """``policy_loss``, ``clip_fraction``, ``ratio_mean``, ``gen_kl`` and ``num_valid_tokens``."""
        outside = (ratio < 1.0 - self.ratio_clip_min) | (ratio > 1.0 + self.ratio_clip_max)
        gen_log_ratio = (curr - gen).detach()
        gen_finite = torch.isfinite(gen_log_ratio)  # a token the behaviour policy "could not" sample
        gen_log_ratio = torch.where(gen_finite, gen_log_ratio, torch.zeros_like(gen_log_ratio))
        return {
            "policy_loss": policy_loss.detach(),
            "clip_fraction": masked_mean(outside.to(m.dtype), m),
            "ratio_mean": masked_mean(ratio.detach(), m),
            "gen_kl": masked_mean(torch.expm1(gen_log_ratio) - gen_log_ratio, m * gen_finite.to(m.dtype)),
            "num_valid_tokens": m.sum(),
        }

    def _is_weight(self, log_w: Tensor, m: Tensor, row_valid: Tensor, metrics: dict[str, Tensor]) -> Tensor:
        """Detached IS weight per token (1 when correction is off); records raw-weight statistics.

        Statistics are over the weighting units: valid tokens, or valid rows at the sequence levels.
        """
        if self.is_level in ("sequence", "geometric"):
            row_log_w = (log_w * m).sum(-1)  # [B]
            if self.is_level == "geometric":
                row_log_w = row_log_w / m.sum(-1).clamp(min=1.0)
            unit_log_w = row_log_w[row_valid]
            log_w = row_log_w[:, None].expand_as(log_w)
        else:
            unit_log_w = log_w[m.bool()]
        metrics.update(weight_stats(unit_log_w))
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


def _masked_inputs(
    mask: Tensor, curr_logprobs: Tensor, prev_logprobs: Tensor, generation_logprobs: Tensor,
    advantages: Tensor,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The inputs with invalid tokens zeroed, all but ``curr`` detached, advantages broadcast to [B, T]."""
    zero = torch.zeros_like(curr_logprobs)
    curr = torch.where(mask, curr_logprobs, zero)
    prev = torch.where(mask, prev_logprobs.detach(), zero)
    gen = torch.where(mask, generation_logprobs.detach(), zero)
    adv = advantages.detach()
    adv = torch.where(mask, adv[:, None].expand_as(curr) if adv.dim() == 1 else adv, zero)
    return curr, prev, gen, adv
