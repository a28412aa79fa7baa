"""Rollout workflows: what a worker does with one sibling between dispatch and report.

A workflow turns each dispatched sibling (a prompt, its sampling seed) into one training row, using the
worker's ``generate`` (batched with everything else the worker decodes). It may call ``generate`` several
times (a multi-turn loop) as long as it returns one row per sibling. Rewards run here, on the worker's
executor thread: never on the controller's event loop, and batched through ``Task.rewards``.

The default, :class:`SingleTurnWorkflow`: generate once, score, build the row with ``ROW_SCHEMA``.
"""

from __future__ import annotations

import asyncio
import importlib
import math
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from screl.envs import PromptRecord, Scored, Task, decode_completion
from screl.models.vision_inputs import VisionInputs
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.moved import refuse_moved
from screl.rollout.rows import ROW_SCHEMA, RowSchema

Generate = Callable[[list[GenerationRequest]], Awaitable[list[GenerationResult]]]


@dataclass(frozen=True)
class RolloutItem:
    """One sibling to roll out: its attempt id (the row's key), prompt and sampling parameters."""

    attempt: str
    prompt: PromptRecord
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    priority: int = 0
    vision: VisionInputs | None = None  # a vision-language prompt's processed images (made on the worker)


@dataclass
class RolloutOutcome:
    """A workflow's result for one item: a row (``sealed``), a failure to resample (``data_error``) or an
    abort (``abort``, no row)."""

    attempt: str
    status: str
    row: dict[str, torch.Tensor] | None = None
    reward: float = 0.0
    end_version: int = 0
    response_len: int = 0
    finish_reason: str = ""
    detail: str = ""
    reward_parts: dict[str, float] | None = None  # each reward function's value (screl.rewards), for the metrics


class RolloutWorkflow(Protocol):
    """Built once per worker as ``cls(task=..., tokenizer=..., schema=...)``."""

    async def run(self, items: Sequence[RolloutItem], generate: Generate) -> list[RolloutOutcome]:
        """One outcome per item, in order."""
        ...


def load_workflow(target: str) -> type:
    """The workflow class named ``"package.module.Class"`` (or ``module:Class``); the error names the config key."""
    key = "data.init_args.generation.workflow"
    refuse_moved(target, key)
    module_name, _, name = target.replace(":", ".").rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ValueError(f"cannot import the workflow class {target!r} ({key}): {err}") from err
    if not callable(getattr(cls, "run", None)):
        raise TypeError(f"the workflow class {target!r} ({key}) has no run(items, generate) method")
    return cls  # type: ignore[no-any-return]


class SingleTurnWorkflow:
    """Generate one completion per sibling, score it with the task, build its row."""

    def __init__(self, task: Task, tokenizer: Any, schema: RowSchema = ROW_SCHEMA) -> None:
        self.task = task
        self.tokenizer = tokenizer
        self.schema = schema

    async def run(self, items: Sequence[RolloutItem], generate: Generate) -> list[RolloutOutcome]:
        requests = [GenerationRequest(i.attempt, list(i.prompt_token_ids), i.sampling, i.priority, i.vision)
                    for i in items]
        results = await generate(requests)
        done = [(i, r) for i, r in zip(items, results, strict=True) if r.finish_reason != "abort"]
        completions = [decode_completion(self.tokenizer, r.token_ids) for _, r in done]
        loop = asyncio.get_running_loop()
        prompts = [i.prompt for i, _ in done]
        ids = [list(r.token_ids) for _, r in done]
        scores, masked = await loop.run_in_executor(None, self.judge, prompts, completions, ids)
        by_attempt = {i.attempt: (r, s, m) for (i, r), s, m in zip(done, scores, masked, strict=True)}
        out = []
        for item, res in zip(items, results, strict=True):
            if item.attempt not in by_attempt:
                out.append(RolloutOutcome(item.attempt, "abort", finish_reason="abort"))
                continue
            _, score, is_masked = by_attempt[item.attempt]
            outcome = RolloutOutcome(item.attempt, "sealed", end_version=res.end_version,
                                     response_len=len(res.token_ids), finish_reason=res.finish_reason)
            if isinstance(score, BaseException):
                outcome.status, outcome.detail = "data_error", repr(score)[:200]
            else:
                keep = not (is_masked or score.unscorable)  # unscorable: every reward function returned None
                outcome.row = self.schema.build(res, score.reward, extra={"sample_mask": [1.0 if keep else 0.0]})
                outcome.reward, outcome.reward_parts = score.reward, dict(score.parts)
            out.append(outcome)
        return out

    def judge(self, prompts: list[PromptRecord], completions: list[str],
              completion_ids: list[list[int]]) -> tuple[list[Scored | BaseException], list[bool]]:
        """Rewards and masks in one trip to the executor."""
        return self.score(prompts, completions, completion_ids), self.masks(prompts, completions)

    def masks(self, prompts: list[PromptRecord], completions: list[str]) -> list[bool]:
        """``Task.masked`` for each sample (a mask that raises counts as masked: the sample cannot be trusted)."""
        out = []
        for p, c in zip(prompts, completions, strict=True):
            try:
                out.append(bool(self.task.masked(p, c)))
            except Exception:  # noqa: BLE001 - an unjudgeable sample trains nothing
                out.append(True)
        return out

    def score(self, prompts: list[PromptRecord], completions: list[str],
              completion_ids: list[list[int]]) -> list[Scored | BaseException]:
        """Rewards in one ``Task.scored`` call; if it raises, each completion alone, so a failure is pinned on the
        sibling that caused it (a data failure: that sibling is resampled, as is one whose reward is not finite)."""
        if not prompts:
            return []
        try:
            return [_checked(s) for s in self.task.scored(prompts, completions, completion_ids)]
        except Exception:  # noqa: BLE001 - find the culprit below
            pass
        out: list[Scored | BaseException] = []
        for p, c, ids in zip(prompts, completions, completion_ids, strict=True):
            try:
                out.append(_checked(self.task.scored([p], [c], [ids])[0]))
            except Exception as err:  # noqa: BLE001 - a reward function failed: a data failure
                out.append(err)
        return out


def _checked(scored: Scored) -> Scored | BaseException:
    """A scored sample, its error if it has one, or a ValueError if its reward is not finite."""
    if scored.error is not None:
        return scored.error
    if not math.isfinite(scored.reward):
        return ValueError(f"the task's reward {scored.reward} is not finite")
    return scored
