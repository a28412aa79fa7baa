"""28 scalar means over 2 ranks (gloo, CPU): one stacked all-reduce against torchmetrics metric objects.

(a) ``stacked``: each rank stacks its 28 sums and counts into one tensor, one ``all_reduce``, then divides (what
    ``screl.modules.chunk.chunk_means`` does with its four numbers).
(b) ``meanmetric``: 28 ``torchmetrics.MeanMetric(sync_on_compute=True)``, each updated with the rank's value and
    computed (each metric syncs its own states: an all-gather of every state's shape, then of the state).
(c) ``collection``: the same 28 in one ``torchmetrics.MetricCollection`` (still one sync per metric).

Each timed iteration runs one whole round (update, sync, means) on both ranks; the figure is rank 0's median over
``--iters`` after ``--warmup``. It also checks that the figures agree, and that ``ValidationMetrics`` synced over the
two ranks (each holding whole prompts) gives ``aggregate`` over all the samples.

    .venv/bin/python bench/metric_sync.py [--iters 200] [--warmup 20] [--figures 28]

Writes ``bench/results/metric_sync.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _values(rank: int, figures: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    return torch.rand(figures, generator=g, dtype=torch.float64), torch.full((figures,), 3.0 + rank, dtype=torch.float64)


def _stacked(sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    both = torch.cat([sums, counts])
    dist.all_reduce(both)
    return both[: len(sums)] / both[len(sums):]


def _metrics(figures: int) -> list[Any]:
    from torchmetrics.aggregation import MeanMetric

    return [MeanMetric(sync_on_compute=True).set_dtype(torch.float64) for _ in range(figures)]


def _meanmetric(metrics: list[Any], sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    for m, s, c in zip(metrics, sums, counts, strict=True):
        m.reset()
        m.update(s / c, weight=c)
    return torch.stack([m.compute() for m in metrics])


def _collection(coll: Any, sums: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    coll.reset()
    for i, (s, c) in enumerate(zip(sums, counts, strict=True)):
        coll[f"m{i}"].update(s / c, weight=c)
    out = coll.compute()
    return torch.stack([out[f"m{i}"] for i in range(len(sums))])


def _time(fn: Any, iters: int, warmup: int) -> tuple[float, torch.Tensor]:
    out = fn()
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _validation_check(rank: int) -> bool:
    """``ValidationMetrics`` synced over the ranks (whole prompts each) equals ``aggregate`` over every sample."""
    from screl.controller.validation import ValidationMetrics, aggregate

    samples = [{"prompt_id": p, "reward": (p * 7 + k) % 4 / 4, "response_len": p + k, "finish_reason":
                "length" if (p + k) % 3 == 0 else "stop"} for p in range(6) for k in range(4)]
    mine = [s for s in samples if s["prompt_id"] % 2 == rank]
    synced = ValidationMetrics(4, 0.5, sync_on_compute=True).update(mine).compute()
    return synced == aggregate(samples, 4, 0.5)


def _worker(rank: int, args: argparse.Namespace, port: int, out: Any) -> None:
    from torchmetrics import MetricCollection

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    sums, counts = _values(rank, args.figures)
    metrics = _metrics(args.figures)
    coll = MetricCollection({f"m{i}": m for i, m in enumerate(_metrics(args.figures))}, compute_groups=False)
    t_a, a = _time(lambda: _stacked(sums, counts), args.iters, args.warmup)
    t_b, b = _time(lambda: _meanmetric(metrics, sums, counts), args.iters, args.warmup)
    t_c, c = _time(lambda: _collection(coll, sums, counts), args.iters, args.warmup)
    agree = bool(torch.allclose(a, b, rtol=0, atol=1e-12) and torch.allclose(a, c, rtol=0, atol=1e-12))
    val_ok = _validation_check(rank)
    if rank == 0:
        out.put({"figures": args.figures, "ranks": 2, "backend": "gloo", "iters": args.iters,
                 "stacked_all_reduce_ms": t_a * 1e3, "meanmetric_sync_ms": t_b * 1e3,
                 "metric_collection_sync_ms": t_c * 1e3, "meanmetric_over_stacked": t_b / t_a,
                 "figures_agree": agree, "validation_metrics_synced_equal_aggregate": val_ok})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--figures", type=int, default=28)
    parser.add_argument("--iters", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--port", type=int, default=29531)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "metric_sync.json"))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args, args.port, queue), nprocs=2, start_method="spawn")
    result = queue.get()
    print(f"{args.figures} scalar means over 2 gloo ranks (CPU), median of {args.iters}:")
    print(f"  (a) one stacked all-reduce            {result['stacked_all_reduce_ms']:8.3f} ms")
    print(f"  (b) {args.figures} MeanMetric, synced on compute   {result['meanmetric_sync_ms']:8.3f} ms")
    print(f"  (c) one MetricCollection of them      {result['metric_collection_sync_ms']:8.3f} ms")
    print(f"  figures agree: {result['figures_agree']}; ValidationMetrics synced == aggregate: "
          f"{result['validation_metrics_synced_equal_aggregate']}")
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
