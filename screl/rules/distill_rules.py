"""``screl.Distill``'s ``model.init_args.distillation``: the teachers, their routing and their tokenizers.

A teacher scores the student's token ids as its own: a teacher whose tokenizer differs from the student's would
score other text, so it is refused, naming both. The map may name only known teachers, and a default teacher is
required (a prompt whose ``task_source`` the map does not name would have none).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from screl.config_distill import KEY, DistillationConfig, Teacher
from screl.rules.context import RuleContext, get, model_algorithm
from screl.rules.megatron_generation_rules import is_megatron_strategy


def _is_distill(cfg: Mapping[str, Any]) -> bool:
    found = model_algorithm(cfg)
    return found is not None and found.name == "distill"


def _spec(value: Any) -> Any:
    """A policy spec from its config (``{class_path, init_args}``, or an already built spec); None if it cannot be
    imported (the parser reports that itself)."""
    if not isinstance(value, Mapping):
        return value if hasattr(value, "build_tokenizer") else None
    module, _, name = str(value.get("class_path", "")).rpartition(".")
    try:
        return getattr(importlib.import_module(module), name)(**dict(value.get("init_args") or {}))
    except (ImportError, AttributeError, TypeError, ValueError):
        return None


def _describe(spec: Any) -> str:
    fields = {k: v for k, v in vars(spec).items() if v is not None and k in ("path", "tokenizer_path", "scale")}
    return f"{type(spec).__name__}({', '.join(f'{k}={v!r}' for k, v in fields.items())})"


def _vocab(spec: Any) -> dict[str, int] | str:
    """The spec's tokenizer vocabulary, or why it could not be built."""
    try:
        return dict(spec.build_tokenizer().get_vocab())
    except Exception as err:  # noqa: BLE001 - reported as a problem naming the key
        return f"{type(err).__name__}: {err}"


def _difference(student: dict[str, int], teacher: dict[str, int]) -> str:
    only = sorted(set(teacher) - set(student))[:3]
    missing = sorted(set(student) - set(teacher))[:3]
    moved = sorted(t for t in set(student) & set(teacher) if student[t] != teacher[t])[:3]
    parts = [f"{len(teacher)} tokens against the student's {len(student)}"]
    if only:
        parts.append(f"tokens the student lacks: {only}")
    if missing:
        parts.append(f"student tokens it lacks: {missing}")
    if moved:
        parts.append(f"tokens with other ids: {moved}")
    return "; ".join(parts)


def distill_rules(c: RuleContext) -> None:
    if not _is_distill(c.cfg):
        return
    raw = get(c.cfg, KEY)
    if not isinstance(raw, Mapping):
        c.bad(KEY, raw, "screl.Distill needs its distillation block", "give model.init_args.distillation: {teachers: "
              "[{name: ..., policy: {class_path: ...}}], default_teacher: ...}")
        return
    teachers = [t for t in raw.get("teachers") or [] if isinstance(t, Mapping)]
    cfg = DistillationConfig(
        teachers=[Teacher(str(t.get("name")), t.get("policy")) for t in teachers],  # type: ignore[arg-type]
        teacher_map=dict(raw.get("teacher_map") or {}), default_teacher=raw.get("default_teacher"),
        **{k: raw[k] for k in ("reward_weight", "kl_coef", "num_cpus_per_teacher", "teacher_threads",
                               "score_timeout_s", "top_k", "num_gpus_per_teacher", "teacher_replicas",
                               "teacher_batch_tokens", "teacher_chunk_tokens") if isinstance(raw.get(k), (int, float))},
        **{k: raw[k] for k in ("estimator", "kl_direction", "teacher_device") if k in raw},
    )
    for key, value, why, fix in cfg.problems():
        c.bad(key, value, why, fix)
    if cfg.estimator == "top_k" and is_megatron_strategy(c.cfg):
        c.bad(f"{KEY}.estimator", "top_k", "the top-k estimator reads the output layer's rows of the teacher's tokens, "
              "which MegatronStrategy shards over the tensor-parallel ranks (not built)",
              "use estimator: sampled under MegatronStrategy, or train under the default strategy or DDPStrategy")
    student = _spec(get(c.cfg, "model.init_args.policy"))
    if student is None:
        return
    student_vocab = _vocab(student)
    if isinstance(student_vocab, str):
        return  # the student's own problem, not the teachers'
    for i, t in enumerate(cfg.teachers):
        spec = _spec(t.policy)
        key = f"{KEY}.teachers[{i}].policy"
        if spec is None:
            continue
        vocab = _vocab(spec)
        if isinstance(vocab, str):
            c.bad(key, _describe(spec), f"teacher {t.name!r}'s tokenizer cannot be built ({vocab})",
                  "point the teacher's path (or tokenizer_path) at a saved model and tokenizer")
        elif vocab != student_vocab:
            c.bad(key, _describe(spec), f"teacher {t.name!r} ({_describe(spec)}) has a tokenizer that differs from "
                  f"the student's ({_describe(student)}): {_difference(student_vocab, vocab)}; it would score other "
                  "text than the student sampled",
                  "use a teacher trained with the student's tokenizer (distillation across tokenizers is not "
                  "supported)")
