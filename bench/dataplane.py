#!/usr/bin/env python
"""Data-plane overhead: put + get + clear of rollout rows through TransferQueue vs a raw Ray round trip.

Rows are shaped as screl's rollout workers write them (``screl.rollout.rows.ROW_SCHEMA``): per sample
``input_ids`` (prompt + L tokens, int64), ``prompt_len`` (int64[1]), ``generation_logprobs`` (float32[L]),
``token_versions`` (int64[L]), ``reward`` (float32[1]). Measured from the driver, alternating over ``--reps``:

* ``tq_group``      one group (G rows): one ``put`` of the G keys, one ``get``, one ``clear``
  (``screl.dataplane.DataPlane``, the wrapper screl uses);
* ``tq_sibling``    the same group written as G single-row ``put``s (how the controller sealed siblings before
  it coalesced writes);
* ``tq_step_*``     one RL step: its P x G rows written as one put (``batched``: how screl's controller writes
  them, coalescing concurrent row writes), P group puts (``group``) or P x G single-row puts (``sibling``),
  then one ``get`` of the step's rows (the trainer's chunk) and one ``clear`` (``complete_step``);
* ``ray_local``     ``ray.put`` + ``ray.get`` + free of the same group's tensors in the driver;
* ``ray_actor``     an actor ``ray.put``s the group and returns the ref; the driver ``ray.get``s it (a
  cross-process hand-off like controller -> trainer), then frees it; ``ray_ping`` is the bare actor call.

The step time is the steady-state step of the tiny config (``configs/grpo_tiny.yaml``: tiny scale, P=8,
G=4, L=16, in_order lookahead 1) measured in the same run, unless ``--step-time-s`` is given.
``dataplane_overhead_fraction_tiny`` (also ``dataplane_overhead_fraction``) = data-plane cost of one step
(``tq_step_<--put-per>``, default batched) / step time (target < 0.05). ``dataplane_overhead_fraction_small``
is the same for the small scale (P=8, G=8, L=64, small model): one step's 64 rows as one put, one get and one
clear, over the small scale's steady step measured in the same run (``--small-steps``; target < 0.02). Both
runs use screl's automatic thread budget.

    python bench/dataplane.py                  # 200 iterations x 3 reps + a 10-step tiny run
    python bench/dataplane.py --quick          # smoke
    python bench/dataplane.py --step-time-s 0.2

Writes ``bench/results/dataplane.json`` and ``dataplane.png``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402

PROMPT_LEN = 4  # "a+b=" in the character tokenizer
SMALL = (8, 8, 64)  # P, G, L of the small scale (bench/vs_trl.py's)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=200, help="timed iterations per pattern and rep (default 200)")
    p.add_argument("--reps", type=int, default=3, help="repetitions, alternating the patterns (default 3)")
    p.add_argument("--steps", type=int, default=10, help="steps of the tiny run that measures the step time")
    p.add_argument("--quick", action="store_true", help="smoke run: 30 iterations, 1 rep, 5-step tiny run")
    p.add_argument("--step-time-s", type=float, default=None,
                   help="use this step time instead of measuring the tiny config in this run")
    p.add_argument("--small-steps", type=int, default=8,
                   help="steps of the small-scale run whose step the small share divides by (0: skip the small scale)")
    p.add_argument("--prompts-per-step", type=int, default=8, help="P (default 8, the tiny config's)")
    p.add_argument("--group", type=int, default=4, help="G (default 4)")
    p.add_argument("--completion-len", type=int, default=16, help="L (default 16)")
    p.add_argument("--put-per", choices=("sibling", "group", "batched"), default="batched",
                   help="which step pattern the headline key uses: one put for the step's rows (batched: what "
                        "screl's controller does since it coalesces concurrent row writes, RowWriter), one per "
                        "group, or one per sibling (screl before that)")
    p.add_argument("--out-dir", type=Path, default=c.RESULTS)
    args = p.parse_args(argv)
    if args.quick:
        args.iters, args.reps, args.steps, args.small_steps = 30, 1, 5, 0
    if args.iters < 1 or args.reps < 1 or args.steps < 3 or 0 < args.small_steps < 3:
        p.error("--iters and --reps must be >= 1, --steps >= 3, --small-steps 0 or >= 3")
    return args


def group_rows(G: int, L: int, seed: int = 0) -> dict[str, list[Any]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return {
        "input_ids": [torch.randint(3, 43, (PROMPT_LEN + L,), generator=g) for _ in range(G)],
        "prompt_len": [torch.tensor([PROMPT_LEN]) for _ in range(G)],
        "generation_logprobs": [-torch.rand(L, generator=g) for _ in range(G)],
        "token_versions": [torch.zeros(L, dtype=torch.int64) for _ in range(G)],
        "reward": [torch.rand(1, generator=g) for _ in range(G)],
    }


FIELDS = ("input_ids", "prompt_len", "generation_logprobs", "token_versions", "reward")


def timed(fn: Callable[[], None]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class Patterns:
    """The measured patterns; each call returns ``{phase: seconds}`` for one iteration."""

    def __init__(self, dp: Any, actor: Any, P: int, G: int, L: int) -> None:
        self.dp, self.actor = dp, actor
        self.P, self.G, self.L = P, G, L
        self.rows = group_rows(self.G, self.L)
        self.n = 0

    def _keys(self, tag: str, count: int) -> list[str]:
        self.n += 1
        return [f"{tag}{self.n}_g{i}" for i in range(count)]

    def tq_group(self) -> dict[str, float]:
        keys = self._keys("grp", self.G)
        put = timed(lambda: self.dp.put(keys, self.rows))
        get = timed(lambda: self.dp.get(keys, FIELDS))
        clear = timed(lambda: self.dp.clear(keys))
        return {"put": put, "get": get, "clear": clear, "total": put + get + clear}

    def tq_sibling(self) -> dict[str, float]:
        keys = self._keys("sib", self.G)

        def puts() -> None:
            for i, k in enumerate(keys):
                self.dp.put([k], {f: [v[i]] for f, v in self.rows.items()})

        put = timed(puts)
        get = timed(lambda: self.dp.get(keys, FIELDS))
        clear = timed(lambda: self.dp.clear(keys))
        return {"put": put, "get": get, "clear": clear, "total": put + get + clear}

    def _tq_step(self, put_per: str) -> dict[str, float]:
        groups = [self._keys("stp", self.G) for _ in range(self.P)]
        flat = [k for keys in groups for k in keys]

        def puts() -> None:
            if put_per == "batched":
                self.dp.put(flat, {f: v * self.P for f, v in self.rows.items()})
                return
            for keys in groups:
                if put_per == "group":
                    self.dp.put(keys, self.rows)
                else:
                    for i, k in enumerate(keys):
                        self.dp.put([k], {f: [v[i]] for f, v in self.rows.items()})

        put = timed(puts)
        get = timed(lambda: self.dp.get(flat, FIELDS))
        clear = timed(lambda: self.dp.clear(flat))
        return {"put": put, "get": get, "clear": clear, "total": put + get + clear}

    def tq_step_sibling(self) -> dict[str, float]:
        return self._tq_step("sibling")

    def tq_step_group(self) -> dict[str, float]:
        return self._tq_step("group")

    def tq_step_batched(self) -> dict[str, float]:
        return self._tq_step("batched")

    def ray_local(self) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        ref = ray.put(self.rows)
        t1 = time.perf_counter()
        ray.get(ref)
        t2 = time.perf_counter()
        del ref
        t3 = time.perf_counter()
        return {"put": t1 - t0, "get": t2 - t1, "clear": t3 - t2, "total": t3 - t0}

    def ray_actor(self) -> dict[str, float]:
        import ray

        t0 = time.perf_counter()
        [ref] = ray.get(self.actor.put_group.remote())
        t1 = time.perf_counter()
        ray.get(ref)
        t2 = time.perf_counter()
        del ref
        t3 = time.perf_counter()
        return {"put": t1 - t0, "get": t2 - t1, "clear": t3 - t2, "total": t3 - t0}

    def ray_ping(self) -> dict[str, float]:
        import ray

        t = timed(lambda: ray.get(self.actor.ping.remote()))
        return {"put": 0.0, "get": 0.0, "clear": 0.0, "total": t}


PATTERNS = ("tq_group", "tq_sibling", "tq_step_sibling", "tq_step_group", "tq_step_batched", "ray_local", "ray_actor",
            "ray_ping")


def make_actor(G: int, L: int) -> Any:
    import ray

    @ray.remote(num_cpus=0)
    class Producer:
        def __init__(self) -> None:
            self.rows = group_rows(G, L)

        def put_group(self) -> list[Any]:
            return [ray.put(self.rows)]

        def ping(self) -> bool:
            return True

    actor = Producer.remote()  # type: ignore[attr-defined]
    ray.get(actor.ping.remote())
    return actor


def measure_step_time(scale: str, P: int, G: int, L: int, steps: int, work: Path) -> dict[str, Any]:
    """Steady-state step of ``scale`` at P, G, L (in_order lookahead 1), and the trainer's in-run data-plane
    ``get`` per chunk."""
    from screl.controller import runtime as rt

    fetch_s: list[float] = []
    orig = rt.RolloutRuntime.fetch

    def fetch(self: Any, keys: list[str], fields: Any = None) -> Any:
        t0 = time.perf_counter()
        out = orig(self, keys, fields)
        fetch_s.append(time.perf_counter() - t0)
        return out

    rt.RolloutRuntime.fetch = fetch  # type: ignore[method-assign]
    try:
        cfg = c.screl_config(run_dir=work / scale / "run", steps=steps, sampler=c.SAMPLERS["async_w1"], scale=scale,
                             prompts_per_step=P, group=G, completion_len=L, threads=None)
        r = c.run_screl(f"{scale}_async_w1", cfg, work / scale / "cfg")
    finally:
        rt.RolloutRuntime.fetch = orig  # type: ignore[method-assign]
    return {"step_s": r.steady_step_s, "in_run_get_s": c.median(c.skip_first(fetch_s)),
            "cpu_s_per_step": r.cpu_s_per_step}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    c.quiet()
    started = c.start_bench_ray()
    work = Path(tempfile.mkdtemp(prefix="screl_bench_dp_"))
    t_all = time.time()
    load_before = c.machine_info()["loadavg"]
    step: dict[str, Any] = {}
    small_step: dict[str, Any] | None = None
    samples: dict[str, list[dict[str, float]]] = {p: [] for p in PATTERNS}
    small_samples: list[dict[str, float]] = []
    try:
        P, G, L = args.prompts_per_step, args.group, args.completion_len
        if args.step_time_s is None:  # screl starts and stops its own TransferQueue
            step = measure_step_time("tiny", P, G, L, args.steps, work)
            print(f"tiny config step {step['step_s']:.3f}s (steady state); in-run get per chunk "
                  f"{step['in_run_get_s'] * 1e3:.2f} ms", flush=True)
        else:
            step = {"step_s": args.step_time_s, "in_run_get_s": None}
        if args.small_steps:
            small_step = measure_step_time("small", *SMALL, args.small_steps, work)
            print(f"small scale step {small_step['step_s']:.3f}s (steady state); in-run get per chunk "
                  f"{small_step['in_run_get_s'] * 1e3:.2f} ms", flush=True)
        from screl.dataplane import DataPlane

        dp = DataPlane.start(num_storage_units=1, partition_id="bench")
        actor = make_actor(G, L)
        pats = Patterns(dp, actor, P, G, L)
        small = Patterns(dp, actor, *SMALL)
        try:
            for _ in range(5):  # warm-up: connections, first allocations
                for name in PATTERNS:
                    getattr(pats, name)()
                small.tq_step_batched()
            for rep in range(args.reps):
                order = PATTERNS[rep % len(PATTERNS):] + PATTERNS[:rep % len(PATTERNS)]
                for name in order:
                    fn = getattr(pats, name)
                    iters = max(3, args.iters // P) if name.startswith("tq_step") else args.iters
                    samples[name].append(_medians([fn() for _ in range(iters)]))
                if small_step is not None:
                    small_samples.append(_medians([small.tq_step_batched() for _ in range(max(3, args.iters // P))]))
        finally:
            dp.shutdown()
    finally:
        c.stop_bench_ray(started)
    result = analyse(args, samples, step)
    if small_step is not None:
        result["small"] = analyse_small(small_samples, small_step)
        result["dataplane_overhead_fraction_small"] = result["small"]["dataplane_overhead_fraction"]
    c.finish("dataplane", result, args.out_dir, t_all, load_before, report, plot)
    import shutil

    shutil.rmtree(work, ignore_errors=True)
    return result


def _medians(per: list[dict[str, float]]) -> dict[str, float]:
    """One repetition's medians per phase, and its 90th percentile total."""
    return {ph: statistics.median(x[ph] for x in per) for ph in per[0]} | {
        "p90_total": sorted(x["total"] for x in per)[int(0.9 * (len(per) - 1))]}


