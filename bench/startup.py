"""Time to first step: ``screl fit`` launch -> its first ``train_step`` event, side by side with the TRL peer's
launch -> end of its first step, alternated over ``--reps`` repetitions, medians printed.

    python bench/startup.py [--reps 3] [--steps 2]

screl: a fresh ``screl fit --config configs/grpo_tiny.yaml`` subprocess (Ray, TransferQueue, workers and the
controller all start inside the timed window), P=8 G=4 L=16, ``--steps`` steps. TRL: ``bench/trl_peer.py``
(``$SCREL_TRL_PEER`` or ``bench/trl_peer.py``) at the same shape; its launch -> first step is the
subprocess's wall time less its ``trainer.train()`` wall time plus its first step (what follows the last step,
writing one JSON file, is left in: a few milliseconds). Writes ``bench/results/startup.json`` (``ratio``, also
under ``first_step_over_trl``: screl's median / TRL's).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def screl_first_step(steps: int, work: Path) -> float:
    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(work), enable_progress_bar=False)
    cfg["grpo"]["max_num_steps"] = steps
    path = work / "config.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    t0 = time.time()
    proc = subprocess.run([sys.executable, "-m", "screl.cli", "fit", "--config", str(path)], capture_output=True,
                          text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"screl fit failed:\n{proc.stderr[-3000:]}")
    events = next(work.rglob("events.jsonl"))
    first = next(json.loads(line) for line in events.read_text().splitlines() if '"train_step"' in line)
    return float(first["time"]) - t0


def trl_first_step(peer: Path, steps: int, out: Path) -> float:
    cmd = [sys.executable, str(peer), "--task", "count_a", "--steps", str(steps), "--scale", "tiny",
           "--prompts-per-step", "8", "--group", "4", "--completion-len", "16", "--no-gradient-checkpointing",
           "--out", str(out)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          check=False)
    elapsed = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"trl_peer failed:\n{proc.stderr[-3000:]}")
    d = json.loads(out.read_text())
    return elapsed - float(d["wall_s_train"]) + float(d["first_step_time_s"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    env_peer = os.environ.get("SCREL_TRL_PEER")
    peer = Path(env_peer) if env_peer else REPO / "bench" / "trl_peer.py"
    if not peer.is_file():
        raise SystemExit(f"startup: the TRL peer is missing at {peer} (set $SCREL_TRL_PEER)")
    screl, trl = [], []
    with tempfile.TemporaryDirectory(prefix="screl-startup-") as tmp:
        for rep in range(args.reps):  # alternated, so drift hits both sides alike
            screl.append(screl_first_step(args.steps, Path(tmp) / f"screl{rep}"))
            trl.append(trl_first_step(peer, args.steps, Path(tmp) / f"trl{rep}.json"))
            print(f"rep {rep}: screl {screl[-1]:.1f} s, TRL {trl[-1]:.1f} s", flush=True)
    res = {"screl_s": screl, "trl_s": trl, "screl_median_s": statistics.median(screl),
           "trl_median_s": statistics.median(trl)}
    res["ratio"] = res["screl_median_s"] / res["trl_median_s"]
    res["first_step_over_trl"] = res["ratio"]  # the key issue 19's targets name (target <= 1.0)
    out = REPO / "bench" / "results" / "startup.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"time to first step (median of {args.reps}): screl {res['screl_median_s']:.1f} s, TRL "
          f"{res['trl_median_s']:.1f} s, screl / TRL = {res['ratio']:.2f} -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
