"""On-policy distillation: per-token KL objectives toward a teacher (pure torch; docs/distillation.md).

``sampled`` (:func:`distill_advantages`, :class:`ReverseKLDistillLoss`): the student samples, a teacher scores the
student's own tokens, and each token's advantage is ``A_t = kl_coef (log pi_t(y_t) - log pi_beh(y_t)) +
reward_weight A_grpo`` (``pi_beh`` the policy that sampled the token, ``A_grpo`` the row's GRPO advantage), each
token on its own: the "discount 0" estimator. Treated as data through :class:`ClippedPGLoss`'s surrogate (its
clipping and IS correction apply as for GRPO), its gradient ``-A_t grad log pi_s(y_t)`` equals, on policy, the
gradient of the sampled per-token reverse KL ``KL(pi_s || pi_t)`` (the score term ``E[grad log pi] = 0``).

``top_k`` (:func:`top_k_reverse_kl`, :func:`top_k_forward_kl`): the exact KL at each visited position over the
teacher's ``k`` most likely tokens plus one bucket for the rest of the vocabulary (both distributions coarsened the
same way: a lower bound of the full KL, equal to it at ``k`` = vocabulary size). It moves the student's mass toward
the teacher's likely tokens whether or not the student sampled them. Reverse KL is mode-seeking (weighted by the
student's probability); forward ``KL(pi_t || pi_s)`` is the cross-entropy toward the teacher at each visited
position, which raises an answer the student gives almost no mass directly.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from screl.algos.losses import ClippedPGLoss
from screl.algos.policy_loss import PolicyLoss
from screl.algos.stats import masked_mean, valid_mask

__all__ = ["ReverseKLDistillLoss", "distill_advantages", "top_k_forward_kl", "top_k_reverse_kl"]

REST_FLOOR = 1e-12
"""Floor of a "rest of the vocabulary" bucket's probability (k = vocabulary size leaves it at rounding level)."""


