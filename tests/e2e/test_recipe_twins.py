"""Shape twins of the recipes in ``configs/recipes/``: each recipe trained 3 steps on CPU at a tiny size.

A twin is the recipe's own config with only what a CPU cannot hold replaced:

- the model: ``screl.models.ShapeTwin`` over the family's ``configs/recipes/shapes/<family>/config.json`` (the recipe
  names the hub id at a pinned revision; ``shapes/hub.json`` maps it to the folder) (sizes
  shrunk; grouped-query ratio, head width, RoPE type and scaling, tied or untied embeddings, QKV bias or QK norm
  kept) and the character tokenizer; the policy's ``chat_template`` stays on where the recipe sets it;
- the dataset: a parquet file written here in the dataset's column layout (the recipe's column names, its
  template over the same columns reworded in characters the tokenizer has);
- the hardware: CPU, vLLM -> the torch engine, one worker, GPU placement dropped;
- the sizes: 4 prompts x 2 generations a step, 8 tokens, 3 steps; the sampler's knobs scaled by the same factor
  (``min_groups_for_streaming_train``, ``max_inflight_prompts``, ``max_buffered_rollouts``), so a recipe that
  streams half-steps still streams half-steps and a sync recipe stays sync.

Everything else is the recipe's: algorithm, loss (the KL penalty and IS correction included), sampler,
strategy, verifier (``MathVerify`` in its own process) and workflow (the agent over the HTTP server).

The two Megatron recipes share one 2-rank run's worth of coverage: the GRPO twin trains at TP=2 over 2 gloo
processes (``screl fit`` as a subprocess, as a user runs it), the PPO twin under ``MegatronStrategy`` at TP=1 in
this process (policy and critic as Megatron models), so tensor parallelism is paid for once. The others run
in-process on the session's Ray cluster. Each twin ends with ``check_events(..., final=True)`` passing.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import yaml
from _fit_env import fit_env
from lightning.pytorch import Callback

from screl.data.event_check import check_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = pytest.mark.slow

RECIPES = ROOT / "configs" / "recipes"
NPS, GENS, STEPS = 4, 2, 3


def _rows(layout: str, n: int, offset: int = 0) -> dict[str, list[Any]]:
    """``n`` sums in a dataset's column layout (lower-case text: the character tokenizer's alphabet)."""
    pairs = [((i * 7 + offset) % 10, (i * 3 + 1) % 10) for i in range(n)]
    if layout == "openmathinstruct2":  # nvidia/OpenMathInstruct-2
        return {"problem": [f"what is {a}+{b}" for a, b in pairs],
                "generated_solution": [f"{a}+{b}={a + b} so \\boxed{{{a + b}}}" for a, b in pairs],
                "expected_answer": [str(a + b) for a, b in pairs],
                "problem_source": ["augmented_math" if i % 2 else "math" for i in range(n)]}
    if layout == "math":  # DigitalLearningGmbH/MATH-lighteval
        return {"problem": [f"what is {a}+{b}" for a, b in pairs],
                "level": ["Level 1"] * n, "type": ["Prealgebra"] * n,
                "solution": [f"${a}+{b}={a + b}$, so the answer is $\\boxed{{{a + b}}}$." for a, b in pairs]}
    if layout == "gsm8k":  # openai/gsm8k, main
        return {"question": [f"what is {a}+{b}" for a, b in pairs],
                "answer": [f"{a}+{b}=<<{a}+{b}={a + b}>>{a + b}\n#### {a + b}" for a, b in pairs]}
    raise ValueError(layout)


def _write(layout: str, folder: Path, splits: dict[str, int]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for i, (split, n) in enumerate(splits.items()):
        pq.write_table(pa.table(_rows(layout, n, offset=i)), folder / f"{split}.parquet")
    return folder


#: hub id -> the folder holding its config.json (configs/recipes/shapes/hub.json)
SHAPES = {e["repo_id"]: folder for folder, e in json.loads((RECIPES / "shapes" / "hub.json").read_text()).items()}


def _twin_policy(spec: dict[str, Any], head_dim: int) -> dict[str, Any]:
    args = spec["init_args"]
    assert spec["class_path"] == "screl.models.HFCausalLM" and args["path"] in SHAPES and args["revision"], spec
    return {"class_path": "screl.models.ShapeTwin",
            "init_args": {"config": str(ROOT / SHAPES[args["path"]]), "head_dim": head_dim,
                          "chat_template": bool(args.get("chat_template", False))}}


def twin_config(recipe: str, tmp_path: Path, *, layout: str, template: str | None = None, head_dim: int = 8,
                tp: int | None = None) -> dict[str, Any]:
    """The recipe ``configs/recipes/<recipe>`` as its CPU shape twin (see the module docstring)."""
    cfg = yaml.safe_load((RECIPES / recipe).read_text())
    algo = "ppo" if "ppo" in cfg else "grpo"
    strategy = cfg["trainer"].get("strategy")
    cfg["trainer"] = {"accelerator": "cpu", "devices": tp or 1, "max_steps": STEPS, "log_every_n_steps": 1,
                      "default_root_dir": str(tmp_path / "root"), "enable_checkpointing": False,
                      "enable_progress_bar": False, "enable_model_summary": False}
    if cfg.get("checkpointing", {}).get("enabled"):  # the recipe's bundles, kept in the test's folder
        cfg["checkpointing"]["checkpoint_dir"] = str(tmp_path / "checkpoints")
    if strategy is not None:
        assert strategy["class_path"] == "screl.strategies.MegatronStrategy", strategy
        strategy["init_args"]["parallelism"]["tensor_model_parallel_size"] = tp or 1
        cfg["trainer"]["strategy"] = strategy
    init = cfg["model"]["init_args"]
    for key in ("policy", "value"):
        if key in init:
            init[key] = _twin_policy(init[key], head_dim)
    data = cfg["data"]["init_args"]
    task = data["task"]["init_args"]
    if data["task"]["class_path"] == "screl.envs.DatasetTask":
        splits = {"train": 16, **({"test": 4} if task.get("val_split") else {})}
        task["path"] = str(_write(layout, tmp_path / "data", splits))
        task["split"] = "train"
        task.pop("revision", None)
        task.pop("name", None)
        if template is not None:
            task["prompt_template"] = template
        if task.get("holdout"):
            task["holdout"] = 2
        task["max_prompt_tokens"] = 64
    elif "syntax" in task:
        task["syntax"] = "compact"  # the character tokenizer cannot write <tool_call>{...}</tool_call>
    gen = data["generation"]
    colocated = bool(gen.get("colocated", {}).get("enabled", False))
    for key in ("colocated", "backend_args", "num_gpus_per_worker", "resources", "device"):
        gen.pop(key, None)
    if gen.get("backend") != "megatron":  # Megatron generation runs on a CPU; vLLM is replaced by the torch engine
        gen["backend"] = "torch"
    gen.update(num_workers=1, max_new_tokens=8, min_new_tokens=0, colocated={"enabled": colocated})
    data["step_timeout_s"] = 120
    scale = NPS / cfg[algo]["num_prompts_per_step"]
    cfg[algo].update(num_prompts_per_step=NPS, num_generations_per_prompt=GENS, max_num_steps=STEPS,
                     max_num_epochs=10, val_period=0)
    if algo == "ppo":
        cfg[algo]["policy_training_start_step"] = 1  # one warmup step, then two steps that train both models
    rl = cfg["async_rl"]
    for key in ("min_groups_for_streaming_train", "max_inflight_prompts", "max_buffered_rollouts"):
        rl[key] = max(1, round(rl[key] * scale))
    cfg.pop("ray", None)
    return copy.deepcopy(cfg)


def _audit(run_dir: Path, cfg: dict[str, Any]) -> list[dict[str, float]]:
    rows = metrics(run_dir)
    assert len(column(rows, "train/loss")) == STEPS, rows
    report = check_events(run_dir, cfg["async_rl"]["sampler"],
                          max_buffered_rollouts=cfg["async_rl"]["max_buffered_rollouts"], final=True)
    assert report.ok, report.format()
    return rows


class StrategySeen(Callback):
    """Records the trainer's strategy (which engine trained the twin)."""

    def __init__(self) -> None:
        self.strategy = ""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.strategy = type(trainer.strategy).__name__


