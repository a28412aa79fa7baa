"""``TaskMixture``: several tasks as one, each prompt tagged with its ``task_source`` (what multi-teacher
distillation routes on, ``distillation.teacher_map``, and what ``rollout_recovery`` overrides key on)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from screl.envs.base import PromptRecord, Task

if TYPE_CHECKING:
    from screl.models.spec import PolicySpec


class TaskMixture(Task):
    """The prompts of every task in ``tasks`` (interleaved, so each step sees all sources), each with
    ``metadata["task_source"]`` = its task's name and scored by that task.

    Args:
        tasks: Task source name -> task.
        id_stride: Source ``k``'s prompt ids are ``k * id_stride + `` the task's own id (must exceed every task's ids).
        tag_prompts: Prefix each prompt's text with ``"<source> "``, so the policy can tell the sources apart (two
            tasks over the same prompt texts, as ``CountLetter`` and ``Addition``, are otherwise indistinguishable).
    """

    def __init__(self, tasks: Mapping[str, Task], id_stride: int = 1000, tag_prompts: bool = True) -> None:
        if not tasks:
            raise ValueError("TaskMixture(tasks={}) needs at least one task: data.init_args.task.init_args.tasks")
        self.tasks = dict(tasks)
        self.names = list(self.tasks)
        self.id_stride = id_stride
        self.tag_prompts = tag_prompts
        for name, task in self.tasks.items():
            big = [p.prompt_id for p in [*task.prompts(), *task.val_prompts()] if not 0 <= p.prompt_id < id_stride]
            if big:
                raise ValueError(f"TaskMixture: task {name!r} has prompt ids outside [0, id_stride={id_stride}) "
                                 f"(e.g. {big[0]}): raise data.init_args.task.init_args.id_stride")

    def _wrap(self, k: int, records: Sequence[PromptRecord]) -> list[PromptRecord]:
        name = self.names[k]
        return [PromptRecord(k * self.id_stride + p.prompt_id, f"{name} {p.text}" if self.tag_prompts else p.text,
                             {**p.metadata, "task_source": name}) for p in records]

    def _interleave(self, per_task: list[list[PromptRecord]]) -> list[PromptRecord]:
        out: list[PromptRecord] = []
        for i in range(max((len(r) for r in per_task), default=0)):
            out.extend(records[i] for records in per_task if i < len(records))
        return out

    def prompts(self) -> list[PromptRecord]:
        return self._interleave([self._wrap(k, self.tasks[n].prompts()) for k, n in enumerate(self.names)])

    def val_prompts(self) -> list[PromptRecord]:
        return self._interleave([self._wrap(k, self.tasks[n].val_prompts()) for k, n in enumerate(self.names)])

    def _inner(self, prompt: PromptRecord) -> tuple[Task, PromptRecord]:
        k, pid = divmod(prompt.prompt_id, self.id_stride)
        name = self.names[k]
        text = prompt.text[len(name) + 1:] if self.tag_prompts else prompt.text
        meta = {key: v for key, v in prompt.metadata.items() if key != "task_source"}
        return self.tasks[name], PromptRecord(pid, text, meta)

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        task, inner = self._inner(prompt)
        return float(task.reward(inner, completion))

    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        out = [0.0] * len(prompts)
        by_task: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            by_task.setdefault(p.prompt_id // self.id_stride, []).append(i)
        for k, idx in by_task.items():
            task = self.tasks[self.names[k]]
            scores = task.rewards([self._inner(prompts[i])[1] for i in idx], [completions[i] for i in idx])
            for i, s in zip(idx, scores, strict=True):
                out[i] = float(s)
        return out

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        task, inner = self._inner(prompt)
        return task.masked(inner, completion)

    def prepare(self, policy: PolicySpec, run_dir: str) -> None:
        for task in self.tasks.values():
            task.prepare(policy, run_dir)
