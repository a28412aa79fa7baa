"""PPO under ``MegatronStrategy`` on CPU: one PPO step at TP=2 over 2 gloo ranks equals the one-process step.

Each spawned rank (``torch.multiprocessing.spawn``, file:// rendezvous on loopback, see ``_megatron_jobs.spawn``)
fits a real ``PPO`` module with a real ``lightning.Trainer(devices=2, strategy=MegatronStrategy(TP=2))`` on
one chunk: the value stage, GAE, 2 critic epochs and 2 policy epochs, 2 micro-batches each, gradients
clipped (the clip is active). The reference is the same module, chunk and weights in this process with
Lightning's default strategy (Hugging Face policy and ``ValueModel`` critic).

Tolerance: 1e-5 on every logged metric (absolute or relative, whichever is larger: the critic's gradient norm
is ~500), 1e-5 absolute on every exported weight (policy and critic, in Hugging Face naming), and 1e-5
relative alone on the policy's and the critic's gradient norms. Both sides are float32; tensor
parallelism changes only the order of float32 sums (the row-parallel all-reduces, the vocabulary-parallel
softmax), which moves results by ~1e-7 relative (seen: weights within 2e-8, metrics within 1e-6 on a value
loss of 6.3). The weights move by ~1e-2 over the step (checked). An error in the parallel path shows in the
norms: counting the replicated parameters (norms, value head) on both TP ranks moves them by ~1e-4 relative
(checked by hand), though the weights, clipped and Adam-normalized, by only ~5e-6. Adam's ``eps`` is raised to
1e-3 in both runs (``ADAM_EPS``, as in ``_megatron_jobs``): at the default 1e-8 the first Adam step is
``lr * sign(g)``, and analytically-zero gradients (the key-projection bias's) turn rounding noise into
full-size steps that would hide the comparison.
"""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import _megatron_jobs as jobs
import pytest
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from screl.algos import ClippedPGLoss, ClippedValueLoss
from screl.models import TinyCausalLM
from screl.modules.grpo import token_logprobs
from screl.modules.ppo import PPO, _check_megatron_layout, _right_padded_positions

TOL = 1e-5
ADAM_EPS = 1e-3
LR = 1e-2
MAX_NORM = 0.05
POLICY, CRITIC = TinyCausalLM(seed=0), TinyCausalLM(seed=1)
PROMPTS, COMPLETIONS = (3, 4, 3, 5), (6, 4, 8, 5)
SEQ = 12


def make_ppo(start: int) -> PPO:
    """The module both runs train: a critic head that is not zero, so the trunk has gradients at once."""
    module = PPO(
        policy=POLICY, value=CRITIC, loss_fn=ClippedPGLoss(use_importance_sampling_correction=True),
        value_loss_fn=ClippedValueLoss(value_clip=0.5), learning_rate=LR, value_learning_rate=LR,
        max_grad_norm=MAX_NORM, value_max_grad_norm=MAX_NORM, micro_batch_size=2,
        algo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2, "ppo_epochs": 2,
              "critic_ppo_epochs": 2, "policy_training_start_step": start},
    )
    with torch.no_grad():
        head = module.critic.head.weight
        head.copy_(torch.randn(head.shape, generator=torch.Generator().manual_seed(3)) * 0.5)
    return module


def make_chunk() -> dict[str, Any]:
    """One step's chunk at trainer version 1: right-padded rows of different lengths, rows 0-1 on-policy,
    rows 2-3 sampled by version 0 (their generation logprobs: the policy's plus noise, so IS weights != 1)."""
    g = torch.Generator().manual_seed(11)
    vocab = int(POLICY.build_model().config.vocab_size)
    rows = len(PROMPTS)
    ids, attention = torch.zeros(rows, SEQ, dtype=torch.long), torch.zeros(rows, SEQ, dtype=torch.long)
    token_mask = torch.zeros(rows, SEQ - 1)
    for i, (p, c) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        ids[i, : p + c] = torch.randint(3, vocab, (p + c,), generator=g)
        attention[i, : p + c] = 1
        token_mask[i, p - 1 : p - 1 + c] = 1.0
    with torch.no_grad():
        policy_lp = token_logprobs(POLICY.build_model().eval(), ids, attention, 1.0)
    versions = torch.tensor([1, 1, 0, 0])[:, None].expand(rows, SEQ - 1).clone()
    noise = 0.1 * torch.randn(rows, SEQ - 1, generator=g)
    return {
        "input_ids": ids, "attention_mask": attention, "token_mask": token_mask,
        "generation_logprobs": (policy_lp + noise) * token_mask, "token_versions": versions,
        "rewards": torch.tensor([1.0, 0.0, 0.5, 2.0]), "sample_mask": torch.ones(rows),
        "start_weight": versions[:, 0].clone(), "trainer_version": 1, "step_groups": 2, "last_chunk": True,
    }


class _Once:
    """The train dataloader: the one chunk (an iterable, so no distributed sampler is injected)."""

    def __init__(self, chunk: dict[str, Any]) -> None:
        self.chunk = chunk

    def __iter__(self) -> Any:
        return iter([self.chunk])


