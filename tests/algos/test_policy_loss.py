"""ClippedPGLoss and kl_estimate: expected values derived by hand in the comments.

Convention in these tests: ``prev_logprobs = 0`` so ``curr_logprobs = log(ratio)``, and
``generation_logprobs = -log(w)`` so the IS weight ``exp(prev - gen)`` is ``w``.
"""

import math

import pytest
import torch

from screl.algos import ClippedPGLoss, kl_estimate


def close(actual: torch.Tensor, expected: float | list | torch.Tensor) -> None:
    expected_t = torch.as_tensor(expected, dtype=actual.dtype)
    torch.testing.assert_close(actual, expected_t, rtol=1e-5, atol=1e-6)


def logs(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).log()


def call(
    loss_fn: ClippedPGLoss,
    ratios: list,
    adv: list,
    weights: list | None = None,
    mask: torch.Tensor | None = None,
    **kwargs: object,
) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
    curr = logs(ratios).requires_grad_(True)
    prev = torch.zeros_like(curr)
    gen = prev if weights is None else -logs(weights)
    mask = torch.ones_like(curr, dtype=torch.bool) if mask is None else mask
    loss, metrics = loss_fn(curr, prev, gen, torch.tensor(adv), mask, **kwargs)
    return loss, metrics, curr


# ratios [[1.5, 0.5], [1.1, 0.9]], advantages per row [1, -1], clip 0.2/0.2:
# row 0 (A=1):  r=1.5 -> max(-1.5, -1.2) = -1.2;  r=0.5 -> max(-0.5, -0.8) = -0.5
# row 1 (A=-1): r=1.1 -> max(1.1, 1.1) = 1.1;     r=0.9 -> max(0.9, 0.9) = 0.9
# token mean = (-1.2 - 0.5 + 1.1 + 0.9) / 4 = 0.075
BASIC_RATIOS = [[1.5, 0.5], [1.1, 0.9]]
BASIC_ADV = [1.0, -1.0]


def test_clipped_surrogate_token_level() -> None:
    loss, metrics, _ = call(ClippedPGLoss(), BASIC_RATIOS, BASIC_ADV)
    close(loss, 0.075)
    close(metrics["policy_loss"], 0.075)
    close(metrics["clip_fraction"], 0.5)  # 1.5 and 0.5 lie outside [0.8, 1.2]
    close(metrics["ratio_mean"], 1.0)  # (1.5 + 0.5 + 1.1 + 0.9) / 4
    close(metrics["num_valid_tokens"], 4.0)
    # gen = prev: gen_kl = mean(r - 1 - log r) over the four ratios
    expected_kl = sum(r - 1 - math.log(r) for r in (1.5, 0.5, 1.1, 0.9)) / 4
    close(metrics["gen_kl"], expected_kl)


def test_gradient_is_zero_where_clipped() -> None:
    # d/d logpi of -A*r = -A*r where unclipped: row 0 t=0 is clipped (grad 0), t=1 unclipped (-0.5/4),
    # row 1: (1.1/4, 0.9/4)
    loss, _, curr = call(ClippedPGLoss(), BASIC_RATIOS, BASIC_ADV)
    loss.backward()
    assert curr.grad is not None
    close(curr.grad, [[0.0, -0.5 / 4], [1.1 / 4, 0.9 / 4]])


def test_decoupled_clip_high() -> None:
    # r = 1.25, A = 1: symmetric 0.2 clips at 1.2 -> -1.2; DAPO clip_max 0.28 keeps -1.25
    close(call(ClippedPGLoss(0.2, 0.2), [[1.25]], [1.0])[0], -1.2)
    close(call(ClippedPGLoss(0.2, 0.28), [[1.25]], [1.0])[0], -1.25)
    # r = 0.75, A = 1: lower bound 1 - 0.2 = 0.8 is inactive for A > 0 (max(-0.75, -0.8) = -0.75),
    # but for A = -1 the clip_min binds: max(0.75, 0.8) = 0.8
    close(call(ClippedPGLoss(0.2, 0.28), [[0.75]], [-1.0])[0], 0.8)


def test_dual_clip() -> None:
    # row 0 (A=-1): r=5 -> max(5, 1.2) = 5 -> dual min(5, 3) = 3;  r=2 -> max(2, 1.2) = 2 -> min(2, 3) = 2
    # row 1 (A=+1): r=5 -> max(-5, -1.2) = -1.2 (dual clip only touches A<0);  r=1 -> -1
    # with c=3: (3 + 2 - 1.2 - 1) / 4 = 0.7; without: (5 + 2 - 1.2 - 1) / 4 = 1.2
    ratios, adv = [[5.0, 2.0], [5.0, 1.0]], [-1.0, 1.0]
    loss, metrics, _ = call(ClippedPGLoss(ratio_clip_c=3.0), ratios, adv)
    close(loss, 0.7)
    close(metrics["dual_clip_fraction"], 0.25)
    close(call(ClippedPGLoss(), ratios, adv)[0], 1.2)


