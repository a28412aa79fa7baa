"""The async dip, from the logged metrics: small scale, count_a, lr 3e-3, in_order lookahead 2, P=4 G=4 L=64
(the async_vs_sync.py setting it was reported at).

    python bench/dip.py [--steps 10] [--seeds 1]

Reported once at this setting: async's reward rose by step 2, collapsed for steps 3-6, then recovered, while
sync rose smoothly. Each variant below runs the same seeds; per step it prints the reward and what could
cause a collapse: the largest advantage magnitude (``train/advantage_abs_max``), the largest raw IS weight
and the fraction outside the truncation (``train/is_weight_max``, ``train/is_oob_fraction``), the staleness
and the gradient norm. Variants:

* ``default``: the upstream-matching estimator (leave-one-out baseline, std-normalized);
* ``std_floor``: the same with ``adv_estimator.std_floor: 0.1``;
* ``group_mean``: the group-mean baseline (``use_leave_one_out_baseline: false``);
* ``naive_ppo``: the default estimator, the IS weight replaced by clipping against the behaviour policy
  (is the IS weight or its truncation the cause?).

Writes ``bench/results/dip.json``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import _common as c  # noqa: E402

LOOKAHEAD_2 = {"name": "in_order", "max_lookahead_versions": 2}
VARIANTS: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {  # (adv_estimator, loss_fn init_args)
    "default": ({}, {"use_importance_sampling_correction": True, "is_truncation": 2.0}),
    "std_floor": ({"std_floor": 0.1}, {"use_importance_sampling_correction": True, "is_truncation": 2.0}),
    "group_mean": ({"use_leave_one_out_baseline": False},
                   {"use_importance_sampling_correction": True, "is_truncation": 2.0}),
    "naive_ppo": ({}, {"use_importance_sampling_correction": False, "proximal_policy": "behaviour"}),
}
COLUMNS = ("reward", "train/advantage_abs_max", "train/is_weight_max", "train/is_oob_fraction", "staleness",
           "train/grad_norm")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--seeds", type=int, default=1)
    p.add_argument("--variants", default=",".join(VARIANTS))
    args = p.parse_args(argv)
    c.quiet()
    started = c.start_bench_ray()
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="screl_bench_dip_"))
    out: dict[str, Any] = {"config": {"scale": "small", "task": "count_a", "prompts_per_step": 4, "group": 4,
                                      "completion_len": 64, "learning_rate": 3e-3, "sampler": LOOKAHEAD_2,
                                      "steps": args.steps, "seeds": args.seeds}, "variants": {}}
    try:
        for name in [v.strip() for v in args.variants.split(",") if v.strip()]:
            adv, loss = VARIANTS[name]
            per_seed = []
            for seed in range(args.seeds):
                cfg = c.screl_config(run_dir=work / f"{name}_{seed}", steps=args.steps, sampler=LOOKAHEAD_2,
                                     scale="small", task="count_a", prompts_per_step=4, completion_len=64,
                                     seed=seed)
                cfg["grpo"]["adv_estimator"] = {"name": "grpo", **adv}
                cfg["model"]["init_args"]["loss_fn"]["init_args"] = {"ratio_clip_min": 0.2, "ratio_clip_max": 0.28,
                                                                    **loss}
                r = c.run_screl(name, cfg, work / f"cfg_{name}_{seed}")
                rows = [m for m in c.read_metrics(Path(r.run_dir)) if "reward" in m]
                per_seed.append({col: [m.get(col, float("nan")) for m in rows] for col in COLUMNS})
            out["variants"][name] = per_seed
            for seed, series in enumerate(per_seed):
                c.print_table(["step", *COLUMNS], [[k, *(series[col][k] for col in COLUMNS)]
                                                   for k in range(len(series["reward"]))], f"{name}, seed {seed}")
    finally:
        c.stop_bench_ray(started)
    path = c.write_result("dip", out)
    print(f"\nwrote {path}")
    return out


if __name__ == "__main__":
    main()
