"""Time to first step: ``screl fit`` launch -> its first ``train_step`` event, side by side with the TRL peer's
launch -> end of its first step, alternated over ``--reps`` repetitions, medians printed.

    python bench/startup.py [--reps 3] [--steps 2]

screl: a fresh ``screl fit --config configs/grpo_tiny.yaml`` subprocess (Ray, TransferQueue, workers and the
controller all start inside the timed window), P=8 G=4 L=16, ``--steps`` steps. TRL: ``bench/trl_peer.py``
(``$SCREL_TRL_PEER`` or ``bench/trl_peer.py``) at the same shape; its launch -> first step is the
subprocess's wall time less its ``trainer.train()`` wall time plus its first step (what follows the last step,
writing one JSON file, is left in: a few milliseconds). Writes ``bench/results/startup.json`` (``ratio``, also
under ``first_step_over_trl``: screl's median / TRL's; ``cpu_s_to_first_step``: the median CPU-seconds each kind of
process, the driver, Ray's services and each actor class, spent from the launch to the first step). The
repository's own bytecode is compiled first (``bytecode_compiled``; see :func:`compile_bytecode`). It also times
``screl check --config configs/grpo_tiny.yaml`` (``check_s``, median of ``--reps``) beside its floor: a bare
Python, ``import torch`` and ``import lightning.pytorch`` in fresh processes (``import_floor_s``), which every
``screl check`` pays before it reads a line of config.

``phases_s`` splits screl's launch -> first step at the run's own start-up lines (stderr, timed as they arrive):
``driver`` (launch -> the rollout side starts at the first batch: imports, the config, the model, Lightning's
set-up), ``fleet`` (-> the generation workers and the controller are ready: their processes boot and import, the
weights load; TransferQueue starts meanwhile) and ``first_rollout_and_step``. ``cpu_floor_s`` is the CPU-seconds to
the first step over the cores this process may use: no overlap of the processes brings the first step below it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]


BOOT = "ray-worker-boot"
"""A Ray worker process from its exec to the moment an actor's class names it (``ray::IDLE`` meanwhile): Python's and
Ray's start, then the imports of the actor's module."""


ZYGOTE = "worker-zygote"
"""The cluster's worker zygote (``screl.dataplane.worker_zygote``): the imports every forked Ray worker shares."""
ZYGOTE_NAME = "screl-zygote"
"""A worker zygote's process name (``/proc/PID/comm``): one forked from ``screl fit`` has the driver's command line."""
STAND_IN = "ray-worker-stand-in"
"""The raylet's process for a forked worker (``screl.dataplane.ray_worker``)."""


def _kind(cmdline: list[str], name: str = "") -> str:
    """A process's kind: a Ray actor's class (``ray::GenerationWorker.update_weights`` -> ``GenerationWorker``, a
    named one's ``ray::screl-generation-0-7:GenerationWorker.generate`` too), ``BOOT`` for a Ray worker that hosts
    no actor yet, a Ray service's program, or ``driver``."""
    title = cmdline[0] if cmdline else "?"
    args = " ".join(cmdline)
    if title == "ray::IDLE" or "default_worker.py" in args:  # its --raylet-name argument must not make it a raylet
        return BOOT
    if title.startswith("ray::"):
        return title[5:].split(".")[0].split(":")[-1].strip()
    if "worker_zygote" in args or name == ZYGOTE_NAME:  # a forked worker carries it until Ray titles it ray::IDLE
        return ZYGOTE
    if "ray_worker.py" in args:
        return STAND_IN
    for part in ("gcs_server", "raylet", "dashboard_agent", "dashboard.py", "log_monitor", "monitor.py",
                 "runtime_env_agent"):
        if part in args:
            return part
    return "driver" if "screl.cli" in args else Path(title).name


def _first_step_time(work: Path) -> float | None:
    for events in work.rglob("events.jsonl"):
        for line in events.read_text().splitlines():
            if '"train_step"' in line:
                return float(json.loads(line)["time"])
    return None