def analyse_small(reps: list[dict[str, float]], step: dict[str, Any]) -> dict[str, Any]:
    """The small scale's share: one step's rows (P x G, one batched put, one get, one clear) / its step."""
    per_step = {ph: c.median(r[ph] for r in reps) for ph in reps[0]}
    step_s = float(step["step_s"])
    return {"shape": dict(zip(("prompts_per_step", "group", "completion_len"), SMALL, strict=True)),
            "step_s": step_s, "in_run_get_s": step["in_run_get_s"], "cpu_s_per_step": step["cpu_s_per_step"],
            "tq_step_batched_s": per_step, "dataplane_step_s": per_step["total"],
            "dataplane_overhead_fraction": per_step["total"] / step_s,
            "target_dataplane_overhead_fraction": 0.02}


def analyse(args: argparse.Namespace, samples: dict[str, list[dict[str, float]]], step: dict[str, Any]) -> dict[str, Any]:
    pats = {}
    for name, reps in samples.items():
        pats[name] = {ph: c.median(r[ph] for r in reps) for ph in reps[0]}
        pats[name]["total_spread"] = c.summary([r["total"] for r in reps])["spread"]
    step_s = float(step["step_s"])
    P = args.prompts_per_step
    per_step = pats[f"tq_step_{args.put_per}"]["total"]
    return {
        "config": {"prompts_per_step": P, "group": args.group, "completion_len": args.completion_len,
                   "iters": args.iters, "reps": args.reps, "put_per": args.put_per,
                   "step_time_source": "given" if args.step_time_s is not None else "tiny config, measured"},
        "step_s": step_s,
        "in_run_get_s": step.get("in_run_get_s"),
        "tiny_run_cpu_s_per_step": step.get("cpu_s_per_step"),
        "patterns_s": pats,
        "tq_group_s": pats["tq_group"]["total"],
        "tq_sibling_group_s": pats["tq_sibling"]["total"],
        "ray_local_group_s": pats["ray_local"]["total"],
        "ray_actor_group_s": pats["ray_actor"]["total"],
        "tq_over_ray_local": pats["tq_group"]["total"] / pats["ray_local"]["total"],
        "tq_over_ray_actor": pats["tq_group"]["total"] / pats["ray_actor"]["total"],
        "dataplane_step_s": per_step,
        "dataplane_overhead_fraction": per_step / step_s,
        "dataplane_overhead_fraction_tiny": per_step / step_s,
        "dataplane_overhead_fraction_by_put": {k: pats[f"tq_step_{k}"]["total"] / step_s
                                               for k in ("sibling", "group", "batched")},
        "dataplane_group_fraction": pats["tq_group"]["total"] / step_s,
        # what the trainer itself waits for each step (the puts overlap training in async mode): its chunk
        # get (measured in the run when it ran) and complete_step's clear
        "dataplane_trainer_path_fraction": ((step.get("in_run_get_s") or pats[f"tq_step_{args.put_per}"]["get"])
                                            + pats[f"tq_step_{args.put_per}"]["clear"]) / step_s,
        "target_dataplane_overhead_fraction": 0.05,
        "step_time_for_target_s": per_step / 0.05,  # the shortest step at which this data plane costs 5%
    }


