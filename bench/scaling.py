#!/usr/bin/env python
"""How cost grows with the batch and the completion length: samples/s and peak RSS for TRL's GRPOTrainer,
screl sync (in_order lookahead 0) and screl async (in_order lookahead 1), at the small scale, in one run.

Two sweeps (``--sweeps``), each point a fresh process per side, the sides' order rotated point by point:

* ``batch``:  P x G from 32 to 512 (G = 8, P = 4 ... 64) at L = 64;
* ``length``: L from 16 to 256 at P x G = 64 (P = 8, G = 8).

Every side runs as its own subprocess, so its memory is its own: screl is ``python -m screl.cli fit`` on the
benchmark's config (``bench/_common.py``: small model, count_a, fixed-length completions, the automatic thread
budget, its own loopback Ray cluster), TRL is the peer script (``trl_peer.py``, 2 threads). A sampler thread
reads the process tree every ``--poll-s`` seconds: **peak RSS** is the largest sum of the tree's RSS (Ray's
daemons and actors included for screl; shared libraries count once per process, as RSS does), with each
process role's share at that moment, in RSS and in PSS (shared pages divided among the processes that map
them: what the tree really adds to the machine). **samples/s** is P x G over the steady step: the median time between
consecutive steps' ends, the first step (first generation, warm-up) left out (screl: ``train_step`` events;
TRL: its per-step times). ``gen_s``/``train_s`` are screl's generation span and training time per step.

It also measures Ray's idle cluster (a process that starts ``start_local_ray`` and waits) once, so screl's
peak can be read as Ray + what screl holds.

    python bench/scaling.py                     # both sweeps, 4 steps per point, 1 rep (~15 min on 2 cores)
    python bench/scaling.py --sweeps batch --reps 2
    python bench/scaling.py --quick             # smoke: two points per sweep, 3 steps

Writes ``bench/results/scaling.json`` and ``scaling.png`` (samples/s and peak RSS against each sweep's axis).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402
from bench.vs_trl import find_peer  # noqa: E402

SIDES = ("trl", "screl_sync", "screl_async")
BATCHES = (32, 64, 128, 256, 512)
LENGTHS = (16, 32, 64, 128, 256)
GROUP = 8
FIXED_L = 64
FIXED_BATCH = 64
MB = 1 << 20


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sweeps", default="batch,length", help="comma-separated: batch, length (default both)")
    p.add_argument("--batches", default=",".join(map(str, BATCHES)),
                   help=f"P x G points of the batch sweep, multiples of G={GROUP} (default {BATCHES})")
    p.add_argument("--lengths", default=",".join(map(str, LENGTHS)), help=f"L points (default {LENGTHS})")
    p.add_argument("--steps", type=int, default=4, help="RL steps per point (default 4; >= 3)")
    p.add_argument("--reps", type=int, default=1, help="repetitions of every point (default 1)")
    p.add_argument("--sides", default=",".join(SIDES), help=f"comma-separated, from {SIDES}")
    p.add_argument("--poll-s", type=float, default=0.2, help="RSS sampling period (default 0.2 s)")
    p.add_argument("--quick", action="store_true", help="smoke run: batch 32,64 and L 16,32, 3 steps")
    p.add_argument("--out-dir", type=Path, default=c.RESULTS)
    p.add_argument("--replot", type=Path, default=None, metavar="JSON",
                   help="redraw the figure (and print the tables) from a written result, without running")
    args = p.parse_args(argv)
    if args.quick:
        args.batches, args.lengths, args.steps = "32,64", "16,32", 3
    args.sweeps = [s.strip() for s in args.sweeps.split(",") if s.strip()]
    args.sides = [s.strip() for s in args.sides.split(",") if s.strip()]
    problems = []
    if bad := [s for s in args.sweeps if s not in ("batch", "length")]:
        problems.append(f"--sweeps: unknown {bad} (batch, length)")
    if bad := [s for s in args.sides if s not in SIDES]:
        problems.append(f"--sides: unknown {bad} ({', '.join(SIDES)})")
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
        args.lengths = [int(x) for x in args.lengths.split(",")]
    except ValueError:
        problems.append("--batches and --lengths take comma-separated integers")
    else:
        if bad := [b for b in args.batches if b < GROUP or b % GROUP]:
            problems.append(f"--batches: {bad} are not positive multiples of G={GROUP}")
        if bad := [n for n in args.lengths if n < 1]:
            problems.append(f"--lengths: {bad} must be >= 1")
    if args.steps < 3 or args.reps < 1:
        problems.append("--steps must be >= 3 and --reps >= 1")
    if problems:
        p.error("; ".join(problems))
    return args


# ------------------------------------------------------------------------------------------ memory
class TreeRSS:
    """Samples the RSS of a process and its descendants in a thread; keeps the peak and its split by role."""

    def __init__(self, pid: int, poll_s: float) -> None:
        import psutil

        self.root = psutil.Process(pid)
        self.poll_s = poll_s
        self.peak = 0.0
        self.by_role: dict[str, float] = {}
        self.pss_by_role: dict[str, float] = {}
        self.last_pids: set[int] = set()
        """The tree's processes at the last sample (what may outlive the root: Ray's daemons)."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        import psutil

        try:
            procs = [self.root, *self.root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        rss: dict[Any, float] = {}
        for proc in procs:
            try:
                rss[proc] = proc.memory_info().rss / MB
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                continue
        self.last_pids = {proc.pid for proc in rss}
        total = sum(rss.values())
        if total <= self.peak:
            return
        # a new peak: its split by role, in RSS and in PSS (shared pages divided among their processes;
        # read only here, since it costs ~1.6 ms a process)
        roles: dict[str, float] = {}
        pss: dict[str, float] = {}
        for proc, mb in rss.items():
            try:
                role = c.process_role(" ".join(proc.cmdline()[:1]), root=proc.pid == self.root.pid)
                p_mb = proc.memory_full_info().pss / MB
            except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                role, p_mb = "exited", 0.0  # gone since its RSS was read (a run's end): the split still sums up
            roles[role] = roles.get(role, 0.0) + mb
            pss[role] = pss.get(role, 0.0) + p_mb
        self.peak, self.by_role, self.pss_by_role = total, roles, pss

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.poll_s)

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_mb": self.peak, "rss_mb_by_role_at_peak": dict(sorted(self.by_role.items())),
                "pss_mb_at_peak": sum(self.pss_by_role.values()),
                "pss_mb_by_role_at_peak": dict(sorted(self.pss_by_role.items()))}


