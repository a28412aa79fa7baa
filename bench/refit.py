"""Refit memory: the peak resident set of a generation worker while it loads new weights, SmolLM2-135M-Instruct
(fp32, 538 MB), on the torch engine and on vLLM's CPU build, before and after buckets stayed buckets.

    python bench/refit.py                       # both engines, before and after (about 4 minutes here)
    python bench/refit.py --engines torch       # one engine
    python bench/refit.py --sides after         # skip the before side

Each (engine, side) runs in its own process, as the real path does: a loopback Ray cluster, one
``GenerationWorker`` actor (backend ``torch`` or ``vllm``), the weights put into the object store one bucket of
``generation.refit_bucket_mb`` (64 MiB) at a time as ``WeightSync`` sends them (``RolloutRuntime.complete_step``'s
way; numpy ``WireBucket`` objects after the change, torch tensors before), and
``worker.update_weights(refs, version)``. A first refit warms the path up; the second is measured.

- ``after``: screl in this tree (the worker streams buckets, the engines load each in place).
- ``before``: screl at ``--before-rev`` (default ``e0c5a7a``, the last commit before the change), checked out in a
  git worktree and put first on ``PYTHONPATH`` for the bench process and its Ray workers: the worker awaited every
  bucket, merged them into one state dict, and the vLLM engine serialized it as one safetensors blob.

Memory: for the worker process and, on vLLM, every process below it (the EngineCore, which holds the model), the
peak resident set over the measured refit (``VmHWM`` after resetting it through ``/proc/<pid>/clear_refs``) less the
resident set just before it. ``refit_peak_over_model_<engine>`` is the sum of those over the processes, over the
model's bytes (an upper bound: the processes need not peak at once); target <= 1.3. Time: the measured refit's
wall time (from the driver: pause, load, label, resume), per MB of the model. Memory figures are robust to other
load on the machine, times are not: run it on a quiet machine.

The vLLM side runs under ``.venv-vllm/bin/python`` (vLLM's CPU build lives there; ``--vllm-python``), the torch side
under this interpreter. Writes ``bench/results/refit.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BEFORE_REV = "e0c5a7a"
BUCKET_MB = 64.0
TARGET = 1.3
ENGINES = ("torch", "vllm")
SIDES = ("before", "after")


# -- one (engine, side), in its own process -----------------------------------------------------------------------


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/{pid}/status has no {field}")


def _descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (the vLLM EngineCore and anything it started)."""
    out: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").iterdir():
            children = (task / "children").read_text().split()
            out.extend(int(c) for c in children)
            todo.extend(int(c) for c in children)
    return sorted(set(out))


def run_one(engine: str, threads: int) -> dict[str, Any]:
    import ray

    import screl
    from screl.models import SmolLM2
    from screl.rollout.engines import buckets
    from screl.rollout.engines.buckets import iter_buckets
    from screl.rollout.engines.protocol import EngineOptions
    from screl.rollout.worker import GenerationWorker

    spec = SmolLM2()
    spec.ensure_converted()
    state = spec.build_model().state_dict()
    model_bytes = sum(t.numel() * t.element_size() for t in {t.data_ptr(): t for t in state.values()}.values())
    ray.init(num_cpus=4, include_dashboard=False, namespace="screl-bench-refit", _node_ip_address="127.0.0.1",
             object_store_memory=2 * 2**30, log_to_driver=False)
    try:
        where = ray.get(ray.remote(lambda: screl.__file__).remote())
        worker: Any = ray.remote(GenerationWorker).options(num_cpus=1, max_concurrency=8).remote(
            spec, backend=engine, options=EngineOptions(num_threads=threads, seed=0))
        pid = int(ray.get(worker.pid.remote(), timeout=600))

        to_wire = getattr(buckets, "bucket_to_wire", lambda b: b)  # what WeightSync puts (before: torch buckets)

        def refs(scale: float) -> list[Any]:  # the trainer's way: one bucket in the object store at a time
            return [ray.put(to_wire(b)) for b in iter_buckets(((k, v * scale) for k, v in state.items()),
                                                              int(BUCKET_MB * 2**20))]

        ray.get(worker.update_weights.remote(refs(1.0), 1), timeout=600)  # warm-up refit
        weights = refs(1.001)
        time.sleep(2.0)
        pids = [pid, *_descendants(pid)]
        idle = {p: _status_kb(p, "VmRSS") for p in pids}
        for p in pids:
            Path(f"/proc/{p}/clear_refs").write_text("5")  # VmHWM := VmRSS
        t0 = time.perf_counter()
        ray.get(worker.update_weights.remote(weights, 2), timeout=600)
        refit_s = time.perf_counter() - t0
        peak = {p: _status_kb(p, "VmHWM") for p in pids}
        names = {p: Path(f"/proc/{p}/comm").read_text().strip() for p in pids}
        version = ray.get(worker.version.remote())
        assert version == 2, version
    finally:
        ray.shutdown()
    procs = {f"{names[p]}[{p}]{' (worker)' if p == pid else ''}": {
        "idle_rss_mb": idle[p] / 1024, "peak_rss_mb": peak[p] / 1024, "peak_above_idle_mb": (peak[p] - idle[p]) / 1024,
    } for p in pids}
    above = sum(max(0, peak[p] - idle[p]) for p in pids) * 1024
    model_mb = model_bytes / 2**20
    return {"engine": engine, "screl": where, "model_mb": model_mb, "bucket_mb": BUCKET_MB,
            "peak_above_idle_mb": above / 2**20, "refit_peak_over_model": above / model_bytes,
            "refit_s": refit_s, "refit_ms_per_mb": 1000 * refit_s / model_mb, "processes": procs}


