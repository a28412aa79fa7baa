"""On-policy distillation against GRPO from scratch, and two teachers for two task sources.

    python bench/distill.py [--steps 50] [--lrs 3e-3,5e-4] [--mix-steps 100] [--mix-prompts 10] [--quick]
                            [--out-dir bench/results]

The teachers are the shipped ones (``examples/distill/make_teachers.py`` wrote them): ``count``, the tiny policy after
30 GRPO steps on count-'a'; ``addition``, the same architecture fitted by cross-entropy on the sums. Every run is the
tiny student (``TinyCausalLM(scale=tiny, seed=0)``, the teacher's own initial weights), P=8 G=4 L=16, lr 3e-3, the
async in_order sampler with lookahead 1 and token TIS at 2 (``configs/distill_tiny.yaml``), one after another on one
loopback Ray cluster. Runs:

* ``teacher``: the count teacher itself under GRPO at learning rate 0 (``--teacher-steps`` steps): its reward with the
  same sampling as the students' (the target);
* ``grpo_lr<lr>``: GRPO from scratch on count-'a', for each ``--lrs`` learning rate (default 3e-3 and 5e-4);
* ``distill_lr<lr>``: ``screl.Distill`` from the count teacher (pure distillation, ``reward_weight: 0``), the same;
* ``mix_distill``: ``screl.Distill`` on ``TaskMixture({count: CountLetter, add: Addition})`` (prompts tagged
  ``count 3+4=`` / ``add 3+4=``; each source keeps ``--mix-prompts`` of its 100 prompts, the rest held out),
  ``teacher_map: {count: count, add: addition}``; the reward of each source's rows is logged per step;
* ``mix_distill_top_k``: the ``mix_distill`` run with ``estimator: top_k`` (``top_k: 16``): the exact reverse KL over
  the teacher's 16 most likely tokens at each position instead of the sampled token's advantage;
* ``mix_distill_top_k_forward``: the same with ``kl_direction: forward`` (the forward KL over those tokens);
* ``mix_grpo``: GRPO from scratch on the same mixture (the baseline of the per-source curves);
* ``warm_*`` (``--warm-start-steps`` > 0, off by default): the mixture runs again from a warm-started student, the usual recipe
  (supervised fine-tuning, then on-policy distillation): the tiny policy fitted for that many full-batch steps on the
  sums as the addition teacher was (``make_teachers.sft_addition_teacher``, 400 steps for the teacher), so that it
  samples right answers some of the time (``warm_start_accuracy``, teacher-forced).

Figures (``bench/results/distill.json``): the per-step reward curves; ``teacher_reward`` (mean over its steps);
``steps_to_teacher`` per run: the first step at which the reward's 3-step moving average reaches
``--target-fraction`` (0.9) of the teacher's reward (null: never within ``--steps``), and
``distill_over_grpo_steps`` per learning rate; for the mixture (``--mix-steps``, completions of at most
``--mix-length`` tokens that may stop early), each source's reward over its first and last 5 steps, and in the
distill runs the teacher's mean logprob of each source's trained tokens (``teacher_logprob_per_step`` and
``teacher_logprob_first5_last5``, per distill run).
"""

from __future__ import annotations

import argparse
import copy
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._common import (  # noqa: E402
    RESULTS,
    SAMPLERS,
    finish,
    print_table,
    quiet,
    read_metrics,
    screl_config,
    settle,
    start_bench_ray,
    stop_bench_ray,
)

REPO = Path(__file__).resolve().parents[1]
TEACHERS = REPO / "examples" / "distill" / "teachers"


def teacher_spec(name: str) -> dict[str, Any]:
    return {"class_path": "screl.models.HFCausalLM",
            "init_args": {"path": str(TEACHERS / name), "tokenizer_path": str(TEACHERS / name / "tokenizer")}}


def base(run_dir: Path, steps: int, seed: int, lr: float = 3e-3) -> dict[str, Any]:
    return screl_config(run_dir=run_dir, steps=steps, sampler=SAMPLERS["async_w1"], seed=seed, learning_rate=lr)


def as_distill(cfg: dict[str, Any], teachers: dict[str, str], teacher_map: dict[str, str]) -> dict[str, Any]:
    cfg = copy.deepcopy(cfg)
    model = cfg["model"]
    model["class_path"] = "screl.Distill"
    model["init_args"]["distillation"] = {
        "teachers": [{"name": n, "policy": teacher_spec(d)} for n, d in teachers.items()],
        "teacher_map": teacher_map, "default_teacher": next(iter(teachers)), "reward_weight": 0.0,
        "num_cpus_per_teacher": 0.5,
    }
    return cfg