def _fit_in_process(cfg: dict[str, Any], tmp_path: Path) -> tuple[Path, list[dict[str, float]], str]:
    """Train the twin in this process and audit it: its run directory, metrics rows and the strategy it ran under."""
    seen = StrategySeen()
    start = time.monotonic()
    run_dir = run_fit(cfg, tmp_path, callbacks=[seen])
    print(f"twin took {time.monotonic() - start:.1f} s")
    return run_dir, _audit(run_dir, cfg), seen.strategy


@pytest.mark.usefixtures("ray_cluster")
def test_ppo_math_1b_megatron_twin(tmp_path: Path) -> None:
    """PPO, Llama-3.2-1B's shape (llama3 RoPE x32, tied, GQA 4:1), policy and critic as Megatron models (TP=1),
    in_order with the warmup lookahead, whole steps, MathVerify over OpenMathInstruct-2's columns."""
    cfg = twin_config("ppo_math_1b_megatron.yaml", tmp_path, layout="openmathinstruct2", template="{problem} =")
    assert cfg["async_rl"]["min_groups_for_streaming_train"] == NPS  # PPO trains whole steps
    _, rows, strategy = _fit_in_process(cfg, tmp_path)
    assert strategy == "MegatronStrategy", strategy
    assert column(rows, "critic/value_loss"), "the critic never trained"
    assert column(rows, "ppo/critic_updates")[-1] == STEPS


