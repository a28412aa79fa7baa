"""The off-policy corrections ``ClippedPGLoss`` offers beyond token TIS, against values derived by hand.

Convention (as in test_policy_loss.py): ``prev_logprobs = 0``, ``curr_logprobs = log(ratio to prev)`` and
``generation_logprobs = -log(w)``, so the IS weight ``exp(prev - gen)`` is ``w`` and the ratio of the
current policy to the behaviour policy is ``ratio * w``. Rows have advantages ``[1, -1]``.
"""

import pytest
import torch

from screl.algos import ClippedPGLoss

W = [[2.0, 0.5], [1.0, 4.0]]
ON_PREV = [[1.0, 1.0], [1.0, 1.0]]  # the current policy equals pi_old: surrogate terms are -A
ADV = [1.0, -1.0]


def close(actual: torch.Tensor, expected: float | list) -> None:
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), rtol=1e-5, atol=1e-6)


def run(loss_fn: ClippedPGLoss, mask: list | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    curr = torch.tensor(ON_PREV).log().requires_grad_(True)
    gen = -torch.tensor(W).log()
    token_mask = torch.ones(2, 2) if mask is None else torch.tensor(mask, dtype=torch.float32)
    loss, metrics = loss_fn(curr, torch.zeros(2, 2), gen, torch.tensor(ADV), token_mask)
    return loss, metrics, curr


def geometric(**kwargs: object) -> ClippedPGLoss:
    return ClippedPGLoss(use_importance_sampling_correction=True, is_level="geometric", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "expected", "oob", "applied"),
    [
        # row weights: geometric means sqrt(2 * 0.5) = 1 and sqrt(1 * 4) = 2 -> terms [-1, -1, 2, 2] -> 2/4
        ({}, 0.5, None, [1.0, 2.0]),
        # truncated at 1.5: row 1 -> 1.5 -> [-1, -1, 1.5, 1.5] -> 1/4; one row of two out of bounds
        ({"is_truncation": 1.5}, 0.25, 0.5, [1.0, 1.5]),
        # masked at 1.5: row 1 dropped -> [-1, -1, 0, 0] -> -2/4
        ({"is_truncation": 1.5, "is_mode": "mask"}, -0.5, 0.5, [1.0, 0.0]),
        # masked outside [1.2, 3]: row 0 (w = 1) dropped, row 1 kept -> [0, 0, 2, 2] -> 4/4
        ({"is_truncation": 3.0, "is_truncation_min": 1.2, "is_mode": "mask"}, 1.0, 0.5, [0.0, 2.0]),
    ],
)
def test_geometric_sequence_is(kwargs: dict, expected: float, oob: float | None, applied: list[float]) -> None:
    loss, m, curr = run(geometric(**kwargs))
    close(loss, expected)
    # statistics over rows of the raw weights [1, 2]: mean 1.5, ESS = 3^2 / (2 * 5)
    close(m["is_weight_mean"], 1.5)
    close(m["is_weight_max"], 2.0)
    close(m["is_ess"], 0.9)
    if oob is not None:
        close(m["is_oob_fraction"], oob)
    loss.backward()  # the applied weight is a constant per row: d loss / d logpi = -A * w_row / 4
    assert curr.grad is not None
    close(curr.grad, [[-applied[0] / 4, -applied[0] / 4], [applied[1] / 4, applied[1] / 4]])


def test_geometric_is_averages_over_the_rows_valid_tokens_only() -> None:
    # token (0, 1) masked: row 0's weight is its one valid token's, 2 (the product would also be 2), row 1's
    # sqrt(4) = 2 (the product: 4) -> geometric terms [-2, 2, 2] -> 2/3; product terms [-2, 4, 4] -> 6/3
    mask = [[1, 0], [1, 1]]
    loss, m, _ = run(geometric(), mask)
    close(loss, 2 / 3)
    close(m["is_weight_mean"], 2.0)
    close(m["num_valid_tokens"], 3.0)
    product, _, _ = run(ClippedPGLoss(use_importance_sampling_correction=True, is_level="sequence"), mask)
    close(product, 2.0)


def test_geometric_is_does_not_grow_with_length() -> None:
    # one row of n tokens each with w = 2: the product weight is 2^n, the geometric one stays 2
    for n in (1, 4, 16):
        curr = torch.zeros(1, n, requires_grad=True)
        gen = torch.full((1, n), -torch.log(torch.tensor(2.0)).item())
        _, m = geometric()(curr, torch.zeros(1, n), gen, torch.tensor([1.0]), torch.ones(1, n))
        _, mp = ClippedPGLoss(use_importance_sampling_correction=True, is_level="sequence")(
            curr, torch.zeros(1, n), gen, torch.tensor([1.0]), torch.ones(1, n))
        close(m["is_weight_mean"], 2.0)
        close(mp["is_weight_mean"], 2.0**n)


def test_naive_ppo_clips_against_the_behaviour_policy() -> None:
    # proximal = behaviour: the ratio is pi / pi_gen = w (the current policy equals pi_old), clip 0.2/0.2,
    # no IS weight. Row 0 (A = 1): r = 2 -> max(-2, -1.2) = -1.2 (clipped); r = 0.5 -> max(-0.5, -0.8) = -0.5.
    # Row 1 (A = -1): r = 1 -> 1; r = 4 -> max(4, 1.2) = 4. Mean (-1.2 - 0.5 + 1 + 4) / 4 = 0.825
    loss, m, curr = run(ClippedPGLoss(proximal_policy="behaviour"))
    close(loss, 0.825)
    close(m["clip_fraction"], 0.75)  # 2, 0.5 and 4 lie outside [0.8, 1.2]
    close(m["ratio_mean"], 7.5 / 4)
    close(m["is_weight_max"], 4.0)  # the diagnostics still measure pi_old / pi_gen
    loss.backward()
    assert curr.grad is not None
    # the clipped stale token (0, 0) loses its gradient; the others get -A * r / 4
    close(curr.grad, [[0.0, -0.5 / 4], [1 / 4, 4 / 4]])


def test_decoupled_ppo_keeps_the_gradient_naive_ppo_clips_away() -> None:
    # the default proximal policy is the trainer's at the step that claimed the data: the ratio to it is 1
    # (nothing clipped) and the stale tokens are reweighted by w instead: terms -A * w = [-2, -0.5, 1, 4]
    loss, m, curr = run(ClippedPGLoss(use_importance_sampling_correction=True))
    close(loss, 0.625)
    close(m["clip_fraction"], 0.0)
    loss.backward()
    assert curr.grad is not None
    close(curr.grad, [[-2 / 4, -0.5 / 4], [1 / 4, 4 / 4]])


def test_naive_ppo_with_an_is_weight_is_refused() -> None:
    with pytest.raises(ValueError, match=r"proximal_policy='behaviour'.*would correct twice.*"
                                         r"use_importance_sampling_correction=False"):
        ClippedPGLoss(proximal_policy="behaviour", use_importance_sampling_correction=True)
    with pytest.raises(ValueError, match=r"proximal_policy='old'.*Use one of \('trainer', 'behaviour'\)"):
        ClippedPGLoss(proximal_policy="old")  # type: ignore[arg-type]