def top_k_reverse_kl(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """``KL(pi_s || pi_t)`` per position over the teacher's top-k tokens plus a rest-of-vocabulary bucket.

    Args:
        student_logprobs: ``[..., k]`` the student's logprobs of the teacher's top-k tokens (normalized over the
            whole vocabulary).
        teacher_logprobs: ``[..., k]`` the teacher's logprobs of them.

    Returns ``[...]``: ``sum_v p_s(v) (log p_s(v) - log p_t(v)) + r_s (log r_s - log r_t)`` with ``r = 1 - sum_v p``.
    """
    teacher, rest_s, rest_t = _top_k_parts(student_logprobs, teacher_logprobs)
    in_top = (student_logprobs.exp() * (student_logprobs - teacher)).sum(-1)
    return in_top + rest_s * (rest_s.log() - rest_t.log())


def top_k_forward_kl(student_logprobs: Tensor, teacher_logprobs: Tensor) -> Tensor:
    """``KL(pi_t || pi_s)`` per position over the teacher's top-k tokens plus a rest-of-vocabulary bucket.

    Arguments as :func:`top_k_reverse_kl`. Returns ``[...]``: ``sum_v p_t(v) (log p_t(v) - log p_s(v)) + r_t (log r_t -
    log r_s)`` with ``r = 1 - sum_v p``.
    """
    teacher, rest_s, rest_t = _top_k_parts(student_logprobs, teacher_logprobs)
    in_top = (teacher.exp() * (teacher - student_logprobs)).sum(-1)
    return in_top + rest_t * (rest_t.log() - rest_s.log())


TOP_K_KL = {"reverse": top_k_reverse_kl, "forward": top_k_forward_kl}
"""``distillation.kl_direction`` -> the top-k divergence."""


def _top_k_parts(student_logprobs: Tensor, teacher_logprobs: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The detached teacher logprobs (in the student's dtype) and both rest-of-vocabulary buckets' probabilities."""
    if student_logprobs.shape != teacher_logprobs.shape:
        raise ValueError(f"student logprobs of shape {tuple(student_logprobs.shape)} against teacher top-k logprobs "
                         f"of shape {tuple(teacher_logprobs.shape)}: they must match")
    teacher = teacher_logprobs.detach().to(student_logprobs.dtype)
    rest_s = (1.0 - student_logprobs.exp().sum(-1)).clamp_min(REST_FLOOR)
    rest_t = (1.0 - teacher.exp().sum(-1)).clamp_min(REST_FLOOR)
    return teacher, rest_s, rest_t


def distill_advantages(
    teacher_logprobs: Tensor, behaviour_logprobs: Tensor, token_mask: Tensor,
    reward_advantages: Tensor | None = None, reward_weight: float = 0.0, kl_coef: float = 1.0,
) -> Tensor:
    """Per-token advantages ``kl_coef (teacher - behaviour) + reward_weight A_grpo``, 0 outside ``token_mask``.

    Args:
        teacher_logprobs: ``[B, T]`` the teacher's logprob of each sampled token.
        behaviour_logprobs: ``[B, T]`` the student's logprob of it under the policy that sampled it.
        token_mask: ``[B, T]`` tokens trained on.
        reward_advantages: ``[B]`` the rows' GRPO advantages (needed when ``reward_weight`` is not 0).
        reward_weight: weight of the task reward's advantage; 0 is pure distillation.
        kl_coef: weight of the reverse-KL advantage.
    """
    if teacher_logprobs.shape != behaviour_logprobs.shape:
        raise ValueError(f"teacher_logprobs has shape {tuple(teacher_logprobs.shape)}, behaviour_logprobs "
                         f"{tuple(behaviour_logprobs.shape)}: they must match (one per completion token)")
    mask = valid_mask(token_mask, None, teacher_logprobs.shape)
    adv = kl_coef * (teacher_logprobs.detach() - behaviour_logprobs.detach())
    if reward_weight != 0.0:
        if reward_advantages is None:
            raise ValueError(f"distillation.reward_weight={reward_weight!r} needs the rows' reward advantages: pass "
                             "reward_advantages, or set reward_weight: 0")
        adv = adv + reward_weight * reward_advantages.detach().to(adv.dtype)[:, None]
    return torch.where(mask, adv, torch.zeros_like(adv))


class ReverseKLDistillLoss(nn.Module):
    """The per-token reverse-KL distillation loss: :func:`distill_advantages` through a clipped policy-gradient
    surrogate (``pg``, a :class:`ClippedPGLoss`: its clip, IS correction and aggregation apply).

    Args:
        pg: the surrogate; None: ``ClippedPGLoss()`` (no IS correction: turn it on for stale rows).
        reward_weight: weight of the task reward's GRPO advantage (``distillation.reward_weight``).
        kl_coef: weight of the reverse-KL advantage.
    """

    def __init__(self, pg: PolicyLoss | None = None, reward_weight: float = 0.0, kl_coef: float = 1.0) -> None:
        super().__init__()
        if not kl_coef > 0.0:
            raise ValueError(f"ReverseKLDistillLoss(kl_coef={kl_coef!r}) must be > 0: use GRPO for reward-only "
                             "training")
        if not reward_weight >= 0.0:
            raise ValueError(f"distillation.reward_weight={reward_weight!r} must be >= 0 (0: pure distillation)")
        self.pg: PolicyLoss = pg if pg is not None else ClippedPGLoss()
        self.reward_weight = reward_weight
        self.kl_coef = kl_coef

    @property
    def requires_reference_logprobs(self) -> bool:
        return self.pg.requires_reference_logprobs

    @property
    def token_level_loss(self) -> bool:
        return self.pg.token_level_loss

    def forward(
        self, curr_logprobs: Tensor, prev_logprobs: Tensor, generation_logprobs: Tensor, teacher_logprobs: Tensor,
        token_mask: Tensor, sample_mask: Tensor | None = None, reward_advantages: Tensor | None = None,
        reference_logprobs: Tensor | None = None, global_normalizer: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)``: ``pg``'s loss and metrics with the distillation advantages, plus ``reverse_kl``
        (the sampled estimate ``mean(log pi_beh - log pi_t)`` over valid tokens) and ``teacher_logprob``
        (the teacher's mean logprob of the student's tokens)."""
        adv = distill_advantages(teacher_logprobs, generation_logprobs, token_mask, reward_advantages,
                                 self.reward_weight, self.kl_coef)
        loss, metrics = self.pg(curr_logprobs, prev_logprobs, generation_logprobs, adv, token_mask, sample_mask,
                                reference_logprobs=reference_logprobs, global_normalizer=global_normalizer)
        m = valid_mask(token_mask, sample_mask, curr_logprobs.shape).to(curr_logprobs.dtype)
        zero = torch.zeros_like(curr_logprobs)
        teacher = torch.where(m.bool(), teacher_logprobs.detach().to(zero.dtype), zero)
        gen = torch.where(m.bool(), generation_logprobs.detach().to(zero.dtype), zero)
        metrics["reverse_kl"] = masked_mean(gen - teacher, m)
        metrics["teacher_logprob"] = masked_mean(teacher, m)
        return loss, metrics