def mixture(cfg: dict[str, Any], length: int, prompts: int = 100) -> dict[str, Any]:
    """The two-source task; completions may stop early (``min_new_tokens: 0``, at most ``length`` tokens): the
    addition teacher ends its answer with <eos>, and a forced tail would be 15 tokens it rates unlikely. Each source
    trains on ``prompts`` of its 100 (the rest held out)."""
    cfg = copy.deepcopy(cfg)
    cfg["data"]["init_args"]["generation"].update(min_new_tokens=0, max_new_tokens=length)
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.TaskMixture", "init_args": {"tasks": {
        "count": {"class_path": "screl.envs.CountLetter", "init_args": {"letter": "a", "holdout": 100 - prompts}},
        "add": {"class_path": "screl.envs.Addition", "init_args": {"holdout": 100 - prompts}}}}}
    cfg["grpo"]["max_num_epochs"] = 100
    return cfg


class SourceRewards:
    """Per step, the mean reward of each task source's rows (the prompt's tag is its first characters)."""

    def __init__(self) -> None:
        from screl.models import build_char_tokenizer

        tok = build_char_tokenizer()
        self.first = {"count": tok.convert_tokens_to_ids("c"), "add": tok.convert_tokens_to_ids("a")}
        self.per_step: dict[str, list[float]] = {k: [] for k in self.first}
        self.teacher_logprob: dict[str, list[float]] = {k: [] for k in self.first}
        """Distill runs: per step, the teacher's mean logprob of each source's trained tokens."""

    def callback(self) -> Any:
        from lightning.pytorch import Callback

        outer = self

        class _Probe(Callback):
            def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
                if "input_ids" not in batch:
                    return
                for source, tid in outer.first.items():
                    rows = batch["input_ids"][:, 0] == tid
                    if bool(rows.any()):
                        outer.per_step[source].append(float(batch["rewards"][rows].float().mean()))
                        if "teacher_logprobs" in batch:
                            mask = batch["token_mask"][rows].bool()
                            outer.teacher_logprob[source].append(
                                float(batch["teacher_logprobs"][rows][mask].float().mean()))

        return _Probe()


def run(name: str, cfg: dict[str, Any], work: Path, probe: SourceRewards | None = None) -> list[float]:
    """``screl fit`` in-process on ``cfg``; the reward per step (``metrics.csv``)."""
    import yaml

    from screl.cli import ScrelCLI

    settle()
    (work / name).mkdir(parents=True, exist_ok=True)
    cfg = copy.deepcopy(cfg)
    cfg["trainer"]["default_root_dir"] = str(work / name)
    path = work / name / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = ScrelCLI(args=["--config", str(path)], run=False)
    if probe is not None:
        cli.trainer.callbacks.append(probe.callback())
    t0 = time.time()
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    rewards = [r["reward"] for r in read_metrics(Path(str(cli.trainer.log_dir))) if "reward" in r]
    print(f"  {name}: reward {rewards[0]:.3f} -> {rewards[-1]:.3f} over {len(rewards)} steps ({time.time() - t0:.0f} s)")
    return rewards


def warm_student(out: Path, steps: int) -> tuple[dict[str, Any], float]:
    """The tiny policy fitted ``steps`` full-batch steps on the sums (both prompt forms), saved to ``out``: its spec
    and its teacher-forced accuracy."""
    sys.path.insert(0, str(REPO / "examples" / "distill"))
    from make_teachers import sft_addition_teacher

    accuracy = sft_addition_teacher(out, steps)
    return {"class_path": "screl.models.HFCausalLM",
            "init_args": {"path": str(out), "tokenizer_path": str(out / "tokenizer")}}, accuracy


