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

from screl.config_distill import KEY, DistillationConfig
from screl.models import PolicySpec
from screl.models.logprobs import chunked_logprobs_of_hidden, chunked_top_k_of_hidden, output_head
from screl.rollout.rows import ROW_SCHEMA, RowField, RowSchema

TEACHER_CHUNK_KEY = f"{KEY}.teacher_chunk_tokens"

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


Sequences = Sequence[tuple[Sequence[int], int]]


def _padded(sequences: Sequences, pad_id: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ``(token ids, attention mask)`` ``[N, width]`` of ``sequences``."""
    width = max(len(ids) for ids, _ in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    attention = torch.zeros((len(sequences), width), dtype=torch.long)
    for i, (seq, _) in enumerate(sequences):
        ids[i, :len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        attention[i, :len(seq)] = 1
    return ids.to(device), attention.to(device)


def _completion_pick(sequences: Sequences, ids: torch.Tensor) -> torch.Tensor:
    """``[N, width - 1]`` bool: the positions that predict a completion token (position t predicts token t + 1)."""
    pick = torch.zeros(ids.shape[0], ids.shape[1] - 1, dtype=torch.bool, device=ids.device)
    for i, (seq, p) in enumerate(sequences):
        pick[i, p - 1:len(seq) - 1] = True
    return pick


def _full_scores(model: torch.nn.Module, sequences: Sequences, temperature: float, pad_id: int,
                 top_k: int) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """``teacher_chunk_tokens: 0`` (an output layer that is not a plain linear head): the completion tokens'
    logprobs ``[T]`` and the top-k ``([T, k], [T, k])`` through full logits."""
    ids, attention = _padded(sequences, pad_id, next(model.parameters()).device)
    pick = _completion_pick(sequences, ids)
    logits = model(input_ids=ids, attention_mask=attention).logits[:, :-1][pick].float() / temperature
    logp = torch.log_softmax(logits, dim=-1)
    tok = logp.gather(-1, ids[:, 1:][pick][:, None]).squeeze(-1)
    return tok, logp.topk(min(top_k, logp.shape[-1]), dim=-1) if top_k else None


def _chunked_scores(model: torch.nn.Module, sequences: Sequences, temperature: float, pad_id: int, top_k: int,
                    chunk_tokens: int | None) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """What :func:`_full_scores` gives, through the trunk once and the output layer over chunks of positions."""
    try:
        head = output_head(model)
    except ValueError as err:
        raise ValueError(f"{TEACHER_CHUNK_KEY}: {err}; for a teacher set {TEACHER_CHUNK_KEY}: 0 instead") from None
    ids, attention = _padded(sequences, pad_id, head.weight.device)
    pick = _completion_pick(sequences, ids)
    trunk: Any = model.base_model
    hidden = trunk(input_ids=ids, attention_mask=attention).last_hidden_state[:, :-1][pick]
    tok = chunked_logprobs_of_hidden(hidden, head.weight, ids[:, 1:][pick], temperature, chunk_tokens)[0]
    top = chunked_top_k_of_hidden(hidden, head.weight, top_k, temperature, chunk_tokens) if top_k else None
    return tok, top


def _score_batch(model: torch.nn.Module, sequences: Sequences, temperature: float, pad_id: int, top_k: int,
                 chunk_tokens: int | None) -> list[Scored]:
    """One forward of ``sequences``: each one's completion logprobs (with ``top_k``, its top-k too)."""
    with torch.no_grad():
        tok, top = (_full_scores(model, sequences, temperature, pad_id, top_k) if chunk_tokens == 0 else
                    _chunked_scores(model, sequences, temperature, pad_id, top_k, chunk_tokens))
    lengths = [len(seq) - p for seq, p in sequences]
    per_row = [t.tolist() for t in tok.cpu().split(lengths)]
    if top is None:
        return list(per_row)
    top_lp, top_ids = top
    return [(t, ix.to(torch.int32).contiguous(), lp.contiguous()) for t, ix, lp in
            zip(per_row, top_ids.cpu().split(lengths), top_lp.cpu().split(lengths), strict=True)]


def score_sequences(model: torch.nn.Module, sequences: Sequences, temperature: float = 1.0, pad_id: int = 0,
                    top_k: int = 0, chunk_tokens: int | None = None,
                    batch_tokens: int | None = None) -> list[Scored]:
    """Each ``(token ids, prompt length)``'s completion-token logprobs under ``model`` (with ``top_k`` > 0 also the
    ``k`` most likely next tokens and their logprobs at each completion position, ``[resp, k]`` each), through the
    trainer's chunked path (:mod:`screl.models.logprobs`: the trunk once, the output layer and log-softmax over
    ``chunk_tokens`` positions at a time, never ``[tokens, vocabulary]``; 0: full logits). The sequences go in
    forwards of at most ``batch_tokens`` padded tokens (None: all in one), longest first; results in the given
    order."""
    if not sequences:
        return []
    order = sorted(range(len(sequences)), key=lambda i: -len(sequences[i][0]))
    out: list[Scored | None] = [None] * len(sequences)
    batch: list[int] = []
    for i in [*order, -1]:
        fits = i >= 0 and (not batch or batch_tokens is None
                           or (len(batch) + 1) * len(sequences[batch[0]][0]) <= batch_tokens)
        if batch and not fits:
            scored = _score_batch(model, [sequences[j] for j in batch], temperature, pad_id, top_k, chunk_tokens)
            for j, one in zip(batch, scored, strict=True):
                out[j] = one
            batch = []
        if i >= 0:
            batch.append(i)
    return [o for o in out if o is not None]


def completion_logprobs(model: torch.nn.Module, sequences: Sequences, temperature: float = 1.0,
                        pad_id: int = 0, chunk_tokens: int | None = None) -> list[list[float]]:
    """The logprob under ``model`` of each completion token of each ``(token ids, prompt length)``: one list of
    ``len(ids) - prompt_len`` floats per sequence (one right-padded forward, :func:`score_sequences`)."""
    return score_sequences(model, sequences, temperature, pad_id, 0, chunk_tokens)  # type: ignore[return-value]


def completion_top_k(model: torch.nn.Module, sequences: Sequences, k: int, temperature: float = 1.0,
                     pad_id: int = 0, chunk_tokens: int | None = None,
                     ) -> list[tuple[list[float], torch.Tensor, torch.Tensor]]:
    """:func:`completion_logprobs` and, at each completion position, the model's ``k`` most likely next tokens
    (``int32 [resp, k]``) with their logprobs (``float32 [resp, k]``); ``k`` is capped at the vocabulary."""
    return score_sequences(model, sequences, temperature, pad_id, k, chunk_tokens)  # type: ignore[return-value]


class TeacherWorker:
    """One teacher model (one replica) in its own process, scoring only."""

    def __init__(self, name: str, policy: PolicySpec, temperature: float = 1.0, num_threads: int = 1,
                 top_k: int = 0, device: str = "cpu", chunk_tokens: int | None = None,
                 batch_tokens: int | None = None) -> None:
        torch.set_num_threads(num_threads)
        self.name = name
        self.temperature = temperature
        self.top_k = top_k  # > 0: also the top-k next tokens at each completion position (estimator: top_k)
        self.chunk_tokens, self.batch_tokens = chunk_tokens, batch_tokens
        self.model = policy.build_model().eval().to(device)
        self.pad_id = int(policy.build_tokenizer().pad_token_id or 0)
        self.calls = 0

    async def score(self, sequences: list[tuple[list[int], int]]) -> list[Scored]:
        """Completion-token logprobs of each ``(token ids, prompt length)``, with ``top_k`` also the top-k tokens
        and logprobs of each completion position (:func:`score_sequences`, off the actor's event loop)."""
        self.calls += 1
        return await asyncio.get_running_loop().run_in_executor(
            None, lambda: score_sequences(self.model, sequences, self.temperature, self.pad_id, self.top_k,
                                          self.chunk_tokens, self.batch_tokens))

    async def ping(self) -> str:
        return self.name

    async def pid(self) -> int:
        return os.getpid()

    async def num_calls(self) -> int:
        return self.calls


@dataclass
class TeacherRouter:
    """What a generation worker holds: each teacher's replica actors by name and the routing of prompts to them."""

    actors: dict[str, list[Any]]
    config: DistillationConfig

    @property
    def schema(self) -> RowSchema:
        """The rows the scored siblings become."""
        return distill_schema(self.config)

    async def score(self, rows: Sequence[tuple[str | None, Sequence[int], int]]) -> list[Scored | BaseException]:
        """Teacher logprobs of each ``(task_source, token ids, prompt length)``: each teacher's rows split evenly
        among its replicas, one call per replica, all at once; a failed call (the teacher raised, died or ran past
        ``score_timeout_s``) fails each of its rows."""
        out: list[Scored | BaseException] = [RuntimeError("not scored")] * len(rows)
        parts: list[tuple[str, Any, list[int]]] = []
        by_teacher: dict[str, list[int]] = {}
        for i, (source, _, _) in enumerate(rows):
            try:
                by_teacher.setdefault(self.config.teacher_for(source), []).append(i)
            except KeyError as err:
                out[i] = err
        for name, idx in by_teacher.items():
            replicas = self.actors[name]
            share = -(-len(idx) // len(replicas))
            parts += [(name, replicas[j], idx[j * share:(j + 1) * share]) for j in range(len(replicas))
                      if idx[j * share:(j + 1) * share]]

        async def one(name: str, actor: Any, idx: list[int]) -> None:
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

        await asyncio.gather(*(one(name, actor, idx) for name, actor, idx in parts))
        return out


def spawn_teachers(config: DistillationConfig, temperature: float,
                   namespace_prefix: str = "screl") -> dict[str, list[Any]]:
    """Start ``teacher_replicas`` :class:`TeacherWorker` actors per teacher, each on ``teacher_device`` with its
    CPUs and GPUs (restarted by Ray up to ``max_teacher_restarts`` times)."""
    import ray

    remote_cls = ray.remote(TeacherWorker)
    c = config
    return {
        t.name: [remote_cls.options(  # type: ignore[attr-defined]
            num_cpus=c.num_cpus_per_teacher, num_gpus=c.num_gpus_per_teacher, max_restarts=c.max_teacher_restarts,
            max_task_retries=0, max_concurrency=16, name=f"{namespace_prefix}-teacher-{t.name}-{r}-{os.getpid()}",
        ).remote(t.name, t.policy, temperature, c.teacher_threads, c.top_k if c.estimator == "top_k" else 0,
                 c.teacher_device, c.teacher_chunk_tokens, c.teacher_batch_tokens)
            for r in range(c.teacher_replicas)]
        for t in c.teachers
    }


def check_teachers_fit(config: DistillationConfig, need: dict[str, float], cluster: dict[str, float]) -> None:
    """Fail before any actor starts when the teachers' workers do not fit beside ``need`` (``CPU``, ``GPU``) of
    other actors."""
    workers = len(config.teachers) * config.teacher_replicas
    for resource, each, key in (("CPU", config.num_cpus_per_teacher, "num_cpus_per_teacher"),
                                ("GPU", config.num_gpus_per_teacher, "num_gpus_per_teacher")):
        teachers, other, have = each * workers, need.get(resource, 0.0), float(cluster.get(resource, 0.0))
        if teachers > 0 and other + teachers > have:
            raise RuntimeError(
                f"the {len(config.teachers)} teacher(s) x {config.teacher_replicas} replica(s) x {each:g} {resource} "
                f"do not fit beside the generation workers and the data plane ({other:g} {resource}) in the Ray "
                f"cluster's {have:g} {resource}: raise ray.num_{resource.lower()}s, or lower "
                f"model.init_args.distillation.{key} or teacher_replicas")
