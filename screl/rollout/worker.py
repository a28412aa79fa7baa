"""``GenerationWorker``: a Ray actor that drives one generation engine.

Requests arrive one prompt group per call from the controller's many concurrent rollouts; a single
decode thread gathers whatever is queued (up to ``max_batch_size`` rows) into one batched
``engine.generate`` call, so concurrent groups share forward passes. Weight updates run beside it
(the torch engine applies them between decode steps and labels each token with its version).

``injected_latency_s`` delays each group's reply by a uniform random amount: a testing aid that
makes completions arrive out of dispatch order, on top of real generation.
"""

from __future__ import annotations

import asyncio
import os
import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray
import torch

from screl.models import PolicySpec
from screl.rollout.engine import GenerationRequest, GenerationResult


@dataclass
class _Pending:
    requests: Sequence[GenerationRequest]
    future: asyncio.Future[list[GenerationResult]]
    loop: asyncio.AbstractEventLoop


class GenerationWorker:
    """One engine in its own process. Create with :func:`spawn_workers`."""

    def __init__(
        self,
        policy: PolicySpec,
        device: str = "cpu",
        num_threads: int = 1,
        max_batch_size: int = 64,
        recompute_kv_cache_after_weight_updates: bool = False,
        injected_latency_s: float = 0.0,
        seed: int = 0,
        backend: str = "torch",
        batch_window_s: float = 0.01,
    ) -> None:
        torch.set_num_threads(num_threads)
        if backend != "torch":
            raise NotImplementedError(
                f"data.init_args.generation.backend={backend!r} is not available in this build: only 'torch' "
                "runs here (vLLM needs a GPU machine and the screl[vllm] extra)"
            )
        from screl.rollout.torch_engine import TorchGenerationEngine

        self.engine = TorchGenerationEngine(
            policy,
            device=device,
            num_threads=num_threads,
            max_batch_size=max_batch_size,
            recompute_kv_cache_after_weight_updates=recompute_kv_cache_after_weight_updates,
            seed=seed,
        )
        self.max_batch_size = max_batch_size
        self.injected_latency_s = injected_latency_s
        self.batch_window_s = batch_window_s
        self._rng = random.Random(seed + 7919)
        self._queue: list[_Pending] = []
        self._cv = threading.Condition()
        self._thread = threading.Thread(target=self._decode_loop, name="screl-decode", daemon=True)
        self._thread.start()

    # -- requests -----------------------------------------------------------------------------------
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate one group's requests (batched with whatever else is queued)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[GenerationResult]] = loop.create_future()
        with self._cv:
            self._queue.append(_Pending(requests, future, loop))
            self._cv.notify()
        results = await future
        if self.injected_latency_s > 0:
            await asyncio.sleep(self._rng.uniform(0.0, self.injected_latency_s))
        return results

    def _decode_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue:
                    self._cv.wait()
                # a step's groups arrive one by one as the pump reserves them: gather them into one decode
                # (until no new group for `batch_window_s`, the batch is full, or 4 windows passed)
                deadline = time.monotonic() + 4 * self.batch_window_s
                while self.batch_window_s > 0 and self._queued_rows() < self.max_batch_size:
                    seen = len(self._queue)
                    self._cv.wait(timeout=self.batch_window_s)
                    if len(self._queue) == seen or time.monotonic() >= deadline:
                        break
                batch, self._queue = take_batch(self._queue, self.max_batch_size)
            flat = [r for item in batch for r in item.requests]
            try:
                results = self.engine.generate(flat)
            except BaseException as err:  # noqa: BLE001 - handed to each waiting caller
                for item in batch:
                    item.loop.call_soon_threadsafe(_set_exception, item.future, err)
                continue
            at = 0
            for item in batch:
                part = results[at : at + len(item.requests)]
                at += len(item.requests)
                item.loop.call_soon_threadsafe(_set_result, item.future, part)

    def _queued_rows(self) -> int:
        return sum(len(item.requests) for item in self._queue)

    async def abort(self, request_ids: list[str]) -> None:
        """Finish these requests early: running ones return partial tokens (finish_reason ``abort``),
        queued ones are dropped before they start (their callers see a cancellation)."""
        ids = set(request_ids)
        with self._cv:
            dropped = [item for item in self._queue if ids & {r.request_id for r in item.requests}]
            self._queue = [item for item in self._queue if item not in dropped]
        for item in dropped:
            item.future.cancel()
        self.engine.abort(request_ids)

    # -- weights --------------------------------------------------------------------------------------
    async def update_weights(self, weights: list[Any], version: int) -> int:
        """Load ``weights[0]`` (a state dict or an ObjectRef to one) as ``version``; returns the version."""
        state = weights[0]
        if isinstance(state, ray.ObjectRef):
            state = await state
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(None, self.engine.update_weights, state, version)
        return version

    async def version(self) -> int:
        return self.engine.version

    async def num_threads(self) -> int:
        """Torch intra-op threads of this worker process."""
        return torch.get_num_threads()

    async def pid(self) -> int:
        return os.getpid()

    async def ping(self) -> bool:
        return True


def take_batch(queue: list[_Pending], max_rows: int) -> tuple[list[_Pending], list[_Pending]]:
    """Split ``queue`` into the next decode batch and the rest: the most urgent priority's groups in arrival
    order while they fit in ``max_rows`` (always at least one group); other priorities wait their turn."""
    priorities = [min((r.priority for r in item.requests), default=0) for item in queue]
    urgent = min(priorities, default=0)
    batch: list[_Pending] = []
    rest: list[_Pending] = []
    rows, full = 0, False
    for item, priority in zip(queue, priorities, strict=True):
        if priority == urgent and not full and (not batch or rows + len(item.requests) <= max_rows):
            batch.append(item)
            rows += len(item.requests)
        else:
            # an urgent group that did not fit ends the batch: later ones must not overtake it
            full = full or priority == urgent
            rest.append(item)
    return batch, rest


def _set_result(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future[Any], err: BaseException) -> None:
    if not future.done():
        future.set_exception(err)


def spawn_workers(
    num_workers: int, policy: PolicySpec, *, namespace_prefix: str = "screl", **kwargs: Any
) -> list[Any]:
    """Start ``num_workers`` generation actors (restarted by Ray if their process dies)."""
    remote_cls = ray.remote(GenerationWorker)
    seed = int(kwargs.pop("seed", 0))
    return [
        remote_cls.options(  # type: ignore[attr-defined]
            num_cpus=1,
            max_restarts=-1,
            max_task_retries=0,
            max_concurrency=64,
            name=f"{namespace_prefix}-generation-{i}-{os.getpid()}",
        ).remote(policy, seed=seed + i, **kwargs)
        for i in range(num_workers)
    ]