def steps_to(rewards: list[float], target: float, window: int = 3) -> int | None:
    for i in range(window - 1, len(rewards)):
        if statistics.fmean(rewards[i - window + 1:i + 1]) >= target:
            return i + 1  # steps trained (1-based)
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50, help="steps of each count-'a' run")
    parser.add_argument("--lrs", type=lambda t: [float(x) for x in t.split(",")], default=[3e-3, 5e-4],
                        help="learning rates of the GRPO / distill pairs")
    parser.add_argument("--mix-steps", type=int, default=100)
    parser.add_argument("--mix-prompts", type=int, default=10, help="prompts each mixture source keeps (of 100)")
    parser.add_argument("--mix-length", type=int, default=8, help="max_new_tokens of the mixture runs")
    parser.add_argument("--teacher-steps", type=int, default=8)
    parser.add_argument("--target-fraction", type=float, default=0.9)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-start-steps", type=int, default=0,
                        help="supervised steps on the sums of the warm-started student (0: no warm_* runs)")
    parser.add_argument("--quick", action="store_true", help="12 steps, a smoke run")
    parser.add_argument("--out-dir", type=Path, default=RESULTS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.teacher_steps, args.mix_steps, args.lrs = 12, 4, 12, [3e-3]
    quiet()
    started, load_before = time.time(), list(os.getloadavg())
    ray_started = start_bench_ray(num_cpus=8)
    result: dict[str, Any] = {"steps": args.steps, "seed": args.seed, "target_fraction": args.target_fraction}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp)
            teacher_cfg = base(work, args.teacher_steps, args.seed)
            teacher_cfg["model"]["init_args"]["policy"] = teacher_spec("count")
            teacher_cfg["model"]["init_args"]["learning_rate"] = 0.0
            curves = {"teacher": run("teacher", teacher_cfg, work)}
            for lr in args.lrs:
                curves[f"grpo_lr{lr:g}"] = run(f"grpo_lr{lr:g}", base(work, args.steps, args.seed, lr), work)
                curves[f"distill_lr{lr:g}"] = run(f"distill_lr{lr:g}", as_distill(
                    base(work, args.steps, args.seed, lr), {"count": "count"}, {}), work)
            per_source: dict[str, dict[str, list[float]]] = {}
            teacher_lp: dict[str, dict[str, list[float]]] = {}
            teachers, routes = {"count": "count", "addition": "addition"}, {"count": "count", "add": "addition"}
            students: list[tuple[str, dict[str, Any] | None]] = [("", None)]
            if args.warm_start_steps > 0:
                warm, result["warm_start_accuracy"] = warm_student(work / "warm", args.warm_start_steps)
                result["warm_start_steps"] = args.warm_start_steps
                students.append(("warm_", warm))
            runs = [(prefix + name, estimator, student) for prefix, student in students for name, estimator in
                    (("mix_distill", ("sampled", "reverse")), ("mix_distill_top_k", ("top_k", "reverse")),
                     ("mix_distill_top_k_forward", ("top_k", "forward")), ("mix_grpo", None))]
            for name, estimator, student in runs:
                cfg = mixture(base(work, args.mix_steps, args.seed), args.mix_length, args.mix_prompts)
                if student is not None:
                    cfg["model"]["init_args"]["policy"] = student
                if estimator is not None:
                    cfg = as_distill(cfg, teachers, routes)
                    cfg["model"]["init_args"]["distillation"].update(estimator=estimator[0], top_k=16,
                                                                      kl_direction=estimator[1])
                probe = SourceRewards()
                curves[name] = run(name, cfg, work, probe)
                per_source[name] = probe.per_step
                if estimator is not None:
                    teacher_lp[name] = probe.teacher_logprob
    finally:
        stop_bench_ray(ray_started)
    teacher = statistics.fmean(curves["teacher"])
    target = args.target_fraction * teacher
    reach = {k: steps_to(v, target) for k, v in curves.items() if k.startswith(("grpo", "distill"))}
    ratios = {f"lr{lr:g}": (reach[f"distill_lr{lr:g}"] or math.inf) / (reach[f"grpo_lr{lr:g}"] or math.inf)
              if reach[f"grpo_lr{lr:g}"] else None for lr in args.lrs}
    result.update(
        teacher_reward=teacher, target_reward=target, reward_per_step=curves, steps_to_teacher=reach,
        distill_over_grpo_steps=ratios, learning_rates=args.lrs, mix_steps=args.mix_steps,
        mix_max_new_tokens=args.mix_length, mix_prompts_per_source=args.mix_prompts,
        per_source_reward_per_step=per_source, teacher_logprob_per_step=teacher_lp,
        teacher_logprob_first5_last5={run_name: {s: [statistics.fmean(v[:5]), statistics.fmean(v[-5:])]
                                                 for s, v in lps.items() if v} for run_name, lps in teacher_lp.items()},
        per_source_first5_last5={run_name: {s: [statistics.fmean(v[:5]), statistics.fmean(v[-5:])]
                                            for s, v in sources.items() if v}
                                 for run_name, sources in per_source.items()},
    )

    def report(r: dict[str, Any]) -> None:
        print_table(["run", "step 1", f"step {args.steps}", "steps to target"],
                    [[k, v[0], v[-1], r["steps_to_teacher"].get(k)] for k, v in r["reward_per_step"].items()],
                    title=f"count-'a' reward (teacher {r['teacher_reward']:.3f}; target {r['target_reward']:.3f})")
        print_table(["run", "source", "first 5 steps", "last 5 steps"],
                    [[run_name, s, a, b] for run_name, d in r["per_source_first5_last5"].items()
                     for s, (a, b) in d.items()], title="two task sources, two teachers")
        print_table(["run", "source", "first 5 steps", "last 5 steps"],
                    [[run_name, s, a, b] for run_name, d in r["teacher_logprob_first5_last5"].items()
                     for s, (a, b) in d.items()], title="the teacher's mean logprob of each source's tokens")
        print("curves (reward per step):")
        for k, v in r["reward_per_step"].items():
            print(f"  {k:12s} " + " ".join(f"{x:.2f}" for x in v))
        for run_name, d in r["per_source_reward_per_step"].items():
            for s, v in d.items():
                print(f"  {run_name}/{s:6s} " + " ".join(f"{x:.2f}" for x in v))

    finish("distill", result, args.out_dir, started, load_before, report)


if __name__ == "__main__":
    main()