def run_watched(cmd: list[str], env: dict[str, str], poll_s: float, what: str) -> dict[str, Any]:
    """Run ``cmd`` to completion while sampling its tree's RSS; its wall time and memory (``started``: the
    ``time.time()`` just before the launch; ``leftover_pids``: the tree's processes at the last sample)."""
    c.settle()
    t0 = time.time()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    mem = TreeRSS(proc.pid, poll_s)
    out, err = proc.communicate()
    res = mem.stop() | {"wall_s": time.time() - t0, "started": t0, "leftover_pids": sorted(mem.last_pids - {proc.pid})}
    if proc.returncode != 0:
        raise RuntimeError(f"{what} failed ({proc.returncode}):\n{(err or out)[-3000:]}")
    return res


def ray_idle(poll_s: float) -> dict[str, Any]:
    """Peak RSS of a process that only starts screl's loopback Ray cluster and waits 8 s."""
    code = ("from screl.dataplane import start_local_ray; import time; start_local_ray(); time.sleep(8)")
    return run_watched([sys.executable, "-c", code], dict(os.environ), poll_s, "ray idle")


# ------------------------------------------------------------------------------------------ sides
def run_trl(peer: Path, P: int, L: int, steps: int, work: Path, poll_s: float) -> dict[str, Any]:
    out = work / "trl.json"
    cmd = [sys.executable, str(peer), "--task", "count_a", "--steps", str(steps), "--scale", "small",
           "--prompts-per-step", str(P), "--group", str(GROUP), "--completion-len", str(L),
           "--no-gradient-checkpointing", "--out", str(out)]
    res = run_watched(cmd, dict(os.environ, PEER_THREADS="2", HF_HUB_OFFLINE="1"), poll_s, "trl_peer")
    d = json.loads(out.read_text())
    steady = c.median(c.skip_first(d["step_time_s_per_step"]))
    return res | {"steady_step_s": steady, "samples_per_s": P * GROUP / steady,
                  "reward": d["rewards_per_step"][-1]}


