#!/usr/bin/env python
"""Colocated generation against disaggregated screl and TRL's GRPOTrainer (issue 34, item 4).

Three sides, each in a process of its own, the order rotated rep by rep (``--reps``, default 3):

* ``screl_sync``: screl disaggregated, sync (in_order lookahead 0): one generation worker process, refit through
  Ray (``bench/vs_trl.py``'s sync side, the same config);
* ``screl_colocated``: the same config with ``generation.colocated.enabled: true``: the torch engine decodes with
  the trainer's own module in the trainer's process, stands down for each train step, and a refit is a version
  bump (no worker process; the controller and TransferQueue still run as Ray actors);
* ``trl``: TRL's ``GRPOTrainer`` through the peer script (``trl_peer.py``, 2 threads), as ``vs_trl.py`` runs it.

Scales as in ``vs_trl.py``: ``tiny`` (hidden 64, 2 layers, P=8 G=4 L=16, 15 steps) and ``small`` (hidden 256,
4 layers, P=8 G=8 L=64, 8 steps, no gradient checkpointing), count_a.

Figures per side, scale and rep (one clock, ``time.time()``; ``t0`` is taken in this process just before the
side's process is launched):

* **samples/s** (the peer's definition, as ``vs_trl.py``): ``steps * P * G / window``. TRL's window is
  ``wall(trainer.train())``; screl's is the first generation (the first ``admit`` event) to the end of the last
  step (``bench/_common.py``: Ray, TransferQueue and the worker start-up are outside it).
* **time to first step**: ``t0`` -> the end of the first optimizer step, wall clock. screl: the benchmark's
  ``StepTimer`` callback (``on_train_batch_end`` of the step's last chunk: after the optimizer step and the refit,
  a version bump when colocated). TRL: a ``TrainerCallback`` added to the peer's trainer (``on_step_end`` at
  ``global_step == 1``, after its optimizer step); the peer runs unchanged in a small wrapper
  (``--trl-wrap``) that loads it as a module and adds the callback. The peer's own figure, launch wall less
  ``wall_s_train`` plus ``first_step_time_s`` (``bench/startup.py``'s), is kept as ``first_step_s_peer_json``:
  TRL's ``step_time`` leaves the optimizer step and the step's callbacks out and the process exit in, so the two
  differ by a little.
  ``startup_s`` splits it: ``t0`` -> the first generation (screl: the first ``admit`` event; TRL:
  ``on_train_begin``).
* **peak RSS**: a thread here samples the side's process and all its descendants (Ray's GCS, raylet and actors
  that the screl process starts are its children) every ``--poll-s`` seconds (default 0.2), sums their RSS per
  sample, and keeps the largest sum, with each role's share and the PSS at that moment (``bench/scaling.py``'s
  ``TreeRSS``).

Keys (medians of the per-rep ratios, sides paired within a rep): ``colocated_tiny_over_trl_samples``
(target >= 0.9), ``colocated_first_step_over_trl`` (tiny, <= 1.5) and ``colocated_peak_rss_over_disaggregated``
(small, <= 0.7), beside every per-rep figure and the medians.

    python bench/colocated.py                # tiny and small, 3 reps
    python bench/colocated.py --scale small --reps 5
    python bench/colocated.py --quick        # smoke: tiny only, 4 steps, 1 rep -> results/colocated_quick.*

Writes ``bench/results/colocated.json``, ``colocated.log`` (what it printed) and ``colocated.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402
from bench import vs_trl  # noqa: E402
from bench.scaling import run_watched  # noqa: E402

SIDES = ("screl_sync", "screl_colocated", "trl")
SCREL_SIDES = ("screl_sync", "screl_colocated")
TARGETS = {"colocated_tiny_over_trl_samples": 0.9, "colocated_first_step_over_trl": 1.5,
           "colocated_peak_rss_over_disaggregated": 0.7}
FIGURES = ("samples_per_s", "tokens_per_s", "steady_step_s", "first_step_s", "startup_s", "peak_rss_mb",
           "pss_mb_at_peak", "wall_s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=("tiny", "small", "both"), default="both", help="scales to run (default both)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: 15 at tiny, 8 at small)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, the sides' order rotated each rep (default 3)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: tiny only, 4 steps, 1 rep; writes results/colocated_quick.json and .log")
    p.add_argument("--task", choices=sorted(c.TASKS), default="count_a")
    p.add_argument("--prompts-per-step", type=int, default=None, help="P (default: the scale's, 8)")
    p.add_argument("--group", type=int, default=None, help="G (default: the scale's, 4 tiny / 8 small)")
    p.add_argument("--completion-len", type=int, default=None, help="L (default: the scale's, 16 tiny / 64 small)")
    p.add_argument("--trl-threads", type=int, default=2, help="torch threads of the TRL process (default 2)")
    p.add_argument("--screl-threads", type=int, default=None,
                   help="torch threads of each screl process (default: screl's automatic budget)")
    p.add_argument("--poll-s", type=float, default=0.2, help="RSS sampling period (default 0.2 s)")
    p.add_argument("--out-dir", type=Path, default=c.RESULTS)
    p.add_argument("--keep-runs", action="store_true", help="keep the run directories (printed at the end)")
    # internal: one screl side in this process (the parent launches it and watches its tree)
    p.add_argument("--child", choices=SCREL_SIDES, default=None, help=argparse.SUPPRESS)
    p.add_argument("--child-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.steps, args.reps = "tiny", 4, 1
    if (args.steps is not None and args.steps < 3) or args.reps < 1:
        p.error("--steps must be >= 3 and --reps >= 1")
    if not 0.01 <= args.poll_s <= 1.0:
        p.error("--poll-s must be within [0.01, 1]")
    args.scales = ["tiny", "small"] if args.scale == "both" else [args.scale]
    return args


# ------------------------------------------------------------------------------------------ child processes
def screl_config(side: str, args: argparse.Namespace, scale: str, work: Path) -> dict[str, Any]:
    """vs_trl's sync config; ``screl_colocated`` sets ``generation.colocated.enabled`` on it (colocated also needs
    ``min_groups_for_streaming_train == num_prompts_per_step``, one worker and one trainer process: the
    benchmark config's defaults)."""
    cfg = vs_trl.screl_side_config("screl_sync", args, scale, work)
    if side == "screl_colocated":
        cfg["data"]["init_args"]["generation"]["colocated"] = {"enabled": True}
    return cfg


