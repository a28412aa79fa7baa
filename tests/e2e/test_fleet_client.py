"""The trainer's side of the rollout fleet over real Ray actors: the NCCL weight-transfer client (no GPU: the
actors record) and the waits that name their knob.

vLLM's own trainer engine hands every engine the same rank offset (1); screl's client must give engine ``i`` the
offset after the ranks of the engines before it, or two engines would claim one NCCL rank.
"""

from __future__ import annotations

from typing import Any

import pytest
import ray

from screl.rollout.engines.vllm_transfer import WorkerSyncClient, nccl_world_size

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


@ray.remote(num_cpus=0)
class _RecordingWorker:
    """Records the transfer calls a generation worker receives."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []

    def weight_transfer(self, method: str, payload: Any = None) -> None:
        self.calls.append((method, payload))

    def seen(self) -> list[tuple[str, Any]]:
        return self.calls


def test_each_engine_gets_its_own_rank_offset_and_every_call() -> None:
    workers = [_RecordingWorker.remote() for _ in range(3)]
    tp = [2, 1, 4]
    client = WorkerSyncClient(workers, tp, timeout_s=30)
    assert client.offsets == [1, 3, 4] and nccl_world_size(tp) == 8  # ranks 1-2, 3, 4-7 after the trainer's 0
    init = {"master_address": "127.0.0.1", "master_port": 29555, "world_size": 8, "rank_offset": 1}
    client.init_weight_transfer_engine(init)
    client.start_weight_update()
    client.update_weights({"names": ["w"], "dtype_names": ["float32"], "shapes": [[2]]})
    client.finish_weight_update("7")
    for worker, offset in zip(workers, [1, 3, 4], strict=True):
        calls = ray.get(worker.seen.remote())
        assert [m for m, _ in calls] == ["init", "start", "update", "finish"]
        assert calls[0][1] == {**init, "rank_offset": offset}
        assert calls[2][1]["names"] == ["w"] and calls[3][1] == "7"


def test_a_wait_on_the_rollout_side_that_runs_out_names_the_knob() -> None:
    from screl.config import GenerationConfig, RunConfig
    from screl.controller.runtime import RolloutRuntime

    @ray.remote(num_cpus=0)
    def never() -> None:
        import time

        time.sleep(30)

    runtime = RolloutRuntime(RunConfig.from_dict({}), GenerationConfig(), timeout_s=0.5)
    with pytest.raises(TimeoutError, match=r"the rollout side did not refit the workers within 1 s \(data.init_args."
                                           r"step_timeout_s = 0.5\): a hung controller or generation worker"):
        runtime._wait(never.remote(), "refit the workers", timeout_s=1.0)
