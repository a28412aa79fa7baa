"""Trainer memory at a real vocabulary: one GRPO training step at vocabulary 151,936, screl before this change
(full logits), screl after (chunked logprobs), TRL 1.16's GRPOTrainer loss path, each in its own process.

    python bench/memory.py                 # the main step (8 x 2048 tokens) for every side, then the sweep
    python bench/memory.py --quick         # smoke: 2 x 512 tokens, a short sweep

The model: a Qwen2 trunk (hidden 256, 2 layers, MLP 768, 4 heads / 2 KV heads, tied embeddings) at vocabulary
151,936, fp32, 2 torch threads, no activation checkpointing on any compared side. The batch: random tokens, the
last ``length - 64`` of each row a completion, micro-batches of ``--micro-rows`` rows (the same on every side).

A step is what a trainer does per RL step: for each micro-batch the policy's logprobs of the completion tokens,
the clipped policy-gradient loss, backward; then gradient clipping and one AdamW step.
- ``before``: ``GRPO(logprob_chunk_tokens=0)``, the full-logits path screl had before (``full_token_logprobs``);
- ``after``: ``GRPO()``, chunked logprobs (the default);
- ``after_ckpt``: ``after`` with ``activation_checkpointing: full`` (reported, not compared);
- ``trl``: TRL's ``add_fused_lm_head`` (as ``GRPOTrainer.__init__`` patches the model: log-probs and entropy in
  tiles, recomputed in backward) and ``model(..., labels=..., fused_lm_head=True)`` as
  ``GRPOTrainer._get_per_token_logps_and_entropies`` calls it, then the same clipped loss and AdamW step.

Memory: each side first takes a one-row warm-up step (the AdamW state exists afterwards), then the peak resident
set (``VmHWM`` after resetting it through ``/proc/self/clear_refs``) over the measured step, less the resident set
just before it. ``MALLOC_MMAP_THRESHOLD_`` is fixed so that freed tensors return to the system on every side.
Time: the measured step's wall time (``step_time_over_trl``) and CPU time (``step_cpu_over_trl``: the same ratio
less exposed to other load on the machine).

Writes ``bench/results/memory.json`` (``memory_over_trl``, ``memory_over_before``, ``memory_growth_flat``,
``step_time_over_trl``, the checkpointed side's figures, the sweep) and ``bench/results/memory.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

VOCAB, HIDDEN, LAYERS, FFN, PROMPT = 151_936, 256, 2, 768, 64
THREADS = 2
SIDES = ("before", "after", "after_ckpt", "trl")
TARGETS = {"memory_over_trl": 0.9, "memory_over_before": 0.25, "memory_growth_flat": 1.5, "step_time_over_trl": 1.1}


# -- one side, in its own process -------------------------------------------------------------------------------


def _rss_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _model() -> Any:
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32_768,
                      tie_word_embeddings=True)
    return Qwen2ForCausalLM(cfg).train()


def _batch(rows: int, length: int) -> dict[str, Any]:
    import torch

    g = torch.Generator().manual_seed(rows * 100_003 + length)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    token_mask = torch.zeros(rows, length - 1)
    token_mask[:, PROMPT - 1:] = 1.0
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_mask": token_mask,
            "advantages": torch.randn(rows, generator=g)}


def _clipped_loss(logp: Any, mask: Any, advantages: Any) -> Any:
    """The clipped PG loss on-policy (ratio 1 in value, its gradient the advantage), token-level mean."""
    import torch

    ratio = torch.exp(logp - logp.detach())
    per_token = -torch.minimum(ratio * advantages[:, None], ratio.clamp(0.8, 1.28) * advantages[:, None])
    return (per_token * mask).sum() / mask.sum().clamp_min(1.0)


class _ScrelSide:
    """screl's own GRPO module computing the step (its ``_micro_batch_loss``: logprobs, IS, clipped loss)."""

    def __init__(self, side: str) -> None:
        from screl.algos import ClippedPGLoss
        from screl.models import PolicySpec
        from screl.modules.grpo import GRPO

        class Spec(PolicySpec):
            def build_model(self) -> Any:
                return _model()

            def build_tokenizer(self) -> Any:
                raise NotImplementedError

        self.module = GRPO(
            policy=Spec(), loss_fn=ClippedPGLoss(use_importance_sampling_correction=True), max_grad_norm=1.0,
            algo={"num_prompts_per_step": 1, "num_generations_per_prompt": 2},
            logprob_chunk_tokens=0 if side == "before" else None,
            activation_checkpointing="full" if side == "after_ckpt" else False,
        )
        self.model = self.module.model
        configured = self.module.configure_optimizers()  # {"optimizer", "lr_scheduler"}: the module's own optimizer
        self.opt = configured["optimizer"] if isinstance(configured, dict) else configured

    def step(self, batch: dict[str, Any], micro_rows: int) -> None:
        import torch

        rows = batch["input_ids"].shape[0]
        full = {
            "input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"],
            "token_mask": batch["token_mask"], "sample_mask": torch.ones(rows),
            "rewards": batch["advantages"], "generation_logprobs": torch.zeros_like(batch["token_mask"]),
            "token_versions": torch.zeros(batch["token_mask"].shape, dtype=torch.long), "trainer_version": 0,
            "step_groups": max(1, rows // 2), "last_chunk": True, "start_weight": torch.zeros(rows),
        }
        self.module.algo.num_generations_per_prompt = 2 if rows % 2 == 0 else 1
        chunk = self.module._chunk_tensors(full)
        for lo in range(0, rows, micro_rows):
            loss, _ = self.module._micro_batch_loss(full, chunk, slice(lo, min(rows, lo + micro_rows)))
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


