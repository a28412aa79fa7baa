"""Advantage estimators, registered by name: GRPO's and RLOO's group-relative advantages, PPO's GAE.

Pure tensor math (torch only). Shapes use ``B`` rows (samples), ``T`` token positions and ``G`` rows per
group. All functions are dtype-generic and never return NaN for masked, empty or constant inputs.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "AdvantageEstimator",
    "adv_estimator_names",
    "gae_advantages",
    "get_adv_estimator",
    "grpo_advantages",
    "masked_whiten",
    "register_adv_estimator",
    "rloo_advantages",
    "terminal_token_rewards",
]


@dataclass(frozen=True)
class AdvantageEstimator:
    """A registered advantage estimator: ``adv_estimator.name`` in a run's algorithm block chooses it.

    Group estimators (``needs_values=False``) are called ``fn(rewards [B], group_size, config) -> [B]``; value
    estimators (``needs_values=True``, for an algorithm with a critic) ``fn(token_rewards [B, T], values [B, T],
    token_mask [B, T], config) -> (advantages, returns)``. ``config`` is the block's ``adv_estimator`` settings.
    """

    name: str
    fn: Callable[..., Any]
    needs_values: bool


_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_adv_estimator(name: str, *, needs_values: bool = False) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register ``fn`` under ``name`` (a decorator); a second registration of one name is refused."""

    def add(fn: Callable[..., Any]) -> Callable[..., Any]:
        if name in _ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered ({_ESTIMATORS[name].fn.__qualname__})")
        _ESTIMATORS[name] = AdvantageEstimator(name, fn, needs_values)
        return fn

    return add


def get_adv_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered as ``name``, or your function given as ``"package.module:fn"`` (imported here; a
    group estimator unless the function was registered with ``needs_values=True``)."""
    if name in _ESTIMATORS:
        return _ESTIMATORS[name]
    module, _, attr = name.partition(":")
    if not attr:
        raise ValueError(f"unknown advantage estimator {name!r}; registered: {adv_estimator_names()}, or give your "
                         "function as 'package.module:fn'")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"advantage estimator {name!r} cannot be imported: {err}") from None
    if not callable(fn):
        raise ValueError(f"advantage estimator {name!r} is a {type(fn).__name__}, not a function")
    return next((e for e in _ESTIMATORS.values() if e.fn is fn), AdvantageEstimator(name, fn, needs_values=False))


def adv_estimator_names(*, needs_values: bool | None = None) -> list[str]:
    """The registered names, all of them or those that do (not) need a critic's values."""
    return sorted(n for n, e in _ESTIMATORS.items() if needs_values is None or e.needs_values == needs_values)


def _check_group_inputs(rewards: Tensor, group_size: int, sample_mask: Tensor | None) -> None:
    if rewards.dim() != 1:
        raise ValueError(f"`grpo_advantages(rewards.shape={tuple(rewards.shape)})` is invalid: expected [B].")
    if group_size < 1 or rewards.numel() % group_size != 0:
        raise ValueError(
            f"`grpo_advantages(group_size={group_size!r})` is invalid for {rewards.numel()} rows: "
            "the row count must be a positive multiple of group_size."
        )
    if sample_mask is not None and sample_mask.shape != rewards.shape:
        raise ValueError(
            f"`grpo_advantages(sample_mask.shape={tuple(sample_mask.shape)})` is invalid: "
            f"expected {tuple(rewards.shape)}, the shape of rewards."
        )