def child_main(args: argparse.Namespace) -> None:
    """One screl side, in this (fresh) process: run it, write ``result.json`` into ``--child-dir``."""
    c.quiet()
    work: Path = args.child_dir
    cfg = screl_config(args.child, args, args.scale, work)
    r = c.run_screl(args.child, cfg, work / "cfg", settle_first=False)  # timed from the launch: no waiting
    res = vs_trl.screl_side_result(r) | {
        "first_step_end": r.step_ends[0],  # StepTimer: after the first optimizer step and its refit
        "window_start": r.window_start,  # the first admit: the first generation starts
        "run_dir": r.run_dir,
    }
    c.write_result("result", res, work)


def trl_wrap(marks: Path, peer: Path, peer_argv: list[str]) -> None:
    """Run the TRL peer's ``main`` in this process with a callback that writes the wall clock of the train's
    begin and of the first optimizer step's end to ``marks``.

    The peer is loaded as a module (its top sets the thread environment before it imports torch, as when it runs
    as a script); only its ``GRPOTrainer`` name is replaced by a subclass that adds the callback.
    """
    import importlib.util

    spec = importlib.util.spec_from_file_location("trl_peer", peer)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules["trl_peer"] = mod
    spec.loader.exec_module(mod)
    from transformers import TrainerCallback

    times: dict[str, float] = {}

    class FirstStepMark(TrainerCallback):  # type: ignore[misc]
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            times["train_begin"] = time.time()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == 1:
                times["first_step_end"] = time.time()
                marks.write_text(json.dumps(times))

    class MarkedGRPOTrainer(mod.GRPOTrainer):  # type: ignore[misc, name-defined]
        def __init__(self, *a: Any, **kw: Any) -> None:
            super().__init__(*a, **kw)
            self.add_callback(FirstStepMark())

    mod.GRPOTrainer = MarkedGRPOTrainer
    mod.main(peer_argv)