def report(res: dict[str, Any]) -> None:
    cfg = res["config"]
    rows = [[name, p["put"] * 1e3, p["get"] * 1e3, p["clear"] * 1e3, p["total"] * 1e3, p["p90_total"] * 1e3,
             p["total_spread"], p["total"] / res["step_s"]] for name, p in res["patterns_s"].items()]
    c.print_table(["pattern", "put_ms", "get_ms", "clear_ms", "total_ms", "p90_ms", "spread", "of step"], rows,
                  f"data plane: P={cfg['prompts_per_step']} G={cfg['group']} L={cfg['completion_len']}, "
                  f"{cfg['iters']} iters x {cfg['reps']} reps (medians); tq_step_* = one RL step")
    print(f"\nstep time {res['step_s'] * 1e3:.1f} ms ({cfg['step_time_source']}); in-run trainer get per chunk "
          f"{(res['in_run_get_s'] or float('nan')) * 1e3:.2f} ms")
    print(f"TransferQueue group round trip = {res['tq_over_ray_local']:.1f}x ray.put/get in-process, "
          f"{res['tq_over_ray_actor']:.1f}x an actor -> driver object hand-off")
    by = res["dataplane_overhead_fraction_by_put"]
    print(f"dataplane_overhead_fraction_tiny = {res['dataplane_overhead_fraction']:.3f} of the step (target < 0.05; puts "
          f"per {cfg['put_per']}); per sibling {by['sibling']:.3f}, per group {by['group']:.3f}, one per step "
          f"{by['batched']:.3f}; one group's put+get+clear alone {res['dataplane_group_fraction']:.4f}; "
          f"on the trainer's path (get + clear) {res['dataplane_trainer_path_fraction']:.3f}; 5% of a step needs "
          f"steps >= {res['step_time_for_target_s']:.2f}s")
    if "small" in res:
        sm = res["small"]
        ph = sm["tq_step_batched_s"]
        print(f"dataplane_overhead_fraction_small = {sm['dataplane_overhead_fraction']:.4f} (target < 0.02): one small "
              f"step's rows put {ph['put'] * 1e3:.1f} ms + get {ph['get'] * 1e3:.1f} ms + clear "
              f"{ph['clear'] * 1e3:.1f} ms of a {sm['step_s']:.3f} s step")


