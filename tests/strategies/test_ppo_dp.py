"""PPO over 2 data-parallel gloo ranks equals the one-process step: ``screl.strategies.DDPStrategy`` and
``MegatronStrategy`` at TP=1, DP=2.

Each spawned rank (``torch.multiprocessing.spawn``, file:// rendezvous on loopback, ``_megatron_jobs.spawn``)
fits a real ``PPO`` with a real ``lightning.Trainer(devices=2)`` on its shard of one step's chunk, cut as
``RolloutDataModule`` cuts it (``shard_groups``: a contiguous run of whole groups, the chunk's size in
``chunk_rows``, ``dp_shards = 2``). The reference fits the same module on the whole chunk in this process.

What has to be reduced over the replicas for the two to agree: GAE whitening (the chunk's rewards differ
between the shards, so each shard's own mean and variance would give other advantages), the loss normalizers
(each shard holds a different number of valid tokens, and a masked row), the gradients (summed), and with
minibatches the split itself (one permutation of the global rows; each replica trains its rows of every
global minibatch, none of some: with 4 minibatches of 2 rows over 2 shards of 4 rows that happens).

Tolerance: 1e-6 absolute on every weight, 1e-5 relative on the logged losses. Both sides are float32 and
differ only in the order of float sums (seen under DDP: weights within 1.2e-7 on moves of 2e-2 to 6e-2); Adam's
eps is raised to 1e-3 in both (as in ``test_ppo_megatron``): at 1e-8 the analytically-zero gradient of the key
projections' biases turns rounding noise into lr-sized steps. Checked by hand: leaving out any one reduction
(whitening's statistics, the step's or a minibatch's normalizer, summing rather than averaging the gradients,
the shard's row offset) fails the DDP test, its logged losses off by 2e-3 to 1.5e-1.
"""

from __future__ import annotations

import os
from typing import Any

import _megatron_jobs as jobs
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from screl.algos import ClippedPGLoss, ClippedValueLoss
from screl.datamodule import collate_chunk, shard_groups
from screl.models import TinyCausalLM
from screl.modules.ppo import PPO

TOL = 1e-6
ADAM_EPS = 1e-3
SEED = "5"
GROUPS, G = 4, 2
MINIBATCHES = (1, 4)


def make_chunk() -> dict[str, Any]:
    """One step of 4 groups x 2 rows at trainer version 1 (sampled by version 0: the IS weights are not 1),
    rewards 0, 1, 2, 0, ...; row 5 masked out of the loss."""
    from tests.test_grpo_module import _rollouts

    meta, data = _rollouts(GROUPS, temperature=1.0, version=0)
    meta["trainer_version"] = 1
    chunk = collate_chunk(meta, data, pad_id=0)
    chunk["sample_mask"][5] = 0
    return chunk


def make_ppo(k: int) -> PPO:
    """2 policy and 2 critic epochs of ``k`` minibatches, micro-batches of 1 row, both norms clipped; a critic head
    that is not zero, so the critic's trunk has gradients from the first update on."""
    module = PPO(
        policy=TinyCausalLM(seed=0), value=TinyCausalLM(seed=1),
        loss_fn=ClippedPGLoss(use_importance_sampling_correction=True), value_loss_fn=ClippedValueLoss(value_clip=0.5),
        learning_rate=1e-2, value_learning_rate=1e-2, max_grad_norm=0.5, value_max_grad_norm=0.5, micro_batch_size=1,
        algo={"num_prompts_per_step": GROUPS, "num_generations_per_prompt": G, "ppo_epochs": 2,
              "critic_ppo_epochs": 2, "num_minibatches": k},
    )
    with torch.no_grad():
        head = module.critic.head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    return module


class _Once:
    """The train dataloader: the one chunk (an iterable, so no distributed sampler is injected)."""

    def __init__(self, chunk: dict[str, Any]) -> None:
        self.chunk = chunk

    def __iter__(self) -> Any:
        return iter([self.chunk])


class Record(Callback):
    """Raises Adam's eps (see the module docstring) and keeps the step's metrics."""

    def __init__(self) -> None:
        self.metrics: dict[str, float] = {}

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["eps"] = ADAM_EPS

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}


