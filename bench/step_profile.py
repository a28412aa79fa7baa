#!/usr/bin/env python
"""Where one RL step's time goes: the trainer's phases (timed in-process) and the rollout side's (from the event
log), medians over the steady steps of one in-process run.

    python bench/step_profile.py                       # tiny, sync (in_order lookahead 0), 40 steps
    python bench/step_profile.py --mode async --scale small --steps 12

Trainer phases (wall ms per step, the first 3 steps left out): ``next_chunk`` (waiting for the controller to hand
over a chunk: in sync mode the whole generation), ``fetch`` (the chunk's rows from TransferQueue), ``collate``,
``training_step`` (of which ``backward_chunk``: forward and backward, ``optimizer_step``, ``log_chunk``) and
``complete_step`` (export, the controller retiring the step and refitting the workers). Rollout phases, from
``events.jsonl``: ``reserve -> first commit`` (dispatch, decode, reward, the rows' put, the report),
``commit span``, ``last commit -> select``, ``select -> train_step`` and ``train_step -> refit`` (the workers'
refit), and the whole ``step`` (refit to refit). Also the CPU seconds per step of each process. Prints a table and
writes ``bench/results/step_profile_<scale>_<mode>.json``; nothing here is a target, it is what the levers of
``bench/README.md`` were measured with.
"""

from __future__ import annotations

import argparse
import collections
import functools
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402

SCALES = {"tiny": {"group": 4, "completion_len": 16}, "small": {"group": 8, "completion_len": 64}}


def _timed(owner: Any, name: str, times: dict[str, list[float]], label: str | None = None) -> None:
    fn = getattr(owner, name)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            times[label or name.strip("_")].append(time.perf_counter() - t)

    setattr(owner, name, wrapper)


def rollout_phases(events: list[dict[str, Any]]) -> dict[str, float]:
    """Medians (s) of the rollout side's phases of steps 1.., from the event log."""
    by: dict[str, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        by[e["event"]].append(e)
    trains, refits, selects = by["train_step"], by["refit"], by["select"]
    phases: dict[str, list[float]] = collections.defaultdict(list)
    for k in range(1, min(len(trains), len(refits), len(selects))):
        reserved = [e["time"] for e in by["reserve"] if e.get("target_step") == k]
        committed = [e["time"] for e in by["commit"] if e.get("target_step") == k]
        if not reserved or not committed:
            continue
        phases["reserve -> first commit"].append(min(committed) - max(reserved))
        phases["commit span"].append(max(committed) - min(committed))
        phases["last commit -> select"].append(selects[k]["time"] - max(committed))
        phases["select -> train_step"].append(trains[k]["time"] - selects[k]["time"])
        phases["train_step -> refit"].append(refits[k]["time"] - trains[k]["time"])
        phases["step (refit to refit)"].append(refits[k]["time"] - refits[k - 1]["time"])
    return {k: statistics.median(v) for k, v in phases.items()}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mode", choices=("sync", "async"), default="sync", help="in_order lookahead 0 or 1")
    p.add_argument("--scale", choices=sorted(SCALES), default="tiny")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--out-dir", type=Path, default=c.RESULTS)
    args = p.parse_args(argv)
    if args.steps < 5:
        p.error("--steps must be >= 5 (the first 3 are left out)")
    from screl import datamodule
    from screl.controller.runtime import RolloutRuntime
    from screl.modules.grpo import GRPO

    times: dict[str, list[float]] = collections.defaultdict(list)
    for name in ("_backward_chunk", "_optimizer_step", "_log_chunk", "training_step"):
        _timed(GRPO, name, times)
    for name in ("next_chunk", "fetch", "complete_step"):
        _timed(RolloutRuntime, name, times)
    _timed(datamodule, "collate_chunk", times, "collate")
    c.quiet()
    started = c.start_bench_ray()
    try:
        with tempfile.TemporaryDirectory(prefix="screl_step_profile_") as tmp:
            shape = SCALES[args.scale]
            cfg = c.screl_config(run_dir=Path(tmp) / "run", steps=args.steps, scale=args.scale, threads=None,
                                 sampler=c.SAMPLERS["sync" if args.mode == "sync" else "async_w1"], **shape)
            run = c.run_screl(args.mode, cfg, Path(tmp) / "cfg")
            events = c.read_events(Path(run.run_dir))
    finally:
        c.stop_bench_ray(started)
    trainer = {k: statistics.median(v[3:]) for k, v in times.items() if len(v) > 3}
    rollout = rollout_phases(events)
    res = {"mode": args.mode, "scale": args.scale, "steps": args.steps, "steady_step_s": run.steady_step_s,
           "samples_per_s": run.samples_per_s, "trainer_phases_s": trainer, "rollout_phases_s": rollout,
           "cpu_s_per_step": run.cpu_s_per_step}
    c.print_table(["trainer phase", "ms"], [[k, f"{1000 * v:.2f}"] for k, v in trainer.items()],
                  title=f"{args.scale} {args.mode}: steady step {1000 * run.steady_step_s:.1f} ms")
    c.print_table(["rollout phase (event log)", "ms"], [[k, f"{1000 * v:.1f}"] for k, v in rollout.items()])
    c.print_table(["process", "CPU ms per step"], [[k, f"{1000 * v:.1f}"] for k, v in run.cpu_s_per_step.items()])
    c.write_result(f"step_profile_{args.scale}_{args.mode}", res, args.out_dir)
    return res


if __name__ == "__main__":
    main()
