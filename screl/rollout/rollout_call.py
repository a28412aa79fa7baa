"""The steps of one rollout call on a generation worker (:meth:`screl.rollout.worker.GenerationWorker.rollout`)
around its workflow: the call's place among those running (:class:`CallState`, for the decode queue's gathering and
the row sink's flush), its deadlines (:func:`deadline_generate`, :func:`watch_deadlines`, :func:`mark_timeouts`),
and what happens to a sealed sibling before its row is written: reward shaping (:func:`shape_reward`) and, under
distillation, the teachers' logprobs (:func:`teacher_score`).

Invariant: a sibling that ran past a deadline is reported ``timeout`` and one whose teacher call failed
``data_error``; neither writes a row.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import torch

from screl.data.core_types import Burst
from screl.rollout.deadlines import CallDeadlines, PausableClock
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult
from screl.rollout.workflows.reward_transform import RewardTransform
from screl.rollout.workflows.workflow import Generate, RolloutItem, RolloutOutcome

__all__ = ["CALL", "CallState", "deadline_generate", "mark_timeouts", "shape_reward", "teacher_score",
           "watch_deadlines"]


@dataclass
class CallState:
    """One rollout call's place, for the gathering of its first generate and the row sink's flush."""

    burst: Burst | None
    generating: int = 0
    first_generate_done: bool = False


#: the rollout call this task runs for (None outside one)
CALL: contextvars.ContextVar[CallState | None] = contextvars.ContextVar("screl_rollout_call", default=None)


def deadline_generate(call: CallDeadlines, generate: Generate, engine: Any) -> Generate:
    """``generate`` under the call's deadlines: each request is open while it generates, and once the rollout ran
    out no new turn starts (its requests return no tokens, ``abort``, at the engine's version)."""

    async def guarded(requests: list[GenerationRequest]) -> list[GenerationResult]:
        ids = [r.request_id for r in requests]
        if call.expired_at is not None:  # the rollout ran out: no new turn starts
            return [GenerationResult(r.request_id, list(r.prompt_token_ids), [], [], "abort", [],
                                     engine.version, engine.version) for r in requests]
        call.opened(ids)
        try:
            return await generate(requests)
        finally:
            call.closed(ids)

    return guarded


async def watch_deadlines(run: asyncio.Future[list[RolloutOutcome]], items: list[RolloutItem], call: CallDeadlines,
                          abort: Callable[[list[str]], Awaitable[None]], poll_s: float,
                          clock: PausableClock) -> list[RolloutOutcome]:
    """The outcomes of the workflow ``run``; what runs past its deadline is aborted, and a workflow still running a
    second after its rollout deadline (e.g. in a hung reward) is cancelled, each of its siblings an abort."""
    try:
        while True:
            done, _ = await asyncio.wait({run}, timeout=poll_s)
            if done:
                return run.result()
            due = call.due()
            if due:
                await abort(due)
            if call.expired_at is not None and clock.now() - call.expired_at > 1.0:
                return [RolloutOutcome(i.attempt, "abort", finish_reason="abort") for i in items]
    finally:
        if not run.done():
            run.cancel()


def mark_timeouts(call: CallDeadlines, outcomes: list[RolloutOutcome]) -> None:
    """An aborted sibling that ran past a deadline becomes a ``timeout``, the deadline its detail."""
    for o in outcomes:
        why = call.reason(o.attempt) if o.status == "abort" else None
        if why is not None:
            o.status, o.detail = "timeout", why


def shape_reward(transform: RewardTransform, outcome: Any) -> None:
    """Reward shaping and scaling of a sealed sibling: its row's ``reward`` and its report change, its
    ``raw_reward`` keeps the task's."""
    assert outcome.row is not None
    shaped = transform(float(outcome.reward), int(outcome.response_len), str(outcome.finish_reason))
    outcome.row["reward"] = torch.tensor([shaped], dtype=outcome.row["reward"].dtype)
    outcome.reward = shaped


async def teacher_score(teachers: Any, items: list[RolloutItem], sealed: list[RolloutOutcome]) -> list[RolloutOutcome]:
    """Distillation: each sealed row gains ``teacher_logprobs`` from its prompt's teacher (``teachers``: a
    :class:`screl.rollout.teachers.TeacherRouter`); a sibling whose teacher call failed becomes a data failure (no
    row written). Returns the rows still sealed."""
    prompts = {i.attempt: i.prompt for i in items}
    rows = [(prompts[o.attempt].metadata.get("task_source"), o.row["input_ids"].tolist(),
             int(o.row["prompt_len"][0])) for o in sealed if o.row is not None]
    scores = await teachers.score(rows)
    kept = []
    for o, scored in zip(sealed, scores, strict=True):
        if isinstance(scored, BaseException):
            o.status, o.row, o.detail = "data_error", None, repr(scored)[:200]
            continue
        assert o.row is not None
        lp = scored
        if isinstance(scored, tuple):  # estimator: top_k
            lp, o.row["teacher_top_ids"], o.row["teacher_top_logprobs"] = scored
        o.row["teacher_logprobs"] = torch.tensor(lp, dtype=torch.float32)
        kept.append(o)
    return kept
