"""Teachers of on-policy distillation (``screl.Distill``): Ray workers that score the student's tokens.

Each teacher (``distillation.teachers``) runs in a :class:`TeacherWorker` actor of its own: it never generates,
it computes the logprob of every completion token of a row under its model (prompt + completion in one forward).
A generation worker routes each sealed sibling to its prompt's teacher (``teacher_map`` by
``metadata["task_source"]``, else ``default_teacher``) through a :class:`TeacherRouter` after the sibling sealed
and before its row is written, so every row in the data plane carries ``teacher_logprobs``
(:data:`DISTILL_SCHEMA`); with ``estimator: top_k`` also the teacher's ``top_k`` most likely next tokens and their
logprobs at each completion position (:data:`DISTILL_TOP_K_SCHEMA`). A failed or timed-out teacher call is a data failure of the siblings it scored: no row
is written, the controller resamples them within ``async_rl.rollout_failure.max_data_attempts``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from screl.config_distill import DistillationConfig
from screl.models import PolicySpec
from screl.rollout.rows import ROW_SCHEMA, RowField, RowSchema

TEACHER_LOGPROBS = RowField("teacher_logprobs", torch.float32, "the teacher's logprob of each completion token",
                            "per_completion_token", fill=0.0)
TEACHER_TOP_IDS = RowField("teacher_top_ids", torch.int32, "the teacher's top-k next tokens at each completion "
                           "position (estimator: top_k)", "per_completion_token", fill=0)
TEACHER_TOP_LOGPROBS = RowField("teacher_top_logprobs", torch.float32, "the teacher's logprobs of them",
                                "per_completion_token", fill=0.0)
#: A distillation run's rows: the standard fields and ``teacher_logprobs``.
DISTILL_SCHEMA = RowSchema((*ROW_SCHEMA.fields, TEACHER_LOGPROBS))
#: ``estimator: top_k``: also the teacher's top-k tokens and their logprobs at each completion position.
DISTILL_TOP_K_SCHEMA = RowSchema((*DISTILL_SCHEMA.fields, TEACHER_TOP_IDS, TEACHER_TOP_LOGPROBS))

#: What a teacher returns for one sequence: its completion tokens' logprobs, or with ``top_k`` also the top-k ids
#: and logprobs at each completion position (``[resp, k]`` each).
Scored = list[float] | tuple[list[float], torch.Tensor, torch.Tensor]


def distill_schema(config: DistillationConfig) -> RowSchema:
    """The rows a distillation run of ``config`` writes and trains on."""
    return DISTILL_TOP_K_SCHEMA if config.estimator == "top_k" else DISTILL_SCHEMA


def _next_token_logprobs(model: torch.nn.Module, sequences: Sequence[tuple[Sequence[int], int]],
                         temperature: float, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(log-softmax [N, width - 1, V], token ids [N, width])`` of one right-padded forward of ``sequences``."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (seq, _) in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention[i, :len(seq)] = 1
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1].float()
        return torch.log_softmax(logits / temperature, dim=-1), ids


def completion_logprobs(model: torch.nn.Module, sequences: Sequence[tuple[Sequence[int], int]],
                        temperature: float = 1.0, pad_id: int = 0) -> list[list[float]]:
    """The logprob under ``model`` of each completion token of each ``(token ids, prompt length)``: one list of
    ``len(ids) - prompt_len`` floats per sequence (one right-padded forward for all of them)."""
    if not sequences:
        return []
    logp, ids = _next_token_logprobs(model, sequences, temperature, pad_id)
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return [tok[i, p - 1:len(seq) - 1].tolist() for i, (seq, p) in enumerate(sequences)]


def completion_top_k(model: torch.nn.Module, sequences: Sequence[tuple[Sequence[int], int]], k: int,
                     temperature: float = 1.0, pad_id: int = 0) -> list[tuple[list[float], torch.Tensor, torch.Tensor]]:
    """:func:`completion_logprobs` and, at each completion position, the model's ``k`` most likely next tokens
    (``int32 [resp, k]``) with their logprobs (``float32 [resp, k]``); ``k`` is capped at the vocabulary."""
    if not sequences:
        return []
    logp, ids = _next_token_logprobs(model, sequences, temperature, pad_id)
    tok = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    top_lp, top_ids = logp.topk(min(k, logp.shape[-1]), dim=-1)
    return [(tok[i, p - 1:len(seq) - 1].tolist(), top_ids[i, p - 1:len(seq) - 1].to(torch.int32).contiguous(),
             top_lp[i, p - 1:len(seq) - 1].contiguous()) for i, (seq, p) in enumerate(sequences)]


class TeacherWorker:
    """One teacher model in its own process, scoring only."""

    def __init__(self, name: str, policy: PolicySpec, temperature: float = 1.0, num_threads: int = 1,
                 top_k: int = 0) -> None:
        torch.set_num_threads(num_threads)
        self.name = name
        self.temperature = temperature
        self.top_k = top_k  # > 0: also the top-k next tokens at each completion position (estimator: top_k)
        self.model = policy.build_model().eval()
        self.pad_id = int(policy.build_tokenizer().pad_token_id or 0)
        self.calls = 0

    async def score(self, sequences: list[tuple[list[int], int]]) -> list[Scored]:
        """Completion-token logprobs of each ``(token ids, prompt length)``, with ``top_k`` also the top-k tokens
        and logprobs of each completion position (off the actor's event loop)."""
        self.calls += 1
        loop = asyncio.get_running_loop()
        if self.top_k > 0:
            top: list[Scored] = list(await loop.run_in_executor(None, completion_top_k, self.model, sequences,
                                                                self.top_k, self.temperature, self.pad_id))
            return top
        plain: list[Scored] = list(await loop.run_in_executor(None, completion_logprobs, self.model, sequences,
                                                              self.temperature, self.pad_id))
        return plain

    async def ping(self) -> str:
        return self.name

    async def pid(self) -> int:
        return os.getpid()

    async def num_calls(self) -> int:
        return self.calls


@dataclass
class TeacherRouter:
    """What a generation worker holds: the teacher actors by name and the routing of prompts to them."""

    actors: dict[str, Any]
    config: DistillationConfig

    @property
    def schema(self) -> RowSchema:
        """The rows the scored siblings become."""
        return distill_schema(self.config)

    async def score(self, rows: Sequence[tuple[str | None, Sequence[int], int]]) -> list[Scored | BaseException]:
        """Teacher logprobs of each ``(task_source, token ids, prompt length)``: one call per teacher, all at once;
        a failed call (the teacher raised, died or ran past ``score_timeout_s``) fails each of its rows."""
        out: list[Scored | BaseException] = [RuntimeError("not scored")] * len(rows)
        by_teacher: dict[str, list[int]] = {}
        for i, (source, _, _) in enumerate(rows):
            try:
                by_teacher.setdefault(self.config.teacher_for(source), []).append(i)
            except KeyError as err:
                out[i] = err

        async def one(name: str, idx: list[int]) -> None:
            actor = self.actors[name]
            try:
                scored = await asyncio.wait_for(
                    actor.score.remote([(list(rows[i][1]), int(rows[i][2])) for i in idx]),
                    self.config.score_timeout_s)
            except Exception as err:  # noqa: BLE001 - a teacher failure is a data failure of its rows
                for i in idx:
                    out[i] = RuntimeError(f"teacher {name!r} failed: {err!r}"[:300])
                return
            for i, lp in zip(idx, scored, strict=True):
                out[i] = lp

        await asyncio.gather(*(one(name, idx) for name, idx in by_teacher.items()))
        return out


def spawn_teachers(config: DistillationConfig, temperature: float, namespace_prefix: str = "screl") -> dict[str, Any]:
    """Start one :class:`TeacherWorker` actor per teacher (restarted by Ray up to ``max_teacher_restarts`` times)."""
    import ray

    remote_cls = ray.remote(TeacherWorker)
    return {
        t.name: remote_cls.options(  # type: ignore[attr-defined]
            num_cpus=config.num_cpus_per_teacher, max_restarts=config.max_teacher_restarts, max_task_retries=0,
            max_concurrency=16, name=f"{namespace_prefix}-teacher-{t.name}-{os.getpid()}",
        ).remote(t.name, t.policy, temperature, config.teacher_threads,
                 config.top_k if config.estimator == "top_k" else 0)
        for t in config.teachers
    }


def check_teachers_fit(config: DistillationConfig, need_cpus: float, cluster: dict[str, float]) -> None:
    """Fail before any actor starts when the teachers do not fit beside ``need_cpus`` of other actors."""
    teachers = config.num_cpus_per_teacher * len(config.teachers)
    have = float(cluster.get("CPU", 0.0))
    if need_cpus + teachers > have:
        raise RuntimeError(
            f"the {len(config.teachers)} teacher worker(s) x {config.num_cpus_per_teacher:g} CPU do not fit beside the "
            f"generation workers and the data plane ({need_cpus:g} CPU) in the Ray cluster's {have:g} CPU: raise "
            "ray.num_cpus, or lower model.init_args.distillation.num_cpus_per_teacher")
