"""Shared helpers of the screl benchmarks.

* :func:`screl_config` builds a run config (a plain dict, the YAML's shape) from ``configs/grpo_tiny.yaml``
  with the scale, task, batch, completion length and sampler of a benchmark;
* :func:`run_screl` runs ``screl fit`` in-process (``ScrelCLI(run=False)`` then ``trainer.fit``) with a
  :class:`StepTimer` callback and reads the run's ``metrics.csv`` and ``events.jsonl`` into a
  :class:`ScrelRun`;
* :func:`start_bench_ray` starts one loopback Ray cluster for the whole benchmark, so that Ray's start
  (seconds) is paid once and never inside a timed window (each run still starts its own TransferQueue,
  generation workers and controller, also outside the timed window);
* statistics and output (:func:`summary`, :func:`write_result`, :func:`finish`, ...) live in ``bench/_report.py``
  and are re-exported here.

Timing (one clock, ``time.time()``, shared with the controller's event log):

* ``steady_step_s``: (end of the last step - end of the first step) / (steps - 1). A step ends when
  ``WeightSync`` has refit the generation workers (the StepTimer runs after it). Start-up and the first
  generation are outside this window: it is the steady-state cost of one RL step.
* ``window_s``: from the first ``admit`` event (the first generation starts; TransferQueue, the workers
  and the controller are already up: screl starts them at the first batch) to the end of the last step:
  every generation and every training step of the run, and nothing of the start-up. This matches the TRL
  peer's ``wall(trainer.train())``; ``samples_per_s = steps * P * G / window_s``.
"""

from __future__ import annotations

import csv
import json
import logging
import math
import os
import time
import warnings
from copy import deepcopy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench._report import (  # noqa: F401 - re-exported: the scripts call them through this module
    RESULTS,
    finish,
    machine_info,
    median,
    parse_modes,
    print_table,
    pyplot,
    save_figure,
    skip_first,
    staleness_bars,
    summary,
    write_result,
)

REPO = Path(__file__).resolve().parents[1]
TINY_CONFIG = REPO / "configs" / "grpo_tiny.yaml"

TASKS: dict[str, dict[str, Any]] = {
    "count_a": {"class_path": "screl.envs.CountLetter", "init_args": {"letter": "a"}},
    "add": {"class_path": "screl.envs.Addition", "init_args": {}},
}
NUM_PROMPTS = 100  # the arithmetic prompt set of both tasks (and of the TRL peer)