def test_sequence_level_aggregation_and_token_advantages() -> None:
    # ratios 1 -> l = -A. Row 0 has 3 valid tokens with A [1, 2, 3], row 1 one valid token with A 4.
    # token level: -(1+2+3+4)/4 = -2.5; sequence level: mean(-(1+2+3)/3, -4) = mean(-2, -4) = -3
    adv = [[1.0, 2.0, 3.0], [4.0, 50.0, 60.0]]
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    ones = [[1.0] * 3] * 2
    close(call(ClippedPGLoss(), ones, adv, mask=mask)[0], -2.5)
    close(call(ClippedPGLoss(token_level_loss=False), ones, adv, mask=mask)[0], -3.0)


def test_sample_mask_drops_rows_and_their_gradient() -> None:
    # row 2 is dropped by sample_mask: loss as BASIC (0.075), no gradient into row 2
    ratios = BASIC_RATIOS + [[2.0, 2.0]]
    loss, _, curr = call(ClippedPGLoss(), ratios, [1.0, -1.0, 100.0], sample_mask=torch.tensor([1, 1, 0]))
    close(loss, 0.075)
    loss.backward()
    assert curr.grad is not None
    close(curr.grad[2], [0.0, 0.0])


def test_gspo_sequence_ratios() -> None:
    # row 0: log ratios [ln 1.5, 0] -> rho = exp(ln(1.5)/2) = sqrt(1.5) = 1.2247 > 1.2, A=1 -> l = -1.2
    # row 1: log ratios [ln 0.9, 0] -> rho = sqrt(0.9) = 0.948683, A=1 -> l = -0.948683
    # sequence-level mean: (-1.2 - sqrt(0.9)) / 2
    loss_fn = ClippedPGLoss(token_level_loss=False, sequence_level_importance_ratios=True)
    loss, metrics, _ = call(loss_fn, [[1.5, 1.0], [0.9, 1.0]], [1.0, 1.0])
    close(loss, (-1.2 - math.sqrt(0.9)) / 2)
    close(metrics["clip_fraction"], 0.5)  # row 0's two tokens carry the clipped ratio


# KL to a reference: curr = prev = [[0, -1]] (ratio 1, A = 0 -> policy term 0), ref = [[-0.5, -1]]
# x = ref - curr = [-0.5, 0]
KL_CURR = [[0.0, -1.0]]
KL_REF = [[-0.5, -1.0]]


@pytest.mark.parametrize(
    ("estimator", "per_token"),
    [
        ("k1", [0.5, 0.0]),  # -x
        ("k2", [0.125, 0.0]),  # x^2 / 2
        ("k3", [math.exp(-0.5) - 1 + 0.5, 0.0]),  # e^x - 1 - x
    ],
)
def test_kl_penalty_estimators(estimator: str, per_token: list[float]) -> None:
    curr = torch.tensor(KL_CURR, requires_grad=True)
    prev = curr.detach().clone()
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1, kl_estimator=estimator)  # type: ignore[arg-type]
    loss, metrics = loss_fn(
        curr, prev, prev, torch.zeros(1), torch.ones(1, 2), reference_logprobs=torch.tensor(KL_REF)
    )
    mean_kl = sum(per_token) / 2
    close(metrics["kl_ref"], mean_kl)
    close(loss, 0.1 * mean_kl)
    close(metrics["policy_loss"], 0.0)


def test_kl_gradient_includes_score_term() -> None:
    # k1 = curr - ref; loss = beta * mean(exp(curr - sg(curr)) * k1): d/dcurr_t = beta/N * (k1_t + 1)
    # = 0.1/2 * [0.5 + 1, 0 + 1] = [0.075, 0.05]  (policy term has A = 0, no gradient)
    curr = torch.tensor(KL_CURR, requires_grad=True)
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1, kl_estimator="k1")
    loss, _ = loss_fn(
        curr, curr.detach(), curr.detach(), torch.zeros(1), torch.ones(1, 2), None, torch.tensor(KL_REF)
    )
    loss.backward()
    assert curr.grad is not None
    close(curr.grad, [[0.075, 0.05]])