class _TrlSide:
    """TRL 1.16's loss path: the fused LM head GRPOTrainer installs, called as GRPOTrainer calls it."""

    def __init__(self) -> None:
        import torch
        from trl.trainer.utils import add_fused_lm_head

        self.model = _model()
        add_fused_lm_head(self.model, temperature=1.0, cast_lm_head_to_fp32=False, outputs=("log_probs", "entropy"))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-3, weight_decay=0.0)

    def step(self, batch: dict[str, Any], micro_rows: int) -> None:
        import torch

        rows, length = batch["input_ids"].shape
        keep = length - PROMPT
        for lo in range(0, rows, micro_rows):
            sl = slice(lo, min(rows, lo + micro_rows))
            ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
            labels = ids.masked_fill(attention == 0, -100)
            labels[:, :-keep] = -100
            out = self.model(input_ids=ids, attention_mask=attention, labels=labels, fused_lm_head=True)
            logp = out.log_probs[:, -keep:]
            mask = batch["token_mask"][sl][:, -keep:]
            loss = _clipped_loss(logp, mask, batch["advantages"][sl]) * (sl.stop - sl.start) / rows
            loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)


def run_side(side: str, rows: int, length: int, micro_rows: int) -> dict[str, float]:
    import torch

    torch.set_num_threads(THREADS)
    runner = _TrlSide() if side == "trl" else _ScrelSide(side)
    runner.step(_batch(1, PROMPT + 16), 1)  # warm-up: the AdamW state exists from here on
    batch = _batch(rows, length)
    idle = _rss_kb("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    cpu0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    runner.step(batch, micro_rows)
    step_s = time.perf_counter() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    peak = _rss_kb("VmHWM")
    return {"idle_rss_mb": idle / 1024, "peak_rss_mb": peak / 1024, "peak_above_idle_mb": (peak - idle) / 1024,
            "step_s": step_s, "step_cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
            "tokens": rows * length}


# -- the driver --------------------------------------------------------------------------------------------------


def child_json(cmd: list[str], env: dict[str, str], what: str) -> dict[str, float]:
    """Run one side in its own process; the JSON object its last line of output prints."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{proc.stderr[-3000:]}")
    result: dict[str, float] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def measure(side: str, rows: int, length: int, micro_rows: int) -> dict[str, float]:
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", OMP_NUM_THREADS=str(THREADS),
               TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--side", side, "--rows", str(rows), "--length", str(length),
           "--micro-rows", str(micro_rows)]
    result = child_json(cmd, env, f"{side} {rows}x{length}")
    print(f"  {side:10s} {rows:3d} x {length:5d}: peak above idle {result['peak_above_idle_mb']:8.0f} MB, "
          f"step {result['step_s']:6.1f} s", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--micro-rows", type=int, default=2, help="rows per micro-batch on every side (2 x 2048 = "
                        "4096 tokens: screl's CPU default budget)")
    parser.add_argument("--sweep-length", type=int, default=1024)
    parser.add_argument("--sweep-tokens", default="1024,4096,32768")
    parser.add_argument("--sweep-sides", default="after,trl")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.side:  # a worker: one measurement, one JSON line
        print(json.dumps(run_side(args.side, args.rows, args.length, args.micro_rows)))
        return
    from _report import finish

    if args.quick:
        args.rows, args.length, args.sweep_length, args.sweep_tokens = 2, 512, 256, "256,1024,2048"
        args.micro_rows = 1
    started, load = time.time(), list(os.getloadavg())
    print(f"main step: {args.rows} x {args.length} tokens, micro-batches of {args.micro_rows} rows, vocabulary {VOCAB}")
    main_step = {side: measure(side, args.rows, args.length, args.micro_rows) for side in SIDES}
    sweep: dict[str, dict[str, dict[str, float]]] = {}
    micro = max(1, (args.micro_rows * args.length) // args.sweep_length)  # the same token budget per micro-batch
    print(f"sweep: rows of {args.sweep_length} tokens, micro-batches of {micro} rows")
    for side in args.sweep_sides.split(","):
        sweep[side] = {}
        for tokens in (int(t) for t in args.sweep_tokens.split(",")):
            rows = max(1, tokens // args.sweep_length)
            sweep[side][str(rows * args.sweep_length)] = measure(side, rows, args.sweep_length, micro)
    after, before, trl = main_step["after"], main_step["before"], main_step["trl"]
    points = sweep.get("after", {})
    keys = sorted(points, key=int)
    four_k = next((k for k in keys if int(k) >= 4096), keys[0]) if keys else None
    result: dict[str, Any] = {
        "memory_over_trl": after["peak_above_idle_mb"] / trl["peak_above_idle_mb"],
        "memory_over_before": after["peak_above_idle_mb"] / before["peak_above_idle_mb"],
        "memory_growth_flat": (points[keys[-1]]["peak_rss_mb"] / points[four_k]["peak_rss_mb"]) if four_k else None,
        "step_time_over_trl": after["step_s"] / trl["step_s"],
        "step_cpu_over_trl": after["step_cpu_s"] / trl["step_cpu_s"],
        "ckpt_peak_above_idle_mb": main_step["after_ckpt"]["peak_above_idle_mb"],
        "ckpt_step_s": main_step["after_ckpt"]["step_s"],
        "targets": TARGETS,
        "main_step": main_step,
        "sweep": sweep,
        "settings": {"vocab": VOCAB, "hidden": HIDDEN, "layers": LAYERS, "ffn": FFN, "rows": args.rows,
                     "length": args.length, "micro_rows": args.micro_rows, "sweep_length": args.sweep_length,
                     "threads": THREADS, "quick": args.quick},
    }
    finish("memory" if not args.quick else "memory_quick", result, args.out_dir, started, load, _report, _plot)


def _report(result: dict[str, Any]) -> None:
    from _report import print_table

    rows = [[side, r["peak_above_idle_mb"], r["peak_rss_mb"], r["step_s"], r["step_cpu_s"]]
            for side, r in result["main_step"].items()]
    print_table(["side", "peak above idle MB", "peak RSS MB", "step s", "step CPU s"], rows, title="main step")
    targets = result["targets"]
    print_table(["figure", "measured", "target"],
                [[k, result[k], f"<= {targets[k]}"] for k in targets], title="targets")
    print_table(["side", "tokens", "peak RSS MB", "peak above idle MB", "step s"],
                [[side, t, r["peak_rss_mb"], r["peak_above_idle_mb"], r["step_s"]]
                 for side, pts in result["sweep"].items() for t, r in sorted(pts.items(), key=lambda x: int(x[0]))],
                title="sweep")


def _plot(result: dict[str, Any], path: Path) -> None:
    from _report import pyplot, save_figure

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for side, pts in result["sweep"].items():
        ts = sorted(pts, key=int)
        ax.plot([int(t) for t in ts], [pts[t]["peak_above_idle_mb"] for t in ts], marker="o",
                label="screl (chunked)" if side == "after" else side)
    before = result["main_step"]["before"]
    ax.scatter([before["tokens"]], [before["peak_above_idle_mb"]], marker="x", color="red",
               label="screl before (full logits)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("tokens in the step (rows x length)")
    ax.set_ylabel("peak RSS above idle (MB)")
    ax.set_title(f"one GRPO step at vocabulary {VOCAB:,}")
    ax.legend(fontsize=8)
    save_figure(fig, path)


if __name__ == "__main__":
    main()
