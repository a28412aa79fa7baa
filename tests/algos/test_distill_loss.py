"""The reverse-KL distillation objective (screl.algos.distill): advantages and loss pinned by hand, a gradcheck."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from screl.algos import ClippedPGLoss, ReverseKLDistillLoss, distill_advantages
from screl.algos.distill import top_k_forward_kl, top_k_reverse_kl

TEACHER = torch.tensor([[-1.0, -2.0, -0.5], [-0.25, -3.0, 0.0]])
BEHAVIOUR = torch.tensor([[-1.5, -1.0, -0.5], [-1.25, -2.0, -9.0]])
MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
# teacher - behaviour on the valid tokens; the masked one is 0
PURE = torch.tensor([[0.5, -1.0, 0.0], [1.0, -1.0, 0.0]])


def test_advantage_is_teacher_minus_behaviour() -> None:
    assert torch.equal(distill_advantages(TEACHER, BEHAVIOUR, MASK), PURE)


def test_advantage_mixes_the_reward_advantage_per_row() -> None:
    adv = distill_advantages(TEACHER, BEHAVIOUR, MASK, torch.tensor([2.0, -1.0]), reward_weight=0.5)
    assert torch.equal(adv, torch.tensor([[1.5, 0.0, 1.0], [0.5, -1.5, 0.0]]))
    scaled = distill_advantages(TEACHER, BEHAVIOUR, MASK, kl_coef=2.0)
    assert torch.equal(scaled, 2.0 * PURE)


def test_reward_weight_without_reward_advantages_is_refused() -> None:
    with pytest.raises(ValueError, match=r"distillation.reward_weight=0.5 needs the rows' reward advantages"):
        distill_advantages(TEACHER, BEHAVIOUR, MASK, reward_weight=0.5)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"teacher_logprobs has shape \(2, 2\), behaviour_logprobs \(2, 3\)"):
        distill_advantages(TEACHER[:, :2], BEHAVIOUR, MASK)


def test_bad_hyperparameters_are_refused() -> None:
    with pytest.raises(ValueError, match=r"kl_coef=0.0\) must be > 0"):
        ReverseKLDistillLoss(kl_coef=0.0)
    with pytest.raises(ValueError, match=r"distillation.reward_weight=-1.0 must be >= 0"):
        ReverseKLDistillLoss(reward_weight=-1.0)


def test_on_policy_loss_is_the_sampled_reverse_kl_and_its_gradient_is_minus_a_over_n() -> None:
    # on-policy (curr = prev = gen): ratio 1, the loss is -mean(A) = mean(gen - teacher), the k1 reverse KL
    curr = BEHAVIOUR.clone().requires_grad_(True)
    loss, metrics = ReverseKLDistillLoss()(curr, BEHAVIOUR, BEHAVIOUR, TEACHER, MASK)
    # A = [0.5, -1, 0, 1, -1] over 5 valid tokens: -sum(A) / 5 = 0.1
    assert loss.item() == pytest.approx(0.1, abs=1e-7)
    assert metrics["reverse_kl"].item() == pytest.approx(0.1, abs=1e-7)
    assert metrics["teacher_logprob"].item() == pytest.approx((-1.0 - 2.0 - 0.5 - 0.25 - 3.0) / 5, abs=1e-7)
    loss.backward()
    assert curr.grad is not None
    torch.testing.assert_close(curr.grad, -PURE / 5, rtol=0, atol=1e-7)


def test_stale_rows_are_importance_weighted_like_grpo() -> None:
    # row 0 was sampled by a policy the trainer now rates log 2 likelier: IS weight exp(prev - gen) = 2
    prev = BEHAVIOUR + torch.tensor([[math.log(2.0)] * 3, [0.0] * 3])
    curr = prev.clone().requires_grad_(True)
    pg = ClippedPGLoss(use_importance_sampling_correction=True)
    loss, metrics = ReverseKLDistillLoss(pg)(curr, prev, BEHAVIOUR, TEACHER, MASK)
    # -(2 * (0.5 - 1 + 0) + 1 * (1 - 1)) / 5 = 0.2; the advantage stays teacher - behaviour (not - prev)
    assert loss.item() == pytest.approx(0.2, abs=1e-6)
    assert metrics["is_weight_max"].item() == pytest.approx(2.0, abs=1e-6)
    loss.backward()
    assert curr.grad is not None
    weight = torch.tensor([[2.0], [1.0]])
    torch.testing.assert_close(curr.grad, -weight * PURE / 5, rtol=0, atol=1e-6)
    # without the correction the same rows weigh 1
    plain, _ = ReverseKLDistillLoss()(prev, prev, BEHAVIOUR, TEACHER, MASK)
    assert plain.item() == pytest.approx(0.1, abs=1e-6)


def test_sample_mask_drops_rows_and_reward_mix_enters_the_loss() -> None:
    loss, metrics = ReverseKLDistillLoss(reward_weight=0.5)(
        BEHAVIOUR, BEHAVIOUR, BEHAVIOUR, TEACHER, MASK, torch.tensor([1.0, 0.0]), torch.tensor([2.0, -1.0]))
    # row 0 only: A = [1.5, 0, 1] -> -2.5 / 3
    assert loss.item() == pytest.approx(-2.5 / 3, abs=1e-6)
    assert metrics["reverse_kl"].item() == pytest.approx((-0.5 + 1.0 + 0.0) / 3, abs=1e-6)


@pytest.mark.parametrize("kwargs", [{}, {"use_importance_sampling_correction": True, "is_truncation": 4.0},
                                    {"token_level_loss": False}])
@pytest.mark.parametrize("reward_weight", [0.0, 0.7])
def test_gradcheck_float64(kwargs: dict, reward_weight: float) -> None:
    g = torch.Generator().manual_seed(0)
    shape = (3, 4)
    prev = -torch.rand(shape, generator=g, dtype=torch.float64) - 0.5
    curr = (prev + 0.05 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    gen = prev + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)
    teacher = prev + torch.randn(shape, generator=g, dtype=torch.float64)
    reward_adv = torch.randn(3, generator=g, dtype=torch.float64)
    token_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss_fn = ReverseKLDistillLoss(ClippedPGLoss(**kwargs), reward_weight=reward_weight)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return loss_fn(c, prev, gen, teacher, token_mask, torch.tensor([1, 1, 0]), reward_adv)[0]

    assert torch.autograd.gradcheck(fn, (curr,), eps=1e-6, atol=1e-8, rtol=1e-6)


# -- the top-k estimator ---------------------------------------------------------------------------------------


def test_top_k_reverse_kl_by_hand_with_a_rest_bucket() -> None:
    """Three tokens, the teacher's top 2: p_s = (0.5, 0.25 | rest 0.25), p_t = (0.75, 0.125 | rest 0.125)."""
    student = torch.tensor([[0.5, 0.25]]).log()
    teacher = torch.tensor([[0.75, 0.125]]).log()
    want = 0.5 * math.log(0.5 / 0.75) + 0.25 * math.log(0.25 / 0.125) + 0.25 * math.log(0.25 / 0.125)
    assert top_k_reverse_kl(student, teacher).item() == pytest.approx(want, abs=1e-6)
    assert top_k_reverse_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)  # equal distributions


