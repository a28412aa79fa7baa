"""How one transition's dispatches become rollout calls: one call per group, or the groups of one step merged
into one call per worker where they land together anyway, and the calls each worker gets at once marked as a
:class:`~screl.data.core_types.Burst` so its decode starts as soon as all of them have arrived."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from screl.config_generation import DEFAULT_WORKFLOW, GenerationConfig
from screl.data.core_types import Burst, Dispatch


@dataclass(frozen=True)
class Call:
    """One rollout call: its worker, its backoff and its siblings, and the burst it belongs to (None: delayed)."""

    worker: int
    delay_s: float
    dispatches: list[Dispatch]
    burst: Burst | None


def groups_land_together(generation: GenerationConfig, whole_call_batches: bool) -> bool:
    """Whether a step's groups on one worker land together anyway, so one call can carry them: the engine decodes
    a call's rows as one batch to its end (it declares ``whole_call_batches``) and the single-turn workflow has no
    per-group waits (injected latency would make them land apart on purpose)."""
    return whole_call_batches and generation.workflow == DEFAULT_WORKFLOW and generation.injected_latency_s == 0


def merge_group_calls(calls: dict[tuple[str, int, float], list[Dispatch]],
                      max_rows: int) -> dict[tuple[str, int, float], list[Dispatch]]:
    """The immediate calls to each worker merged into calls of at most ``max_rows`` siblings of one priority
    (whole groups; a group larger than that alone), in dispatch order: a later step's groups never share a call
    with the current step's, which the worker decodes first. Delayed calls (retries) stay as they are."""
    out: dict[tuple[str, int, float], list[Dispatch]] = {}
    open_: dict[tuple[int, int], tuple[str, int, float]] = {}
    for key, dispatches in calls.items():
        _, worker, delay = key
        if delay > 0:
            out[key] = dispatches
            continue
        slot = (worker, min(d.priority for d in dispatches))
        current = open_.get(slot)
        if current is not None and len(out[current]) + len(dispatches) <= max_rows:
            out[current] = out[current] + dispatches
        else:
            open_[slot] = key
            out[key] = list(dispatches)
    return out


def plan_calls(dispatches: Iterable[Dispatch], merge: bool, max_rows: int, burst_ids: Iterator[int]) -> list[Call]:
    """The calls of one transition: a call per group (``merge``: see :func:`merge_group_calls`); the immediate
    calls to each worker form one burst (one call too), numbered from ``burst_ids``."""
    calls: dict[tuple[str, int, float], list[Dispatch]] = defaultdict(list)
    for d in dispatches:
        calls[d.group_id, d.worker, d.delay_s].append(d)
    if merge:
        calls = merge_group_calls(calls, max_rows)
    per_worker = Counter(worker for _, worker, delay in calls if delay == 0)
    bursts = {w: Burst(next(burst_ids), n) for w, n in per_worker.items()}
    return [Call(worker, delay, ds, bursts[worker] if delay == 0 else None) for (_, worker, delay), ds in calls.items()]
