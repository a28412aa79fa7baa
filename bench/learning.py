"""Learning quality under asynchrony: does async learn as well as sync per step, and faster per second?

    python bench/learning.py [--quick] [--steps 120] [--seeds 3] [--modes sync,async_w1,...]

Every mode trains the same model from the same initial weights on the same task, over ``--seeds`` seeds
(the seed drives sampling and data order), one run after another in one process, on one shared loopback
Ray cluster (Ray's start is outside every run). Modes:

* ``sync``: in_order, lookahead 0 (on-policy);
* ``async_w1``, ``async_w2``, ``async_w4``: in_order lookahead 1, 2, 4, token TIS at 2;
* ``async_w4_geo``: lookahead 4 with GSPO-style geometric-mean sequence IS, masked outside [0.5, 2];
* ``async_w4_naive``: lookahead 4, naive PPO (clipped against the behaviour policy, no IS weight);
* ``windowed_s2``: the windowed sampler, staleness 2, freshest first.

The task (``--task``) is ``count_a`` at ``--learning-rate 5e-4`` (tiny scale, P=8 G=4 L=16): its reward starts
near 0.04 and rises smoothly, still below 0.9 at step 110 (at lr 3e-3 it saturates within 20 steps, and then
no mode can be told apart). Measured alternatives (bench/README.md): ``add`` at the small scale collapses to
a reward of 0 by step 70; a position-wise target-match reward plateaus at 0.185 (a constant output) by step
100 at any learning rate tried.

Figures per mode (``bench/results/learning.json``), rewards being each step's mean over its groups:

* ``final_reward_mean`` / ``final_reward_std``: the mean reward of the last ``--tail`` of the first ``--steps``
  steps, mean and std over seeds; ``half_reward_mean``: the same ``--tail`` steps around half-way (async modes
  run ``--async-steps-factor`` times longer, for the time figures; these use only their first ``--steps``);
* ``reward_per_step`` and ``time_per_step_s`` (mean over seeds; time from the first generation), and
  ``time_at_step_n_s``, the time at step ``--steps``;
* ``step_to_sync_final`` / ``time_to_sync_final_s``: the first step (and its time) at which the mode's
  seed-mean reward, averaged over ``--tail`` steps, reaches sync's final mean; null if never;
* ``staleness_fraction``: the staleness distribution of the trained groups;
* ``final_minus_sync_same_version_mean`` / ``_std``: a step's logged reward is that of rollouts generated
  ``lag_steps`` (the mean staleness, rounded) versions earlier, so the final reward is also compared, seed by
  seed, with sync's reward of the same generating version (sync's steps ``lag_steps`` earlier): whether async
  learns as much per update, with the measurement lag taken out;
* ``val_*``: the policy itself, scored at equal trainer versions. Every ``--val-period`` steps the weights of
  that version are validated (``grpo.val_period``, docs/validation-during-training.md) on ``--val-prompts``
  held-out prompts x ``--val-samples`` samples at the training temperature, each sample seeded by its prompt
  and index only, so versions and modes compare pairwise. ``val_reward_per_version`` (mean over seeds),
  ``val_final_mean`` / ``_std`` (versions in the last ``2 x --val-period`` steps of the first ``--steps``),
  ``val_half_mean`` / ``_std`` (the same width ending half-way), and whether each lies within sync's spread.
  This is the equal-steps comparison without the lag of the logged training reward;
* and ``async_w1_time_over_sync`` at the top level.

It writes the JSON and ``learning.png`` (reward against step and against wall time, the staleness
histogram). ``--quick``: 30 steps, 1 seed, sync and async_w1, validation every 5 steps (a smoke run of a few minutes).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402

TIS = {"use_importance_sampling_correction": True, "is_truncation": 2.0}
#: mode -> (sampler, loss_fn init_args)
MODES: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "sync": ({"name": "in_order", "max_lookahead_versions": 0}, TIS),
    "async_w1": ({"name": "in_order", "max_lookahead_versions": 1}, TIS),
    "async_w2": ({"name": "in_order", "max_lookahead_versions": 2}, TIS),
    "async_w4": ({"name": "in_order", "max_lookahead_versions": 4}, TIS),
    "async_w4_geo": ({"name": "in_order", "max_lookahead_versions": 4},
                     {"use_importance_sampling_correction": True, "is_level": "geometric", "is_mode": "mask",
                      "is_truncation": 2.0, "is_truncation_min": 0.5}),
    "async_w4_naive": ({"name": "in_order", "max_lookahead_versions": 4},
                       {"use_importance_sampling_correction": False, "proximal_policy": "behaviour"}),
    "windowed_s2": ({"name": "windowed", "max_staleness_versions": 2, "sample_freshest_first": True}, TIS),
}
DEFAULT_MODES = ("sync", "async_w1", "async_w2", "async_w4", "async_w4_geo", "async_w4_naive", "windowed_s2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=120, help="RL steps per run (default 120)")
    p.add_argument("--seeds", type=int, default=3, help="seeds per mode (default 3)")
    p.add_argument("--tail", type=int, default=10, help="steps averaged for the final and half-way rewards")
    p.add_argument("--async-steps-factor", type=float, default=1.5,
                   help="async modes run this many times --steps, so that the time they take to reach sync's final "
                        "reward is measured even when they need more steps; equal-step figures use the first --steps")
    p.add_argument("--modes", default=",".join(DEFAULT_MODES), help=f"comma-separated subset of {', '.join(MODES)}")
    p.add_argument("--task", choices=sorted(c.TASKS), default="count_a")
    p.add_argument("--scale", choices=("tiny", "small"), default="tiny")
    p.add_argument("--prompts-per-step", type=int, default=8)
    p.add_argument("--group", type=int, default=4)
    p.add_argument("--completion-len", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=5e-4)
    p.add_argument("--val-period", type=int, default=10,
                   help="validate the policy every this many steps (0: off; the prompts below are held out)")
    p.add_argument("--val-prompts", type=int, default=20, help="held-out prompts scored at each validation")
    p.add_argument("--val-samples", type=int, default=4, help="samples per held-out prompt")
    p.add_argument("--quick", action="store_true", help="30 steps, 1 seed, sync and async_w1, validation every 5 steps")
    p.add_argument("--out-dir", type=Path, default=c.RESULTS)
    p.add_argument("--reanalyse", type=Path, default=None,
                   help="recompute the figures from a learning.json this script wrote (its per-seed rewards, its "
                        "seed-mean times and staleness) instead of running")
    args = p.parse_args(argv)
    if args.quick:
        args.steps, args.seeds, args.val_period = 30, 1, min(args.val_period, 5)
        if args.modes == ",".join(DEFAULT_MODES):
            args.modes = "sync,async_w1"
    args.modes = c.parse_modes(p, args.modes, list(MODES))
    if args.steps < 2 * args.tail:
        p.error(f"--steps ({args.steps}) must be at least twice --tail ({args.tail})")
    if args.val_period < 0 or (args.val_period and args.steps < 4 * args.val_period):
        p.error(f"--val-period ({args.val_period}) must be 0 or at most a quarter of --steps ({args.steps})")
    return args


def mode_steps(mode: str, args: argparse.Namespace) -> int:
    return args.steps if mode == "sync" else math.ceil(args.steps * args.async_steps_factor)


def mode_config(mode: str, seed: int, args: argparse.Namespace, run_dir: Path) -> dict[str, Any]:
    sampler, loss = MODES[mode]
    cfg = c.screl_config(run_dir=run_dir, steps=mode_steps(mode, args), sampler=sampler, scale=args.scale, task=args.task,
                         prompts_per_step=args.prompts_per_step, group=args.group,
                         completion_len=args.completion_len, learning_rate=args.learning_rate, seed=seed,
                         min_groups=max(1, args.prompts_per_step // 2) if sampler["name"] == "windowed" else None)
    cfg["model"]["init_args"]["loss_fn"]["init_args"] = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28, **loss}
    # epochs to spare: a windowed sampler evicts groups that fell out of its window (a sixth of them, measured),
    # and the run must still reach max_num_steps
    cfg["grpo"]["max_num_epochs"] = 2 * int(cfg["grpo"]["max_num_epochs"])
    if args.val_period:
        cfg["data"]["init_args"]["task"]["init_args"]["holdout"] = args.val_prompts
        cfg["grpo"].update(val_period=args.val_period, val_at_start=True, val_at_end=False,
                           validation={"num_samples": args.val_samples, "temperature": 1.0})
    return cfg


def per_run(r: c.ScrelRun) -> dict[str, Any]:
    val = {int(m["val/version"]): m["val/reward_mean"] for m in c.read_metrics(Path(r.run_dir))
           if "val/version" in m and "val/reward_mean" in m}
    return {"reward": r.reward, "time": r.reward_by_time(), "staleness": r.staleness, "window_s": r.window_s,
            "val": dict(sorted(val.items()))}


def _val_window(run: dict[str, Any], end: int, width: int) -> float:
    """Mean validation reward of the versions in ``(end - width, end]``."""
    return _mean([r for v, r in run.get("val", {}).items() if end - width < int(v) <= end])


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def _std(xs: list[float]) -> float:
    return statistics.stdev(xs) if len(xs) > 1 else 0.0


def _within_spread(m: dict[str, Any], ref: dict[str, Any], mean: str, std: str) -> bool:
    """Whether mode ``m``'s ``mean`` lies within the larger of its own and ``ref``'s seed spread (``std``)."""
    return abs(m[mean] - ref[mean]) <= max(ref[std], m[std])


def _first_reaching(curve: list[float], target: float, tail: int) -> int | None:
    """The first step at which the running mean of the last ``tail`` steps reaches ``target``."""
    for k in range(tail - 1, len(curve)):
        if _mean(curve[k - tail + 1:k + 1]) >= target - 1e-9:
            return k
    return None


def analyse(args: argparse.Namespace, runs: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    n, tail = args.steps, args.tail
    half = slice(n // 2 - tail // 2, n // 2 - tail // 2 + tail)
    modes: dict[str, Any] = {}
    for mode, rs in runs.items():
        finals = [_mean(r["reward"][n - tail:n]) for r in rs]
        halves = [_mean(r["reward"][half]) for r in rs]
        stal = Counter(s for r in rs for s in r["staleness"])
        total = sum(stal.values()) or 1
        lag = round(sum(k * v for k, v in stal.items()) / total)  # the steps between generation and training
        modes[mode] = {
            "lag_steps": lag,
            "reward_per_seed": [r["reward"] for r in rs],
            "final_reward_mean": _mean(finals),
            "final_reward_std": _std(finals),
            "final_reward_per_seed": finals,
            "half_reward_mean": _mean(halves),
            "half_reward_std": _std(halves),
            "reward_per_step": [_mean([r["reward"][k] for r in rs]) for k in range(len(rs[0]["reward"]))],
            "time_per_step_s": [_mean([r["time"][k] for r in rs]) for k in range(len(rs[0]["time"]))],
            "time_at_step_n_s": _mean([r["time"][n - 1] for r in rs]),
            "window_s": _mean([r["window_s"] for r in rs]),
            "staleness_fraction": {str(k): v / total for k, v in sorted(stal.items())},
            "staleness_mean": sum(k * v for k, v in stal.items()) / total,
        }
    width = 2 * args.val_period
    for mode, rs in runs.items():
        if not width or not all(r.get("val") for r in rs):
            continue
        finals, halves = [_val_window(r, n, width) for r in rs], [_val_window(r, n // 2, width) for r in rs]
        versions = sorted({int(v) for r in rs for v in r["val"]})
        modes[mode].update({
            "val_reward_per_version": {str(v): _mean([r["val"][v] for r in rs if v in r["val"]]) for v in versions},
            "val_reward_per_seed": [{str(v): x for v, x in r["val"].items()} for r in rs],
            "val_final_mean": _mean(finals), "val_final_std": _std(finals),
            "val_half_mean": _mean(halves), "val_half_std": _std(halves),
        })
    if "val_final_mean" in modes.get("sync", {}):
        for m in modes.values():
            if "val_final_mean" in m:
                for key in ("final", "half"):
                    m[f"val_{key}_within_sync_spread"] = _within_spread(m, modes["sync"], f"val_{key}_mean",
                                                                        f"val_{key}_std")
    target = modes["sync"]["final_reward_mean"]
    sync_seeds = modes["sync"]["reward_per_seed"]
    for m in modes.values():
        # the reward a step logs is that of rollouts its lag's worth of versions older: compare with sync's reward
        # of the same generating version (sync's steps lag earlier), seed by seed
        lo, hi = n - tail - m["lag_steps"], n - m["lag_steps"]
        gaps = [_mean(own[n - tail:n]) - _mean(ref[lo:hi]) for own, ref in zip(m["reward_per_seed"], sync_seeds,
                                                                                 strict=False)]
        m["final_minus_sync_same_version_mean"] = _mean(gaps)
        m["final_minus_sync_same_version_std"] = _std(gaps)
    for m in modes.values():
        k = _first_reaching(m["reward_per_step"], target, tail)
        m["step_to_sync_final"] = k
        m["time_to_sync_final_s"] = m["time_per_step_s"][k] if k is not None else None
        m["final_within_sync_spread"] = _within_spread(m, modes["sync"], "final_reward_mean", "final_reward_std")
        m["half_within_sync_spread"] = _within_spread(m, modes["sync"], "half_reward_mean", "half_reward_std")
    sync_t, w1 = modes["sync"]["time_to_sync_final_s"], modes.get("async_w1", {}).get("time_to_sync_final_s")
    return {
        "config": {"task": args.task, "scale": args.scale, "prompts_per_step": args.prompts_per_step,
                   "group": args.group, "completion_len": args.completion_len, "steps": n, "seeds": args.seeds,
                   "tail": tail, "learning_rate": args.learning_rate, "modes": args.modes,
                   "val_period": args.val_period, "val_prompts": args.val_prompts, "val_samples": args.val_samples},
        "sync_final_reward": target,
        "async_w1_time_over_sync": (w1 / sync_t) if (w1 is not None and sync_t) else None,
        "modes": modes,
    }


def report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(f"\nlearning quality: task={cfg['task']} scale={cfg['scale']} P={cfg['prompts_per_step']} "
          f"G={cfg['group']} L={cfg['completion_len']} lr={cfg['learning_rate']} steps={cfg['steps']} "
          f"seeds={cfg['seeds']} (rewards: mean of {cfg['tail']} steps, mean +- std over seeds)")
    rows = []
    for mode, m in res["modes"].items():
        rows.append([mode, f"{m['half_reward_mean']:.3f} +- {m['half_reward_std']:.3f}",
                     f"{m['final_reward_mean']:.3f} +- {m['final_reward_std']:.3f}",
                     ("yes" if m["half_within_sync_spread"] else "no") + "/"
                     + ("yes" if m["final_within_sync_spread"] else "no"), m["step_to_sync_final"],
                     m["time_to_sync_final_s"] if m["time_to_sync_final_s"] is not None else float("nan"),
                     m["time_at_step_n_s"], m["staleness_mean"],
                     f"{m['final_minus_sync_same_version_mean']:+.4f} +- {m['final_minus_sync_same_version_std']:.4f}"])
    c.print_table(["mode", "half-way", "final", "~sync half/final", "step->sync", "time->sync s",
                   f"s to step {cfg['steps']}", "stale", "final - sync (same version)"], rows)
    val_rows = [[mode, f"{m['val_half_mean']:.3f} +- {m['val_half_std']:.3f}",
                 f"{m['val_final_mean']:.3f} +- {m['val_final_std']:.3f}",
                 ("yes" if m["val_half_within_sync_spread"] else "no") + "/"
                 + ("yes" if m["val_final_within_sync_spread"] else "no")]
                for mode, m in res["modes"].items() if "val_half_within_sync_spread" in m]
    if val_rows:
        c.print_table(["mode", "val half-way", "val final", "~sync half/final"], val_rows,
                      title=f"the policy at equal trainer versions: held-out reward every {cfg['val_period']} steps "
                            f"({cfg['val_prompts']} prompts x {cfg['val_samples']} samples)")
    if res["async_w1_time_over_sync"] is not None:
        print(f"\nasync_w1 reaches sync's final reward in {res['async_w1_time_over_sync']:.2f}x sync's time "
              "(target <= 0.7)")


def plot(res: dict[str, Any], path: Path) -> None:
    plt = c.pyplot()
    fig, ax = plt.subplots(1, 4, figsize=(22, 5))
    for mode, m in res["modes"].items():
        ax[0].plot(range(len(m["reward_per_step"])), m["reward_per_step"], label=mode, lw=1.2)
        ax[1].plot(m["time_per_step_s"], m["reward_per_step"], label=mode, lw=1.2)
        val = m.get("val_reward_per_version", {})
        ax[3].plot([int(v) for v in val], list(val.values()), marker="o", ms=3, label=mode, lw=1.2)
    ax[3].set_xlabel("trainer version (steps trained)")
    ax[3].set_ylabel("held-out reward (mean over seeds)")
    ax[3].set_title("the policy at equal versions (validation)")
    ax[3].legend(fontsize=7)
    target = res["sync_final_reward"]
    for a, xlabel in ((ax[0], "RL step"), (ax[1], "wall time since the first generation (s)")):
        a.axhline(target, color="k", ls=":", lw=1, label=f"sync final {target:.3f}")
        a.set_xlabel(xlabel)
        a.set_ylabel("mean reward (mean over seeds)")
        a.legend(fontsize=7)
    ax[0].set_title("reward at equal steps")
    ax[1].set_title("reward at equal wall time")
    c.staleness_bars(ax[2], {m: v["staleness_fraction"] for m, v in res["modes"].items()},
                     "fraction of trained groups")
    cfg = res["config"]
    fig.suptitle(f"screl learning quality: {cfg['task']}, {cfg['scale']} P={cfg['prompts_per_step']} "
                 f"G={cfg['group']} L={cfg['completion_len']} lr={cfg['learning_rate']}, {cfg['seeds']} seeds")
    c.save_figure(fig, path)


def runs_from(path: Path) -> dict[str, list[dict[str, Any]]]:
    """The per-seed runs a written result holds again (times and staleness as the seed means it kept)."""
    import json

    out: dict[str, list[dict[str, Any]]] = {}
    for mode, m in json.loads(path.read_text())["modes"].items():
        n_groups = 1000
        staleness = [int(k) for k, f in m["staleness_fraction"].items() for _ in range(round(f * n_groups))]
        vals = m.get("val_reward_per_seed") or [{} for _ in m["reward_per_seed"]]
        out[mode] = [{"reward": rewards, "time": m["time_per_step_s"], "staleness": staleness,
                      "window_s": m["window_s"], "val": {int(v): x for v, x in val.items()}}
                     for rewards, val in zip(m["reward_per_seed"], vals, strict=True)]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.reanalyse is not None:
        import json

        old = json.loads(args.reanalyse.read_text())
        result = analyse(args, runs_from(args.reanalyse)) | {k: old[k] for k in ("machine", "bench_wall_s")}
        report(result)
        c.write_result("learning", result, args.out_dir)
        plot(result, args.out_dir / "learning.png")
        return result
    c.quiet()
    started = c.start_bench_ray()
    work = Path(tempfile.mkdtemp(prefix="screl_bench_learning_"))
    t_all = time.time()
    runs: dict[str, list[dict[str, Any]]] = {m: [] for m in args.modes}
    try:
        for seed in range(args.seeds):
            for mode in args.modes:
                t0 = time.time()
                r = c.run_screl(mode, mode_config(mode, seed, args, work / f"{mode}_{seed}"),
                                work / f"cfg_{mode}_{seed}")
                runs[mode].append(per_run(r))
                print(f"seed {seed} {mode:15s} final {_mean(r.reward[-args.tail:]):.3f}  run {r.window_s:.1f}s "
                      f"(with start-up {time.time() - t0:.1f}s)", flush=True)
    finally:
        c.stop_bench_ray(started)
    result = analyse(args, runs)
    result["machine"] = c.machine_info()
    result["bench_wall_s"] = time.time() - t_all
    report(result)
    name = "learning_quick" if args.quick else "learning"
    out = c.write_result(name, result, args.out_dir)
    plot(result, args.out_dir / f"{name}.png")
    print(f"\nwrote {out} and {args.out_dir / (name + '.png')} ({result['bench_wall_s']:.0f}s)")
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
