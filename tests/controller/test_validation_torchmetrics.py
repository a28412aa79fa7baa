"""The ``val/*`` figures as torchmetrics states: each worker's share of a validation (whole prompts) aggregated on its
own and merged (or synced over ranks) gives exactly the figures of all the samples at once."""

from __future__ import annotations

import os
import pickle
import socket
from typing import Any

import pytest
import torch

from screl.controller.validation import ValidationMetrics, aggregate, aggregate_shares


def _prompt(pid: int, rewards: list[float], lens: list[int], truncated: list[bool]) -> list[dict[str, Any]]:
    return [{"prompt_id": pid, "sample": k, "reward": r, "response_len": n, "finish_reason": "length" if t else "stop"}
            for k, (r, n, t) in enumerate(zip(rewards, lens, truncated, strict=True))]


P1 = _prompt(1, [1.0, 0.0, 0.5, 1.0], [4, 8, 2, 6], [True, False, False, False])  # 3 of 4 pass (>= 0.5)
P2 = _prompt(2, [0.25, 0.25, 0.75, 0.0], [3, 3, 3, 3], [False, True, False, False])  # 1 of 4
P3 = _prompt(3, [0.0, 0.0, 0.0, 0.0], [1, 1, 1, 1], [False] * 4)  # none
WORKER_A, WORKER_B = P1 + P3, P2  # ValidationRunner's round-robin of whole prompts over two workers
BY_HAND = {
    "val/reward_mean": 3.75 / 12, "val/response_length": 36 / 12, "val/truncated_fraction": 2 / 12,
    "val/prompts": 3.0,
    "val/pass@1": (3 / 4 + 1 / 4 + 0) / 3,  # per prompt c / n
    "val/pass@4": (1 + 1 + 0) / 3,  # a prompt with any pass
}


def test_two_workers_partial_states_merged_give_the_figures_of_all_samples_exactly() -> None:
    at_once = aggregate(WORKER_A + WORKER_B, num_samples=4, pass_threshold=0.5)
    assert at_once == BY_HAND
    a = ValidationMetrics(4, 0.5).update(WORKER_A)
    b_states = pickle.loads(pickle.dumps(ValidationMetrics(4, 0.5).update(WORKER_B).states()))  # as over Ray
    assert a.compute()["val/prompts"] == 2.0 and a.compute()["val/pass@4"] == 0.5  # a share alone: its own figures
    merged = a.merge(b_states).compute()
    assert merged == BY_HAND
    assert list(merged) == list(at_once)  # the same keys, in the order they were always logged
    assert aggregate_shares([WORKER_B, [], WORKER_A], 4, 0.5) == BY_HAND  # the runner's path; a worker with none


def test_the_metrics_are_torchmetrics_aggregators_in_float64() -> None:
    from torchmetrics.aggregation import MeanMetric, SumMetric

    m = ValidationMetrics(4, 0.5).update(WORKER_A)
    assert isinstance(m.metrics["val/pass@1"], MeanMetric) and isinstance(m.metrics["val/prompts"], SumMetric)
    assert all(s.dtype == torch.float64 for states in m.states().values() for s in states.values())
    with pytest.raises(KeyError, match="val/pass@1"):
        m.merge({k: v for k, v in ValidationMetrics(4, 0.5).states().items() if k != "val/pass@1"})


def _rank(rank: int, port: int, results: Any) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        share = WORKER_A if rank == 0 else WORKER_B
        results.put((rank, ValidationMetrics(4, 0.5, sync_on_compute=True).update(share).compute()))
    finally:
        dist.destroy_process_group()


def test_ranks_holding_shares_sync_to_the_figures_of_all_samples() -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.SimpleQueue()
    mp.start_processes(_rank, args=(port, results), nprocs=2, start_method="spawn")
    got = dict(results.get() for _ in range(2))
    assert got[0] == BY_HAND and got[1] == BY_HAND