# ------------------------------------------------------------------------------------------ sides
def wait_gone(pids: list[int], timeout_s: float = 30.0) -> int:
    """Wait for what outlived a side's process (Ray's daemons shutting down); the number still alive after."""
    import psutil

    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            continue
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    return len(alive)


def run_side(side: str, args: argparse.Namespace, scale: str, where: Path, peer: Path | None) -> dict[str, Any]:
    where.mkdir(parents=True, exist_ok=True)
    s = vs_trl.shape(args, scale)
    me = str(Path(__file__).resolve())
    if side == "trl":
        assert peer is not None
        peer_cmd, env = vs_trl.trl_command(peer, args, scale, where / "trl.json")
        cmd = [sys.executable, me, "--trl-wrap", str(where / "marks.json"), *peer_cmd[1:]]
    else:
        cmd = [sys.executable, me, "--child", side, "--child-dir", str(where), "--scale", scale, "--task", args.task,
               "--steps", str(s["steps"]), "--prompts-per-step", str(s["prompts_per_step"]), "--group",
               str(s["group"]), "--completion-len", str(s["completion_len"])]
        if args.screl_threads is not None:
            cmd += ["--screl-threads", str(args.screl_threads)]
        env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    mem = run_watched(cmd, env, args.poll_s, side)  # settles this tree first, then t0, launch, RSS sampling
    t0 = mem["started"]
    lingering = wait_gone(mem.pop("leftover_pids"))
    if side == "trl":
        d = json.loads((where / "trl.json").read_text())
        marks = json.loads((where / "marks.json").read_text())
        r = vs_trl.trl_result(d) | {
            "first_step_s": marks["first_step_end"] - t0,
            "startup_s": marks["train_begin"] - t0,
            "first_step_s_peer_json": mem["wall_s"] - float(d["wall_s_train"]) + float(d["first_step_time_s"]),
        }
    else:
        r = json.loads((where / "result.json").read_text())
        r["first_step_s"] = r.pop("first_step_end") - t0
        r["startup_s"] = r.pop("window_start") - t0
    return r | mem | {"lingering_processes": lingering}


# ------------------------------------------------------------------------------------------ main
class _Tee:
    """Writes to the terminal and to the log file."""

    def __init__(self, stream: Any, fh: Any) -> None:
        self.stream, self.fh = stream, fh

    def write(self, text: str) -> int:
        self.stream.write(text)
        self.fh.write(text)
        return len(text)

    def flush(self) -> None:
        self.stream.flush()
        self.fh.flush()


def _stdout_is(path: Path) -> bool:
    """Whether stdout already goes to ``path`` (``bench/all.sh`` redirects it there)."""
    try:
        return path.exists() and os.path.samestat(os.fstat(sys.stdout.fileno()), os.stat(path))
    except (OSError, ValueError, AttributeError):
        return False


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--trl-wrap"]:
        trl_wrap(Path(argv[1]), Path(argv[2]), argv[3:])
        return None
    args = parse_args(argv)
    if args.child:
        child_main(args)
        return None
    script = "colocated_quick" if args.quick else "colocated"
    log = args.out_dir / f"{script}.log"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    if _stdout_is(log):
        return _run(args, script)
    with log.open("w") as fh:
        saved = sys.stdout
        sys.stdout = _Tee(saved, fh)
        try:
            return _run(args, script)
        finally:
            sys.stdout = saved


def _run(args: argparse.Namespace, script: str) -> dict[str, Any]:
    peer = vs_trl.find_peer()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("colocated: TRL is not installed: pip install -e '.[bench]' (trl, matplotlib)") from None
    work = Path(tempfile.mkdtemp(prefix="screl_bench_colocated_"))
    t_all = time.time()
    load_before = c.machine_info()["loadavg"]
    print(f"colocated bench: scales {args.scales}, {args.reps} reps, sides {list(SIDES)} rotated per rep; "
          f"load {load_before[0]:.2f}", flush=True)
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {side: [] for side in SIDES} for s in args.scales}
    for rep in range(args.reps):
        for scale in args.scales:
            k = rep % len(SIDES)
            for side in SIDES[k:] + SIDES[:k]:
                r = run_side(side, args, scale, work / f"{scale}_{side}_{rep}", peer)
                r["rep"] = rep
                runs[scale][side].append(r)
                print(f"rep {rep} {scale:5s} {side:16s} samples/s {r['samples_per_s']:7.1f}  first step "
                      f"{r['first_step_s']:5.1f}s (start-up {r['startup_s']:5.1f}s)  peak RSS "
                      f"{r['peak_rss_mb']:6.0f} MB  steady step {r['steady_step_s']:.3f}s  process "
                      f"{r['wall_s']:.1f}s" + (f"  [{r['lingering_processes']} processes outlived it]"
                                               if r["lingering_processes"] else ""), flush=True)
    result = analyse(args, runs)
    c.finish(script, result, args.out_dir, t_all, load_before, report, plot)
    if args.keep_runs:
        print(f"run directories kept under {work}")
    else:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


