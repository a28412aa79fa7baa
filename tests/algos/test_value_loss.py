"""ClippedValueLoss: expected values derived by hand in the comments."""

import pytest
import torch

from screl.algos import ClippedValueLoss


def close(actual: torch.Tensor, expected: float | list | torch.Tensor) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=1e-5, atol=1e-6)


# value_clip 0.2, V_old = 0.5 everywhere:
# a: V=1.0, R=1.2: (1.0-1.2)^2 = 0.04;  V_c = 0.5+0.2 = 0.7: (0.7-1.2)^2 = 0.25  -> 0.25 (clipped term)
# b: V=0.6, R=0.0: 0.36;                 V_c = 0.6 (inside):   0.36             -> 0.36
# c: V=0.0, R=0.0: 0;                    V_c = 0.3:            0.09             -> 0.09 (clipped term)
# d: V=2.0, R=3.0: 1.0;                  V_c = 0.7:            5.29             -> 5.29 (clipped term)
V = [[1.0, 0.6], [0.0, 2.0]]
V_OLD = [[0.5, 0.5], [0.5, 0.5]]
RET = [[1.2, 0.0], [0.0, 3.0]]


def call(loss_fn: ClippedValueLoss, mask: list | None = None, **kwargs: object) -> tuple:
    v = torch.tensor(V, requires_grad=True)
    m = torch.ones(2, 2) if mask is None else torch.tensor(mask)
    loss, metrics = loss_fn(v, torch.tensor(V_OLD), torch.tensor(RET), m, **kwargs)
    return loss, metrics, v


def test_clipped() -> None:
    # 0.5 * (0.25 + 0.36 + 0.09 + 5.29) / 4 = 0.74875
    loss, metrics, v = call(ClippedValueLoss(value_clip=0.2))
    close(loss, 0.74875)
    close(metrics["value_loss"], 0.74875)
    close(metrics["vf_clip_fraction"], 0.75)
    close(metrics["value_mean"], 0.9)  # (1 + 0.6 + 0 + 2) / 4
    close(metrics["returns_mean"], 1.05)
    # explained variance: R - V = [0.2, -0.6, 0, 1], mean 0.15,
    #   pop. var = (0.0025 + 0.5625 + 0.0225 + 0.7225)/4 = 0.3275
    # R mean 1.05, pop. var = (0.0225 + 1.1025 + 1.1025 + 3.8025)/4 = 1.5075
    close(metrics["explained_variance"], 1 - 0.3275 / 1.5075)
    # gradient: clipped terms have zero gradient in V (V_c is constant there);
    #   b: 0.5 * 2 * (0.6 - 0) / 4 = 0.15
    loss.backward()
    assert v.grad is not None
    close(v.grad, [[0.0, 0.15], [0.0, 0.0]])


def test_unclipped() -> None:
    # 0.5 * (0.04 + 0.36 + 0 + 1.0) / 4 = 0.175
    loss, metrics, _ = call(ClippedValueLoss(value_clip=None))
    close(loss, 0.175)
    close(metrics["vf_clip_fraction"], 0.0)


def test_masks_and_coef() -> None:
    # token d masked: 0.5 * (0.25 + 0.36 + 0.09) / 3 = 0.35 / 3
    close(call(ClippedValueLoss(), mask=[[1, 1], [1, 0]])[0], 0.35 / 3)
    # sample_mask drops row 1: 0.5 * (0.25 + 0.36) / 2 = 0.1525; value_coef 2 doubles it
    close(call(ClippedValueLoss(), sample_mask=torch.tensor([1, 0]))[0], 0.1525)
    close(call(ClippedValueLoss(value_coef=2.0), sample_mask=torch.tensor([1, 0]))[0], 0.305)
    # global normalizer 10: 0.5 * 5.99 / 10
    close(call(ClippedValueLoss(), global_normalizer=10.0)[0], 0.2995)


def test_all_masked_gives_zero_with_grad_and_no_nan() -> None:
    loss, metrics, v = call(ClippedValueLoss(), mask=[[0, 0], [0, 0]])
    assert loss.requires_grad
    close(loss, 0.0)
    loss.backward()
    assert v.grad is not None
    close(v.grad, torch.zeros(2, 2))
    for name, value in metrics.items():
        assert value == 0.0, name


def test_constant_returns_explained_variance_is_zero() -> None:
    v = torch.tensor([[1.0, 2.0]])
    _, metrics = ClippedValueLoss()(v, v, torch.ones(1, 2), torch.ones(1, 2))
    close(metrics["explained_variance"], 0.0)


@pytest.mark.parametrize("value_clip", [0.2, None])
def test_gradcheck_float64(value_clip: float | None) -> None:
    g = torch.Generator().manual_seed(0)
    old = torch.randn(3, 4, generator=g, dtype=torch.float64)
    values = (old + 0.3 * torch.randn(3, 4, generator=g, dtype=torch.float64)).requires_grad_(True)
    returns = torch.randn(3, 4, generator=g, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss_fn = ClippedValueLoss(value_clip=value_clip)

    def fn(v: torch.Tensor) -> torch.Tensor:
        return loss_fn(v, old, returns, mask, torch.tensor([1, 0, 1]))[0]

    assert torch.autograd.gradcheck(fn, (values,), eps=1e-6, atol=1e-8, rtol=1e-6)


def test_invalid_hyperparameters_raise() -> None:
    with pytest.raises(ValueError, match=r"`ClippedValueLoss\(value_clip=0.0\)` is invalid: must be > 0"):
        ClippedValueLoss(value_clip=0.0)
    with pytest.raises(ValueError, match=r"(?s)value_clip=-1.0.*\n.*value_coef=0.0"):
        ClippedValueLoss(value_clip=-1.0, value_coef=0.0)
