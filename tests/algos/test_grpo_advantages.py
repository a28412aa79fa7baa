"""GRPO group-relative advantages: expected values derived by hand in the comments."""

import math

import pytest
import torch

from screl.algos import grpo_advantages

EPS = 1e-6  # the default std epsilon


def close(actual: torch.Tensor, expected: list[float] | torch.Tensor) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=1e-5, atol=1e-6)


def test_leave_one_out_without_std() -> None:
    # r = [1, 0, 2]; b_0 = (0+2)/2 = 1, b_1 = (1+2)/2 = 1.5, b_2 = (1+0)/2 = 0.5
    # A = [1-1, 0-1.5, 2-0.5] = [0, -1.5, 1.5]
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 2.0]), 3, normalize_std=False)
    close(adv, [0.0, -1.5, 1.5])


def test_mean_baseline_without_std() -> None:
    # mean([1, 0, 2]) = 1 -> A = [0, -1, 1]
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 2.0]), 3, leave_one_out=False, normalize_std=False)
    close(adv, [0.0, -1.0, 1.0])


def test_mean_baseline_with_bessel_std() -> None:
    # mean 1, deviations [0, -1, 1]; Bessel std = sqrt((0+1+1)/(3-1)) = 1 -> A = [0, -1, 1] / (1 + eps)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 2.0]), 3, leave_one_out=False)
    close(adv, [0.0, -1.0 / (1 + EPS), 1.0 / (1 + EPS)])


def test_leave_one_out_std_over_the_other_rows() -> None:
    # r = [1, 0, 2]. Row 0: others [0, 2], b=1, A=0.
    # Row 1: others [1, 2], b=1.5, std = sqrt((0.25+0.25)/1) = sqrt(0.5) -> A = -1.5/(sqrt(0.5)+eps)
    # Row 2: others [1, 0], b=0.5, std = sqrt(0.5) -> A = 1.5/(sqrt(0.5)+eps)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 2.0]), 3)
    s = math.sqrt(0.5)
    close(adv, [0.0, -1.5 / (s + EPS), 1.5 / (s + EPS)])


def test_leave_one_out_zero_spread_among_others_stays_unnormalized() -> None:
    # r = [1, 0, 0]. Row 0: others [0, 0], b=0, std 0 -> A = 1, not divided (no 1/eps blow-up).
    # Rows 1, 2: others [1, 0], b=0.5, std sqrt(0.5) -> A = -0.5/(sqrt(0.5)+eps)
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), 3)
    a = -0.5 / (math.sqrt(0.5) + EPS)
    close(adv, [1.0, a, a])


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_zero_variance_group_gives_zero_not_nan(leave_one_out: bool, normalize_std: bool) -> None:
    # every reward equal -> every baseline equals the reward -> A = 0; std 0 is never divided by
    adv = grpo_advantages(torch.full((4,), 3.0), 4, leave_one_out=leave_one_out, normalize_std=normalize_std)
    close(adv, [0.0] * 4)


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize_std", [True, False])
def test_one_sample_groups_give_zero(leave_one_out: bool, normalize_std: bool) -> None:
    # G = 1: no sibling to compare against -> A = 0 (LOO would otherwise divide by n-1 = 0)
    adv = grpo_advantages(
        torch.tensor([5.0, -2.0]), 1, leave_one_out=leave_one_out, normalize_std=normalize_std
    )
    close(adv, [0.0, 0.0])


def test_groups_are_independent() -> None:
    # G = 2, groups [1, 0] and [10, 20].
    # Mean baseline, no std: [0.5, -0.5, -5, 5]. LOO, no std: [1, -1, -10, 10].
    # LOO with std: each row's "others" set has one row -> std undefined -> unnormalized, same values.
    # Mean with std: group 0 std = sqrt((0.25+0.25)/1) = sqrt(0.5) -> +-0.5/(sqrt(0.5)+eps);
    #                group 1 std = sqrt((25+25)/1) = sqrt(50) -> +-5/(sqrt(50)+eps).
    r = torch.tensor([1.0, 0.0, 10.0, 20.0])
    close(grpo_advantages(r, 2, leave_one_out=False, normalize_std=False), [0.5, -0.5, -5.0, 5.0])
    close(grpo_advantages(r, 2, normalize_std=False), [1.0, -1.0, -10.0, 10.0])
    close(grpo_advantages(r, 2), [1.0, -1.0, -10.0, 10.0])
    a0, a1 = 0.5 / (math.sqrt(0.5) + EPS), 5.0 / (math.sqrt(50.0) + EPS)
    close(grpo_advantages(r, 2, leave_one_out=False), [a0, -a0, -a1, a1])


def test_masked_rows_are_excluded_from_the_baseline_and_get_zero() -> None:
    # Row 2 is masked; its reward (NaN here) must not leak. Valid rows [1, 0, 2] as in the tests above:
    # mean baseline -> [0, -1, (masked) 0, 1]; LOO -> [0, -1.5, 0, 1.5].
    r = torch.tensor([1.0, 0.0, float("nan"), 2.0])
    mask = torch.tensor([True, True, False, True])
    close(grpo_advantages(r, 4, mask, leave_one_out=False, normalize_std=False), [0.0, -1.0, 0.0, 1.0])
    close(grpo_advantages(r, 4, mask, normalize_std=False), [0.0, -1.5, 0.0, 1.5])
    # with std (mean baseline): Bessel std of [1, 0, 2] = 1
    close(grpo_advantages(r, 4, mask, leave_one_out=False), [0.0, -1 / (1 + EPS), 0.0, 1 / (1 + EPS)])


