"""GAE, terminal token rewards and masked whitening: expected values derived by hand."""

import math

import pytest
import torch

from screl.algos import gae_advantages, masked_whiten, terminal_token_rewards


def close(actual: torch.Tensor, expected: list | torch.Tensor) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=1e-5, atol=1e-6)


R = torch.tensor([[0.0, 0.0, 1.0]])
V = torch.tensor([[0.5, 0.6, 0.7]])
M = torch.ones(1, 3, dtype=torch.bool)


def test_gamma_one_lambda_one_is_return_minus_value() -> None:
    # delta_2 = 1 + 0 - 0.7 = 0.3; delta_1 = 0 + 0.7 - 0.6 = 0.1; delta_0 = 0 + 0.6 - 0.5 = 0.1
    # A = [0.1+0.1+0.3, 0.1+0.3, 0.3] = [0.5, 0.4, 0.3] (= 1 - V); returns = A + V = [1, 1, 1]
    adv, ret = gae_advantages(R, V, M, gamma=1.0, lam=1.0)
    close(adv, [[0.5, 0.4, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_discounted() -> None:
    # gamma = lam = 0.5, gamma*lam = 0.25
    # t=2: delta = 1 - 0.7 = 0.3, A = 0.3
    # t=1: delta = 0.5*0.7 - 0.6 = -0.25, A = -0.25 + 0.25*0.3 = -0.175
    # t=0: delta = 0.5*0.6 - 0.5 = -0.2, A = -0.2 + 0.25*(-0.175) = -0.24375
    # returns = A + V = [0.25625, 0.425, 1.0]
    adv, ret = gae_advantages(R, V, M, gamma=0.5, lam=0.5)
    close(adv, [[-0.24375, -0.175, 0.3]])
    close(ret, [[0.25625, 0.425, 1.0]])


def test_masked_positions_are_skipped_not_bootstrapped_through() -> None:
    # positions 1, 2 are tool tokens (masked) with garbage rewards/values that must be ignored.
    # gamma = lam = 0.5. t=3: delta = 1 - 0.7 = 0.3, A = 0.3.
    # t=0 bootstraps from t=3 (one discount step): delta = 0.5*0.7 - 0.5 = -0.15,
    #   A = -0.15 + 0.25*0.3 = -0.075
    # returns: [-0.075 + 0.5, 0, 0, 0.3 + 0.7] = [0.425, 0, 0, 1.0]
    r = torch.tensor([[0.0, 9.0, 9.0, 1.0]])
    v = torch.tensor([[0.5, 100.0, 100.0, 0.7]])
    m = torch.tensor([[1, 0, 0, 1]])
    adv, ret = gae_advantages(r, v, m, gamma=0.5, lam=0.5)
    close(adv, [[-0.075, 0.0, 0.0, 0.3]])
    close(ret, [[0.425, 0.0, 0.0, 1.0]])


def test_trailing_padding_and_all_masked_row() -> None:
    # row 0: mask [1, 1, 0]; t=1 is terminal: delta = 1 - 0.4 = 0.6; t=0: delta = 0.4 - 0.2 = 0.2, A = 0.8
    # row 1: nothing valid -> zeros
    r = torch.tensor([[0.0, 1.0, 5.0], [1.0, 1.0, 1.0]])
    v = torch.tensor([[0.2, 0.4, 9.0], [1.0, 1.0, 1.0]])
    m = torch.tensor([[1, 1, 0], [0, 0, 0]])
    adv, ret = gae_advantages(r, v, m, gamma=1.0, lam=1.0)
    close(adv, [[0.8, 0.6, 0.0], [0.0, 0.0, 0.0]])
    close(ret, [[1.0, 1.0, 0.0], [0.0, 0.0, 0.0]])


def test_decoupled_value_lambda() -> None:
    # lam = 0: A = delta = [0.1, 0.1, 0.3]; value_lam = 1 (gamma 1): returns = 1 - V + V = [1, 1, 1]
    adv, ret = gae_advantages(R, V, M, gamma=1.0, lam=0.0, value_lam=1.0)
    close(adv, [[0.1, 0.1, 0.3]])
    close(ret, [[1.0, 1.0, 1.0]])


def test_per_row_lambda_tensor() -> None:
    # same row twice, lam = [1, 0]: row 0 as in the lam=1 test, row 1 = deltas
    adv, _ = gae_advantages(
        R.repeat(2, 1), V.repeat(2, 1), M.repeat(2, 1), gamma=1.0, lam=torch.tensor([1.0, 0.0])
    )
    close(adv, [[0.5, 0.4, 0.3], [0.1, 0.1, 0.3]])


def test_whiten_matches_masked_whiten() -> None:
    # raw A (gamma = lam = 1) = [0.5, 0.4, 0.3]; mean 0.4, population var = (0.01+0+0.01)/3
    adv, _ = gae_advantages(R, V, M, gamma=1.0, lam=1.0, whiten=True)
    std = math.sqrt(0.02 / 3 + 1e-8)
    close(adv, [[0.1 / std, 0.0, -0.1 / std]])


def test_gae_shape_mismatch_raises() -> None:
    with pytest.raises(ValueError, match=r"same \[B, T\] shape"):
        gae_advantages(R, V[:, :2], M)
    with pytest.raises(ValueError, match=r"pass a float or a \[B\] tensor"):
        gae_advantages(R, V, M, lam=torch.tensor([1.0, 0.5]))


def test_masked_whiten() -> None:
    # valid [1, 2, 3] (100 masked): mean 2, population var 2/3 -> [-1, 0, 1]/sqrt(2/3 + 1e-8), masked -> 0
    x = torch.tensor([1.0, 2.0, 3.0, 100.0])
    s = math.sqrt(2.0 / 3.0 + 1e-8)
    close(masked_whiten(x, torch.tensor([1, 1, 1, 0])), [-1 / s, 0.0, 1 / s, 0.0])
    # one valid element -> x - mean = 0; empty mask -> zeros (no NaN)
    close(masked_whiten(x, torch.tensor([0, 1, 0, 0])), [0.0] * 4)
    close(masked_whiten(x, torch.zeros(4)), [0.0] * 4)


def test_terminal_token_rewards() -> None:
    # score at the last valid position: row 0 -> t=1, row 1 -> t=2, row 2 (empty) -> nowhere
    scores = torch.tensor([1.0, 2.0, 3.0])
    m = torch.tensor([[1, 1, 0], [1, 0, 1], [0, 0, 0]])
    close(terminal_token_rewards(scores, m), [[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    # KL in reward, coef 0.5, kl = [0.1, 0.2, 0.3] per row: subtract 0.5*kl on valid tokens only
    # row 0: [-0.05, 1 - 0.1, 0]; row 1: [-0.05, 0, 2 - 0.15]; row 2: zeros
    kl = torch.tensor([[0.1, 0.2, 0.3]]).repeat(3, 1)
    close(
        terminal_token_rewards(scores, m, kl=kl, kl_coef=0.5),
        [[-0.05, 0.9, 0.0], [-0.05, 0.0, 1.85], [0.0, 0.0, 0.0]],
    )


def test_lambda_one_is_discounted_return_minus_value_and_lambda_zero_is_td() -> None:
    # gamma = 0.9, rewards [0.2, 0, 1] on 3 valid tokens, V = [0.5, 0.6, 0.7]
    # lambda = 1: A_t = sum_k 0.9^k r_{t+k} - V_t: G = [0.2 + 0.81, 0.9, 1.0] = [1.01, 0.9, 1.0]
    r = torch.tensor([[0.2, 0.0, 1.0]])
    adv, ret = gae_advantages(r, V, M, gamma=0.9, lam=1.0)
    close(adv, [[1.01 - 0.5, 0.9 - 0.6, 1.0 - 0.7]])
    close(ret, [[1.01, 0.9, 1.0]])
    # lambda = 0: A_t = delta_t = r_t + 0.9 V_{t+1} - V_t = [0.2 + 0.54 - 0.5, 0.63 - 0.6, 1 - 0.7]
    adv0, ret0 = gae_advantages(r, V, M, gamma=0.9, lam=0.0)
    close(adv0, [[0.24, 0.03, 0.3]])
    close(ret0, [[0.74, 0.63, 1.0]])
