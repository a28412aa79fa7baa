"""GRPO under ``MegatronStrategy`` end to end on CPU: TP=2 and PP=2 over 2 gloo ranks on loopback. (DP=2 end to end,
the groups sharded over the replicas, is tests/recovery/test_multirank.py's Megatron run: in sync mode its logprobs
equal the workers', and its bundles resumed at TP=2 reproduce it step for step, so it equals this file's reference
too; the step at DP=2 against DP=1 is tests/strategies/test_megatron_strategy.py's and test_distributed_optimizer.py's.)

Each spawned rank (``torch.multiprocessing.spawn``, file:// rendezvous, see ``_megatron_jobs.spawn``)
builds ``screl fit``'s CLI objects for ``configs/grpo_megatron_tiny.yaml`` (shortened) and fits them;
rank 0 starts the real controller, Ray and TransferQueue and broadcasts each chunk. The run is in sync
mode (lookahead 0) so that every token is on-policy: ``train/logprob_mismatch`` then compares the
generation worker's logprobs with the trainer's on every step, which after step 0 checks that the
workers hold exactly the weights the TP=2 trainer exported. Every step's loss and gradient norm are
compared with the single-process Hugging Face GRPO on the same chunk from the same starting weights.
Tolerance: float32 rounding, 1e-5 (absolute) on losses and logprobs, 1e-5 (relative) on the norm.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import _megatron_jobs as jobs
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "grpo_megatron_tiny.yaml"
STEPS = 3
SAMPLER = {"name": "in_order", "max_lookahead_versions": 0}
TOL = 1e-5


def run_config(run_dir: str) -> dict[str, Any]:
    """The shipped config, shortened: 3 steps of 4 prompts x 2 generations, 8 tokens, sync sampling."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["trainer"].update(
        max_steps=STEPS, default_root_dir=run_dir, enable_progress_bar=False, enable_model_summary=False
    )
    cfg["grpo"].update(num_prompts_per_step=4, num_generations_per_prompt=2, max_num_steps=STEPS)
    cfg["async_rl"].update(
        sampler=dict(SAMPLER),
        min_groups_for_streaming_train=4,
        max_inflight_prompts=8,
        max_buffered_rollouts=8,
    )
    cfg["data"]["init_args"]["generation"].update(max_new_tokens=8, min_new_tokens=8)
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    cfg["ray"] = {"num_cpus": 4}
    return cfg  # type: ignore[no-any-return]


def grpo_job(rank: int, out: str) -> None:
    """One training rank: ``screl fit``'s objects for the config, ``fit``, then what the test checks."""
    import ray
    from lightning.pytorch import Callback, LightningModule, Trainer

    from screl.cli import ScrelCLI

    class Record(Callback):
        """Before each chunk: the chunk and the full weights it starts from (rank 0); after each step
        (after WeightSync): this rank's logged metrics."""

        def __init__(self) -> None:
            self.steps: list[dict[str, float]] = []
            self.starts: list[dict[str, Any]] = []

        def on_train_batch_start(
            self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int
        ) -> None:
            if not (isinstance(batch, dict) and "input_ids" in batch):
                return
            weights = pl_module.export_weights()  # type: ignore[operator]  # a collective: every rank
            chunk = {k: v.clone() if torch.is_tensor(v) else v for k, v in batch.items()}
            self.starts.append({"chunk": chunk, "weights": weights if trainer.global_rank == 0 else None})

        def on_train_batch_end(
            self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
        ) -> None:
            if isinstance(batch, dict) and batch.get("last_chunk"):
                self.steps.append({k: float(v) for k, v in trainer.callback_metrics.items()})

    cli = ScrelCLI(args=["--config", os.path.join(os.path.dirname(out), "config.yaml")], run=False)
    record = Record()
    cli.trainer.callbacks.append(record)  # type: ignore[attr-defined]
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    run_dir = cli.trainer.log_dir  # a collective: every rank asks
    model: Any = cli.model
    torch.save(
        {
            "run_dir": run_dir,
            "steps": record.steps,
            "starts": record.starts,
            "global_step": cli.trainer.global_step,
            "strategy": type(cli.trainer.strategy).__name__,
            "model": type(model.model).__name__,
            "ray_running": ray.is_initialized(),
        },
        f"{out}.{rank}",
    )


