"""vLLM's native NCCL weight transfer, trainer side (``backend_args: {weight_transfer: nccl}``, GPU only;
docs/generation.md). **Written against vLLM 0.33's API and not verified on a GPU here**:
``examples/gpu/vllm_nccl_check.py`` is the check to run where one is.

The trainer process is NCCL rank 0 and broadcasts every parameter straight from the policy module (vLLM's
``ModuleSource``: Hugging Face names, no copy of the model, none through the object store) to every engine, packed
into buffers of ``bucket_bytes`` (two in flight) that each engine loads buffer by buffer through its layerwise reload
(a CUDA-stream loop: no CPU test). :class:`WorkerSyncClient` implements vLLM's ``VLLMWeightSyncClient`` over screl's
workers and gives engine ``i`` its own rank offset (``1 + TP_0 + ... + TP_{i-1}``), so one broadcast feeds them all.

One refit (:meth:`NcclWeightSender.refit`): every worker pauses (``keep``), the trainer sends (vLLM's
``send_weights``: start -> update, concurrently with the broadcast -> finish), every worker labels the version and
resumes. Invariant: a worker Ray restarted cannot rejoin the NCCL group, so the controller fails the run naming it.
"""

from __future__ import annotations

import socket
from typing import Any

import ray
import torch

#: The packed buffer of the broadcast: ``generation.refit_bucket_mb``'s default (vLLM's own is 1 GiB, two of them
#: on each side of the broadcast: half a 1B fp32 model in flight).
DEFAULT_BUCKET_BYTES = 64 * 2**20


class WorkerSyncClient:
    """vLLM's ``VLLMWeightSyncClient`` over screl's generation workers (each call fans out and waits)."""

    def __init__(self, workers: list[Any], tp_sizes: list[int], timeout_s: float = 600.0) -> None:
        self.workers = workers
        self.offsets = [1 + sum(tp_sizes[:i]) for i in range(len(workers))]
        self.timeout_s = timeout_s

    def _all(self, method: str, payloads: list[Any]) -> None:
        ray.get([w.weight_transfer.remote(method, p) for w, p in zip(self.workers, payloads, strict=True)],
                timeout=self.timeout_s)

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self._all("init", [{**init_info, "rank_offset": off} for off in self.offsets])

    def start_weight_update(self) -> None:
        self._all("start", [None] * len(self.workers))

    def update_weights(self, update_info: Any) -> None:
        self._all("update", [update_info] * len(self.workers))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._all("finish", [weight_version] * len(self.workers))


def nccl_world_size(tp_sizes: list[int]) -> int:
    """The trainer (rank 0) plus every engine's tensor-parallel ranks."""
    return 1 + sum(tp_sizes)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


class NcclWeightSender:
    """The trainer's end of the NCCL weight group (built once, on the first refit)."""

    def __init__(self, workers: list[Any], module: torch.nn.Module, master_address: str = "127.0.0.1",
                 timeout_s: float = 600.0, bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> None:
        from vllm.distributed.weight_transfer.base import ModuleSource
        from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.workers = workers
        self.timeout_s = timeout_s
        tp_sizes = [int(t) for t in ray.get([w.tensor_parallel_size.remote() for w in workers], timeout=timeout_s)]
        info = NCCLTrainerInitInfo(master_address=master_address, master_port=_free_port(master_address),
                                   world_size=nccl_world_size(tp_sizes), rank=0, packed=True,
                                   packed_buffer_size_bytes=bucket_bytes, packed_num_buffers=2)
        self.engine = WeightTransferTrainerFactory.trainer_init(
            info, client=WorkerSyncClient(workers, tp_sizes, timeout_s), source=ModuleSource(module))

    def refit(self, version: int) -> None:
        """Pause every engine, broadcast the weights, label ``version``, resume."""
        ray.get([w.pause_for_transfer.remote() for w in self.workers], timeout=self.timeout_s)
        try:
            self.engine.send_weights()
        finally:
            ray.get([w.resume_after_transfer.remote(version) for w in self.workers], timeout=self.timeout_s)
