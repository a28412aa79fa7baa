"""End-to-end fixtures: one loopback Ray cluster per session, runs of `screl fit` in-process."""

from __future__ import annotations

import copy
import csv
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import yaml
from _ray_session import session_ray

from screl.dataplane import tq_actors_alive

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def ray_cluster() -> Iterator[None]:
    with session_ray(num_cpus=8, namespace="screl-tests"):
        yield


def base_config(run_dir: Path) -> dict[str, Any]:
    """A small, fast run: tiny model, 4 prompts x 2 generations, 8 tokens, injected generation latency."""
    cfg = yaml.safe_load((ROOT / "configs" / "grpo_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=4, default_root_dir=str(run_dir), enable_progress_bar=False,
                          enable_model_summary=False)
    # refits travel in many small buckets (the tiny policy is ~0.4 MB), so every run checks bucketed refits
    cfg["data"]["init_args"]["generation"].update(max_new_tokens=8, min_new_tokens=8, injected_latency_s=0.3,
                                                  refit_bucket_mb=0.02)
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    cfg["grpo"].update(num_prompts_per_step=4, num_generations_per_prompt=2, max_num_steps=4)
    cfg["async_rl"].update(min_groups_for_streaming_train=4, max_inflight_prompts=8, max_buffered_rollouts=8)
    return copy.deepcopy(cfg)


def run_fit(cfg: dict[str, Any], tmp_path: Path, callbacks: list[Any] | None = None) -> Path:
    """Run `screl fit` in-process; returns the run directory (events.jsonl, metrics.csv, config.yaml)."""
    from screl.cli import ScrelCLI

    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = ScrelCLI(args=["--config", str(path)], run=False)
    if callbacks:
        cli.trainer.callbacks.extend(callbacks)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    finally:
        _undo_megatron_setup()
    run_dir = Path(cli.trainer.log_dir)
    assert tq_actors_alive() == [], "TransferQueue actors leaked"
    leaked = [a for a in ray.util.list_named_actors(all_namespaces=True) if "screl" in str(a)]
    assert leaked == [], f"screl actors leaked: {leaked}"
    return run_dir


def _undo_megatron_setup() -> None:
    """Undo what a MegatronStrategy fit leaves in this process: its teardown keeps ``parallel_state`` initialized
    and, on CPU, the CUDA shim applied (``torch.cuda``, ``Tensor.cuda``, megatron's masks and RNG tracker, process-wide),
    which later tests in the session would see. ``destroy_model_parallel`` is the strategy's own undo (a no-op when
    nothing is set up); not imported when no fit loaded megatron."""
    parallel = sys.modules.get("screl.strategies.parallel")
    if parallel is not None:
        parallel.destroy_model_parallel()


def metrics(run_dir: Path) -> list[dict[str, float]]:
    rows = []
    with (run_dir / "metrics.csv").open() as fh:
        for row in csv.DictReader(fh):
            rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def column(rows: list[dict[str, float]], key: str) -> list[float]:
    return [r[key] for r in rows if key in r]
