"""``MegatronStrategy(use_distributed_optimizer=True)`` on CPU: megatron-core's ``DistributedOptimizer`` over gloo.

Two spawned jobs (``_distributed_optimizer_jobs.py``) train the tiny Qwen2-layout GPTModel from one Hugging Face
state dict on the same global batches with per-token loss, clipping and AdamW (weight decay 0.1): a one-process
job (the torch AdamW path, then the distributed optimizer at DP=1) and a 2-rank job (DP=2, a checkpoint after 3
steps resumed at DP=2 and at TP=2, PP=2, and the refusals). Tolerance: float32 rounding of the data-parallel sums
(1e-6 on weights, 1e-5 on losses and gradient norms); DP=1 agrees with the torch AdamW to float32's last bits
(``test_dp1_distributed_optimizer_is_the_torch_adamw`` derives its bounds).
"""

from __future__ import annotations

from typing import Any

import _distributed_optimizer_jobs as djobs
import _megatron_jobs as jobs
import pytest
import torch
from screl.strategies import MegatronStrategy

WEIGHT_ATOL = 1e-6
SCALAR_ATOL = 1e-5


def _load(path: str) -> Any:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    return _load(jobs.spawn(djobs.reference_job, 1, str(tmp_path_factory.mktemp("dist_opt_ref"))))


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = jobs.spawn(djobs.parallel_job, 2, str(tmp_path_factory.mktemp("dist_opt_par")))
    return [_load(f"{out}.{rank}") for rank in range(2)]


def _assert_same_training(got: dict[str, Any], want: dict[str, Any], steps: slice = slice(None)) -> None:
    assert got["loss"] == pytest.approx(want["loss"][steps], abs=SCALAR_ATOL)
    assert got["grad_norm"] == pytest.approx(want["grad_norm"][steps], abs=SCALAR_ATOL)
    assert len(got["weights"]) == len(want["weights"][steps]) > 0
    for i, (mine, theirs) in enumerate(zip(got["weights"], want["weights"][steps], strict=True)):
        diff = djobs.weights_close(mine, theirs)
        assert diff <= WEIGHT_ATOL, f"step {i}: weights differ by {diff:.3g}"


def test_knob_and_ddp_config_must_agree() -> None:
    with pytest.raises(ValueError, match=r"ddp_config.use_distributed_optimizer=True contradicts use_distributed_opt"):
        MegatronStrategy(ddp_config={"use_distributed_optimizer": True})
    strategy = MegatronStrategy(use_distributed_optimizer=True, ddp_config={"grad_reduce_in_fp32": True})
    assert strategy.use_distributed_optimizer
    assert strategy.ddp_config == {"grad_reduce_in_fp32": True}  # the DDP flag is set when wrapping


def _l2_distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """The Euclidean distance between two exported weight dicts (float64 sums)."""
    return sum(float(((a[k].double() - b[k].double()) ** 2).sum()) for k in a) ** 0.5


def _ulp(value: float) -> float:
    """The float32 spacing at ``|value|`` (one unit in the last place)."""
    top = torch.tensor(abs(value), dtype=torch.float32)
    return float(torch.nextafter(top, torch.tensor(float("inf"))) - top)


def _ulp_of_largest(weights: dict[str, Any]) -> float:
    return _ulp(max(float(w.abs().max()) for w in weights.values()))


@pytest.mark.slow
@pytest.mark.parity
def test_dp1_distributed_optimizer_is_the_torch_adamw(one_process: dict[str, Any]) -> None:
    """At DP=1 megatron's optimizer steps as the torch AdamW it replaces (same elementwise math), but not bit for
    bit: with clipping active, megatron's clip factor comes from its own reduction of the gradient norm and its
    AdamW runs over its own buffers, so the new weights can round to a neighbouring float32. The bounds follow:

    - step 0's loss is exact: the same weights through the same forward kernels in the same order (no optimizer
      has run yet);
    - each later loss agrees to first order in the weights' difference, |dL| <= |grad L| * |dw| (Cauchy-Schwarz,
      with the step's own gradient norm and the L2 distance of the weights it ran on), plus 2 units in the last
      place of the loss for its own rounding (a machine with another vector width or thread count rounded the
      4th step's loss one ulp apart: 3.7777576 vs 3.7777574);
    - the weights agree to one float32 ulp of the largest weight (|w| <= 1.02 here, so 2.4e-7; runs saw 0 and
      5.96e-8 at every step): one rounding apart, never an update apart.
    """
    torch_path, dp1 = one_process["torch"], one_process["dp1"]
    assert max(torch_path["grad_norm"]) > jobs.MAX_GRAD_NORM  # clipping is active
    assert dp1["loss"][0] == torch_path["loss"][0]
    assert len(dp1["loss"]) == len(torch_path["loss"]) == djobs.STEPS + 1
    for k in range(1, djobs.STEPS + 1):
        drift = _l2_distance(dp1["weights"][k - 1], torch_path["weights"][k - 1])
        bound = torch_path["grad_norm"][k] * drift + 2 * _ulp(torch_path["loss"][k])
        diff = abs(dp1["loss"][k] - torch_path["loss"][k])
        assert diff <= bound, (
            f"step {k}: losses differ by {diff:.3g}, more than |grad| * |dw| + 2 ulp = {bound:.3g} "
            f"(|grad| {torch_path['grad_norm'][k]:.4g}, |dw| {drift:.3g})"
        )
    for k, (mine, theirs) in enumerate(zip(dp1["weights"], torch_path["weights"], strict=True)):
        diff, ulp = djobs.weights_close(mine, theirs), _ulp_of_largest(theirs)
        assert diff <= ulp, f"step {k}: weights differ by {diff:.3g}, more than one float32 ulp ({ulp:.3g})"
    shards = one_process["dp1_shards"]
    assert shards["main"] == shards["exp_avg"] == shards["model"]  # one replica holds everything
    assert shards["main_dtypes"] == ["torch.float32"]


