"""MegatronStrategy on CPU: 2 gloo ranks on loopback (``torch.multiprocessing.spawn``, file:// rendezvous).

Three spawned jobs (see ``_megatron_jobs.py``) train a tiny Qwen2-layout GPTModel, initialized from one
Hugging Face state dict, on the same global batches: a world-size-1 reference (TP=1, DP=1), a 2-rank job
(TP=2, then TP=1/DP=2 reloading the TP=2 checkpoint, then DP=2) and a 2-rank ``lightning.Trainer`` job.
Tolerance: float32 rounding only, 1e-5 on losses and 1e-6 on gradients and weights (absolute).
"""

from __future__ import annotations

from typing import Any

import _megatron_jobs as jobs
import pytest
import torch
from screl.strategies import MegatronStrategy, ParallelismConfig
from torch import Tensor

LOSS_ATOL = 1e-5
TENSOR_ATOL = 1e-6


def _load(path: str) -> Any:
    return torch.load(path, weights_only=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = jobs.spawn(jobs.reference_job, 1, str(tmp_path_factory.mktemp("reference")))
    return _load(out)


@pytest.fixture(scope="module")
def parallel(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = jobs.spawn(jobs.parallel_job, 2, str(tmp_path_factory.mktemp("parallel")))
    return [_load(f"{out}.{rank}") for rank in range(2)]


@pytest.fixture(scope="module")
def lightning_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    out = jobs.spawn(jobs.lightning_job, 2, str(tmp_path_factory.mktemp("lightning")))
    return [_load(f"{out}.{rank}") for rank in range(2)]


def assert_state_close(
    actual: dict[str, Tensor], expected: dict[str, Tensor], atol: float = TENSOR_ATOL
) -> None:
    assert set(actual) == set(expected)
    for key in expected:
        diff = float((actual[key] - expected[key]).abs().max())
        assert diff <= atol, f"{key}: max abs difference {diff:.3g} > {atol:g}"


def test_bad_sizes_name_the_sizes_and_world_size() -> None:
    with pytest.raises(
        ValueError, match=r"tensor_model_parallel_size=4 .* = 4 does not divide the world size 6"
    ):
        ParallelismConfig(tensor_model_parallel_size=4).validate(6)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 = 4, but the world size is 2"):
        ParallelismConfig(tensor_model_parallel_size=2, data_parallel_size=2).validate(2)
    with pytest.raises(ValueError, match=r"sizes must be >= 1, got pipeline_model_parallel_size=0"):
        ParallelismConfig(pipeline_model_parallel_size=0)
    assert ParallelismConfig(tensor_model_parallel_size=2).validate(8) == 4


def test_strategy_rejects_bad_sizes_and_sequence_parallel_on_cpu_before_connecting() -> None:
    from lightning.pytorch.accelerators import CPUAccelerator
    from lightning.pytorch.plugins.environments import LightningEnvironment

    def strategy(**sizes: Any) -> MegatronStrategy:
        return MegatronStrategy(
            parallelism=ParallelismConfig(**sizes),
            accelerator=CPUAccelerator(),
            parallel_devices=[torch.device("cpu")] * 2,
            cluster_environment=LightningEnvironment(),
        )

    with pytest.raises(ValueError, match=r"tensor_model_parallel_size=4 .* does not divide the world size 2"):
        strategy(tensor_model_parallel_size=4).setup_environment()
    with pytest.raises(ValueError, match=r"sequence_parallel=True is not supported on CPU"):
        strategy(tensor_model_parallel_size=2, sequence_parallel=True).setup_environment()


@pytest.mark.parity
@pytest.mark.slow
def test_megatron_model_matches_hugging_face(reference: dict[str, Any]) -> None:
    """Same logits and log-probs as the Qwen2 model its weights came from; export gives them back."""
    assert reference["logit_diff"] < 1e-5
    assert reference["logprob_diff"] < 1e-5
    hf = jobs.hf_model().state_dict()
    hf.pop("lm_head.weight")  # tied to the embedding
    # exact: loaded from these very tensors and exported before any step, copies and reshapes only, no arithmetic
    assert_state_close(reference["export0"], hf, atol=0.0)


@pytest.mark.parity
@pytest.mark.slow
def test_tp2_matches_tp1_losses_and_reduced_gradients(
    reference: dict[str, Any], parallel: list[dict[str, Any]]
) -> None:
    expected = reference["mean"]
    for rank_result in parallel:
        got = rank_result["tp2"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=LOSS_ATOL)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], abs=LOSS_ATOL)
        assert max(expected["grad_norm"]) > jobs.MAX_GRAD_NORM  # clipping took effect
        assert len(got["grads"]) == jobs.STEPS
        for grads, ref_grads in zip(got["grads"], expected["grads"], strict=True):
            assert_state_close(grads, ref_grads)
        assert_state_close(got["export"], expected["export"])


@pytest.mark.parity
@pytest.mark.slow
def test_pp2_matches_pp1_losses_and_reduced_gradients(
    reference: dict[str, Any], parallel: list[dict[str, Any]]
) -> None:
    """PP=2 on CPU (gloo point-to-point activations, tied embeddings across the stages) = the one-process run."""
    expected = reference["mean"]
    for rank_result in parallel:
        got = rank_result["pp2"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=LOSS_ATOL)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], abs=LOSS_ATOL)
        for grads, ref_grads in zip(got["grads"], expected["grads"], strict=True):
            assert_state_close(grads, ref_grads)
        assert_state_close(got["export"], expected["export"])