def run_screl(side: str, P: int, L: int, steps: int, work: Path, poll_s: float) -> dict[str, Any]:
    import yaml

    cfg = c.screl_config(run_dir=work / "run", steps=steps, sampler=c.SAMPLERS["sync" if side == "screl_sync"
                         else "async_w1"], scale="small", prompts_per_step=P, group=GROUP, completion_len=L,
                         threads=None)
    work.mkdir(parents=True, exist_ok=True)
    path = work / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    res = run_watched([sys.executable, "-m", "screl.cli", "fit", "--config", str(path)], env, poll_s, side)
    run_dir = next(work.rglob("events.jsonl")).parent
    ends = sorted(float(e["time"]) for e in c.read_events(run_dir) if e["event"] == "train_step")
    if len(ends) != steps:
        raise RuntimeError(f"{side}: expected {steps} train_step events, found {len(ends)} ({run_dir})")
    r = c.summarise(side, cfg, run_dir, None, ends)
    steady = c.median(b - a for a, b in zip(ends[1:], ends[2:], strict=False)) if steps > 2 else r.steady_step_s
    return res | {"steady_step_s": steady, "samples_per_s": P * GROUP / steady,
                  "gen_span_s": c.median(c.skip_first(r.gen_span_s)),
                  "train_step_s": c.median(c.skip_first(r.train_step_s)), "reward": r.reward[-1]}


