"""``WithRewardFuncs``: any task's prompts, scored by TRL-style reward functions (:class:`RewardFuncs`)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from screl.envs.base import PromptKeys, PromptRecord, Scored, Task
from screl.rewards.funcs import RewardFunc, RewardFuncs

if TYPE_CHECKING:
    from screl.models.spec import PolicySpec


class CompletionTokens:
    """The token ids of completions known only as text (validation, a task that calls ``rewards``): the policy's
    tokenizer encodes them (no special tokens added), built on first use from the spec ``prepare`` was given."""

    def __init__(self) -> None:
        self.policy: PolicySpec | None = None
        self._tokenizer: Any = None

    def prepare(self, policy: PolicySpec) -> None:
        self.policy = policy

    def __call__(self, completions: Sequence[str]) -> list[list[int]]:
        if self.policy is None:
            raise RuntimeError("completion_ids of completions given as text need the policy's tokenizer: "
                               "call task.prepare(policy, run_dir) first (screl fit does)")
        if self._tokenizer is None:
            self._tokenizer = self.policy.build_tokenizer()
        return [list(self._tokenizer(c, add_special_tokens=False)["input_ids"]) for c in completions]

    def __getstate__(self) -> dict[str, Any]:
        return {"policy": self.policy, "_tokenizer": None}  # rebuilt where it is used


class WithRewardFuncs(Task):
    """A task's prompts, scored by reward functions with weights (TRL's ``reward_funcs``, ``reward_weights``).

    Args:
        task: The task whose prompts (and masks, images, held-out prompts) are used; its own reward is not.
        reward_funcs: Callables or ``"package.module:function"`` paths with TRL's signature
            ``fn(prompts, completions, completion_ids, **kwargs) -> list[float | None]`` (docs/rewards.md).
        reward_weights: One weight per function (default: all 1.0).
        reward_names: Metric names (``train/rewards/<name>/mean``); default each function's ``__name__``.
    """

    def __init__(self, task: Task, reward_funcs: Sequence[str | RewardFunc],
                 reward_weights: Sequence[float] | None = None, reward_names: Sequence[str] | None = None) -> None:
        self.task = task
        self.reward_funcs = RewardFuncs(reward_funcs, reward_weights, reward_names)
        self.completion_ids = CompletionTokens()

    def prompts(self) -> Sequence[PromptRecord]:
        """The wrapped task's prompts."""
        return self.task.prompts()

    def prompt_index(self) -> Iterator[PromptKeys]:
        """The wrapped task's."""
        return self.task.prompt_index()

    def prompt(self, prompt_id: int) -> PromptRecord:
        """The wrapped task's own lookup (a lazily built dataset's too)."""
        return self.task.prompt(prompt_id)

    def val_prompts(self) -> Sequence[PromptRecord]:
        """The wrapped task's held-out prompts."""
        return self.task.val_prompts()

    def val_prompt(self, prompt_id: int) -> PromptRecord:
        """A held-out prompt by id: the wrapped task's lookup where it has one."""
        lookup = getattr(self.task, "val_prompt", None)
        if lookup is not None:
            return lookup(prompt_id)  # type: ignore[no-any-return]
        return next(p for p in self.task.val_prompts() if p.prompt_id == prompt_id)

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        """The weighted total of one completion."""
        return self.rewards([prompt], [completion])[0]

    def rewards(self, prompts: Sequence[PromptRecord], completions: Sequence[str]) -> list[float]:
        """The weighted totals (completion ids from the policy's tokenizer); a non-finite value raises."""
        return self.reward_funcs.score(prompts, completions, self.completion_ids(completions)).totals

    def scored(self, prompts: Sequence[PromptRecord], completions: Sequence[str],
               completion_ids: Sequence[Sequence[int]]) -> list[Scored]:
        """Totals and per-function values with the sampled token ids (what the rollout workflow calls)."""
        return self.reward_funcs.scored(prompts, completions, completion_ids)

    def masked(self, prompt: PromptRecord, completion: str) -> bool:
        return self.task.masked(prompt, completion)

    def prepare(self, policy: PolicySpec, run_dir: str) -> None:
        """Prepare the wrapped task; keep the policy spec (its tokenizer encodes completions given as text)."""
        self.task.prepare(policy, run_dir)
        self.completion_ids.prepare(policy)