# -- the driver --------------------------------------------------------------------------------------------------


def _worktree(rev: str) -> Path:
    """A checkout of ``rev`` (reused when present)."""
    path = Path("/tmp") / f"screl-refit-{rev}"
    if not (path / "screl").is_dir():
        subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "--force", str(path), rev],
                       check=True, capture_output=True)
    return path


def measure(engine: str, side: str, python: str, before_rev: str, threads: int) -> dict[str, Any]:
    src = REPO if side == "after" else _worktree(before_rev)
    env = dict(os.environ, PYTHONPATH=str(src), MALLOC_MMAP_THRESHOLD_="131072", TOKENIZERS_PARALLELISM="false",
               PYTHONWARNINGS="ignore", OMP_NUM_THREADS=str(threads))
    cmd = [python, str(Path(__file__).resolve()), "--one", engine, "--threads", str(threads)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=str(src), check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{engine}/{side} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    if not result["screl"].startswith(str(src)):
        raise RuntimeError(f"{engine}/{side}: the worker imported screl from {result['screl']}, not {src}")
    result["rev"] = before_rev if side == "before" else _head()
    print(f"  {engine:5s} {side:6s}: peak above idle {result['peak_above_idle_mb']:7.0f} MB "
          f"= {result['refit_peak_over_model']:.2f} x the model, refit {result['refit_s']:.2f} s "
          f"({result['refit_ms_per_mb']:.2f} ms/MB)", flush=True)
    return result


def _head() -> str:
    out = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--", "screl"], capture_output=True,
                           text=True).stdout.strip()
    return out.stdout.strip() + ("+dirty" if dirty else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--one", choices=ENGINES, help=argparse.SUPPRESS)
    parser.add_argument("--engines", default=",".join(ENGINES))
    parser.add_argument("--sides", default=",".join(SIDES))
    parser.add_argument("--before-rev", default=BEFORE_REV)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    parser.add_argument("--out-dir", type=Path, default=REPO / "bench" / "results")
    args = parser.parse_args()
    if args.one:  # one measurement, one JSON line
        print(json.dumps(run_one(args.one, args.threads)))
        return
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _report import finish

    started, load = time.time(), list(os.getloadavg())
    runs: dict[str, dict[str, Any]] = {}
    for engine in args.engines.split(","):
        python = args.vllm_python if engine == "vllm" else sys.executable
        for side in args.sides.split(","):
            runs[f"{engine}_{side}"] = measure(engine, side, python, args.before_rev, args.threads)
    result: dict[str, Any] = {"target": TARGET}
    for engine in args.engines.split(","):
        if f"{engine}_after" in runs:
            result[f"refit_peak_over_model_{engine}"] = runs[f"{engine}_after"]["refit_peak_over_model"]
            result[f"refit_ms_per_mb_{engine}"] = runs[f"{engine}_after"]["refit_ms_per_mb"]
        if f"{engine}_before" in runs:
            result[f"refit_peak_over_model_{engine}_before"] = runs[f"{engine}_before"]["refit_peak_over_model"]
            result[f"refit_ms_per_mb_{engine}_before"] = runs[f"{engine}_before"]["refit_ms_per_mb"]
    after = [v for k, v in result.items() if k.startswith("refit_peak_over_model_") and not k.endswith("_before")]
    if after:
        result["refit_peak_over_model"] = max(after)
    result["runs"] = runs
    result["settings"] = {"model": "SmolLM2-135M-Instruct fp32", "bucket_mb": BUCKET_MB, "threads": args.threads,
                          "before_rev": args.before_rev}
    finish("refit", result, args.out_dir, started, load, _report)


def _report(result: dict[str, Any]) -> None:
    for name, run in result["runs"].items():
        procs = ", ".join(f"{k} {v['peak_above_idle_mb']:.0f} MB" for k, v in run["processes"].items())
        print(f"{name:13s} {run['refit_peak_over_model']:.2f} x model ({procs}); {run['refit_ms_per_mb']:.2f} ms/MB")
    print(f"refit_peak_over_model = {result.get('refit_peak_over_model')} (target <= {TARGET})")


if __name__ == "__main__":
    main()