def grpo_advantages(
    rewards: Tensor,
    group_size: int,
    sample_mask: Tensor | None = None,
    *,
    leave_one_out: bool = True,
    normalize_std: bool = True,
    eps: float = 1e-6,
    std_floor: float = 0.0,
) -> Tensor:
    """Group-relative (GRPO) advantages, one scalar per row.

    Rows are group-contiguous: rows ``[g*G:(g+1)*G]`` are the ``G`` generations of group ``g``.
    For row ``i`` of a group, with ``V`` the group's *valid* rows (``sample_mask`` true) and ``n = |V|``:

    * baseline ``b_i``: leave-one-out ``mean_{j in V, j != i} r_j``, or ``mean_{j in V} r_j``;
    * ``A_i = r_i - b_i``;
    * with ``normalize_std``: ``s_i`` is the Bessel-corrected std over the same set as the baseline
      (the other valid rows for leave-one-out, all valid rows otherwise); where ``s_i > 0``,
      ``A_i /= (max(s_i, std_floor) + eps)``; where the set has fewer than two rows or zero spread, ``A_i`` is left
      unnormalized (so an all-equal group gives exactly 0).

    Masked rows are **excluded** from their group's baseline and std, and their own advantage is 0 (so a
    filtered sample, e.g. a truncated one, cannot shift its siblings' advantages). A group with at most one
    valid row gives 0 for every row. Broadcast the ``[B]`` result to tokens with ``adv[:, None]``.

    Args:
        rewards: ``[B]`` scalar reward per row, ``B`` a multiple of ``group_size``.
        group_size: ``G``, rows per group (``num_generations_per_prompt``).
        sample_mask: ``[B]`` bool or 0/1; ``None`` means every row is valid.
        leave_one_out: leave-one-out baseline (RLOO) instead of the group mean.
        normalize_std: divide by the group std (see above).
        eps: added to a positive std before dividing.
        std_floor: lower bound on a positive std (``0``: none); bounds ``|A_i|`` by ``|r_i - b_i| / std_floor``.

    Returns ``[B]`` advantages, same dtype as ``rewards``.
    """
    _check_group_inputs(rewards, group_size, sample_mask)
    r = rewards.reshape(-1, group_size)  # [N, G]
    valid = (
        torch.ones_like(r, dtype=torch.bool) if sample_mask is None else sample_mask.reshape(r.shape).bool()
    )
    m = valid.to(r.dtype)
    r = torch.where(valid, r, torch.zeros_like(r))  # masked rewards may be NaN or garbage
    if std_floor < 0:
        raise ValueError(f"`grpo_advantages(std_floor={std_floor!r})` is invalid: it must be >= 0 (0 for none).")
    adv = _relative_to_baseline(r, m, leave_one_out, normalize_std, eps, std_floor)
    n_valid = m.sum(-1, keepdim=True)  # [N, 1]
    keep = valid & (n_valid > 1.0)
    return torch.where(keep, adv, torch.zeros_like(adv)).reshape(rewards.shape)


@register_adv_estimator("grpo")
def _grpo(rewards: Tensor, group_size: int, config: Any) -> Tensor:
    """GRPO (Shao et al., 2024): each row against its group's (leave-one-out by default) mean, over its std."""
    return grpo_advantages(rewards, group_size, leave_one_out=config.use_leave_one_out_baseline,
                           normalize_std=config.normalize_rewards, std_floor=config.std_floor)


@register_adv_estimator("rloo")
def rloo_advantages(rewards: Tensor, group_size: int, config: Any = None) -> Tensor:
    """RLOO (Ahmadian et al., 2024, eq. 6): ``A_i = r_i - mean_{j != i} r_j`` over the group, never divided by a
    std, so a rare success among failures keeps its raw reward gap (``G / (G - 1) * (r_i - mean r)``)."""
    return grpo_advantages(rewards, group_size, leave_one_out=True, normalize_std=False)


def _relative_to_baseline(
    r: Tensor, m: Tensor, leave_one_out: bool, normalize_std: bool, eps: float, std_floor: float = 0.0
) -> Tensor:
    """``[N, G]`` rewards minus each row's baseline, over its baseline set, std-normalized where it can be."""
    group_size = r.shape[1]
    # member[n, i, j] = 1 if row j belongs to row i's baseline set.
    member = m[:, None, :].expand(-1, group_size, -1)
    if leave_one_out:
        member = member * (1.0 - torch.eye(group_size, dtype=r.dtype, device=r.device))
    k = member.sum(-1)  # [N, G] size of each row's baseline set
    baseline = (member * r[:, None, :]).sum(-1) / k.clamp(min=1.0)
    adv = r - baseline
    if normalize_std:
        sq_dev = member * (r[:, None, :] - baseline[..., None]) ** 2
        std = (sq_dev.sum(-1) / (k - 1.0).clamp(min=1.0)).sqrt()
        normalize = (k > 1.0) & (std > 0)
        adv = torch.where(normalize, adv / (std.clamp(min=std_floor) + eps), adv)
    return adv