def test_kl_estimate_clamps() -> None:
    # x = -30 -> input clamp -20 -> k1 = 20 -> output clamp 10; both clamps kill the gradient
    curr = torch.tensor([0.0], requires_grad=True)
    ref = torch.tensor([-30.0])
    close(kl_estimate(curr, ref, "k1", output_clamp=None), [20.0])
    out = kl_estimate(curr, ref, "k1")
    close(out, [10.0])
    out.sum().backward()
    assert curr.grad is not None
    close(curr.grad, [0.0])
    with pytest.raises(ValueError, match=r"estimator='k4'.*Use one of"):
        kl_estimate(curr, ref, "k4")  # type: ignore[arg-type]


def test_missing_reference_logprobs_raises() -> None:
    loss_fn = ClippedPGLoss(reference_policy_kl_penalty=0.1)
    assert loss_fn.requires_reference_logprobs
    with pytest.raises(ValueError, match=r"needs reference_logprobs"):
        call(loss_fn, [[1.0]], [1.0])


def test_global_normalizer_sums_microbatches_to_the_global_mean() -> None:
    # BASIC token losses sum to 0.3 over 4 tokens. Split into two microbatches of one row each,
    # each divided by the global count 4: (-1.7)/4 + (2.0)/4 = 0.075 = full-batch mean
    loss_fn = ClippedPGLoss()
    full = call(loss_fn, BASIC_RATIOS, BASIC_ADV)[0]
    mb0 = call(loss_fn, BASIC_RATIOS[:1], BASIC_ADV[:1], global_normalizer=4.0)[0]
    mb1 = call(loss_fn, BASIC_RATIOS[1:], BASIC_ADV[1:], global_normalizer=4.0)[0]
    close(mb0, -1.7 / 4)
    close(mb0 + mb1, full)


# ---------------------------------------------------------------- importance-sampling correction
# curr = prev (ratio 1); A per row [1, -1] -> l = [[-1, -1], [1, 1]]; IS weights w = [[2, 0.5], [1, 4]]
IS_ONES = [[1.0, 1.0], [1.0, 1.0]]
IS_W = [[2.0, 0.5], [1.0, 4.0]]


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
@pytest.mark.parametrize("token_level_loss", [True, False])
def test_on_policy_weights_are_one_and_loss_unchanged(level: str, token_level_loss: bool) -> None:
    # gen == prev -> w = 1 exactly, so the corrected loss equals the uncorrected one bit for bit
    on = ClippedPGLoss(
        use_importance_sampling_correction=True,
        is_level=level,  # type: ignore[arg-type]
        token_level_loss=token_level_loss,
    )
    off = ClippedPGLoss(token_level_loss=token_level_loss)
    loss_on, metrics, _ = call(on, BASIC_RATIOS, BASIC_ADV)
    loss_off, _, _ = call(off, BASIC_RATIOS, BASIC_ADV)
    assert torch.equal(loss_on, loss_off)
    for key in ("is_weight_mean", "is_weight_min", "is_weight_max", "is_weight_p50", "is_ess"):
        close(metrics[key], 1.0)


def test_token_level_is_untruncated() -> None:
    # weighted l = [-2, -0.5, 1, 4] -> mean 2.5/4 = 0.625
    loss, m, curr = call(ClippedPGLoss(use_importance_sampling_correction=True), IS_ONES, BASIC_ADV, IS_W)
    close(loss, 0.625)
    close(m["is_weight_mean"], 1.875)  # (2 + 0.5 + 1 + 4) / 4
    close(m["is_weight_min"], 0.5)
    close(m["is_weight_max"], 4.0)
    # sorted [0.5, 1, 2, 4]: p10 at index 0.3 -> 0.5 + 0.3*0.5 = 0.65; p50 at 1.5 -> 1.5;
    # p90 at 2.7 -> 2 + 0.7*2 = 3.4
    close(m["is_weight_p10"], 0.65)
    close(m["is_weight_p50"], 1.5)
    close(m["is_weight_p90"], 3.4)
    # ESS = (sum w)^2 / (n sum w^2) = 7.5^2 / (4 * (4 + 0.25 + 1 + 16)) = 56.25 / 85
    close(m["is_ess"], 56.25 / 85)
    # the weight is a constant: d loss / d logpi = -A * w / 4
    loss.backward()
    assert curr.grad is not None
    close(curr.grad, [[-2 / 4, -0.5 / 4], [1 / 4, 4 / 4]])


def test_is_metrics_reported_even_when_correction_is_off() -> None:
    # diagnostics still see the mismatch, but the loss is unweighted: mean([-1, -1, 1, 1]) = 0
    loss, m, _ = call(ClippedPGLoss(), IS_ONES, BASIC_ADV, IS_W)
    close(loss, 0.0)
    close(m["is_weight_max"], 4.0)