def points(args: argparse.Namespace, sweep: str) -> list[tuple[int, int, int]]:
    """``(x, P, L)`` of each point of ``sweep``."""
    if sweep == "batch":
        return [(b, b // GROUP, FIXED_L) for b in args.batches]
    return [(n, FIXED_BATCH // GROUP, n) for n in args.lengths]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replot is not None:
        result: dict[str, Any] = json.loads(args.replot.read_text())
        report(result)
        plot(result, args.replot.with_suffix(".png"))
        return result
    peer = find_peer() if "trl" in args.sides else None
    work = Path(tempfile.mkdtemp(prefix="screl_bench_scaling_"))
    t_all = time.time()
    load_before = c.machine_info()["loadavg"]
    idle = ray_idle(args.poll_s)
    print(f"Ray's idle cluster: peak RSS {idle['peak_rss_mb']:.0f} MB {idle['rss_mb_by_role_at_peak']}", flush=True)
    raw: dict[str, dict[int, dict[str, list[dict[str, Any]]]]] = {}
    k = 0
    for sweep in args.sweeps:
        raw[sweep] = {}
        for x, P, L in points(args, sweep):
            raw[sweep][x] = {side: [] for side in args.sides}
            for rep in range(args.reps):
                order = args.sides[k % len(args.sides):] + args.sides[:k % len(args.sides)]
                k += 1
                for side in order:
                    where = work / f"{sweep}_{x}_{side}_{rep}"
                    where.mkdir(parents=True)
                    if side == "trl":
                        assert peer is not None
                        r = run_trl(peer, P, L, args.steps, where, args.poll_s)
                    else:
                        r = run_screl(side, P, L, args.steps, where, args.poll_s)
                    raw[sweep][x][side].append(r)
                    print(f"{sweep} {x:4d} (P={P} G={GROUP} L={L}) {side:12s} samples/s {r['samples_per_s']:7.1f}  "
                          f"steady step {r['steady_step_s']:.3f}s  peak RSS {r['peak_rss_mb']:6.0f} MB  "
                          f"(process {r['wall_s']:.0f}s)", flush=True)
    result = analyse(args, raw, idle)
    c.finish("scaling", result, args.out_dir, t_all, load_before, report, plot)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return result


def analyse(args: argparse.Namespace, raw: dict[str, Any], idle: dict[str, Any]) -> dict[str, Any]:
    sweeps: dict[str, Any] = {}
    for sweep, by_x in raw.items():
        xs = sorted(by_x)
        sides: dict[str, Any] = {}
        for side in args.sides:
            e: dict[str, Any] = {}
            for key in ("samples_per_s", "steady_step_s", "peak_rss_mb", "pss_mb_at_peak", "gen_span_s",
                        "train_step_s"):
                if key in by_x[xs[0]][side][0]:
                    e[key] = [c.median(r[key] for r in by_x[x][side]) for x in xs]
            # how much each step along the axis multiplies the throughput (1.0: the curve is flat)
            e["samples_per_s_growth"] = [b / a for a, b in zip(e["samples_per_s"], e["samples_per_s"][1:],
                                                                 strict=False)]
            e["rss_mb_by_role_at_peak"] = [by_x[x][side][0]["rss_mb_by_role_at_peak"] for x in xs]
            sides[side] = e
        entry: dict[str, Any] = {"x": xs, "x_name": "P x G" if sweep == "batch" else "L", "sides": sides,
                                 "fixed": {"L": FIXED_L, "G": GROUP} if sweep == "batch"
                                 else {"P x G": FIXED_BATCH, "G": GROUP}}
        for side in args.sides:
            if side != "trl" and "trl" in sides:
                entry[f"{side}_over_trl_samples"] = [a / b for a, b in zip(
                    sides[side]["samples_per_s"], sides["trl"]["samples_per_s"], strict=True)]
        sweeps[sweep] = entry
    res: dict[str, Any] = {
        "config": {"steps": args.steps, "reps": args.reps, "sides": args.sides, "group": GROUP,
                   "poll_s": args.poll_s, "scale": "small", "task": "count_a",
                   "screl_sync": "in_order lookahead 0", "screl_async": "in_order lookahead 1"},
        "ray_idle": idle, "sweeps": sweeps,
    }
    # the small scale's point (P x G = 64, L = 64): peak memory side by side
    for sweep, x in (("batch", FIXED_BATCH), ("length", FIXED_L)):
        if sweep in raw and x in raw[sweep]:
            res["memory_small"] = {side: c.median(r["peak_rss_mb"] for r in rs)
                                   for side, rs in raw[sweep][x].items()}
            res["memory_small_pss"] = {side: c.median(r["pss_mb_at_peak"] for r in rs)
                                       for side, rs in raw[sweep][x].items()}
            res["memory_small_by_role"] = {side: rs[0]["rss_mb_by_role_at_peak"] for side, rs in raw[sweep][x].items()}
            res["memory_small_pss_by_role"] = {side: rs[0]["pss_mb_by_role_at_peak"]
                                               for side, rs in raw[sweep][x].items()}
            break
    return res


def report(res: dict[str, Any]) -> None:
    for sweep, e in res["sweeps"].items():
        rows = []
        for i, x in enumerate(e["x"]):
            for side, s in e["sides"].items():
                rows.append([x, side, s["samples_per_s"][i], s["samples_per_s_growth"][i - 1] if i else float("nan"),
                             s["steady_step_s"][i], s.get("gen_span_s", [float("nan")] * len(e["x"]))[i],
                             s.get("train_step_s", [float("nan")] * len(e["x"]))[i], s["peak_rss_mb"][i]])
        c.print_table([e["x_name"], "side", "samples/s", "x prev", "step_s", "gen_s", "train_s", "peak RSS MB"], rows,
                      f"{sweep} sweep (fixed {e['fixed']}), {res['config']['steps']} steps x "
                      f"{res['config']['reps']} reps, medians")
    idle = res["ray_idle"]
    print(f"\nRay idle cluster: {idle['peak_rss_mb']:.0f} MB RSS, {idle['pss_mb_at_peak']:.0f} MB PSS "
          f"{idle['pss_mb_by_role_at_peak']}")
    if "memory_small" in res:
        print("peak RSS at the small scale (P x G = 64, L = 64): " + ", ".join(
            f"{side} {mb:.0f} MB" for side, mb in res["memory_small"].items()))
        for side, roles in res["memory_small_by_role"].items():
            pss = res["memory_small_pss_by_role"][side]
            print(f"  {side} (RSS / PSS MB): " + ", ".join(f"{k} {v:.0f}/{pss.get(k, 0):.0f}" for k, v in roles.items())
                  + f"; PSS total {res['memory_small_pss'][side]:.0f}")


def plot(res: dict[str, Any], path: Path) -> None:
    plt = c.pyplot()
    sweeps = list(res["sweeps"])
    fig, ax = plt.subplots(len(sweeps), 2, figsize=(12, 4 * len(sweeps)), squeeze=False)
    for i, sweep in enumerate(sweeps):
        e = res["sweeps"][sweep]
        for side, s in e["sides"].items():
            ax[i][0].plot(e["x"], s["samples_per_s"], marker="o", label=side)
            ax[i][1].plot(e["x"], s["peak_rss_mb"], marker="o", label=side)
        ax[i][1].axhline(res["ray_idle"]["peak_rss_mb"], color="gray", linestyle=":", label="Ray idle cluster")
        for a, ylabel in zip(ax[i], ("samples/s (steady step)", "peak RSS of the process tree, MB"), strict=True):
            a.set_xscale("log", base=2)
            a.set_xticks(e["x"], [str(x) for x in e["x"]])
            a.set_xlabel(f"{e['x_name']} (fixed {e['fixed']})")
            a.set_ylabel(ylabel)
            a.legend(fontsize=8)
        ax[i][0].set_title(f"{sweep} sweep: throughput")
        ax[i][1].set_title(f"{sweep} sweep: memory")
    fig.suptitle("screl vs TRL GRPOTrainer, small scale, count_a: how cost grows")
    c.save_figure(fig, path)


if __name__ == "__main__":
    main()