@pytest.mark.slow
def test_dp2_equals_dp1_step_for_step_with_half_the_state_per_rank(
    one_process: dict[str, Any], two_ranks: list[dict[str, Any]]
) -> None:
    reference = one_process["torch"]
    for rank in two_ranks:
        _assert_same_training(rank["dp2"], reference, slice(0, djobs.STEPS))
        _assert_same_training(rank["dp2"]["next"], reference, slice(djobs.STEPS, djobs.STEPS + 1))
    sizes = [rank["dp2_shards"] for rank in two_ranks]
    model = sizes[0]["model"]
    assert sizes[0]["main"] + sizes[1]["main"] == model  # fp32 main parameters: disjoint shards of the model
    assert sizes[0]["exp_avg"] + sizes[1]["exp_avg"] == model
    assert all(abs(s["main"] - model / 2) <= 64 for s in sizes), sizes  # about half each (bucket padding)
    assert all(s["main_dtypes"] == ["torch.float32"] for s in sizes)


@pytest.mark.slow
def test_checkpoint_resumes_at_dp2_and_resharded_at_tp2(
    one_process: dict[str, Any], two_ranks: list[dict[str, Any]]
) -> None:
    """A DP=2 checkpoint after 3 steps: a fresh DP=2 run and a fresh TP=2 (DP=1) run load it, and their 4th step
    is the uninterrupted run's (weights, Adam moments and step count all restored)."""
    reference = one_process["torch"]
    assert "common.pt" in two_ranks[0]["ckpt_files"]
    for rank in two_ranks:
        for name in ("resume_dp2", "resume_tp2"):
            resumed = rank[name]
            assert resumed["global_step"] == djobs.STEPS
            assert resumed["step_state"] == [float(djobs.STEPS + 1)]  # Adam's bias correction continues
            _assert_same_training(resumed, reference, slice(djobs.STEPS, djobs.STEPS + 1))


@pytest.mark.slow
def test_pp2_with_the_distributed_optimizer_equals_pp1(
    one_process: dict[str, Any], two_ranks: list[dict[str, Any]]
) -> None:
    for rank in two_ranks:
        _assert_same_training(rank["pp2"], one_process["torch"], slice(0, djobs.STEPS))


@pytest.mark.slow
def test_refusals_name_the_fix(two_ranks: list[dict[str, Any]]) -> None:
    errors = two_ranks[0]["errors"]
    assert "saved with use_distributed_optimizer=True; resume with MegatronStrategy(use_distributed_optimizer=True)" \
        in errors["torch_loads_distributed"]
    assert "replaces a torch AdamW, got SGD" in errors["sgd"]
    assert "must update exactly the trainable parameters of its Megatron modules (2 parameters given" \
        in errors["subset"]


@pytest.mark.slow
def test_ppo_trains_unchanged_under_the_distributed_optimizer(tmp_path: Any) -> None:
    """PPO's two AdamW (the critic's under a LambdaLR, eps raised through param_groups by a callback) become
    distributed optimizers without a change to PPO: one TP=2 step equals the one-process step (1e-5)."""
    import test_ppo_megatron as ppo

    chunk = ppo.make_chunk()
    torch.save(chunk, tmp_path / "chunk.pt")
    out = jobs.spawn(djobs.ppo_job, 2, str(tmp_path))
    ranks = [_load(f"{out}.{rank}") for rank in range(2)]
    reference = ppo.fit_step(chunk, start=0, tp=None)
    for result in ranks:
        assert result["optimizers"] == ["DistributedAdam", "DistributedAdam"]
        assert result["update_counts"] == reference["update_counts"] == {"policy": 2, "critic": 2}
        for key in ("train/loss", "critic/value_loss", "train/grad_norm", "critic/grad_norm"):
            assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=ppo.TOL, abs=ppo.TOL), key
        for part in ("policy", "critic"):
            ppo._assert_close(result["after"][part], reference["after"][part])
            assert ppo._max_diff(result["after"][part], result["before"][part]) > 1000 * ppo.TOL  # it trained
