"""Validation during training, run by the controller beside the rollouts.

The weights of version ``v`` are validated when ``v`` is due (``val_at_start``: 0; ``val_period`` N: every
multiple of N; ``val_at_end``: the last). The held-out prompts' samples go to the workers right after the refit
to ``v``, at priority ``v`` (they share decode batches with that step's rollouts, never the replay buffer or the
data plane). The next refit waits until they are done, so every validation token comes from version ``v``: the
pin is checked on each result and recorded in the ``validate`` event. Results reach the trainer, which logs them
as ``val/*`` at step ``v``, only once every sample is scored: never half-logged. A checkpoint counts a
validation as pending until the trainer has it, and a resume redoes it.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from screl.config import GRPOConfig
from screl.data.core_types import seed_for
from screl.data.events import Event, ValidateEvent
from screl.rollout.engines.protocol import SamplingParams


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of ``n`` samples with ``c`` passes: ``1 - C(n-c, k) / C(n, k)``."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


class ValidationMetrics:
    """The ``val/*`` figures of one validation as torchmetrics states, in float64: a ``MeanMetric`` per mean (reward,
    response length, truncated fraction, pass@k over prompts) and a ``SumMetric`` of prompts. Each share of the
    samples (a worker's, a rank's) updates its own; :meth:`merge` joins shares (``Metric.merge_state``: states from
    another process, e.g. :meth:`states` over Ray); with ``sync_on_compute=True`` (and ``process_group``) ranks
    that each hold a share sync in :meth:`compute` (each metric all-gathers its states). pass@k is a mean over
    prompts of each prompt's pass@k: a share must hold whole prompts (:class:`ValidationRunner` splits so)."""

    def __init__(self, num_samples: int, pass_threshold: float, **metric_kwargs: Any) -> None:
        from torchmetrics.aggregation import MeanMetric, SumMetric

        # the controller has no process group of its own; NaN rewards propagate into the figures as they always did;
        # no cached compute: a merge after a compute counts (merge_state does not clear torchmetrics' cache)
        kwargs = {"sync_on_compute": False, "nan_strategy": "disable", "compute_with_cache": False, **metric_kwargs}
        self.ks, self.pass_threshold = sorted({1, num_samples}), pass_threshold
        names = ["val/reward_mean", "val/response_length", "val/truncated_fraction"]
        self.metrics: dict[str, Any] = {n: MeanMetric(**kwargs).set_dtype(torch.float64) for n in names}
        self.metrics["val/prompts"] = SumMetric(**kwargs).set_dtype(torch.float64)
        self.metrics.update({f"val/pass@{k}": MeanMetric(**kwargs).set_dtype(torch.float64) for k in self.ks})

    def update(self, samples: Sequence[dict[str, Any]]) -> ValidationMetrics:
        """Add a share's samples (every sample of each of its prompts; none: the metrics count as updated)."""
        by_prompt: dict[int, list[float]] = {}
        for s in samples:
            by_prompt.setdefault(int(s["prompt_id"]), []).append(float(s["reward"]))
        f64 = torch.float64
        m = self.metrics
        m["val/reward_mean"].update(torch.tensor([float(s["reward"]) for s in samples], dtype=f64))
        m["val/response_length"].update(torch.tensor([int(s["response_len"]) for s in samples], dtype=f64))
        m["val/truncated_fraction"].update(torch.tensor([s["finish_reason"] == "length" for s in samples], dtype=f64))
        m["val/prompts"].update(torch.tensor(float(len(by_prompt)), dtype=f64))
        for k in self.ks:
            m[f"val/pass@{k}"].update(torch.tensor(
                [pass_at_k(len(r), sum(x >= self.pass_threshold for x in r), k) for r in by_prompt.values()], dtype=f64))
        return self

    def states(self) -> dict[str, dict[str, Tensor]]:
        """Every metric's state (plain tensors: what another process sends to :meth:`merge`)."""
        return {name: {k: v.clone() for k, v in metric.metric_state.items()} for name, metric in self.metrics.items()}

    def merge(self, other: ValidationMetrics | dict[str, dict[str, Tensor]]) -> ValidationMetrics:
        """Join another share's states into this one's."""
        incoming = other.metrics if isinstance(other, ValidationMetrics) else other
        for name, metric in self.metrics.items():
            metric.merge_state(incoming[name])
        return self

    def compute(self) -> dict[str, float]:
        return {name: float(metric.compute()) for name, metric in self.metrics.items()}


def aggregate(samples: Sequence[dict[str, Any]], num_samples: int, pass_threshold: float) -> dict[str, float]:
    """``val/*`` metrics of one validation: reward mean, pass@1 and pass@n over prompts, response length,
    truncated fraction (:class:`ValidationMetrics` over all the samples at once)."""
    return ValidationMetrics(num_samples, pass_threshold).update(samples).compute()


def aggregate_shares(shares: Sequence[Sequence[dict[str, Any]]], num_samples: int,
                     pass_threshold: float) -> dict[str, float]:
    """:func:`aggregate` of the shares' samples together, each share's metrics updated on its own and merged."""
    first, *rest = [ValidationMetrics(num_samples, pass_threshold).update(share) for share in shares or [[]]]
    for other in rest:
        first.merge(other)
    return first.compute()


@dataclass
class ValidationResult:
    version: int
    metrics: dict[str, float]


class ValidationRunner:
    """The controller's validation pump. ``workers[i].validate`` generates and scores; ``ensure_fresh(worker)``
    brings a restarted worker up to date first; ``emit`` logs events."""

    def __init__(self, algo: GRPOConfig, prompt_ids: Sequence[int], max_new_tokens: int, seed: int,
                 workers: list[Any], ensure_fresh: Callable[[Any], Any], emit: Callable[[Event], None]) -> None:
        v = algo.validation
        self.period, self.at_start, self.at_end = algo.val_period, algo.val_at_start, algo.val_at_end
        self.num_samples, self.pass_threshold = v.num_samples, v.pass_threshold
        self.prompt_ids = list(prompt_ids)[: v.max_prompts] if v.max_prompts else list(prompt_ids)
        self.sampling = SamplingParams(max_new_tokens=v.max_new_tokens or max_new_tokens, temperature=v.temperature,
                                       top_p=v.top_p)
        self.seed = seed
        self.workers, self.ensure_fresh, self.emit = workers, ensure_fresh, emit
        self.tasks: dict[int, asyncio.Task[None]] = {}
        self.done: list[ValidationResult] = []
        self.started: set[int] = set()

    @property
    def enabled(self) -> bool:
        return bool(self.period or self.at_start or self.at_end)

    def due(self, version: int, final: bool = False) -> bool:
        if version in self.started:
            return False
        if version == 0:
            return self.at_start
        return bool(self.period and version % self.period == 0) or (final and self.at_end)

    def start(self, version: int) -> None:
        """Send version ``version``'s samples to the workers (the caller has just refit them to it)."""
        self.started.add(version)
        self.tasks[version] = asyncio.get_running_loop().create_task(self._run(version))

    def _samples(self, version: int) -> list[list[tuple[int, int, int]]]:
        """Each worker's share: whole prompts round-robin; seeds depend on prompt and sample, not on the version,
        so every validation scores the same requests."""
        parts: list[list[tuple[int, int, int]]] = [[] for _ in self.workers]
        for i, pid in enumerate(self.prompt_ids):
            parts[i % len(parts)] += [(pid, k, seed_for(self.seed, "val", pid, k)) for k in range(self.num_samples)]
        return [p for p in parts if p]

    async def _part(self, index: int, version: int, part: list[tuple[int, int, int]]) -> list[dict[str, Any]]:
        import ray

        worker = self.workers[index]
        for attempt in (1, 2):  # a worker that died is restarted by Ray: bring it up to date and ask again
            try:
                await self.ensure_fresh(worker)
                return await worker.validate.remote(version, part, self.sampling)  # type: ignore[no-any-return]
            except (ray.exceptions.RayActorError, ray.exceptions.ActorUnavailableError):
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    async def _run(self, version: int) -> None:
        import time

        t0 = time.perf_counter()
        parts = self._samples(version)
        results = await asyncio.gather(*(self._part(i, version, p) for i, p in enumerate(parts)))
        samples = [s for part in results for s in part]
        seen = sorted({v for s in samples for v in s["versions"]})
        if seen and seen != [version]:
            raise RuntimeError(f"validation of version {version} generated tokens with weight versions {seen}: "
                               "the refit did not wait for it")
        metrics = aggregate_shares(results, self.num_samples, self.pass_threshold)  # each worker's, merged
        metrics.update({"val/version": float(version), "val/time_s": time.perf_counter() - t0})
        self.done.append(ValidationResult(version, metrics))
        self.emit(ValidateEvent(trainer_version=version, extra={
            "token_versions": seen, "samples": len(samples),
            **{k.removeprefix("val/"): round(v, 6) for k, v in metrics.items() if k != "val/version"}}))

    async def wait(self, timeout_s: float) -> None:
        """Every started validation finished (before the weights change); raises what one raised."""
        running = [t for t in self.tasks.values() if not t.done()]
        if running:
            _, late = await asyncio.wait(running, timeout=timeout_s)
            if late:
                raise TimeoutError(f"validation did not finish within {timeout_s:.0f} s (versions "
                                   f"{sorted(v for v, t in self.tasks.items() if t in late)}); raise "
                                   "data.init_args.step_timeout_s or validate fewer prompts "
                                   "(validation.max_prompts)")
        for version, task in list(self.tasks.items()):
            if task.done():
                del self.tasks[version]
                task.result()

    def take(self) -> list[dict[str, Any]]:
        """The finished validations the trainer has not had yet (it logs them)."""
        out, self.done = self.done, []
        return [{"version": r.version, "metrics": r.metrics} for r in out]

    def pending(self) -> list[int]:
        """Versions started whose results the trainer has not had (a resume redoes them)."""
        return sorted({v for v, t in self.tasks.items() if not t.done()} | {r.version for r in self.done})

    def cancel(self) -> None:
        for task in self.tasks.values():
            task.cancel()