@pytest.mark.parametrize(
    ("kwargs", "expected", "oob"),
    [
        # TIS at 2: w = [2, 0.5, 1, 2] -> [-2, -0.5, 1, 2] -> 0.5/4
        ({"is_truncation": 2.0}, 0.125, 0.25),
        # TIS in [0.6, 2]: w = [2, 0.6, 1, 2] -> [-2, -0.6, 1, 2] -> 0.4/4
        ({"is_truncation": 2.0, "is_truncation_min": 0.6}, 0.1, 0.5),
        # MIS at 2: token with w=4 is zeroed -> [-2, -0.5, 1, 0] -> -1.5/4
        ({"is_truncation": 2.0, "is_mode": "mask"}, -0.375, 0.25),
        # MIS in [0.6, 2]: tokens with w=0.5 and w=4 zeroed -> [-2, 0, 1, 0] -> -1/4
        ({"is_truncation": 2.0, "is_truncation_min": 0.6, "is_mode": "mask"}, -0.25, 0.5),
    ],
)
def test_token_level_truncation_and_masking(kwargs: dict, expected: float, oob: float) -> None:
    loss, m, _ = call(
        ClippedPGLoss(use_importance_sampling_correction=True, **kwargs), IS_ONES, BASIC_ADV, IS_W
    )
    close(loss, expected)
    close(m["is_oob_fraction"], oob)
    close(m["is_weight_max"], 4.0)  # statistics are of the raw weights


@pytest.mark.parametrize(
    ("kwargs", "expected"),
    [
        # row weights: row 0 = 2 * 0.5 = 1, row 1 = 1 * 4 = 4 -> [-1, -1, 4, 4] -> 6/4
        ({}, 1.5),
        # truncate at 2 -> row 1 weight 2 -> [-1, -1, 2, 2] -> 2/4
        ({"is_truncation": 2.0}, 0.5),
        # mask at 2 -> row 1 dropped -> [-1, -1, 0, 0] -> -2/4
        ({"is_truncation": 2.0, "is_mode": "mask"}, -0.5),
    ],
)
def test_sequence_level_is(kwargs: dict, expected: float) -> None:
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True, is_level="sequence", **kwargs)
    loss, m, _ = call(loss_fn, IS_ONES, BASIC_ADV, IS_W)
    close(loss, expected)
    # statistics over rows: w = [1, 4]; mean 2.5; ESS = 5^2 / (2 * 17)
    close(m["is_weight_mean"], 2.5)
    close(m["is_ess"], 25 / 34)


def test_non_finite_weight_becomes_zero() -> None:
    # gen = -inf on token (0, 0) -> log w = +inf -> weight 0; the rest as in the untruncated test
    # weighted l = [0, -0.5, 1, 4] -> 4.5/4
    curr = torch.zeros(2, 2, requires_grad=True)
    gen = -logs(IS_W)
    gen[0, 0] = -math.inf
    loss_fn = ClippedPGLoss(use_importance_sampling_correction=True)
    loss, metrics = loss_fn(curr, torch.zeros(2, 2), gen, torch.tensor(BASIC_ADV), torch.ones(2, 2))
    close(loss, 4.5 / 4)
    assert all(torch.isfinite(v) for v in metrics.values())


ALL_CONFIGS: list[dict[str, object]] = [
    {},
    {"token_level_loss": False},
    {"token_level_loss": False, "sequence_level_importance_ratios": True},
    {"ratio_clip_c": 1.5},
    {"reference_policy_kl_penalty": 0.1, "kl_estimator": "k1"},
    {"use_importance_sampling_correction": True, "is_truncation": 2.0},
    {
        "use_importance_sampling_correction": True,
        "is_level": "sequence",
        "is_truncation": 2.0,
        "is_mode": "mask",
    },
    {"use_importance_sampling_correction": True, "is_level": "geometric", "is_truncation": 2.0},
    {"proximal_policy": "behaviour", "ratio_clip_c": 3.0},
]