def _ratios(num: list[dict[str, Any]], den: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Per-rep ratios ``num[key] / den[key]`` of the same rep, summarised (median, min, max, spread)."""
    n = min(len(num), len(den))
    return c.summary([num[i][key] / den[i][key] for i in range(n)]) | {
        "per_rep": [num[i][key] / den[i][key] for i in range(n)]}


def analyse(args: argparse.Namespace, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    scales: dict[str, Any] = {}
    for scale, sides in runs.items():
        entry: dict[str, Any] = {"shape": vs_trl.shape(args, scale), "sides": {}}
        for side, rs in sides.items():
            e: dict[str, Any] = {key: c.summary([r[key] for r in rs]) for key in FIGURES}
            for key in ("gen_span_s", "train_step_s", "own_cores", "other_cores", "first_step_s_peer_json"):
                if key in rs[0]:
                    e[key] = c.median(r[key] for r in rs)
            e["reward_last"] = c.median(r["reward"][-1] for r in rs)
            e["rss_mb_by_role_at_peak"] = rs[0]["rss_mb_by_role_at_peak"]  # rep 0's split
            e["pss_mb_by_role_at_peak"] = rs[0]["pss_mb_by_role_at_peak"]
            e["per_rep"] = rs
            entry["sides"][side] = e
        col, sync, trl = sides["screl_colocated"], sides["screl_sync"], sides["trl"]
        entry["ratios"] = {
            "colocated_over_trl_samples": _ratios(col, trl, "samples_per_s"),
            "sync_over_trl_samples": _ratios(sync, trl, "samples_per_s"),
            "colocated_over_sync_samples": _ratios(col, sync, "samples_per_s"),
            "colocated_first_step_over_trl": _ratios(col, trl, "first_step_s"),
            "sync_first_step_over_trl": _ratios(sync, trl, "first_step_s"),
            "colocated_first_step_over_sync": _ratios(col, sync, "first_step_s"),
            "colocated_peak_rss_over_disaggregated": _ratios(col, sync, "peak_rss_mb"),
            "colocated_peak_rss_over_trl": _ratios(col, trl, "peak_rss_mb"),
            "colocated_pss_over_disaggregated": _ratios(col, sync, "pss_mb_at_peak"),
        }
        entry["trl_torch_threads"] = trl[0]["torch_threads"]
        scales[scale] = entry

    def key(scale: str, name: str) -> float | None:
        return scales[scale]["ratios"][name]["median"] if scale in scales else None

    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "commit": _commit(),
        "quick": bool(args.quick),
        "config": {"task": args.task, "reps": args.reps, "scales": args.scales, "sides": list(SIDES),
                   "trl_threads": args.trl_threads, "screl_threads": args.screl_threads, "poll_s": args.poll_s,
                   "screl_sync": "disaggregated, in_order lookahead 0",
                   "screl_colocated": "the same, generation.colocated.enabled: true",
                   "first_step": "launch -> end of the first optimizer step (screl: StepTimer after the refit; "
                                 "TRL: a TrainerCallback's on_step_end)",
                   "peak_rss": "max over samples of the summed RSS of the side's process and all descendants"},
        "colocated_tiny_over_trl_samples": key("tiny", "colocated_over_trl_samples"),
        "colocated_first_step_over_trl": key("tiny", "colocated_first_step_over_trl"),
        "colocated_peak_rss_over_disaggregated": key("small", "colocated_peak_rss_over_disaggregated"),
        **{f"target_{k}": v for k, v in TARGETS.items()},
        "scales": scales,
    }


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=c.REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    for scale, e in res["scales"].items():
        sh = e["shape"]
        rows = []
        for side, s in e["sides"].items():
            over_trl = e["ratios"].get(f"{side.removeprefix('screl_')}_over_trl_samples", {}).get("median", 1.0)
            rows.append([side, s["samples_per_s"]["median"], s["samples_per_s"]["spread"], over_trl,
                         s["first_step_s"]["median"], s["startup_s"]["median"], s["peak_rss_mb"]["median"],
                         s["pss_mb_at_peak"]["median"], s["steady_step_s"]["median"],
                         s.get("gen_span_s", float("nan")), s.get("train_step_s", float("nan")),
                         s.get("other_cores", float("nan")), s["reward_last"]])
        c.print_table(
            ["side", "samples/s", "spread", "samples/TRL", "first step s", "start-up s", "peak RSS MB", "PSS MB",
             "step_s", "gen_s", "train_s", "cores:others", "reward@N"], rows,
            f"{scale}: P={sh['prompts_per_step']} G={sh['group']} L={sh['completion_len']} task={cfg['task']} "
            f"steps={sh['steps']} reps={cfg['reps']}, medians (TRL {e['trl_torch_threads']} threads; screl "
            f"{cfg['screl_threads'] or 'automatic'})")
        per_rep = [[r["rep"], side, r["samples_per_s"], r["first_step_s"], r["startup_s"], r["peak_rss_mb"],
                    r["wall_s"]] for side, s in e["sides"].items() for r in s["per_rep"]]
        c.print_table(["rep", "side", "samples/s", "first step s", "start-up s", "peak RSS MB", "process s"],
                      sorted(per_rep, key=lambda x: (x[0], x[1])), f"{scale}: per rep")
        print("ratios (median of per-rep ratios): " + ", ".join(
            f"{k} {v['median']:.3f}" for k, v in e["ratios"].items()))
        for side, s in e["sides"].items():
            pss = s["pss_mb_by_role_at_peak"]
            print(f"  {side} at its peak (rep 0, RSS / PSS MB): " + ", ".join(
                f"{k} {v:.0f}/{pss.get(k, 0):.0f}" for k, v in s["rss_mb_by_role_at_peak"].items()))
        if "first_step_s_peer_json" in e["sides"]["trl"]:
            print(f"  TRL first step from the peer's own JSON (launch wall - wall_s_train + first_step_time_s): "
                  f"{e['sides']['trl']['first_step_s_peer_json']:.2f} s")
    print()
    for name, target in TARGETS.items():
        v = res[name]
        op = ">=" if name == "colocated_tiny_over_trl_samples" else "<="  # throughput up, time and memory down
        if v is None:
            print(f"{name} = - (its scale did not run; target {op} {target})")
        else:
            met = v >= target if op == ">=" else v <= target
            print(f"{name} = {v:.3f} (target {op} {target}: {'met' if met else 'missed'})")
    if res["quick"]:
        print("QUICK smoke run: not a result (one rep, few steps)")


def plot(res: dict[str, Any], path: Path) -> None:
    plt = c.pyplot()
    scales = list(res["scales"])
    panels = (("samples_per_s", "samples/s"), ("first_step_s", "time to first step, s"),
              ("peak_rss_mb", "peak RSS of the process tree, MB"))
    fig, ax = plt.subplots(len(scales), len(panels), figsize=(13, 3.6 * len(scales)), squeeze=False)
    for i, scale in enumerate(scales):
        sides = res["scales"][scale]["sides"]
        names = list(sides)
        for j, (figure, label) in enumerate(panels):
            a = ax[i][j]
            a.bar(names, [sides[n][figure]["median"] for n in names], color=["C0", "C1", "C2"][:len(names)])
            for x, n in enumerate(names):
                a.scatter([x] * len(sides[n]["per_rep"]), [r[figure] for r in sides[n]["per_rep"]], color="k", s=8)
            a.set_title(f"{scale}: {label}")
            a.tick_params(axis="x", labelsize=8)
    fig.suptitle(f"colocated vs disaggregated screl vs TRL ({res['date']}; bars: medians, dots: reps)")
    c.save_figure(fig, path)


if __name__ == "__main__":
    main()