def await_first_step(proc: subprocess.Popen[Any], work: Path, tick: Callable[[], None] = lambda: None) -> float | None:
    """The time of the first ``train_step`` event ``proc`` (a ``screl fit`` logging under ``work``) logs, polled every
    0.1 s (``tick`` runs at each poll) until it appears or ``proc`` ends; waits for ``proc`` to end. None: no step."""
    first = None
    while proc.poll() is None and first is None:
        tick()
        first = _first_step_time(work)
        time.sleep(0.1)
    proc.wait()
    return first if first is not None else _first_step_time(work)


def tiny_config(work: Path, steps: int) -> Path:
    """``configs/grpo_tiny.yaml`` for ``steps`` steps logging under ``work``, written there; its path."""
    cfg = yaml.safe_load((REPO / "configs" / "grpo_tiny.yaml").read_text())
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(work), enable_progress_bar=False)
    cfg["grpo"]["max_num_steps"] = steps
    path = work / "config.yaml"
    work.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg))
    return path


PHASE_LINES = (("driver", "screl: Ray "), ("fleet", " and the controller ready in "))
"""The start-up lines that end each phase but the last (``screl.controller.runtime``'s ``screl.startup`` log)."""


def _time_lines(stream: Any, t0: float, seen: dict[str, float], tail: list[str]) -> None:
    """Read ``stream`` to its end: the time (since ``t0``) each of :data:`PHASE_LINES` first appears; the lines."""
    for line in stream:
        tail.append(line)
        for phase, text in PHASE_LINES:
            if phase not in seen and text in line:
                seen[phase] = time.time() - t0


def _phases(seen: dict[str, float], first_s: float) -> dict[str, float]:
    """The phases' lengths from the times their ends were seen (see the module)."""
    missing = [text for phase, text in PHASE_LINES if phase not in seen]
    if missing:
        raise RuntimeError(f"screl fit did not print its start-up lines containing {missing}")
    driver, fleet = seen["driver"], seen["fleet"]
    return {"driver": round(driver, 2), "fleet": round(fleet - driver, 2),
            "first_rollout_and_step": round(first_s - fleet, 2)}


def screl_first_step(steps: int, work: Path) -> tuple[float, dict[str, float], int, dict[str, float]]:
    """Launch -> first ``train_step`` event; the CPU-seconds each kind of process spent until then (sampled
    every 0.1 s over the ``screl fit`` process and everything it started: Ray's services, the actors); and its
    phases (see the module)."""
    import psutil

    path = tiny_config(work, steps)
    t0 = time.time()
    proc = psutil.Popen([sys.executable, "-m", "screl.cli", "fit", "--config", str(path)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    seen: dict[str, float] = {}
    lines: list[str] = []
    reader = threading.Thread(target=_time_lines, args=(proc.stderr, t0, seen, lines), daemon=True)
    reader.start()
    cpu: dict[int, tuple[str, float]] = {}

    def sample_cpu() -> None:
        try:
            family = [proc, *proc.children(recursive=True)]
        except psutil.Error:  # the launch has ended
            return
        for p in family:
            try:
                times = p.cpu_times()
                cpu[p.pid] = (_kind(p.cmdline(), p.name()), times.user + times.system)
            except psutil.Error:
                pass

    first = await_first_step(proc, work, sample_cpu)
    reader.join()
    if proc.returncode != 0:
        raise RuntimeError(f"screl fit failed:\n{''.join(lines)[-3000:]}")
    if first is None:
        raise RuntimeError(f"screl fit logged no train_step under {work}")
    per_kind: dict[str, float] = {}
    for kind, seconds in cpu.values():
        per_kind[kind] = round(per_kind.get(kind, 0.0) + seconds, 2)
    return first - t0, dict(sorted(per_kind.items(), key=lambda kv: -kv[1])), len(cpu), _phases(seen, first - t0)


def trl_first_step(peer: Path, steps: int, out: Path) -> float:
    cmd = [sys.executable, str(peer), "--task", "count_a", "--steps", str(steps), "--scale", "tiny",
           "--prompts-per-step", "8", "--group", "4", "--completion-len", "16", "--no-gradient-checkpointing",
           "--out", str(out)]
    t0 = time.time()
    proc = subprocess.run(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), capture_output=True, text=True,
                          check=False)
    elapsed = time.time() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"trl_peer failed:\n{proc.stderr[-3000:]}")
    d = json.loads(out.read_text())
    return elapsed - float(d["wall_s_train"]) + float(d["first_step_time_s"])