def plot(res: dict[str, Any], path: Path) -> None:
    plt = c.pyplot()
    names = list(res["patterns_s"])
    fig, ax = plt.subplots(figsize=(9, 4.5))
    totals = [res["patterns_s"][n]["total"] * 1e3 for n in names]
    bars = ax.bar(names, totals, color=["tab:blue" if n.startswith("tq") else "tab:gray" for n in names])
    for b, v in zip(bars, totals, strict=True):
        ax.annotate(f"{v:.2f}", (b.get_x() + b.get_width() / 2, v), ha="center", va="bottom", fontsize=8)
    ax.axhline(res["step_s"] * 1e3 * 0.05, color="k", linestyle="--", label="5% of the tiny step")
    ax.set_yscale("log")
    ax.tick_params(axis="x", labelrotation=20)
    ax.set_ylabel("put + get + clear, ms (median)")
    cfg = res["config"]
    ax.set_title(f"data-plane latency, P={cfg['prompts_per_step']} G={cfg['group']} L={cfg['completion_len']}: "
                 f"overhead {res['dataplane_overhead_fraction']:.1%} of a {res['step_s'] * 1e3:.0f} ms step")
    ax.legend(fontsize=8)
    c.save_figure(fig, path)


if __name__ == "__main__":
    main()