def masked_whiten(values: Tensor, mask: Tensor, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` over the positions where ``mask`` is true; zero elsewhere.

    ``(x - mean) / sqrt(var + eps)`` with the masked mean and the masked *population* variance.
    An empty mask gives all zeros.

    Args:
        values: any shape.
        mask: same shape as ``values``, bool or 0/1.
        eps: added to the variance.
    """
    m = mask.to(values.dtype)
    x = torch.where(mask.bool(), values, torch.zeros_like(values))
    count = m.sum().clamp(min=1.0)
    mean = (x * m).sum() / count
    var = (((x - mean) * m) ** 2).sum() / count
    return ((x - mean) * torch.rsqrt(var + eps)) * m


def terminal_token_rewards(
    scores: Tensor,
    token_mask: Tensor,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Token-level rewards for GAE: the scalar score at each row's last valid token.

    ``r[b, t] = -kl_coef * kl[b, t] * mask[b, t] + scores[b] * [t == last valid position of row b]``.
    Rows with no valid token get no reward. Positions outside the mask are 0.

    Args:
        scores: ``[B]`` scalar reward per row.
        token_mask: ``[B, T]`` bool or 0/1, the positions that are trained on.
        kl: ``[B, T]`` optional per-token KL estimate to subtract (KL-in-reward).
        kl_coef: ``beta`` for the KL term.

    Returns:
        ``[B, T]`` rewards, dtype of ``scores``.
    """
    valid = token_mask.bool()
    m = valid.to(scores.dtype)
    positions = torch.arange(token_mask.shape[1], device=token_mask.device).expand_as(valid)
    last = torch.where(valid, positions, torch.full_like(positions, -1)).amax(dim=1)  # [B], -1 if empty
    is_last = (positions == last[:, None]) & valid
    rewards = is_last.to(scores.dtype) * scores[:, None]
    if kl is not None and kl_coef != 0.0:
        rewards = rewards - kl_coef * torch.where(valid, kl.to(scores.dtype), torch.zeros_like(m))
    return rewards


def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    token_mask: Tensor,
    *,
    gamma: float = 1.0,
    lam: float | Tensor = 0.95,
    value_lam: float | Tensor | None = None,
    whiten: bool = False,
    eps: float = 1e-8,
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (Schulman et al., 2016, eq. 16) over token positions.

    Backward recursion over the valid positions of each row:
    ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``, where ``V_next``
    and ``A_next`` belong to the next *valid* position (0 past the last one). Positions outside
    ``token_mask`` (padding, tool or user tokens) are skipped, not bootstrapped through: their values
    and rewards are ignored, ``V_next``/``A_next`` are carried across them unchanged, and discounting
    counts valid tokens, not positions. Their advantage and return are 0.

    Args:
        rewards: ``[B, T]`` per-token rewards (see :func:`terminal_token_rewards`); ignored outside mask.
        values: ``[B, T]`` critic values ``V_t``; ignored outside mask.
        token_mask: ``[B, T]`` bool or 0/1.
        gamma: discount.
        lam: GAE lambda for the advantages; a float or a ``[B]`` tensor (per-row, e.g. length-adaptive).
        value_lam: lambda for the critic's returns (decoupled GAE); ``None`` uses ``lam``.
        whiten: whiten the advantages over the mask (:func:`masked_whiten`).
        eps: variance epsilon for whitening.

    Returns:
        ``(advantages, returns)``, both ``[B, T]``; ``returns = A(value_lam) + V`` on valid positions.
    """
    if not (rewards.shape == values.shape == token_mask.shape) or rewards.dim() != 2:
        raise ValueError(
            f"`gae_advantages` got rewards {tuple(rewards.shape)}, values {tuple(values.shape)}, "
            f"token_mask {tuple(token_mask.shape)}: all three must be the same [B, T] shape."
        )
    valid = token_mask.bool()
    values = torch.where(valid, values, torch.zeros_like(values)).detach()
    rewards = torch.where(valid, rewards, torch.zeros_like(rewards)).detach()
    adv = _gae(rewards, values, valid, gamma, lam)
    returns_adv = adv if value_lam is None else _gae(rewards, values, valid, gamma, value_lam)
    returns = torch.where(valid, returns_adv + values, torch.zeros_like(values))
    if whiten:
        adv = masked_whiten(adv, valid, eps)
    return adv, returns


def _gae(rewards: Tensor, values: Tensor, valid: Tensor, gamma: float, lam: float | Tensor) -> Tensor:
    batch, length = rewards.shape
    lam_t = torch.as_tensor(lam, dtype=rewards.dtype, device=rewards.device).reshape(-1)
    if lam_t.numel() not in (1, batch):
        raise ValueError(f"`gae_advantages(lam)` has {lam_t.numel()} values: pass a float or a [B] tensor.")
    next_value = torch.zeros(batch, dtype=rewards.dtype, device=rewards.device)
    next_adv = torch.zeros_like(next_value)
    out = torch.zeros_like(rewards)
    for t in range(length - 1, -1, -1):
        m = valid[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        adv_t = delta + gamma * lam_t * next_adv
        out[:, t] = torch.where(m, adv_t, torch.zeros_like(adv_t))
        next_value = torch.where(m, values[:, t], next_value)
        next_adv = torch.where(m, adv_t, next_adv)
    return out


@register_adv_estimator("gae", needs_values=True)
def _gae_estimator(rewards: Tensor, values: Tensor, token_mask: Tensor, config: Any) -> tuple[Tensor, Tensor]:
    """PPO's GAE over token positions with the block's ``gamma`` and ``lam`` (whitening is the module's)."""
    return gae_advantages(rewards, values, token_mask, gamma=config.gamma, lam=config.lam, whiten=False)
