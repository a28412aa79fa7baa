"""Tasks: a prompt dataset plus a reward function (the reward plugin point).

Write a reward in one of two ways:

* subclass :class:`Task` and implement ``prompts()`` and ``reward(prompt, completion)``;
* keep a task's prompts and give a plain function as ``"module:function"``, with the signature
  ``fn(prompt: PromptRecord, completion: str) -> float``, through :class:`CustomReward`
  (or :class:`JsonlTask` for prompts read from a JSONL file).

* or give TRL-style reward functions with weights (``fn(prompts, completions, completion_ids, **columns)``, a
  reward model, verl's ``compute_score``) through :mod:`screl.rewards` (``WithRewardFuncs``; docs/rewards.md).

``completion`` is the decoded completion text (:func:`decode_completion`: special tokens skipped,
as TRL decodes). Rewards must be deterministic plain floats and cheap; they run on the controller.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # annotations only: screl.envs stays importable without transformers
    from screl.models.spec import PolicySpec


PromptKeys = tuple[int, Any, Any, Any]
"""``(prompt_id, task_source, agent, dataset_id)`` of a prompt (:meth:`Task.prompt_index`)."""


@dataclass(frozen=True)
class PromptRecord:
    """One prompt of a task's dataset."""

    prompt_id: int
    """Stable integer id: the same prompt has the same id in every run and process."""
    text: str
    """The prompt text given to the tokenizer (no special tokens added)."""
    metadata: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    """Task-specific fields the reward needs (e.g. the operands ``a`` and ``b``)."""


RewardFn = Callable[[PromptRecord, str], float]
"""``fn(prompt, completion_text) -> float``."""


@dataclass(frozen=True)
class Scored:
    """One completion's reward as :meth:`Task.scored` gives it: the total, and for a task scored by several reward
    functions (:mod:`screl.rewards`) each function's own value (logged as ``train/rewards/<name>/mean`` and ``/std``)."""

    reward: float
    """The reward (the weighted sum of the functions' values)."""
    parts: dict[str, float] = field(default_factory=dict)
    """Each reward function's value by name; a function that returned ``None`` (does not apply) is absent."""
    unscorable: bool = False
    """Every reward function returned ``None``: the sample is masked out of the loss (TRL zeroes its advantage)."""
    error: BaseException | None = None
    """The sample could not be scored (a non-finite value): a data failure, resampled like a verifier error."""


class _Decoder(Protocol):
    def decode(self, token_ids: Any, skip_special_tokens: bool = ..., **kwargs: Any) -> Any: ...


def decode_completion(tokenizer: _Decoder, token_ids: Sequence[int]) -> str:
    """The completion text a reward sees: special tokens (pad, eos, bos) skipped, as TRL decodes."""
    return str(tokenizer.decode(list(token_ids), skip_special_tokens=True))


def load_reward_fn(target: str) -> RewardFn:
    """Import ``"package.module:function"`` and return the function."""
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward_fn={target!r} must have the form 'package.module:function'.")
    fn = importlib.import_module(module_name)
    for part in attr.split("."):
        fn = getattr(fn, part)
    if not callable(fn):
        raise TypeError(f"reward_fn={target!r} resolves to {fn!r}, which is not callable.")
    return fn  # type: ignore[return-value]


class Task(ABC):
    """A prompt dataset and a reward function. Subclass to plug in a task."""

    @abstractmethod
    def prompts(self) -> Sequence[PromptRecord]:
        """All prompts, in a fixed order, with unique stable ``prompt_id``s (a list, or a sequence that builds each
        record as it is read: :class:`screl.envs.DatasetTask`)."""

    @abstractmethod
    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """Score one decoded completion of ``prompt``."""

    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        """Score many completions (override to batch an expensive verifier)."""
        if len(prompts) != len(completions):
            raise ValueError(f"rewards: {len(prompts)} prompts but {len(completions)} completions.")
        return [float(self.reward(p, c)) for p, c in zip(prompts, completions, strict=True)]

    def scored(self, prompts: Sequence[PromptRecord], completions: Sequence[str],
               completion_ids: Sequence[Sequence[int]]) -> list[Scored]:
        """Score many completions with their token ids, and say what each reward function gave: what the rollout
        workflow calls (a task scored by :class:`screl.rewards.RewardFuncs` overrides it). Default: ``rewards``."""
        return [Scored(float(r)) for r in self.rewards(prompts, completions)]

    def images(self, prompt: PromptRecord) -> list[Any]:
        """The prompt's images (PIL images), drawn or loaded where they are used: on the rollout worker, never on the
        controller (a record carries ids and metadata only). A vision-language policy's prompts carry them
        (:mod:`screl.models.vision`). Default: none (a text task)."""
        return []

    def prompt_index(self) -> Iterator[PromptKeys]:
        """``(prompt_id, task_source, agent, dataset_id)`` of each training prompt, in order: what the rollout core
        keeps of it (its metadata's keys, None where absent). Default: read from :meth:`prompts`; a task that holds
        its prompts column-wise reads the columns alone (:class:`screl.envs.DatasetTask`)."""
        for p in self.prompts():
            yield p.prompt_id, p.metadata.get("task_source"), p.metadata.get("agent"), p.metadata.get("dataset_id")

    def val_prompts(self) -> Sequence[PromptRecord]:
        """Held-out prompts for validation during training (``grpo.val_period``, ``val_at_start``,
        ``val_at_end``), never trained on. Default: none (give ``data.init_args.val_task`` instead)."""
        return []

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        """Flag a sample to be excluded from the loss (a malformed tool call, an unparseable answer): it keeps its
        reward in its group's baseline, but no gradient comes from it. Default: nothing is masked."""
        return False

    def prepare(self, policy: PolicySpec, run_dir: str) -> None:
        """Called once before the rollout side starts (on global rank 0, before the task is sent to the workers),
        with the policy spec (``policy.build_tokenizer()``, ``policy.prompt_token_ids``) and the run directory.
        A task that filters or formats its prompts by the policy's tokenizer does it here
        (:class:`screl.envs.DatasetTask`); it must be idempotent. Default: nothing."""
        return None

    def prompt(self, prompt_id: int) -> PromptRecord:
        """Look a prompt up by id."""
        by_id: dict[int, PromptRecord] | None = self.__dict__.get("_by_id")
        if by_id is None:
            by_id = {}
            for rec in self.prompts():
                if rec.prompt_id in by_id:
                    raise ValueError(f"{type(self).__name__}: duplicate prompt_id {rec.prompt_id}.")
                by_id[rec.prompt_id] = rec
            self.__dict__["_by_id"] = by_id
        if prompt_id not in by_id:
            raise KeyError(f"{type(self).__name__} has no prompt_id {prompt_id}.")
        return by_id[prompt_id]