@pytest.mark.usefixtures("ray_cluster")
def test_grpo_qwen25_math_sync_twin(tmp_path: Path) -> None:
    """Sync GRPO, Qwen2.5-Math-1.5B's shape (QKV bias, tied, GQA 6:1), Megatron TP=1, in_order with no lookahead
    and whole steps, the model's chat template, MathVerify reading MATH's \\boxed{} solutions, a test split."""
    cfg = twin_config("grpo_qwen2.5_math_1.5b_sync.yaml", tmp_path, layout="math")
    cfg["model"]["init_args"]["policy"]["init_args"]["system_prompt"] = "reason step by step"
    _, rows, strategy = _fit_in_process(cfg, tmp_path)
    assert strategy == "MegatronStrategy", strategy
    assert max(column(rows, "train/staleness_max") or [0.0]) == 0.0  # on-policy: nothing generated by older weights


@pytest.mark.usefixtures("ray_cluster")
def test_grpo_llama31_8b_streaming_twin(tmp_path: Path) -> None:
    """Windowed streaming GRPO, Llama-3.1-8B's shape (untied embeddings, llama3 RoPE x8, GQA 4:1), Megatron TP=1
    with the distributed optimizer, half-step chunks, over-sampled dispatch, MathVerify over GSM8K's columns."""
    cfg = twin_config("grpo_llama3.1_8b_streaming.yaml", tmp_path, layout="gsm8k", template="{question} =")
    cfg["data_plane"].pop("storage_node_resource")  # a single-node cluster offers no head_node resource
    assert cfg["async_rl"]["min_groups_for_streaming_train"] == NPS // 2
    run_dir, rows, strategy = _fit_in_process(cfg, tmp_path)
    assert strategy == "MegatronStrategy", strategy
    assert max(column(rows, "train/staleness_max")) <= 1.0  # the window [T-1, T]
    selects = [json.loads(e) for e in (run_dir / "events.jsonl").read_text().splitlines() if '"event":"select"' in e]
    assert sum(len(e["group_ids"]) for e in selects) == STEPS * NPS, selects


@pytest.mark.usefixtures("ray_cluster")
def test_grpo_qwen3_agent_twin(tmp_path: Path) -> None:
    """Qwen3-0.6B's shape (QK norm, head width 2 x hidden/heads, tied), the recipe's agent over the policy server
    in front of a Megatron generation worker (TP=1, refitted in Megatron's names), token capture, the calculator task
    (compact tool syntax: the character tokenizer has no '<' or '{')."""
    cfg = twin_config("grpo_qwen3_0.6b_agent.yaml", tmp_path, layout="", head_dim=16)
    gen = cfg["data"]["init_args"]["generation"]
    assert (gen["workflow"], gen["backend"], gen["expose_http_server"]) == ("screl.rollout.AgentWorkflow", "megatron",
                                                                           True)
    _, rows, strategy = _fit_in_process(cfg, tmp_path)
    assert strategy == "MegatronStrategy", strategy
    assert all(t > 0 for t in column(rows, "train/num_valid_tokens")), rows


@pytest.mark.usefixtures("ray_cluster")
def test_grpo_1b_megatron_colocated_twin(tmp_path: Path) -> None:
    """Llama-3.2-1B's shape, Megatron TP=1 with colocated Megatron generation in the trainer's process (no worker),
    whole-step chunks with one step of lookahead, MathVerify over OpenMathInstruct-2's columns."""
    cfg = twin_config("grpo_1b_megatron_colocated.yaml", tmp_path, layout="openmathinstruct2", template="{problem} =")
    gen = cfg["data"]["init_args"]["generation"]
    assert (gen["backend"], gen["colocated"]["enabled"]) == ("megatron", True)
    assert cfg["async_rl"]["min_groups_for_streaming_train"] == NPS  # colocated: whole steps
    _, rows, strategy = _fit_in_process(cfg, tmp_path)
    assert strategy == "MegatronStrategy", strategy
    assert [a for a in ray.util.list_named_actors(all_namespaces=True) if "generation" in str(a)] == []
    assert max(column(rows, "train/logprob_mismatch")) < 1e-5  # the engine decodes with the trainer's module


def test_grpo_math_1b_megatron_twin_at_tp2(tmp_path: Path) -> None:
    """GRPO, Llama-3.2-1B's shape, Megatron TP=2 over 2 gloo processes (``screl fit`` as a subprocess: Lightning
    starts rank 1), in_order with one step of lookahead and half-step chunks, the KL penalty against the starting
    weights, MathVerify over OpenMathInstruct-2's columns with a holdout."""
    cfg = twin_config("grpo_math_1b_megatron.yaml", tmp_path, layout="openmathinstruct2", template="{problem} =", tp=2)
    assert cfg["model"]["init_args"]["loss_fn"]["init_args"]["reference_policy_kl_penalty"] > 0
    cfg["ray"] = {"num_cpus": 4}
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "screl.cli", "fit", "--config", str(config)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, env=fit_env({"PYTHONUNBUFFERED": "1"}))
    print(f"twin took {time.monotonic() - start:.1f} s")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    (run_dir,) = {p.parent for p in (tmp_path / "root").rglob("events.jsonl")}
    rows = _audit(run_dir, cfg)
    assert len(column(rows, "train/kl_ref")) == STEPS, sorted(rows[-1])