def test_top_k_reverse_kl_over_the_whole_vocabulary_is_the_full_kl() -> None:
    g = torch.Generator().manual_seed(0)
    s = torch.log_softmax(torch.randn(4, 7, generator=g, dtype=torch.float64) * 2, -1)
    t = torch.log_softmax(torch.randn(4, 7, generator=g, dtype=torch.float64) * 2, -1)
    order = torch.argsort(t, -1, descending=True)  # the teacher's top-7 of 7, in its own order
    full = (s.exp() * (s - t)).sum(-1)
    got = top_k_reverse_kl(s.gather(-1, order), t.gather(-1, order))
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9)


def test_top_k_reverse_kl_pulls_mass_to_the_teachers_token_the_student_never_sampled() -> None:
    """The gradient at a position raises the logit of the teacher's answer (the sampled estimator would only push
    down the sampled tokens)."""
    logits = torch.zeros(1, 5, dtype=torch.float64, requires_grad=True)  # a uniform student
    teacher = torch.tensor([[-1e-3, -8.0]], dtype=torch.float64)  # the teacher: token 3 almost surely, then token 0
    top = torch.tensor([[3, 0]])
    top_k_reverse_kl(torch.log_softmax(logits, -1).gather(-1, top), teacher).sum().backward()
    assert logits.grad is not None and int(logits.grad[0].argmin()) == 3  # descent raises token 3's logit most