def quiet() -> None:
    """Keep the benchmark's output to its own tables (Lightning/Ray/TQ info lines off)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    warnings.filterwarnings("ignore")
    import lightning.pytorch  # noqa: F401 - sets its loggers' levels at import: override them after

    for name in ("lightning", "lightning.pytorch", "lightning.fabric", "pytorch_lightning", "ray",
                 "transfer_queue", "screl"):
        logging.getLogger(name).setLevel(logging.ERROR)


def start_bench_ray(num_cpus: int = 6) -> bool:
    """Start the loopback Ray cluster every run of this process joins (``screl`` then leaves it running)."""
    from screl.dataplane import start_local_ray

    return start_local_ray(num_cpus=num_cpus, namespace="screl-bench")


def stop_bench_ray(started: bool) -> None:
    from screl.dataplane import stop_ray_if_started

    stop_ray_if_started(started)


# ------------------------------------------------------------------------------------------ config
SAMPLERS: dict[str, dict[str, Any]] = {
    "sync": {"name": "in_order", "max_lookahead_versions": 0},
    "async_w1": {"name": "in_order", "max_lookahead_versions": 1},
    "async_w2": {"name": "in_order", "max_lookahead_versions": 2},
    "windowed": {"name": "windowed", "max_staleness_versions": 1, "sample_freshest_first": True,
                 "over_sampling_ratio": 2.0},
}


def screl_config(
    *,
    run_dir: Path,
    steps: int,
    sampler: dict[str, Any],
    scale: str = "tiny",
    task: str = "count_a",
    prompts_per_step: int = 8,
    group: int = 4,
    completion_len: int = 16,
    min_groups: int | None = None,
    threads: int | None = 1,
    learning_rate: float = 3e-3,
    seed: int = 0,
    backend: str = "torch",
) -> dict[str, Any]:
    """A run config (the YAML as a dict): ``configs/grpo_tiny.yaml`` with the benchmark's settings
    (``backend``: the generation backend, ``torch`` or ``vllm``).

    Completions have a fixed length (``min_new_tokens = max_new_tokens = completion_len``). The buffer
    and in-flight bounds are ``P x (window + 1)`` groups, as in ``configs/samplers/*.yaml``.
    """
    import yaml

    cfg: dict[str, Any] = yaml.safe_load(TINY_CONFIG.read_text())
    window = int(sampler.get("max_lookahead_versions", sampler.get("max_staleness_versions", 0)))
    batches_per_epoch = NUM_PROMPTS // prompts_per_step
    epochs = math.ceil((steps + window + 2) / batches_per_epoch) + 1
    cfg["seed_everything"] = seed
    cfg["trainer"].update(
        max_steps=steps, default_root_dir=str(run_dir), enable_progress_bar=False, enable_model_summary=False,
        log_every_n_steps=1, enable_checkpointing=False,
    )
    model = cfg["model"]["init_args"]
    model["policy"] = {"class_path": "screl.models.TinyCausalLM", "init_args": {"scale": scale}}
    model["learning_rate"] = learning_rate
    data = cfg["data"]["init_args"]
    data["task"] = deepcopy(TASKS[task])
    data["generation"].update(max_new_tokens=completion_len, min_new_tokens=completion_len, num_threads=threads,
                              num_workers=1, max_batch_size=max(64, prompts_per_step * group), backend=backend)
    data["train_num_threads"] = threads  # None: screl's automatic budget (see screl.threads)
    data["step_timeout_s"] = 300
    data["seed"] = seed
    cfg["grpo"].update(num_prompts_per_step=prompts_per_step, num_generations_per_prompt=group,
                       max_num_epochs=epochs, max_num_steps=steps)
    bound = prompts_per_step * (window + 1)
    cfg["async_rl"] = {
        "sampler": deepcopy(sampler),
        "min_groups_for_streaming_train": min_groups if min_groups is not None else prompts_per_step,
        "max_inflight_prompts": bound,
        "max_buffered_rollouts": bound,
    }
    cfg["data_plane"] = {"enabled": True, "backend": "simple"}
    return cfg


# ------------------------------------------------------------------------------------------ running
MACHINE = "_machine"


def cpu_snapshot() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process and its descendants, by role.

    Roles: ``trainer`` (this process: the train pump), one per Ray actor class (``GenerationWorker``,
    ``RolloutController``, ``TransferQueueController``, ``SimpleStorageUnit``, ...; from the ``ray::Class``
    process title), and ``ray_system`` (raylet, GCS, Ray's helpers); ``_machine`` is the whole machine's
    busy CPU time (all processes, ours and other jobs').
    """
    import psutil

    me = psutil.Process()
    out: dict[str, float] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            t = proc.cpu_times()
            cmd = " ".join(proc.cmdline()[:1])
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        role = process_role(cmd, root=proc.pid == me.pid)
        out[role] = out.get(role, 0.0) + t.user + t.system
    m = psutil.cpu_times()  # the whole machine, every CPU: what other jobs take shows up here
    out[MACHINE] = m.user + m.nice + m.system + getattr(m, "irq", 0.0) + getattr(m, "softirq", 0.0) + getattr(
        m, "steal", 0.0)
    return out


def process_role(cmd: str, root: bool) -> str:
    """``trainer`` for the tree's root, the actor class of a ``ray::Class`` process, else ``ray_system``."""
    if root:
        return "trainer"
    if cmd.startswith("ray::"):
        return cmd[5:].split(".")[0].split()[0] or "ray_worker"
    return "ray_system"


def settle(max_s: float = 6.0, busy_cores: float = 0.1, interval_s: float = 0.5) -> float:
    """Wait until this process tree is quiet (the last run's actors gone, Ray's worker pool refilled).

    Returns the seconds waited: at most ``max_s``, until the tree used under ``busy_cores`` cores over an
    ``interval_s`` window. Every timed run starts after it, so a run does not pay for its predecessor.
    """
    t0 = time.time()
    prev = sum(v for k, v in cpu_snapshot().items() if k != MACHINE)
    while time.time() - t0 < max_s:
        time.sleep(interval_s)
        cur = sum(v for k, v in cpu_snapshot().items() if k != MACHINE)
        if cur - prev < busy_cores * interval_s:
            break
        prev = cur
    return time.time() - t0


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0) > 0}


def _timer_callback(steps: int) -> Any:
    from lightning.pytorch import Callback

    class StepTimer(Callback):
        """Wall-clock (``time.time()``) of ``on_train_start`` and of the end of every RL step (after refit)."""

        def __init__(self) -> None:
            self.train_start: float | None = None
            self.step_ends: list[float] = []
            self.cpu_first: dict[str, float] = {}
            self.cpu_last: dict[str, float] = {}

        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            self.train_start = time.time()

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if isinstance(batch, dict) and batch.get("last_chunk"):
                # snapshots stay outside the steady window: before the first step's end, after the last's
                if not self.step_ends:
                    self.cpu_first = cpu_snapshot()
                self.step_ends.append(time.time())
                if len(self.step_ends) == steps:
                    self.cpu_last = cpu_snapshot()

    return StepTimer()


@dataclass
class ScrelRun:
    """What one screl run measured (times in seconds; per-step lists indexed by step)."""

    name: str
    steps: int
    rows_per_step: int
    completion_len: int
    steady_step_s: float
    window_s: float
    step_ends: list[float]
    window_start: float
    train_step_s: list[float] = field(default_factory=list)
    wait_s: list[float] = field(default_factory=list)
    gen_span_s: list[float] = field(default_factory=list)
    group_generation_s: list[float] = field(default_factory=list)
    refit_s: list[float] = field(default_factory=list)
    reward: list[float] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    evicted: int = 0
    aborted: int = 0
    run_dir: str = ""
    cpu_s_per_step: dict[str, float] = field(default_factory=dict)
    """CPU seconds per steady-state step of each process role (see :func:`cpu_snapshot`)."""
    own_cores: float = float("nan")
    """Cores this run's processes kept busy on average over the steady window."""
    other_cores: float = float("nan")
    """Cores everything else on the machine (other jobs) kept busy over the same window."""

    @property
    def samples_per_s(self) -> float:
        return self.steps * self.rows_per_step / self.window_s

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.completion_len

    @property
    def steady_samples_per_s(self) -> float:
        return self.rows_per_step / self.steady_step_s

    def reward_by_time(self) -> list[float]:
        """Seconds since the window start at which each step ended."""
        return [t - self.window_start for t in self.step_ends]


def read_metrics(run_dir: Path) -> list[dict[str, float]]:
    rows: list[dict[str, float]] = []
    path = run_dir / "metrics.csv"
    if not path.exists():
        return rows
    with path.open() as fh:
        for row in csv.DictReader(fh):
            rows.append({k: float(v) for k, v in row.items() if v not in ("", None)})
    return rows


def read_events(run_dir: Path) -> list[dict[str, Any]]:
    out = []
    with (run_dir / "events.jsonl").open() as fh:
        for line in fh:
            line = line.strip()
            if line:
                out.append(json.loads(line))
    return out


def run_screl(name: str, cfg: dict[str, Any], work_dir: Path, settle_first: bool = True) -> ScrelRun:
    """Run ``screl fit`` in-process on ``cfg`` and read back what it measured (``settle_first``: wait for this
    process tree to go quiet first; a fresh process of its own, timed from its start, leaves it off)."""
    import yaml

    from screl.cli import ScrelCLI

    if settle_first:
        settle()
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli = ScrelCLI(args=["--config", str(path)], run=False)
    steps = int(cfg["grpo"]["max_num_steps"])
    timer = _timer_callback(steps)
    trainer: Any = cli.trainer
    trainer.callbacks.append(timer)
    trainer.fit(cli.model, datamodule=cli.datamodule)
    run_dir = Path(str(trainer.log_dir))
    if len(timer.step_ends) != steps:
        raise RuntimeError(f"{name}: expected {steps} steps, the trainer ran {len(timer.step_ends)} ({run_dir})")
    run = summarise(name, cfg, run_dir, timer.train_start, timer.step_ends)
    if steps > 1:
        delta = cpu_delta(timer.cpu_first, timer.cpu_last)
        machine = delta.pop(MACHINE, float("nan"))
        span = timer.step_ends[-1] - timer.step_ends[0]
        run.cpu_s_per_step = {k: v / (steps - 1) for k, v in delta.items()}
        run.own_cores = sum(delta.values()) / span
        run.other_cores = max(0.0, machine - sum(delta.values())) / span
    return run


def summarise(
    name: str, cfg: dict[str, Any], run_dir: Path, train_start: float | None, step_ends: list[float]
) -> ScrelRun:
    events = read_events(run_dir)
    reserve: dict[str, dict[str, Any]] = {}
    commit: dict[str, dict[str, Any]] = {}
    steps_ev: list[dict[str, Any]] = []
    refit_s: list[float] = []
    evicted = aborted = 0
    for e in events:
        kind = e["event"]
        if kind == "reserve":
            reserve[e["group_id"]] = e
        elif kind == "commit":
            commit[e["group_id"]] = e
        elif kind == "train_step":
            steps_ev.append(e)
        elif kind == "refit" and "refit_s" in e:
            refit_s.append(float(e["refit_s"]))
        elif kind == "evict":
            evicted += 1
        elif kind == "abort":
            aborted += 1
    # The rollout side starts at the first batch (after on_train_start): the window opens with the first
    # admit, when TransferQueue, the workers and the controller are up and the first generation begins.
    first = min((float(e["time"]) for e in events if e["event"] in ("admit", "reserve")), default=float("nan"))
    window_start = first if not math.isnan(first) else float(train_start or step_ends[0])
    gen_span: list[float] = []
    reward: list[float] = []
    staleness: list[int] = []
    for e in sorted(steps_ev, key=lambda x: x["step"]):
        gids = e["group_ids"]
        starts = [float(reserve[g]["time"]) for g in gids if g in reserve]
        ends = [float(commit[g]["time"]) for g in gids if g in commit]
        if starts and ends:
            gen_span.append(max(ends) - min(starts))
        rs = [float(commit[g]["reward_mean"]) for g in gids if g in commit and "reward_mean" in commit[g]]
        reward.append(sum(rs) / len(rs) if rs else float("nan"))
        staleness.extend(int(e["step"]) - int(reserve[g]["start_weight"]) for g in gids if g in reserve)
    metrics = read_metrics(run_dir)
    train_step_s = [r["time/train_step_s"] for r in metrics if "time/train_step_s" in r]
    wait_s: list[float] = []
    acc = 0.0
    for r in metrics:  # rows are chunks in order; the step-closing chunk carries time/train_step_s
        acc += r.get("rollout/wait_s", 0.0)
        if "time/train_step_s" in r:
            wait_s.append(acc)
            acc = 0.0
    steps = len(step_ends)
    rows = int(cfg["grpo"]["num_prompts_per_step"]) * int(cfg["grpo"]["num_generations_per_prompt"])
    steady = (step_ends[-1] - step_ends[0]) / (steps - 1) if steps > 1 else step_ends[-1] - window_start
    return ScrelRun(
        name=name,
        steps=steps,
        rows_per_step=rows,
        completion_len=int(cfg["data"]["init_args"]["generation"]["max_new_tokens"]),
        steady_step_s=steady,
        window_s=step_ends[-1] - window_start,
        step_ends=step_ends,
        window_start=window_start,
        train_step_s=train_step_s,
        wait_s=wait_s,
        gen_span_s=gen_span,
        group_generation_s=[float(c["generation_s"]) for c in commit.values() if "generation_s" in c],
        refit_s=refit_s,
        reward=reward,
        staleness=staleness,
        evicted=evicted,
        aborted=aborted,
        run_dir=str(run_dir),
    )