@pytest.mark.parametrize("kwargs", ALL_CONFIGS)
@pytest.mark.parametrize("masked_by", ["token_mask", "sample_mask"])
def test_all_masked_gives_zero_loss_with_grad_and_no_nan(kwargs: dict, masked_by: str) -> None:
    # garbage (NaN / inf) in masked positions must not leak
    curr = torch.tensor([[0.3, float("nan")], [-0.2, 0.1]], requires_grad=True)
    junk = torch.tensor([[float("-inf"), 1.0], [float("nan"), 0.0]])
    token_mask = torch.zeros(2, 2) if masked_by == "token_mask" else torch.ones(2, 2)
    sample_mask = torch.zeros(2) if masked_by == "sample_mask" else None
    loss, metrics = ClippedPGLoss(**kwargs)(curr, junk, junk, junk, token_mask, sample_mask, junk)
    assert loss.requires_grad
    close(loss, 0.0)
    loss.backward()
    assert curr.grad is not None
    close(curr.grad, torch.zeros(2, 2))
    for name, value in metrics.items():
        assert torch.isfinite(value), name
        assert value == 0.0, name


# The KL term multiplies by exp(logpi - sg(logpi)); finite differences move the stop-gradient copy too, so
# they cannot see its score-function gradient. gradcheck the KL estimators on their own below; the full
# KL gradient is pinned by hand in test_kl_gradient_includes_score_term.
@pytest.mark.parametrize("kwargs", [c for c in ALL_CONFIGS if not c.get("reference_policy_kl_penalty")])
def test_gradcheck_float64(kwargs: dict) -> None:
    # random small log-ratios keep ratios away from clip boundaries (kinks) by >> the finite-difference step
    g = torch.Generator().manual_seed(0)
    shape = (3, 4)
    prev = -torch.rand(shape, generator=g, dtype=torch.float64) - 0.5
    curr = (prev + 0.3 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_(True)
    gen = prev + 0.5 * torch.randn(shape, generator=g, dtype=torch.float64)
    ref = prev + 0.2 * torch.randn(shape, generator=g, dtype=torch.float64)
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    token_mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    loss_fn = ClippedPGLoss(**kwargs)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return loss_fn(c, prev, gen, adv, token_mask, torch.tensor([1, 1, 0]), ref)[0]

    assert torch.autograd.gradcheck(fn, (curr,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_estimate_gradcheck_float64(estimator: str) -> None:
    g = torch.Generator().manual_seed(0)
    curr = torch.randn(2, 3, generator=g, dtype=torch.float64).requires_grad_(True)
    ref = curr.detach() + torch.randn(2, 3, generator=g, dtype=torch.float64)

    def fn(c: torch.Tensor) -> torch.Tensor:
        return kl_estimate(c, ref, estimator)  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(fn, (curr,), eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"ratio_clip_min": 1.0}, r"`ClippedPGLoss\(ratio_clip_min=1.0\)` is invalid: must be in \[0, 1\)"),
        ({"ratio_clip_max": -0.1}, r"ratio_clip_max=-0.1.*must be >= 0"),
        ({"ratio_clip_c": 1.0}, r"ratio_clip_c=1.0.*must be > 1"),
        (
            {"sequence_level_importance_ratios": True},
            r"sequence_level_importance_ratios=True.*token_level_loss=False",
        ),
        ({"reference_policy_kl_penalty": -1.0}, r"reference_policy_kl_penalty=-1.0.*must be >= 0"),
        ({"kl_estimator": "k4"}, r"kl_estimator='k4'.*Use one of \('k1', 'k2', 'k3'\)"),
        ({"kl_clamp": 0.0}, r"kl_clamp=0.0.*must be > 0"),
        ({"is_level": "group"}, r"is_level='group'.*Use one of \('token', 'sequence', 'geometric'\)"),
        ({"is_mode": "clip"}, r"is_mode='clip'.*Use one of \('truncate', 'mask'\)"),
        ({"is_truncation": 2.0}, r"is_truncation=2.0.*Set use_importance_sampling_correction=True"),
        (
            {"use_importance_sampling_correction": True, "is_truncation": 0.0},
            r"is_truncation=0.0.*must be > 0",
        ),
        (
            {"use_importance_sampling_correction": True, "is_mode": "mask"},
            r"is_mode='mask'.*Set is_truncation",
        ),
        (
            {"use_importance_sampling_correction": True, "is_truncation_min": 0.5},
            r"is_truncation_min=0.5.*Set is_truncation",
        ),
        (
            {"use_importance_sampling_correction": True, "is_truncation": 2.0, "is_truncation_min": 3.0},
            r"is_truncation_min=3.0.*must be <= is_truncation",
        ),
    ],
)
def test_invalid_hyperparameters_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ClippedPGLoss(**kwargs)


def test_all_issues_reported_at_once() -> None:
    with pytest.raises(ValueError, match=r"(?s)ratio_clip_min=-1.*\n.*ratio_clip_c=0.5"):
        ClippedPGLoss(ratio_clip_min=-1.0, ratio_clip_c=0.5)