class HeldOut(Task):
    """A task's held-out prompts (``task.val_prompts()``) as a task of their own, scored by the same reward."""

    def __init__(self, task: Task) -> None:
        self.task = task
        self._records = task.val_prompts()

    def prompts(self) -> Sequence[PromptRecord]:
        return self._records

    def prompt(self, prompt_id: int) -> PromptRecord:
        """The wrapped task's own lookup of a held-out prompt (``val_prompt``) where it has one."""
        lookup = getattr(self.task, "val_prompt", None)
        return lookup(prompt_id) if lookup is not None else super().prompt(prompt_id)

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        return float(self.task.reward(prompt, completion))

    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        return self.task.rewards(prompts, completions)

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        return self.task.masked(prompt, completion)

    def prepare(self, policy: PolicySpec, run_dir: str) -> None:
        """Prepare the wrapped task, then take its held-out prompts again (preparing may filter them)."""
        self.task.prepare(policy, run_dir)
        self._records = self.task.val_prompts()
        self.__dict__.pop("_by_id", None)


class Verifier(ABC):
    """Scores completions against the reference answer their prompt carries (``prompt.metadata``): the reward
    of a task whose prompts come from data (``DatasetTask(verifier=...)``; :class:`screl.envs.MathVerify`).

    ``rewards`` runs on the rollout workers' executor threads, batched. Raising fails the batch: the workflow
    then scores each completion alone, and one that raises again is a data failure (its sibling is resampled,
    under ``failure.max_data_attempts``), never a zero reward."""

    @abstractmethod
    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        """One reward per completion."""

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        """Exclude the sample from the loss (:meth:`Task.masked`). Default: nothing is masked."""
        return False


class CustomReward(Task):
    """Another task's prompts scored by a user function.

    Args:
        task: The task whose prompts are used.
        reward_fn: ``"package.module:function"``; called as ``fn(prompt, completion) -> float``.
    """

    def __init__(self, task: Task, reward_fn: str) -> None:
        self.task = task
        self.reward_fn = reward_fn
        self._fn = load_reward_fn(reward_fn)

    def prompts(self) -> Sequence[PromptRecord]:
        """The wrapped task's prompts."""
        return self.task.prompts()

    def prompt_index(self) -> Iterator[PromptKeys]:
        """The wrapped task's."""
        return self.task.prompt_index()

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """The user function's score."""
        return float(self._fn(prompt, completion))


class SlowReward(Task):
    """Another task with a verifier that takes ``delay_s`` per completion (an expensive reward, simulated).

    A testing and benchmarking aid: rewards run on the rollout workers, so a slow verifier delays only the
    groups it scores, never the controller. ``rewards`` scores a batch in one call (one delay per completion).

    Args:
        task: The task whose prompts and rewards are used.
        delay_s: Seconds each completion's reward takes (>= 0).
    """

    def __init__(self, task: Task, delay_s: float = 0.2) -> None:
        if delay_s < 0:
            raise ValueError(f"SlowReward.delay_s must be >= 0, got {delay_s}")
        self.task = task
        self.delay_s = delay_s

    def prompts(self) -> Sequence[PromptRecord]:
        """The wrapped task's prompts."""
        return self.task.prompts()

    def prompt_index(self) -> Iterator[PromptKeys]:
        """The wrapped task's."""
        return self.task.prompt_index()

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """The wrapped task's reward, after ``delay_s``."""
        import time

        time.sleep(self.delay_s)
        return float(self.task.reward(prompt, completion))
