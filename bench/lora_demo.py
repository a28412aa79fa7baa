"""LoRA against full fine-tuning on the laptop demo (issue 48): SmolLM2-135M-Instruct learning held-out sums.

    python bench/lora_demo.py [--seeds 0 1] [--steps 20]

For each seed, ``configs/grpo_smollm2_math.yaml`` (full fine-tuning, lr 2e-5) and
``configs/grpo_smollm2_math_lora.yaml`` (rank-16 adapters on every linear layer, lr 2e-4) run as ``screl fit`` on the
same generated data (300 training sums, 128 held-out ones); the figure is each run's held-out greedy accuracy at its
last validation. LoRA "learns within the full runs' spread" when its mean final accuracy is at least the lowest
full run's less two binomial standard errors (128 prompts).

Then the last LoRA run's final bundle is exported twice with ``screl export``: merged (``--dtype fp32``) and as a
PEFT adapter (``--adapter``). Both answer the held-out prompts greedily through ``transformers`` (the prompt ids the
policy spec builds, the run's 16-token cap): the adapter on its base is the trained policy as the trainer holds it,
and the merged folder must give the same completions. Their accuracy (``MathVerify``) is reported beside the run's own
last validation. Writes ``bench/results/lora_demo.json``. About 25 minutes on 2 cores (four runs of ~5 minutes).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from smollm2_demo import MATH_DATA, curve  # noqa: E402

from screl.plot import read_metrics, resolve_run_dir  # noqa: E402

OUT = ROOT / "bench" / "results" / "lora_demo.json"
DATA = ROOT / "runs" / "data" / "sums20"
CONFIGS = {"full": "grpo_smollm2_math.yaml", "lora": "grpo_smollm2_math_lora.yaml"}
SYSTEM_PROMPT = "You are a calculator."  # both configs' policy
MAX_NEW_TOKENS = 16


def fit(kind: str, seed: int, steps: int, out: Path) -> dict[str, Any]:
    """One ``screl fit`` of the config; its held-out curve."""
    cmd = [sys.executable, "-m", "screl.cli", "fit", "--config", str(ROOT / "configs" / CONFIGS[kind]),
           "--seed_everything", str(seed), "--trainer.default_root_dir", str(out),
           "--trainer.enable_progress_bar", "false", "--checkpointing.checkpoint_dir", str(out / "checkpoints"),
           "--trainer.max_steps", str(steps), "--grpo.max_num_steps", str(steps),
           "--data.init_args.task.init_args.path", str(DATA)]
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=ROOT)
    c = curve(read_metrics(resolve_run_dir(out)), int(MATH_DATA[MATH_DATA.index("--test-rows") + 1]))
    c["wall_s"] = round(time.perf_counter() - t0, 1)
    print(f"{kind} seed {seed}: held-out {c.get('initial')} -> {c.get('final')} ({c['wall_s']} s)", flush=True)
    return c


def held_out() -> tuple[list[Any], list[str]]:
    """The held-out prompts as records (their answers in the metadata) and their texts."""
    import pyarrow.parquet as pq

    from screl.envs.base import PromptRecord

    table = pq.read_table(DATA / "test.parquet").to_pylist()
    records = [PromptRecord(prompt_id=int(r["id"]), text=r["question"], metadata={"answer": r["answer"]})
               for r in table]
    return records, [r.text for r in records]


def greedy(model: Any, tokenizer: Any, spec: Any, texts: list[str], max_new_tokens: int = MAX_NEW_TOKENS) -> list[str]:
    """Each prompt's greedy completion (the ids the policy spec builds, one prompt at a time: no padding)."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for text in texts:
            ids = torch.tensor([spec.prompt_token_ids(tokenizer, text)])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id)
            out.append(tokenizer.decode(gen[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def export_check(run: Path) -> dict[str, Any]:
    """The run's final bundle merged and as an adapter: the same greedy answers, and their accuracy."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from screl.envs import MathVerify
    from screl.models import SmolLM2

    merged, adapter = run / "export_merged_fp32", run / "export_adapter"
    for folder, extra in ((merged, []), (adapter, ["--adapter"])):
        subprocess.run([sys.executable, "-m", "screl.cli", "export", str(run / "checkpoints"), "--out", str(folder),
                        "--dtype", "fp32", *extra], check=True, cwd=ROOT)
    spec = SmolLM2(system_prompt=SYSTEM_PROMPT)
    records, texts = held_out()
    tokenizer = AutoTokenizer.from_pretrained(str(merged))
    trained = PeftModel.from_pretrained(spec.build_model(), str(adapter))
    policy_answers = greedy(trained, tokenizer, spec, texts)
    export_answers = greedy(AutoModelForCausalLM.from_pretrained(str(merged)), tokenizer, spec, texts)
    verify = MathVerify(timeout_s=10.0)
    acc = {name: sum(verify.rewards(records, answers)) / len(records)
           for name, answers in (("trained_policy", policy_answers), ("export", export_answers))}
    same = sum(a == b for a, b in zip(policy_answers, export_answers, strict=True))
    return {"prompts": len(texts), "same_answers": same, "accuracy": acc,
            "differing": [(t, a, b) for t, a, b in zip(texts, policy_answers, export_answers, strict=True)
                          if a != b][:5]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--out", default="runs/lora_demo")
    args = parser.parse_args()
    if not (DATA / "test.parquet").exists():
        subprocess.run([sys.executable, str(ROOT / "examples" / "make_math_parquet.py"), "--out", str(DATA),
                        *MATH_DATA], check=True)
    out = ROOT / args.out
    runs: dict[str, dict[str, Any]] = {kind: {} for kind in CONFIGS}
    for seed in args.seeds:
        for kind in CONFIGS:
            runs[kind][str(seed)] = fit(kind, seed, args.steps, out / f"{kind}_seed{seed}")
    finals = {kind: [c["final"] for c in by_seed.values()] for kind, by_seed in runs.items()}
    n = runs["full"][str(args.seeds[0])]["held_out_prompts"]
    low = min(finals["full"])
    se = math.sqrt(max(low * (1 - low), 1.0 / n) / n)  # at least one prompt's worth when the accuracy is 0 or 1
    lora_mean = sum(finals["lora"]) / len(finals["lora"])
    result = {
        "seeds": args.seeds, "steps": args.steps, "held_out_prompts": n, "final_accuracy": finals,
        "initial_accuracy": {kind: [c["initial"] for c in by_seed.values()] for kind, by_seed in runs.items()},
        "wall_s": {kind: [c["wall_s"] for c in by_seed.values()] for kind, by_seed in runs.items()},
        "lora_mean_final": lora_mean, "bar": low - 2 * se, "lora_within_full_spread": lora_mean >= low - 2 * se,
        "export": export_check(out / f"lora_seed{args.seeds[-1]}"),
        "curves": runs,
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "curves"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