def _wall(cmd: list[str]) -> float:
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=REPO)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return time.time() - t0


def check_times(reps: int) -> dict[str, Any]:
    """``screl check`` of the tiny config, and the imports it cannot avoid, each in a fresh process."""
    check = [_wall([sys.executable, "-m", "screl.cli", "check", "--config", "configs/grpo_tiny.yaml"])
             for _ in range(reps)]
    floor = {name: statistics.median(_wall([sys.executable, "-c", code]) for _ in range(reps))
             for name, code in (("python", "pass"), ("torch", "import torch"),
                                ("lightning", "import lightning.pytorch"))}
    return {"check_s": check, "check_median_s": statistics.median(check), "import_floor_s": floor}


BYTECODE_DIRS = ("screl", "callbacks", "strategies")


def compile_bytecode() -> bool:
    """The repository's own bytecode, written before the launches are timed, as TRL's (pip compiled it at install)
    and as ``.ci/run`` does: where ``PYTHONDONTWRITEBYTECODE`` is set (this machine kind sets it) an editable
    install's modules are otherwise compiled again by every process, the driver and each Ray worker alike. A user's
    second run has it. Returns whether every file compiled."""
    proc = subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *BYTECODE_DIRS], cwd=REPO,
                          capture_output=True, text=True, check=False)
    return proc.returncode == 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    env_peer = os.environ.get("SCREL_TRL_PEER")
    peer = Path(env_peer) if env_peer else REPO / "bench" / "trl_peer.py"
    if not peer.is_file():
        raise SystemExit(f"startup: the TRL peer is missing at {peer} (set $SCREL_TRL_PEER)")
    compiled = compile_bytecode()
    screl, trl, breakdowns, counts, phases = [], [], [], [], []
    with tempfile.TemporaryDirectory(prefix="screl-startup-") as tmp:
        for rep in range(args.reps):  # alternated, so drift hits both sides alike
            seconds, per_kind, processes, phase = screl_first_step(args.steps, Path(tmp) / f"screl{rep}")
            screl.append(seconds)
            counts.append(processes)
            breakdowns.append(per_kind)
            phases.append(phase)
            trl.append(trl_first_step(peer, args.steps, Path(tmp) / f"trl{rep}.json"))
            print(f"rep {rep}: screl {screl[-1]:.1f} s ({phase}), TRL {trl[-1]:.1f} s; CPU-s to the first step: "
                  f"{per_kind}", flush=True)
    kinds = sorted({k for b in breakdowns for k in b})
    res: dict[str, Any] = {"screl_s": screl, "trl_s": trl, "screl_median_s": statistics.median(screl),
           "trl_median_s": statistics.median(trl),
           "phases_s": {p: statistics.median(ph[p] for ph in phases) for p in phases[0]},
           "cpu_s_to_first_step": {k: statistics.median(b.get(k, 0.0) for b in breakdowns) for k in kinds},
           "processes_to_first_step": statistics.median(counts)}
    res["cpu_s_to_first_step_total"] = round(sum(res["cpu_s_to_first_step"].values()), 2)
    res["cores"] = len(os.sched_getaffinity(0))
    res["cpu_floor_s"] = round(res["cpu_s_to_first_step_total"] / res["cores"], 2)
    res["first_step_target_s"] = round(1.5 * res["trl_median_s"], 2)  # issue 52: at most 1.5x TRL's
    res.update(check_times(args.reps))
    res["bytecode_compiled"] = compiled
    res["ratio"] = res["screl_median_s"] / res["trl_median_s"]
    res["first_step_over_trl"] = res["ratio"]  # the key issue 19's targets name (target <= 1.0)
    out = REPO / "bench" / "results" / "startup.json"
    out.write_text(json.dumps(res, indent=1))
    print(f"time to first step (median of {args.reps}): screl {res['screl_median_s']:.1f} s {res['phases_s']}, TRL "
          f"{res['trl_median_s']:.1f} s, screl / TRL = {res['ratio']:.2f} (CPU floor {res['cpu_floor_s']:.1f} s on "
          f"{res['cores']} cores); screl check {res['check_median_s']:.1f} s (import floor: {res['import_floor_s']}) "
          f"-> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
