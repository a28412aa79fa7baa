"""The ``distillation`` block of ``screl.Distill`` (``model.init_args.distillation``): the teachers, which prompts each
one scores (by ``task_source``), and how the teacher signal mixes with the task reward.

Plain values only (a teacher's model is a picklable policy spec): the trainer, the rollout runtime and
``screl check`` read the same object.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from screl.algorithms import Algorithm, register_algorithm
from screl.config_algo import GRPOConfig
from screl.models.spec import PolicySpec

KEY = "model.init_args.distillation"
TEACHER_DEVICES = ("cpu", "cuda")
ESTIMATORS = ("sampled", "top_k")
KL_DIRECTIONS = ("reverse", "forward")


@dataclass
class Teacher:
    """One named teacher: a policy spec (an HF directory, a tiny in-memory model) that scores the student's tokens."""

    name: str
    """What ``teacher_map`` and ``default_teacher`` call it."""
    policy: PolicySpec
    """The teacher model (``screl.models.HFCausalLM``, ``screl.models.TinyCausalLM``, ...); its tokenizer must be the
    student's."""


@dataclass
class DistillationConfig:
    """Multi-teacher on-policy distillation."""

    teachers: list[Teacher] = field(default_factory=list)
    """The teachers, each with a unique name; each runs in a Ray worker of its own (scoring only)."""
    teacher_map: dict[str, str] = field(default_factory=dict)
    """``task_source`` (a prompt's ``metadata["task_source"]``) -> teacher name; other prompts go to
    ``default_teacher``."""
    default_teacher: str | None = None
    """The teacher of prompts whose task source the map does not name (required unless the map covers every
    prompt: ``screl check`` refuses it missing)."""
    reward_weight: float = 0.0
    """Weight of the task reward's GRPO advantage added to every token's distillation advantage (0: pure
    distillation; the reward is still logged)."""
    kl_coef: float = 1.0
    """Weight of the reverse-KL term (``sampled``: the per-token advantage teacher logprob - student behaviour
    logprob; ``top_k``: the exact reverse KL over the teacher's top-k tokens at each completion position)."""
    estimator: str = "sampled"
    """How the reverse KL toward the teacher is estimated. ``sampled``: from the sampled token alone, as a per-token
    advantage through the clipped policy-gradient surrogate (the teacher returns one logprob per token).
    ``top_k``: exactly at each completion position, over the teacher's ``top_k`` most likely next tokens plus one
    bucket for the rest of the vocabulary (the teacher returns k ids and logprobs per token; with k = vocabulary size
    it is the full reverse KL). It needs no lucky sample of the teacher's answer, so it pulls a student that starts
    far from its teacher (see docs/distillation.md)."""
    kl_direction: str = "reverse"
    """``estimator: top_k``: ``reverse`` (``KL(student || teacher)``, mode-seeking, the default) or ``forward``
    (``KL(teacher || student)`` at each position the student visited: the cross-entropy toward the teacher's
    distribution, which raises a teacher's answer the student gives almost no mass; see docs/distillation.md). The
    ``sampled`` estimator is reverse only."""
    top_k: int = 16
    """``estimator: top_k``: how many of the teacher's most likely tokens each position carries (capped at the
    vocabulary; each costs 8 bytes per completion token in the row)."""
    num_cpus_per_teacher: float = 1.0
    """Logical CPUs Ray reserves for each teacher worker."""
    teacher_threads: int = 1
    """Torch intra-op threads of each teacher worker."""
    teacher_device: str = "cpu"
    """Where each teacher worker runs its model: ``cpu`` or ``cuda`` (the GPU Ray gives it:
    ``num_gpus_per_teacher`` > 0)."""
    num_gpus_per_teacher: float = 0.0
    """GPUs Ray reserves for each teacher worker (``teacher_device: cuda``; a fraction shares a GPU)."""
    teacher_replicas: int = 1
    """Workers per teacher, each with its own copy of the model; a teacher's rows of a call are split among them."""
    teacher_batch_tokens: int = 16384
    """Padded tokens (rows x width) of one teacher forward: a call's sequences go in forwards of at most this many,
    longest first (at least one sequence each), which bounds the teacher's activations."""
    teacher_chunk_tokens: int | None = None
    """Completion positions whose logits a teacher computes at once (the trainer's chunked logprobs,
    :mod:`screl.models.logprobs`: never ``[tokens, vocabulary]``); None sizes it from the vocabulary (128 MiB of
    fp32 logits), 0 computes full logits (teachers whose output layer is not a plain linear head)."""
    max_teacher_restarts: int = -1
    """Times Ray restarts a teacher worker whose process died (-1: always); its calls fail meanwhile (a data failure
    each: the sibling is resampled within ``rollout_failure.max_data_attempts``)."""
    score_timeout_s: float = 120.0
    """Longest wait for one teacher call; past it the call is a data failure."""

    @classmethod
    def coerce(cls, value: DistillationConfig | Mapping[str, Any] | None) -> DistillationConfig:
        if value is None:
            return cls()
        if isinstance(value, DistillationConfig):
            return value
        data = dict(value)
        data["teachers"] = [t if isinstance(t, Teacher) else Teacher(**t) for t in data.get("teachers", [])]
        return cls(**data)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.teachers]

    def teacher_for(self, task_source: str | None) -> str:
        """The teacher that scores a prompt of ``task_source`` (KeyError naming the key when none does)."""
        if task_source is not None and task_source in self.teacher_map:
            return self.teacher_map[task_source]
        if self.default_teacher is None:
            raise KeyError(f"no teacher for task_source {task_source!r}: {KEY}.teacher_map does not name it and "
                           f"{KEY}.default_teacher is not set")
        return self.default_teacher

    def problems(self) -> list[tuple[str, Any, str, str]]:
        """Every structural problem as ``(dotted key, value, why, fix)`` (tokenizers are checked by
        ``screl.rules.distill_rules``, which builds them)."""
        out: list[tuple[str, Any, str, str]] = []
        names = self.names
        if not self.teachers:
            out.append((f"{KEY}.teachers", [], "screl.Distill needs at least one teacher",
                        "list the teachers: [{name: ..., policy: {class_path: ...}}]"))
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            out.append((f"{KEY}.teachers", dupes, "teacher names must be unique", "rename the duplicates"))
        for source, name in self.teacher_map.items():
            if name not in names:
                out.append((f"{KEY}.teacher_map.{source}", name, f"names an unknown teacher (teachers: {names})",
                            "name one of the teachers, or add a teacher of that name"))
        if self.default_teacher is None:
            out.append((f"{KEY}.default_teacher", None, "no default teacher: a prompt whose task_source the map does "
                        "not name would have none", f"set default_teacher to one of {names}"))
        elif self.default_teacher not in names:
            out.append((f"{KEY}.default_teacher", self.default_teacher,
                        f"names an unknown teacher (teachers: {names})", "name one of the teachers"))
        for key, value, ok, fix in (
            ("reward_weight", self.reward_weight, self.reward_weight >= 0.0, "use 0 for pure distillation"),
            ("kl_coef", self.kl_coef, self.kl_coef > 0.0, "use 1.0; for reward-only training use screl.GRPO"),
            ("num_cpus_per_teacher", self.num_cpus_per_teacher, self.num_cpus_per_teacher >= 0.0, "use e.g. 1"),
            ("teacher_threads", self.teacher_threads, self.teacher_threads >= 1, "use e.g. 1"),
            ("score_timeout_s", self.score_timeout_s, self.score_timeout_s > 0.0, "use e.g. 120"),
            ("estimator", self.estimator, self.estimator in ESTIMATORS, f"use one of {list(ESTIMATORS)}"),
            ("top_k", self.top_k, self.top_k >= 1, "use e.g. 16 (the vocabulary size for the full reverse KL)"),
            ("kl_direction", self.kl_direction, self.kl_direction in KL_DIRECTIONS, f"use one of {list(KL_DIRECTIONS)}"),
        ):
            if not ok:
                out.append((f"{KEY}.{key}", value, "out of range", fix))
        out += self._placement_problems()
        if self.kl_direction == "forward" and self.estimator == "sampled":
            out.append((f"{KEY}.kl_direction", "forward", "the sampled estimator sees one token per position, so it "
                        "estimates the reverse KL only", "set estimator: top_k, or kl_direction: reverse"))
        return out


    def _placement_problems(self) -> list[tuple[str, Any, str, str]]:
        """The teacher workers' placement and batching keys."""
        out = [(f"{KEY}.{key}", value, "out of range", fix) for key, value, ok, fix in (
            ("teacher_device", self.teacher_device, self.teacher_device in TEACHER_DEVICES,
             f"use one of {list(TEACHER_DEVICES)}"),
            ("num_gpus_per_teacher", self.num_gpus_per_teacher, self.num_gpus_per_teacher >= 0.0, "use e.g. 1"),
            ("teacher_replicas", self.teacher_replicas, self.teacher_replicas >= 1, "use e.g. 1"),
            ("teacher_batch_tokens", self.teacher_batch_tokens, self.teacher_batch_tokens >= 1, "use e.g. 16384"),
            ("teacher_chunk_tokens", self.teacher_chunk_tokens,
             self.teacher_chunk_tokens is None or self.teacher_chunk_tokens >= 0,
             "use null (sized from the vocabulary), or 0 for full logits"),
        ) if not ok]
        if self.teacher_device == "cuda" and self.num_gpus_per_teacher <= 0.0:
            out.append((f"{KEY}.num_gpus_per_teacher", self.num_gpus_per_teacher, "teacher_device: cuda needs a GPU "
                        "share: Ray shows a worker no GPU it did not reserve", "set num_gpus_per_teacher, e.g. 1"))
        if self.teacher_device == "cpu" and self.num_gpus_per_teacher > 0.0:
            out.append((f"{KEY}.num_gpus_per_teacher", self.num_gpus_per_teacher, "reserves GPUs that teachers on "
                        "the CPU never use", "set teacher_device: cuda, or num_gpus_per_teacher: 0"))
        return out


def distill_plan_name(raw: Mapping[str, Any]) -> str:
    """The algorithm line ``screl check`` prints for a (valid) raw ``distillation`` block."""
    names = [t.get("name") for t in raw.get("teachers") or [] if isinstance(t, Mapping)]
    top_k = (f", top-{raw.get('top_k', 16)} {raw.get('kl_direction', 'reverse')} KL"
             if raw.get("estimator") == "top_k" else "")
    return (f"Distill (GRPO steps; teachers {names}, map {raw.get('teacher_map') or {}}, default "
            f"{raw.get('default_teacher')!r}, reward_weight {raw.get('reward_weight', 0.0)}{top_k})")


# Distill trains GRPO's steps on the `grpo` block; its teachers are `model.init_args.distillation` (above)
register_algorithm(Algorithm(
    name="distill", title="Distill", config_key="grpo", module="screl.modules.distill.Distill", block=GRPOConfig,
    step_may_shrink=True, needs_critic=False, default_adv_estimator="grpo", min_generations_per_prompt=2,
    rules=("screl.rules.distill_rules:distill_rules",),
    megatron_context_parallel=False,
    vision_refusal="distillation rows carry the teachers' logprobs, not {policy}'s images (the teachers would "
                   "score the completions without them)",
))