def test_all_masked_group_and_single_valid_row_give_zero() -> None:
    # group 0 fully masked; group 1 has one valid row (no baseline) -> all zeros, no NaN
    r = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 6.0])
    mask = torch.tensor([0, 0, 0, 0, 1, 0])
    for loo in (True, False):
        close(grpo_advantages(r, 3, mask, leave_one_out=loo), [0.0] * 6)


def test_float64_preserved() -> None:
    adv = grpo_advantages(torch.tensor([1.0, 0.0], dtype=torch.float64), 2, normalize_std=False)
    assert adv.dtype == torch.float64
    close(adv, [1.0, -1.0])


def test_invalid_shapes_raise() -> None:
    with pytest.raises(ValueError, match=r"group_size=3.*multiple of group_size"):
        grpo_advantages(torch.zeros(4), 3)
    with pytest.raises(ValueError, match=r"rewards.shape=\(2, 2\).*expected \[B\]"):
        grpo_advantages(torch.zeros(2, 2), 2)
    with pytest.raises(ValueError, match=r"sample_mask.shape=\(3,\)"):
        grpo_advantages(torch.zeros(4), 2, torch.ones(3))


def test_std_floor_bounds_the_near_tie_blow_up() -> None:
    # r = [0.1, 0.1, 0.11, 0.5], leave-one-out. Row 3: others [0.1, 0.1, 0.11], b = 0.31/3, deviations
    # [-0.01/3, -0.01/3, 0.02/3], Bessel std s = sqrt(6e-4/9 / 2) ~ 0.00577 -> A = (0.5 - b) / s ~ 68.7.
    # A floor of 0.1 divides by max(s, 0.1) instead: (0.5 - b) / 0.1 ~ 3.97. Rows 0-2 have a wide spread
    # among their others (they include 0.5), above the floor: unchanged.
    r = torch.tensor([0.1, 0.1, 0.11, 0.5])
    b3 = 0.31 / 3
    s3 = math.sqrt((2 * (0.01 / 3) ** 2 + (0.02 / 3) ** 2) / 2)
    plain = grpo_advantages(r, 4)
    floored = grpo_advantages(r, 4, std_floor=0.1)
    close(plain[3:], [(0.5 - b3) / (s3 + EPS)])
    close(floored[3:], [(0.5 - b3) / (0.1 + EPS)])
    close(floored[:3], plain[:3])
    assert float(plain[:3].abs().max()) < 1.0  # the others' stds exceed the floor
    # zero spread stays unnormalized and equal groups stay exactly 0 under a floor
    close(grpo_advantages(torch.tensor([1.0, 0.0, 0.0]), 3, std_floor=0.5)[:1], [1.0])
    assert torch.equal(grpo_advantages(torch.full((4,), 2.0), 4, std_floor=0.5), torch.zeros(4))


def test_negative_std_floor_is_refused() -> None:
    with pytest.raises(ValueError, match=r"std_floor=-0.1.*must be >= 0"):
        grpo_advantages(torch.zeros(4), 4, std_floor=-0.1)


# --- RLOO, the registered ``rloo`` estimator (Ahmadian et al., 2024) ---------------------------------------


def test_rloo_is_each_reward_minus_the_mean_of_its_siblings_unnormalized() -> None:
    from screl.algos import get_adv_estimator, rloo_advantages

    # group 1, r = [1, 0, 0, 0]: A_0 = 1 - (0+0+0)/3 = 1; A_j = 0 - (1+0+0)/3 = -1/3 for the three failures
    # group 2, r = [2, 2, 5, 3]: A = [2-10/3, 2-10/3, 5-7/3, 3-3] = [-4/3, -4/3, 8/3, 0]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 5.0, 3.0])
    want = [1.0, -1 / 3, -1 / 3, -1 / 3, -4 / 3, -4 / 3, 8 / 3, 0.0]
    close(rloo_advantages(rewards, 4), want)
    estimator = get_adv_estimator("rloo")
    assert not estimator.needs_values
    close(estimator.fn(rewards, 4, None), want)  # the registered entry ignores the block's normalization knobs
    # the same as G / (G - 1) x (r_i - group mean): 4/3 x (1 - 1/4) = 1
    close(rloo_advantages(rewards, 4), 4 / 3 * (rewards.reshape(2, 4) - rewards.reshape(2, 4).mean(1, True)).reshape(-1))


def test_registered_estimators_and_their_refusals() -> None:
    from screl.algos import adv_estimator_names, get_adv_estimator, register_adv_estimator

    assert adv_estimator_names() == ["gae", "grpo", "rloo"]
    assert adv_estimator_names(needs_values=True) == ["gae"]
    with pytest.raises(ValueError, match=r"unknown advantage estimator 'nope'; registered: \['gae', 'grpo', 'rloo'\]"):
        get_adv_estimator("nope")
    with pytest.raises(ValueError, match=r"advantage estimator 'rloo' is already registered \(rloo_advantages\)"):
        register_adv_estimator("rloo")(lambda rewards, group_size, config: rewards)


def test_the_grpo_entry_reads_the_blocks_knobs() -> None:
    from screl.algos import get_adv_estimator
    from screl.config import AdvantageEstimatorConfig

    rewards = torch.tensor([1.0, 0.0, 2.0])
    config = AdvantageEstimatorConfig(use_leave_one_out_baseline=False, normalize_rewards=False)
    close(get_adv_estimator("grpo").fn(rewards, 3, config), [0.0, -1.0, 1.0])  # mean([1, 0, 2]) = 1