@pytest.mark.parity
@pytest.mark.slow
def test_dp2_matches_dp1_with_the_same_global_batch(
    reference: dict[str, Any], parallel: list[dict[str, Any]]
) -> None:
    """Per-token loss: gradients divided by the global token count, summed over the two DP ranks."""
    expected = reference["tokens"]
    for rank_result in parallel:
        got = rank_result["dp2"]
        assert got["loss"] == pytest.approx(expected["loss"], abs=LOSS_ATOL)
        assert got["grad_norm"] == pytest.approx(expected["grad_norm"], abs=LOSS_ATOL)
        for grads, ref_grads in zip(got["grads"], expected["grads"], strict=True):
            assert_state_close(grads, ref_grads)
        assert_state_close(got["export"], expected["export"])


@pytest.mark.parity
@pytest.mark.slow
def test_tp2_checkpoint_reloads_at_tp1(reference: dict[str, Any], parallel: list[dict[str, Any]]) -> None:
    """Saved at TP=2 through a staged fsspec URL, loaded at TP=1 (DP=2): same loss, and the AdamW state
    carries over (the next step equals the uninterrupted reference step)."""
    for rank_result in parallel:
        assert {"common.pt", "metadata.json", ".metadata"} <= set(rank_result["ckpt_files"])
        reload = rank_result["tp1_reload"]
        assert reload["global_step"] == jobs.STEPS
        assert reload["probe"] == pytest.approx(rank_result["tp2"]["probe_after"], abs=LOSS_ATOL)
        assert reload["probe"] == pytest.approx(reference["probe_after"], abs=LOSS_ATOL)
        assert reload["next_loss"] == pytest.approx(reference["mean"]["next_loss"], abs=LOSS_ATOL)
        assert_state_close(reload["next_export"], reference["mean"]["next_export"])


@pytest.mark.parity
@pytest.mark.slow
def test_export_weights_at_tp2_equals_tp1(reference: dict[str, Any], parallel: list[dict[str, Any]]) -> None:
    for rank_result in parallel:
        # exact: both exported before any step, the same HF tensors split into TP shards and gathered back (copies)
        assert_state_close(rank_result["export0"], reference["export0"], atol=0.0)
        assert_state_close(rank_result["tp2"]["export"], reference["mean"]["export"])


@pytest.mark.slow
def test_export_weights_gathers_across_pipeline_stages(parallel: list[dict[str, Any]]) -> None:
    """Each PP stage holds one layer; every rank gets all of them, under global layer indices."""
    for rank, rank_result in enumerate(parallel):
        pp = rank_result["pp2_export"]
        assert ("embedding.word_embeddings.weight" in pp["local"]) == (rank == 0)
        assert ("output_layer.weight" in pp["local"]) == (rank == 1)
        assert_state_close(pp["exported"], pp["expected"], atol=0.0)  # exact: loaded then gathered, copies only


@pytest.mark.parity
@pytest.mark.slow
def test_lightning_trainer_fits_and_resumes_at_tp2(
    reference: dict[str, Any], lightning_run: list[dict[str, Any]]
) -> None:
    """``Trainer(strategy=MegatronStrategy(TP=2), accelerator="cpu", devices=2)`` on spawned ranks: the
    microbatched path, a resume from its checkpoint, plain automatic and manual optimization."""
    for rank_result in lightning_run:
        assert rank_result["fit"] == pytest.approx(reference["mean"]["loss"], abs=LOSS_ATOL)
        assert rank_result["ckpt_is_dir"]
        assert rank_result["resumed"] == pytest.approx([reference["mean"]["next_loss"]], abs=LOSS_ATOL)
        assert rank_result["plain"] == pytest.approx(reference["plain"]["loss"], abs=LOSS_ATOL)
        assert rank_result["manual"] == pytest.approx(reference["plain"]["loss"], abs=LOSS_ATOL)
        assert (
            "gradient_clip_val=1.0) clips by a norm that ignores tensor parallelism"
            in rank_result["clip_error"]
        )


def test_parallelism_config_is_a_plain_dataclass() -> None:
    cfg = ParallelismConfig(tensor_model_parallel_size=2, sequence_parallel=True)
    assert cfg.model_parallel_size == 2
    assert cfg.validate(4) == 2
    with pytest.raises(ValueError, match=r"sequence_parallel=True needs tensor_model_parallel_size > 1"):
        ParallelismConfig(sequence_parallel=True).validate(2)


def test_strategy_is_configured_from_yaml() -> None:
    """The ``trainer.strategy`` block of a screl config, as LightningCLI (jsonargparse) parses it."""
    from jsonargparse import ArgumentParser
    from lightning.pytorch.strategies import Strategy
    from screl.strategies import GPTModelProvider

    parser = ArgumentParser()
    parser.add_argument("--strategy", type=Strategy | str)
    cfg = parser.parse_string(
        """
        strategy:
          class_path: screl.strategies.MegatronStrategy
          init_args:
            parallelism: {tensor_model_parallel_size: 2}
            model_provider:
              class_path: screl.strategies.GPTModelProvider
              init_args: {hidden_size: 32, num_layers: 2}
            ddp_config: {grad_reduce_in_fp32: true}
        """
    )
    strategy = parser.instantiate(cfg).strategy
    assert isinstance(strategy, MegatronStrategy)
    assert strategy.parallelism.tensor_model_parallel_size == 2
    assert isinstance(strategy.model_provider, GPTModelProvider)
    assert strategy.model_provider.hidden_size == 32
    assert strategy.ddp_config == {"grad_reduce_in_fp32": True}