def _weights(module: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Policy and critic, full and in Hugging Face naming (under Megatron a collective on every rank)."""
    return {"policy": module.export_weights(), "critic": module.export_critic_weights()}


class Record(Callback):
    """Raises Adam's eps (see the module docstring); exports both models around the step, keeps its metrics."""

    def __init__(self) -> None:
        self.out: dict[str, Any] = {}

    @override
    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        for opt in trainer.optimizers:
            for group in opt.param_groups:
                group["eps"] = ADAM_EPS

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.out["before"] = _weights(pl_module)

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.out["after"] = _weights(pl_module)
        self.out["metrics"] = {k: float(v) for k, v in trainer.callback_metrics.items()}


def fit_step(chunk: dict[str, Any], start: int, tp: int | None) -> dict[str, Any]:
    """Fit one PPO step; ``tp``: MegatronStrategy at that TP size over 2 ranks, None: one process."""
    module, record = make_ppo(start), Record()
    strategy: Any = "auto"
    if tp is not None:
        from screl.strategies import MegatronStrategy, ParallelismConfig

        strategy = MegatronStrategy(parallelism=ParallelismConfig(tensor_model_parallel_size=tp))
    trainer = Trainer(
        accelerator="cpu", devices=1 if tp is None else 2, strategy=strategy, max_steps=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[record],
    )
    trainer.fit(module, train_dataloaders=_Once(chunk))
    return {
        **record.out, "global_step": trainer.global_step, "update_counts": dict(module.update_counts),
        "refit_due": module.refit_due, "models": (type(module.model).__name__, type(module.critic).__name__),
    }


def ppo_job(rank: int, out: str) -> None:
    """One of the 2 ranks: the full step and a warmup step at TP=2 (DP=2: ``test_ppo_dp.py``)."""
    chunk = torch.load(os.path.join(os.path.dirname(out), "chunk.pt"))
    result: dict[str, Any] = {"train": fit_step(chunk, start=0, tp=2), "warmup": fit_step(chunk, start=2, tp=2)}
    torch.save(result, f"{out}.{rank}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    workdir = tmp_path_factory.mktemp("ppo_megatron")
    chunk = make_chunk()
    torch.save(chunk, workdir / "chunk.pt")
    out = jobs.spawn(ppo_job, 2, str(workdir))
    ranks = [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]
    return {"ranks": ranks, "reference": fit_step(chunk, start=0, tp=None)}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _assert_close(megatron: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Every exported weight within TOL; the only reference key Megatron lacks is the tied LM head."""
    assert {k.removeprefix("trunk.") for k in set(reference) - set(megatron)} == {"lm_head.weight"}
    worst = {k: float((v - reference[k]).abs().max()) for k, v in megatron.items()}
    assert max(worst.values()) < TOL, sorted(worst.items(), key=lambda kv: -kv[1])[:5]


@pytest.mark.parity
@pytest.mark.slow
def test_one_tp2_step_equals_the_one_process_step(runs: dict[str, Any]) -> None:
    reference = runs["reference"]
    for result in (step["train"] for step in runs["ranks"]):
        assert result["models"] == ("GPTModel", "MegatronValueModel")
        assert result["global_step"] == 1 and result["refit_due"] is True
        assert result["update_counts"] == reference["update_counts"] == {"policy": 2, "critic": 2}
        keys = [k for k in reference["metrics"] if not k.startswith("time/")]
        norms = ("train/grad_norm", "critic/grad_norm")
        assert {"train/loss", "critic/value_loss", "critic/explained_variance", *norms} <= set(keys)
        for key in keys:
            assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=TOL, abs=TOL), key
        for key in norms:
            assert reference["metrics"][key] > MAX_NORM  # the clip is active
            assert result["metrics"][key] == pytest.approx(reference["metrics"][key], rel=TOL, abs=0.0), key
        for part in ("policy", "critic"):
            _assert_close(result["before"][part], reference["before"][part])  # the same start
            _assert_close(result["after"][part], reference["after"][part])
            moved = _max_diff(result["after"][part], result["before"][part])
            assert moved > 1000 * TOL, f"{part} barely moved ({moved}): the comparison would prove nothing"
    trunk_moved = {k: v for k, v in runs["ranks"][0]["train"]["after"]["critic"].items() if k.startswith("trunk.")}
    assert _max_diff(trunk_moved, runs["ranks"][0]["train"]["before"]["critic"]) > 1000 * TOL


@pytest.mark.slow
def test_warmup_leaves_the_megatron_policy_bit_identical(runs: dict[str, Any]) -> None:
    for result in (step["warmup"] for step in runs["ranks"]):
        before, after = result["before"], result["after"]
        assert before["policy"].keys() == after["policy"].keys()
        assert all(torch.equal(v, before["policy"][k]) for k, v in after["policy"].items()), "policy moved"
        assert _max_diff(after["critic"], before["critic"]) > 1000 * TOL  # the critic trained
        assert result["update_counts"] == {"policy": 0, "critic": 2} and result["refit_due"] is False
        assert result["global_step"] == 1


# ------------------------------------------------------------------------------ fast unit checks
def test_unsupported_layouts_are_named_together() -> None:
    parallelism = SimpleNamespace(pipeline_model_parallel_size=2, context_parallel_size=1, sequence_parallel=True)
    strategy = SimpleNamespace(parallelism=parallelism, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"trainer.strategy.init_args.parallelism: .*pipeline_model_parallel_size"
                                         r".*; sequence_parallel"):
        _check_megatron_layout(strategy)
    ok = SimpleNamespace(parallelism=SimpleNamespace(pipeline_model_parallel_size=1, context_parallel_size=1,
                                                     sequence_parallel=False), data_parallel_size=2)
    _check_megatron_layout(ok)  # data parallelism is supported


def test_megatron_rows_must_be_right_padded() -> None:
    ids = torch.ones(2, 4, dtype=torch.long)
    assert torch.equal(_right_padded_positions(ids, torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]]))[1],
                       torch.arange(4))
    with pytest.raises(ValueError, match="PPO under MegatronStrategy needs right-padded rows"):
        _right_padded_positions(ids, torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]))