def reference_step(cfg: dict[str, Any], chunk: dict[str, Any], weights: dict[str, Any]) -> dict[str, float]:
    """One process, the Hugging Face policy (no Megatron) from ``weights``: one step's loss and grad norm."""
    from lightning.pytorch import Trainer

    from screl import GRPO
    from screl.algos import ClippedPGLoss
    from screl.models import TinyCausalLM

    init = cfg["model"]["init_args"]
    module = GRPO(
        policy=TinyCausalLM(**init["policy"]["init_args"]),
        loss_fn=ClippedPGLoss(**init["loss_fn"]["init_args"]),
        learning_rate=init["learning_rate"],
        max_grad_norm=init["max_grad_norm"],
        algo=cfg["grpo"],
    )
    result = module.model.load_state_dict(weights, strict=False)
    assert result.missing_keys == ["lm_head.weight"] and not result.unexpected_keys  # tied to the embedding
    trainer = Trainer(
        accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
    )
    loader: Any = torch.utils.data.DataLoader([chunk], batch_size=None)  # type: ignore[arg-type]
    trainer.fit(module, train_dataloaders=loader)
    return {k: float(trainer.callback_metrics[k]) for k in ("train/loss", "train/grad_norm")}


LAYOUTS: dict[str, dict[str, int]] = {
    "tp2": {"tensor_model_parallel_size": 2},
    "pp2": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2},
}
"""Parallel sizes over the 2 ranks (``pp2``: two pipeline stages, the activations sent between them over gloo, the
loss and metrics on the last stage)."""

Run = tuple[str, dict[str, Any], list[dict[str, Any]]]


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Run:
    layout = str(request.param)
    workdir = tmp_path_factory.mktemp(f"grpo_megatron_{layout}")
    cfg = run_config(str(workdir / "run"))
    cfg["trainer"]["strategy"]["init_args"]["parallelism"] = dict(LAYOUTS[layout])
    if layout == "tp2":  # the worker is a Megatron engine (TP=1), refitted in Megatron's names from the TP=2 shards
        cfg["data"]["init_args"]["generation"]["backend"] = "megatron"
    (workdir / "config.yaml").write_text(yaml.safe_dump(cfg))
    out = jobs.spawn(grpo_job, 2, str(workdir))
    return layout, cfg, [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]


def full_chunk(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    """The chunk of one step: TP and PP peers hold all of it (broadcast, not sharded)."""
    first = chunks[0]
    assert "dp_shards" not in first
    assert all(torch.equal(c["input_ids"], first["input_ids"]) for c in chunks)
    return first


@pytest.mark.slow
def test_grpo_runs_end_to_end(run: Run) -> None:
    from screl.data.event_check import check_events

    _, _, ranks = run
    zero = ranks[0]
    for result in ranks:
        assert result["strategy"] == "MegatronStrategy"
        assert result["model"] == "GPTModel"  # the Megatron shard replaced the HF policy
        assert result["global_step"] == STEPS
        assert len(result["steps"]) == STEPS
        assert not result["ray_running"]  # rank 0 stopped the Ray cluster it started; rank 1 never joined
    report = check_events(Path(zero["run_dir"]), SAMPLER)
    assert report.ok, report.format()
    for step in zero["steps"]:
        for key in ("train/loss", "reward", "train/grad_norm"):
            assert math.isfinite(step[key]), f"{key} = {step[key]}"
    # both ranks report the whole chunk's loss and the reduced gradient norm
    for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True):
        assert a["train/loss"] == pytest.approx(b["train/loss"], abs=TOL)
        assert a["train/grad_norm"] == pytest.approx(b["train/grad_norm"], rel=TOL)


@pytest.mark.parity
@pytest.mark.slow
def test_workers_generate_with_the_exported_weights(run: Run) -> None:
    """Sync mode: every token is on-policy, so the worker's logprobs must equal the trainer's. At steps
    1 and 2 the worker holds the full weights that rank 0 exported after the previous step (HF-named for the torch
    engine at PP=2; Megatron-named for the Megatron engine at TP=2)."""
    _, _, ranks = run
    mismatch = [step["train/logprob_mismatch"] for step in ranks[0]["steps"]]
    assert len(mismatch) == STEPS
    assert max(mismatch) < TOL, mismatch


