"""The rollout core's settings and the recovery policy, read from the run config (pure, no Ray): what the
controller hands :class:`screl.data.core.RolloutCore` when it starts."""

from __future__ import annotations

from screl.config import RunConfig
from screl.data.core_types import CorePrompt, CoreSettings, FailureBudget
from screl.data.ledger import RecoveryPolicy
from screl.data.prompt_table import PromptTable
from screl.data.reserve import ReservePolicy
from screl.envs import Task

__all__ = ["core_prompts", "core_settings", "recovery_policy"]


def core_settings(run: RunConfig, task: Task, num_workers: int, seed: int, id_prefix: str = "") -> CoreSettings:
    """The core's settings from the run config (prompt routing keys from each prompt's metadata)."""
    algo, f = run.algo, run.async_rl.rollout_failure
    warmup = getattr(algo, "policy_training_start_step", 0) if run.algorithm.needs_critic else None
    return CoreSettings(
        prompts=core_prompts(task), groups_per_step=algo.num_prompts_per_step,
        generations_per_prompt=algo.num_generations_per_prompt, max_num_epochs=algo.max_num_epochs,
        max_num_steps=algo.max_num_steps, min_groups=run.min_groups,
        max_buffered_rollouts=run.max_buffered_rollouts, max_inflight_prompts=run.max_inflight_prompts,
        num_workers=num_workers, seed=seed, id_prefix=id_prefix,
        policy_training_start_step=warmup,
        failure=FailureBudget(**{name: getattr(f, name) for name in FailureBudget.__dataclass_fields__}),
        dynamic_sampling=algo.use_dynamic_sampling, step_may_shrink=run.algorithm.step_may_shrink,
        algo_key=run.algorithm.config_key,
        reserve=ReservePolicy(enabled=f.on_dropped_prompt == "replace", size=f.replacement_reserve_prompts,
                              max_per_slot=f.max_replacement_attempts),
    )


def core_prompts(task: Task) -> PromptTable:
    """The core's table of the task's training prompts: ids and the keys recovery granularity is routed by, read
    one prompt at a time (a million-prompt task is not held as records here)."""
    return PromptTable(CorePrompt(*keys) for keys in task.prompt_index())


def recovery_policy(run: RunConfig) -> RecoveryPolicy:
    """``rollout_recovery``'s granularities; without token capture (``token_capture.enabled: false``) no finished
    sibling is kept for an unfinished group, so every group recovers whole (``prompt_group``)."""
    rr = run.rollout_recovery
    if not run.token_capture.enabled:
        return RecoveryPolicy(default_granularity="prompt_group")  # type: ignore[arg-type]
    return RecoveryPolicy(
        default_granularity=rr.default_granularity,  # type: ignore[arg-type]
        task_source_granularity_overrides=dict(rr.task_source_granularity_overrides),  # type: ignore[arg-type]
        agent_granularity_overrides=dict(rr.agent_granularity_overrides),  # type: ignore[arg-type]
    )