@pytest.mark.parametrize("fn", [top_k_reverse_kl, top_k_forward_kl])
def test_top_k_gradcheck_float64(fn: Any) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, generator=g, dtype=torch.float64, requires_grad=True)
    top = torch.tensor([[0, 2], [5, 1], [3, 4]])
    teacher = torch.log_softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1).gather(-1, top)
    assert torch.autograd.gradcheck(lambda z: fn(torch.log_softmax(z, -1).gather(-1, top), teacher), (logits,))


@pytest.mark.parametrize("fn", [top_k_reverse_kl, top_k_forward_kl])
def test_top_k_shape_mismatch_is_refused(fn: Any) -> None:
    with pytest.raises(ValueError, match=r"student logprobs of shape \(1, 2\) against teacher top-k logprobs"):
        fn(torch.zeros(1, 2), torch.zeros(1, 3))


def test_top_k_forward_kl_by_hand_with_a_rest_bucket() -> None:
    """The same two distributions as the reverse case: KL(p_t || p_s) weighs each log ratio by the teacher."""
    student = torch.tensor([[0.5, 0.25]]).log()
    teacher = torch.tensor([[0.75, 0.125]]).log()
    want = 0.75 * math.log(0.75 / 0.5) + 0.125 * math.log(0.125 / 0.25) + 0.125 * math.log(0.125 / 0.25)
    assert top_k_forward_kl(student, teacher).item() == pytest.approx(want, abs=1e-6)
    assert top_k_forward_kl(teacher, teacher).item() == pytest.approx(0.0, abs=1e-6)


def test_top_k_forward_kl_over_the_whole_vocabulary_is_the_full_kl() -> None:
    g = torch.Generator().manual_seed(2)
    s = torch.log_softmax(torch.randn(4, 7, generator=g, dtype=torch.float64) * 2, -1)
    t = torch.log_softmax(torch.randn(4, 7, generator=g, dtype=torch.float64) * 2, -1)
    order = torch.argsort(t, -1, descending=True)
    full = (t.exp() * (t - s)).sum(-1)
    got = top_k_forward_kl(s.gather(-1, order), t.gather(-1, order))
    torch.testing.assert_close(got, full, rtol=1e-9, atol=1e-9)


def test_forward_kl_raises_an_answer_the_student_gives_almost_no_mass_faster_than_reverse() -> None:
    """A student sure of token 0 (p = 0.996), a teacher sure of token 3: the forward KL's gradient on token 3's logit
    is about -(p_t - p_s) = -1, the reverse KL's is weighted by the student's p_s(3) = 0.001."""
    base = torch.tensor([[7.0, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    teacher = torch.tensor([[-1e-3, -8.0]], dtype=torch.float64)  # token 3, then token 0
    top = torch.tensor([[3, 0]])
    grads = {}
    for name, fn in (("forward", top_k_forward_kl), ("reverse", top_k_reverse_kl)):
        logits = base.clone().requires_grad_(True)
        fn(torch.log_softmax(logits, -1).gather(-1, top), teacher).sum().backward()
        assert logits.grad is not None
        grads[name] = float(logits.grad[0, 3])
    p3 = float(torch.softmax(base, -1)[0, 3])
    assert grads["forward"] == pytest.approx(-(1 - 1e-3 - p3), abs=2e-3)  # -(p_t(3) - p_s(3)); the rest bucket ~0
    assert grads["reverse"] < 0 and abs(grads["forward"]) > 50 * abs(grads["reverse"])