def fit_step(chunk: dict[str, Any], k: int, strategy: Any = "auto", devices: int = 1) -> dict[str, Any]:
    """Fit one PPO step of ``k`` minibatches on ``chunk``; the weights after it, its metrics and counts."""
    os.environ["PL_GLOBAL_SEED"] = SEED
    module, record = make_ppo(k), Record()
    trainer = Trainer(
        accelerator="cpu", devices=devices, strategy=strategy, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )
    trainer.fit(module, train_dataloaders=_Once(chunk))
    return {
        "policy": module.export_weights(), "critic": module.export_critic_weights(), "metrics": record.metrics,
        "global_step": trainer.global_step, "update_counts": dict(module.update_counts),
        "rows": int(chunk["input_ids"].shape[0]),
    }


def ddp_job(rank: int, out: str) -> None:
    """One of the 2 ranks under screl's DDPStrategy: its shard of the chunk, once per minibatch count."""
    from screl.strategies import DDPStrategy

    chunk = torch.load(os.path.join(os.path.dirname(out), "chunk.pt"))
    shard = shard_groups(chunk, G, num_shards=2, shard=rank)
    torch.save({k: fit_step(shard, k, DDPStrategy(), devices=2) for k in MINIBATCHES}, f"{out}.{rank}")


def megatron_job(rank: int, out: str) -> None:
    """One of the 2 ranks under MegatronStrategy at TP=1 (DP=2)."""
    from screl.strategies import MegatronStrategy, ParallelismConfig

    chunk = torch.load(os.path.join(os.path.dirname(out), "chunk.pt"))
    shard = shard_groups(chunk, G, num_shards=2, shard=rank)
    results = {}
    for k in MINIBATCHES:
        strategy = MegatronStrategy(parallelism=ParallelismConfig(tensor_model_parallel_size=1))
        results[k] = fit_step(shard, k, strategy, devices=2)
    torch.save(results, f"{out}.{rank}")


@pytest.fixture(scope="module")
def chunk_and_reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict[int, dict[str, Any]]]:
    workdir = tmp_path_factory.mktemp("ppo_dp")
    chunk = make_chunk()
    torch.save(chunk, workdir / "chunk.pt")
    return str(workdir), {k: fit_step(chunk, k) for k in MINIBATCHES}


def _run(job: Any, workdir: str, name: str) -> list[dict[int, dict[str, Any]]]:
    sub = os.path.join(workdir, name)
    os.makedirs(sub)
    os.link(os.path.join(workdir, "chunk.pt"), os.path.join(sub, "chunk.pt"))
    out = jobs.spawn(job, 2, sub)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[key] - b[key]).abs().max()) for key in b)


def _assert_equals_one_process(ranks: list[dict[int, dict[str, Any]]], reference: dict[int, dict[str, Any]],
                               megatron: bool) -> None:
    for k in MINIBATCHES:
        ref = reference[k]
        assert ref["update_counts"] == {"policy": 2 * k, "critic": 2 * k}
        assert [r[k]["rows"] for r in ranks] == [4, 4]  # each rank trained its half
        for result in (r[k] for r in ranks):
            assert result["global_step"] == 1
            assert result["update_counts"] == ref["update_counts"]
            for key in ("train/loss", "critic/value_loss"):
                assert result["metrics"][key] == pytest.approx(ref["metrics"][key], rel=1e-5, abs=1e-7), (k, key)
            assert result["metrics"]["train/policy_updates"] == 2 * k
            for part in ("policy", "critic"):
                keys = set(ref[part])
                if megatron:  # Megatron's export has no tied LM head
                    keys = {key for key in keys if not key.endswith("lm_head.weight")}
                assert keys <= set(result[part]), (k, part)
                worst = _max_diff({key: result[part][key] for key in keys}, {key: ref[part][key] for key in keys})
                assert worst < TOL, (k, part, worst)
    moved = _max_diff(reference[4]["policy"], make_ppo(4).export_weights())
    assert moved > 1e-3, f"the policy barely moved ({moved}): the comparison would prove nothing"
    assert _max_diff(reference[4]["policy"], reference[1]["policy"]) > 1e-3  # minibatches change the step


@pytest.mark.parity
def test_ddp_ppo_step_equals_the_one_process_step(
    chunk_and_reference: tuple[str, dict[int, dict[str, Any]]],
) -> None:
    workdir, reference = chunk_and_reference
    _assert_equals_one_process(_run(ddp_job, workdir, "ddp"), reference, megatron=False)


@pytest.mark.parity
@pytest.mark.slow
def test_megatron_dp2_ppo_step_equals_the_one_process_step(
    chunk_and_reference: tuple[str, dict[int, dict[str, Any]]],
) -> None:
    workdir, reference = chunk_and_reference
    _assert_equals_one_process(_run(megatron_job, workdir, "megatron"), reference, megatron=True)