@pytest.mark.parity
@pytest.mark.slow
def test_every_step_matches_single_process_reference(run: Run) -> None:
    _, cfg, ranks = run
    starts = ranks[0]["starts"]
    assert len(starts) == STEPS  # one chunk per step
    assert any(step["train/grad_norm"] > 0.01 for step in ranks[0]["steps"])  # some step has a gradient
    steps = zip(starts, ranks[1]["starts"], ranks[0]["steps"], strict=True)
    for version, (start, peer, step) in enumerate(steps):
        chunk = full_chunk([start["chunk"], peer["chunk"]])
        assert chunk["trainer_version"] == version
        expected = reference_step(cfg, chunk, start["weights"])
        assert step["train/loss"] == pytest.approx(expected["train/loss"], abs=TOL)
        assert step["train/grad_norm"] == pytest.approx(expected["train/grad_norm"], rel=TOL, abs=1e-7)


# ------------------------------------------------------------------------------ fast unit checks
def _chunk(groups: int, group_size: int) -> dict[str, Any]:
    rows = groups * group_size
    token_mask = torch.zeros(rows, 5)
    for i in range(rows):
        token_mask[i, : 1 + i % 4] = 1.0
    return {
        "trainer_version": 3, "step_groups": 8, "last_chunk": True,
        "input_ids": torch.arange(rows * 6).reshape(rows, 6), "attention_mask": torch.ones(rows, 6),
        "token_mask": token_mask, "generation_logprobs": torch.zeros(rows, 5),
        "token_versions": torch.zeros(rows, 5, dtype=torch.long), "rewards": torch.arange(rows).float(),
        "raw_rewards": torch.arange(rows).float() - 1.0, "finish_reason": torch.arange(rows) % 3,
        "sample_mask": torch.ones(rows), "start_weight": torch.zeros(rows, dtype=torch.long),
    }


@pytest.mark.parametrize(("groups", "shards"), [(4, 2), (5, 2), (3, 4)])
def test_shard_groups_splits_whole_groups(groups: int, shards: int) -> None:
    from screl.datamodule import ROW_KEYS, shard_groups

    chunk = _chunk(groups, group_size=3)
    parts = [shard_groups(chunk, 3, shards, r) for r in range(shards)]
    assert sum(p["input_ids"].shape[0] for p in parts) == groups * 3
    assert all(p["input_ids"].shape[0] % 3 == 0 for p in parts)  # whole groups only
    assert max(p["rewards"].numel() for p in parts) - min(p["rewards"].numel() for p in parts) <= 3
    for key in ROW_KEYS:
        assert torch.equal(torch.cat([p[key] for p in parts]), chunk[key])
    for p in parts:
        assert (p["chunk_rows"], p["dp_shards"], p["trainer_version"]) == (groups * 3, shards, 3)
        assert p["chunk_valid_tokens"] == float(chunk["token_mask"].sum())


def test_shard_groups_rejects_partial_groups() -> None:
    from screl.datamodule import shard_groups

    with pytest.raises(ValueError, match="a chunk of 7 rows is not whole groups of 2"):
        shard_groups(_chunk(7, 1), 2, 2, 0)


def test_megatron_logprobs_need_right_padding() -> None:
    from screl.modules.megatron_policy import megatron_token_logprobs

    ids = torch.ones(2, 4, dtype=torch.long)
    left_padded = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    with pytest.raises(ValueError, match="needs right-padded rows"):
        megatron_token_logprobs(None, torch.nn.Identity(), ids, left_padded, 1.0)


def test_explicit_model_provider_must_match_the_policy() -> None:
    from types import SimpleNamespace

    from screl.strategies import GPTModelProvider

    from screl.models import TinyCausalLM
    from screl.modules.megatron_policy import fit_provider_to_policy

    hf = TinyCausalLM(scale="tiny").build_model()
    default = SimpleNamespace(model_provider=GPTModelProvider(), model_provider_is_default=True)
    fit_provider_to_policy(default, hf)
    assert default.model_provider == GPTModelProvider.from_hf_config(hf.config)
    matching = SimpleNamespace(
        model_provider=GPTModelProvider.from_hf_config(hf.config), model_provider_is_default=False
    )
    fit_provider_to_policy(matching, hf)
    wrong = SimpleNamespace(model_provider=GPTModelProvider(hidden_size=32), model_provider_is_default=False)
    with pytest.raises(ValueError, match=r"hidden_size=32 \(policy: 64\)"):
        fit_provider_to_policy(wrong, hf)
