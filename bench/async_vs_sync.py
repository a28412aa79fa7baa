#!/usr/bin/env python
"""Async overlap: the same screl config in sync mode and in async modes, side by side in one run.

Modes (everything but the sampler is identical; fixed-length completions; one torch thread for the
trainer process and one for the generation worker in every mode, so generation and training each have one
core and only the overlap differs):

* ``sync``      in_order, ``max_lookahead_versions: 0`` (generation and training take turns)
* ``async_w1``  in_order, lookahead 1 (the next step generates while this one trains)
* ``async_w2``  in_order, lookahead 2
* ``windowed``  windowed streaming (staleness window 1, freshest first, over-sampling 2.0, chunks of P/2)

The modes alternate over ``--reps`` repetitions (the order rotates each repetition); every figure is the
median over repetitions, with the spread. Timed windows exclude Ray/TransferQueue/worker start-up (see
``bench/_common.py``). Costs in isolation come from the sync runs: ``gen`` = the step's generation span
(first reserve to last commit of its groups, from ``events.jsonl``), ``train`` = the rest of the sync
step (fetch, forward/backward/optimizer, refit). The ideal async step is ``max(gen, train)``, so the
speedup limit is ``(gen + train) / max(gen, train)``.

    python bench/async_vs_sync.py                 # small scale, P=4, G=4, L=64, 20 steps, 3 reps

The default batch (P=4, G=4, L=64 at the small scale) is where generation and training cost the same here
(0.36 s and 0.37 s per step on one thread each, measured in the sync runs), the condition of the target;
at P=8 training costs 1.3x generation and the limit is 0.56 rather than 0.5.
    python bench/async_vs_sync.py --quick         # a smoke run (tiny scale, 5 steps, 1 rep, 2 modes)

Writes ``bench/results/async_vs_sync.json`` (key ``async_over_sync_wall``) and ``async_vs_sync.png``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402

MODES = ("sync", "async_w1", "async_w2", "windowed")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="RL steps per run (default 20)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of every mode, alternated (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny scale, L=16, 5 steps, 1 rep, sync and async_w1 only")
    p.add_argument("--modes", default=",".join(MODES), help=f"comma-separated subset of {','.join(MODES)}")
    p.add_argument("--scale", choices=("tiny", "small"), default="small", help="model scale (default small)")
    p.add_argument("--task", choices=sorted(c.TASKS), default="count_a")
    p.add_argument("--prompts-per-step", type=int, default=4,
                   help="P (default 4: generation and training cost the same at the small scale)")
    p.add_argument("--group", type=int, default=4, help="G (default 4)")
    p.add_argument("--completion-len", type=int, default=64,
                   help="L, fixed completion length (default 64: gen and train cost about the same at small)")
    p.add_argument("--out-dir", type=Path, default=c.RESULTS, help="where the JSON and PNG go")
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories (printed)")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.completion_len, args.steps, args.reps = "tiny", 16, 5, 1
        if args.modes == ",".join(MODES):
            args.modes = "sync,async_w1"
    args.modes = c.parse_modes(p, args.modes, MODES)
    if args.steps < 3 or args.reps < 1:
        p.error("--steps must be >= 3 and --reps >= 1")
    return args


def mode_config(mode: str, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    P = args.prompts_per_step
    return c.screl_config(
        run_dir=run_dir, steps=args.steps, sampler=c.SAMPLERS[mode], scale=args.scale, task=args.task,
        prompts_per_step=P, group=args.group, completion_len=args.completion_len,
        min_groups=max(1, P // 2) if mode == "windowed" else P,
    )


def per_run(r: c.ScrelRun) -> dict[str, Any]:
    """Steady-state figures of one run (the first step, which includes the rollout start-up, is left out)."""
    return {
        "window_s": r.window_s,
        "step_s": r.steady_step_s,
        "samples_per_s": r.samples_per_s,
        "steady_samples_per_s": r.steady_samples_per_s,
        "gen_span_s": c.median(c.skip_first(r.gen_span_s)),
        "train_step_s": c.median(c.skip_first(r.train_step_s)),
        "wait_s": c.median(c.skip_first(r.wait_s)),
        "refit_s": c.median(r.refit_s),
        "group_generation_s": c.median(r.group_generation_s),
        "reward": r.reward,
        "staleness": r.staleness,
        "cpu_s_per_step": r.cpu_s_per_step,
        "own_cores": r.own_cores,
        "other_cores": r.other_cores,
        "evicted": r.evicted,
        "aborted": r.aborted,
        "step_ends": [t - r.window_start for t in r.step_ends],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    c.quiet()
    started = c.start_bench_ray()
    work = Path(tempfile.mkdtemp(prefix="screl_bench_avs_"))
    t_all = time.time()
    load_before = c.machine_info()["loadavg"]
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    try:
        for rep in range(args.reps):
            order = args.modes[rep % len(args.modes):] + args.modes[:rep % len(args.modes)]
            for mode in order:
                t0 = time.time()
                r = c.run_screl(mode, mode_config(mode, args, work / f"{mode}_{rep}"), work / f"cfg_{mode}_{rep}")
                runs[mode].append(per_run(r))
                print(f"rep {rep} {mode:9s} step {r.steady_step_s:.3f}s  window {r.window_s:.2f}s  "
                      f"samples/s {r.samples_per_s:.1f}  (run incl. start-up {time.time() - t0:.1f}s)", flush=True)
    finally:
        c.stop_bench_ray(started)
    result = analyse(args, runs)
    c.finish("async_vs_sync", result, args.out_dir, t_all, load_before, report, lambda res, path: plot(res, runs, path))
    if args.keep_runs:
        print(f"run directories kept under {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


def analyse(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    sync = runs["sync"]
    gen = c.median(r["gen_span_s"] for r in sync)
    sync_step = c.median(r["step_s"] for r in sync)
    train = sync_step - gen  # everything the train pump does serially: fetch, fwd/bwd/opt, refit
    ideal = max(gen, train)
    limit = (gen + train) / ideal
    modes: dict[str, Any] = {}
    for mode, rs in runs.items():
        n = len(rs)
        stal = Counter(s for r in rs for s in r["staleness"])
        total = sum(stal.values()) or 1
        step = c.summary([r["step_s"] for r in rs])
        rewards = [[r["reward"][k] for r in rs] for k in range(args.steps)]
        paired = [rs[i]["window_s"] / sync[i]["window_s"] for i in range(min(n, len(sync)))]
        paired_steady = [rs[i]["step_s"] / sync[i]["step_s"] for i in range(min(n, len(sync)))]
        roles = sorted({k for r in rs for k in r["cpu_s_per_step"]})
        modes[mode] = {
            "step_s": step,
            "window_s": c.summary([r["window_s"] for r in rs]),
            "samples_per_s": c.summary([r["samples_per_s"] for r in rs]),
            "steady_samples_per_s": c.summary([r["steady_samples_per_s"] for r in rs]),
            "gen_span_s": c.median(r["gen_span_s"] for r in rs),
            "train_step_s": c.median(r["train_step_s"] for r in rs),
            "wait_s": c.median(r["wait_s"] for r in rs),
            "refit_s": c.median(r["refit_s"] for r in rs),
            "group_generation_s": c.median(r["group_generation_s"] for r in rs),
            "overlap_efficiency": step["median"] / ideal,
            "speedup_over_sync": sync_step / step["median"],
            "wall_over_sync": c.summary(paired),
            "steady_step_over_sync": c.summary(paired_steady),
            "staleness_fraction": {str(k): v / total for k, v in sorted(stal.items())},
            "staleness_mean": sum(k * v for k, v in stal.items()) / total,
            "reward_per_step": [c.median(x) for x in rewards],
            "reward_last3": c.median(x for k in range(max(0, args.steps - 3), args.steps) for x in rewards[k]),
            "cpu_s_per_step": {k: c.median(r["cpu_s_per_step"].get(k, 0.0) for r in rs) for k in roles},
            "own_cores": c.median(r["own_cores"] for r in rs),
            "other_cores": c.median(r["other_cores"] for r in rs),
            "evicted": c.median(r["evicted"] for r in rs),
            "aborted": c.median(r["aborted"] for r in rs),
        }
    w1 = modes.get("async_w1")
    result: dict[str, Any] = {
        "config": {"scale": args.scale, "task": args.task, "prompts_per_step": args.prompts_per_step,
                   "group": args.group, "completion_len": args.completion_len, "steps": args.steps,
                   "reps": args.reps, "modes": args.modes, "torch_threads_per_process": 1},
        "gen_s": gen,
        "train_s": train,
        "sync_step_s": sync_step,
        "theoretical_speedup_limit": limit,
        "theoretical_wall_ratio_limit": 1.0 / limit,
        "async_over_sync_wall": w1["wall_over_sync"]["median"] if w1 else None,
        "async_over_sync_steady_step": w1["steady_step_over_sync"]["median"] if w1 else None,
        "async_speedup": w1["speedup_over_sync"] if w1 else None,
        "target_async_over_sync_wall": 0.6,
        "modes": modes,
    }
    return result


def report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(f"\nasync vs sync: scale={cfg['scale']} task={cfg['task']} P={cfg['prompts_per_step']} G={cfg['group']} "
          f"L={cfg['completion_len']} steps={cfg['steps']} reps={cfg['reps']} (medians; spread = (max-min)/median)")
    print(f"costs in isolation (sync runs): gen {res['gen_s']:.3f}s  train {res['train_s']:.3f}s  "
          f"-> ideal async step max = {max(res['gen_s'], res['train_s']):.3f}s")
    rows = []
    for mode, m in res["modes"].items():
        rows.append([
            mode, m["step_s"]["median"], m["step_s"]["spread"], m["samples_per_s"]["median"],
            m["gen_span_s"], m["train_step_s"], m["wait_s"], m["refit_s"], m["overlap_efficiency"],
            m["speedup_over_sync"], m["wall_over_sync"]["median"], m["staleness_mean"], m["reward_last3"],
        ])
    c.print_table(
        ["mode", "step_s", "spread", "samples/s", "gen_s", "train_s", "wait_s", "refit_s", "step/max(g,t)",
         "speedup", "wall/sync", "stale", "reward@N"], rows, "per mode (step = steady-state wall per RL step)")
    stale_rows = [[mode, ", ".join(f"{k}: {v:.2f}" for k, v in m["staleness_fraction"].items()), m["aborted"],
                   m["evicted"]] for mode, m in res["modes"].items()]
    c.print_table(["mode", "staleness distribution (fraction of groups)", "aborted", "evicted"], stale_rows)
    roles = sorted({k for m in res["modes"].values() for k in m["cpu_s_per_step"]})
    cpu_rows = [[mode, *[m["cpu_s_per_step"].get(k, 0.0) for k in roles], m["own_cores"], m["other_cores"]]
                for mode, m in res["modes"].items()]
    c.print_table(["mode", *roles, "cores:run", "cores:others"], cpu_rows,
                  "CPU seconds per steady-state step, by process; average cores busy (this run / other jobs)")
    limit = res["theoretical_speedup_limit"]
    if res["async_over_sync_wall"] is not None:
        print(f"\nasync_w1 speedup {res['async_speedup']:.2f}x (steady) vs theoretical limit (gen+train)/max(gen,train)"
              f" = {limit:.2f}x")
        print(f"async_over_sync_wall = {res['async_over_sync_wall']:.3f} (target <= 0.6; best possible here "
              f"{1 / limit:.3f})")


def plot(res: dict[str, Any], runs: dict[str, list[dict[str, Any]]], path: Path) -> None:
    plt = c.pyplot()
    modes = list(res["modes"])
    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    a = ax[0][0]
    med = [res["modes"][m]["step_s"]["median"] for m in modes]
    lo = [med[i] - res["modes"][m]["step_s"]["min"] for i, m in enumerate(modes)]
    hi = [res["modes"][m]["step_s"]["max"] - med[i] for i, m in enumerate(modes)]
    a.bar(modes, med, yerr=[lo, hi], capsize=4, color="tab:blue")
    for y, label, style in ((res["gen_s"] + res["train_s"], "gen+train", "--"),
                            (max(res["gen_s"], res["train_s"]), "max(gen, train)", ":")):
        a.axhline(y, linestyle=style, color="k", label=f"{label} = {y:.3f}s")
    a.set_ylabel("wall per RL step (s)")
    a.set_title("steady-state step time (median, min-max)")
    a.legend(fontsize=8)
    a = ax[0][1]
    roles = sorted({k for m in modes for k in res["modes"][m]["cpu_s_per_step"]})
    bottom = [0.0] * len(modes)
    for role in roles:
        vals = [res["modes"][m]["cpu_s_per_step"].get(role, 0.0) for m in modes]
        a.bar(modes, vals, bottom=bottom, label=role)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    a.set_ylabel("CPU s per step")
    a.set_title("CPU time per step by process")
    a.legend(fontsize=7)
    a = ax[1][0]
    for m in modes:
        ys = res["modes"][m]["reward_per_step"]
        a.plot(range(len(ys)), ys, marker="o", ms=3, label=m)
    a.set_xlabel("RL step")
    a.set_ylabel("mean reward (median over reps)")
    a.set_title("reward at equal steps")
    a.legend(fontsize=8)
    c.staleness_bars(ax[1][1], {m: res["modes"][m]["staleness_fraction"] for m in modes})
    cfg = res["config"]
    fig.suptitle(f"screl async vs sync — {cfg['scale']} P={cfg['prompts_per_step']} G={cfg['group']} "
                 f"L={cfg['completion_len']}, {cfg['steps']} steps x {cfg['reps']} reps; "
                 f"async_w1/sync wall = {res['async_over_sync_wall'] or float('nan'):.3f}")
    c.save_figure(fig, path)


if __name__ == "__main__":
    main()
