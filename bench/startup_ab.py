"""Time to first step, A/B: fresh ``screl fit`` launches of the tiny config under several environments, alternated,
medians printed. For a start-up change, point one side at a worktree of it (``PYTHONPATH`` comes first on
``sys.path``, before the editable install, in the driver and in every Ray worker it starts):

    git worktree add /tmp/wt <rev>
    python bench/startup_ab.py --reps 6 base: "change:PYTHONPATH=/tmp/wt"

A side is ``LABEL:`` followed by comma-separated ``NAME=VALUE`` settings added to the environment. Each launch is
``screl fit --config configs/grpo_tiny.yaml`` with 2 steps, timed as ``bench/startup.py`` times it (launch -> its
first ``train_step`` event). A launch that fails is reported with its last output and left out of the medians.
Launches vary by about 0.5 s here (and drift over minutes): alternate, and take 6 or more a side for a 0.5 s
difference. Prints one JSON object (per side: the median, the launches, the failures); writes nothing.
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.startup import await_first_step, tiny_config  # noqa: E402


def side(spec: str) -> tuple[str, dict[str, str]]:
    """``LABEL:NAME=VALUE,...`` -> (label, settings)."""
    label, sep, rest = spec.partition(":")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"a side is LABEL: or LABEL:NAME=VALUE,...; got {spec!r}")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"{item!r} in {spec!r} is not NAME=VALUE")
        env[name] = value
    return label, env


def launch(env: dict[str, str], work: Path, steps: int) -> tuple[float | None, str]:
    """One ``screl fit`` of the tiny config under ``os.environ`` + ``env``: (launch -> first step, or None; its
    output's tail)."""
    config = tiny_config(work, steps)
    log = work / "fit.log"
    t0 = time.time()
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "screl.cli", "fit", "--config", str(config)],
                                env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=out,
                                cwd=tempfile.gettempdir())  # not the repository: PYTHONPATH decides which screl
        first = await_first_step(proc, work)
    return (None if first is None or proc.returncode != 0 else first - t0), log.read_text()[-2000:]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sides", nargs="+", type=side, help="LABEL: or LABEL:NAME=VALUE,...")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    times: dict[str, list[float]] = {label: [] for label, _ in args.sides}
    failed: dict[str, int] = {label: 0 for label, _ in args.sides}
    with tempfile.TemporaryDirectory(prefix="screl-startup-ab-") as tmp:
        for rep in range(args.reps):
            for label, env in args.sides:
                seconds, tail = launch(env, Path(tmp) / f"{label}{rep}", args.steps)
                if seconds is None:
                    failed[label] += 1
                    print(f"{label} rep {rep}: failed\n{tail}", file=sys.stderr, flush=True)
                    continue
                times[label].append(round(seconds, 2))
                print(f"{label} rep {rep}: {seconds:.2f} s", file=sys.stderr, flush=True)
    print(json.dumps({label: {"median_s": statistics.median(t) if t else None, "launches_s": t,
                              "failed": failed[label]} for label, t in times.items()}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
