#!/usr/bin/env python
"""Does the VLM read the image? ``configs/grpo_vlm_tiny.yaml`` against its blind control (issue 50 item 1).

    python bench/vlm_learning.py [--seeds 0 1 2] [--steps 200] [--last 20] [--lr 3e-3 --out /tmp/lr.json]

For each seed (the policy's initial weights, the task's scenes and answers, the prompt order and the sampling: the
config's seeds all set to it), the config runs twice through ``screl fit``: as shipped, and with every image blank
(``ShapesTask(blank_images=True)``: the same prompts, questions and answers, a white canvas). The task's answers are
balanced over its prompts (``ShapesTask`` draws them first), so the blind run can learn only the answers' shares:
chance, 0.5 for this config's counts of 0 or 1. The figure is each run's mean reward over its last ``--last`` steps
(128 samples a step); the target is the image runs' mean at least the blind runs' mean + 0.2. Writes
``bench/results/vlm_learning.json`` (per run the curve and the final figure; per side mean and standard deviation
over the seeds; the target and whether it is met).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from screl.plot import read_metrics, resolve_run_dir  # noqa: E402

OUT = ROOT / "bench" / "results" / "vlm_learning.json"
CONFIG = ROOT / "configs" / "grpo_vlm_tiny.yaml"
MARGIN = 0.2


def fit(blind: bool, seed: int, steps: int, out: Path, lr: float | None = None) -> list[float]:
    """One ``screl fit`` of the config (at learning rate ``lr``: None, the config's); its reward per step."""
    cmd = [sys.executable, "-m", "screl.cli", "fit", "--config", str(CONFIG), "--seed_everything", str(seed),
           "--data.init_args.seed", str(seed), "--model.init_args.policy.init_args.seed", str(seed),
           "--data.init_args.task.init_args.seed", str(seed),
           "--trainer.default_root_dir", str(out), "--trainer.enable_progress_bar", "false",
           "--trainer.max_steps", str(steps), "--grpo.max_num_steps", str(steps),
           "--data.init_args.task.init_args.blank_images", str(blind).lower(),
           *(["--model.init_args.learning_rate", str(lr)] if lr is not None else [])]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    rows = read_metrics(resolve_run_dir(out))
    reward = {int(r["step"]): r["reward"] for r in rows if "reward" in r and "step" in r}
    return [reward[s] for s in sorted(reward)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--last", type=int, default=20, help="steps the final figure averages")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: the config's)")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args()
    t0 = time.perf_counter()
    runs: dict[str, dict[str, Any]] = {"image": {}, "blind": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for side in runs:
                curve = fit(side == "blind", seed, args.steps, Path(tmp) / f"{side}_{seed}", args.lr)
                final = statistics.fmean(curve[-args.last:])
                runs[side][str(seed)] = {"final": final, "first": statistics.fmean(curve[:args.last]),
                                         "curve": curve}
                print(f"{side} seed {seed}: first {args.last} steps {runs[side][str(seed)]['first']:.3f}, "
                      f"last {args.last} {final:.3f}", flush=True)
    summary = {side: {"mean": statistics.fmean(f), "std": statistics.stdev(f) if len(f) > 1 else 0.0}
               for side, f in ((s, [r["final"] for r in by_seed.values()]) for s, by_seed in runs.items())}
    result = {"config": str(CONFIG.relative_to(ROOT)), "steps": args.steps, "seeds": args.seeds, "lr": args.lr,
              "final_is": f"mean reward over the last {args.last} steps", "runs": runs, "summary": summary,
              "target": f"image mean >= blind mean + {MARGIN}",
              "met": summary["image"]["mean"] >= summary["blind"]["mean"] + MARGIN,
              "wall_s": round(time.perf_counter() - t0, 1), "date": time.strftime("%Y-%m-%d")}
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
