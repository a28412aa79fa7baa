"""What happens to a prompt group dropped before it trains (kept apart so the core file stays about its main
transitions): after its retries (``drop``), or by dynamic sampling (``filter_group``, reason ``filtered``).

Its slot in the step is refilled from the replacement reserve (``on_dropped_prompt: replace``) or left empty: the
step shrinks, down to ``min_step_batch_fraction`` (PPO: not at all), and below that the run stops with an error
that names the knobs. Pure, like the core.

The core ends the group's run itself and hands in its effects, with itself as :class:`DropState`, the fields
these functions read and move; they call nothing of the core's, so this module does not import it.
"""

from __future__ import annotations

import math
from typing import Protocol

from screl.data import core_admission
from screl.data.core_types import Effects, GroupRun, RolloutFailure
from screl.data.events import DropEvent, ReplaceEvent


class DropState(core_admission.AdmissionState, Protocol):
    """What the drops read and move of the core's state: admission's (a refill holds spares back and takes one),
    the drop budget's counters, the steps' shortfall and the metrics."""

    consecutive_drops: int
    skipped_prompts: int
    shortfall: dict[int, int]
    metrics: dict[str, float]


def drop(core: DropState, run: GroupRun, reason: str, detail: str, eff: Effects) -> Effects:
    """Count a group dropped after its retries (``eff``: the effects of ending its run) against the drop budget,
    then refill or shrink its slot; past the budget, ``eff.error`` stops the run."""
    f = core.settings.failure
    core.consecutive_drops += 1
    budget_ok = ((reason.startswith("data") and core.skipped_prompts < f.max_skipped_prompts)
                 or (reason.startswith("infra") and core.consecutive_drops <= f.max_consecutive_dropped_prompts))
    eff.events.append(DropEvent(reason=reason, group_id=run.group_id, prompt_id=run.prompt_id))
    core.metrics["dropped"] += 1
    if not budget_ok:
        eff.error = RolloutFailure(
            f"prompt {run.prompt_id} (group {run.group_id}) failed: {reason} ({detail}); the drop budget "
            "async_rl.rollout_failure.max_skipped_prompts / max_consecutive_dropped_prompts is spent")
        return eff
    if reason.startswith("data"):
        core.skipped_prompts += 1
    if not _refill(core, run, eff):
        _shrink(core, run, eff, "drops")
    return eff


def filter_group(core: DropState, run: GroupRun, reward: float, eff: Effects) -> Effects:
    """Dynamic sampling: a group whose rewards all agree teaches nothing; drop it (reason ``filtered``; ``eff``:
    the effects of ending its run) and refill its slot. Not a failure: no drop budget is spent."""
    eff.events.append(DropEvent(reason="filtered", group_id=run.group_id, prompt_id=run.prompt_id,
                                extra={"reward": reward}))
    core.metrics["filtered"] += 1
    if not _refill(core, run, eff):
        _shrink(core, run, eff, f"dynamic sampling ({core.settings.algo_key}.use_dynamic_sampling)")
    return eff


def _refill(core: DropState, run: GroupRun, eff: Effects) -> bool:
    """Hand a dropped group's slot to a spare from the replacement reserve, stamped for the same step; it is
    reserved ahead of the queue. False: no spare, or the slot's ``max_replacement_attempts`` is spent."""
    stamp = run.target_step
    core_admission.hold_spares(core, eff, drained=True)
    if (stamp is not None and stamp < core.trainer_version) or not core.reserve.can_replace(run.replacements):
        return False
    prompt_id, epoch = core.reserve.take()
    core.admitted.appendleft((prompt_id, stamp, epoch, run.replacements + 1))
    eff.events.append(ReplaceEvent(group_id=run.group_id, prompt_id=run.prompt_id, replacement=prompt_id,
                                   target_step=stamp, extra={"attempt": run.replacements + 1,
                                                             "reserve": len(core.reserve)}))
    core.metrics["replaced"] += 1
    return True


def _shrink(core: DropState, run: GroupRun, eff: Effects, cause: str) -> None:
    """The slot stays empty: its step trains fewer groups, down to ``min_step_batch_fraction`` (PPO: none)."""
    step, f = run.target_step, core.settings.failure
    if step is None:  # no step to shrink (``screl check`` keeps drops away from samplers that cannot cope)
        return
    core.shortfall[step] = lost = core.shortfall.get(step, 0) + 1
    floor = math.ceil(core.P * f.min_step_batch_fraction) if core.settings.step_may_shrink else core.P
    if core.P - lost >= floor:
        return
    limit = (f"async_rl.rollout_failure.min_step_batch_fraction={f.min_step_batch_fraction}"
             if core.settings.step_may_shrink else "a full step (PPO trains full steps only)")
    lower = ", or lower min_step_batch_fraction" if core.settings.step_may_shrink else ""
    if core.settings.reserve.enabled and run.replacements >= core.settings.reserve.max_per_slot:
        fix = (f"its slot spent its async_rl.rollout_failure.max_replacement_attempts="
               f"{core.settings.reserve.max_per_slot}: raise it{lower}")
    elif core.settings.reserve.enabled:
        fix = f"no spare was left for its slot (the dataloader is exhausted){lower}"
    else:
        fix = f"set async_rl.rollout_failure.on_dropped_prompt: replace to refill dropped slots from a reserve{lower}"
    eff.error = RolloutFailure(f"step {step} lost {lost} of {core.P} groups to {cause}, below {limit}; {fix}")


def filter_hint(core: DropState) -> str:
    """What to add to a starvation error when dynamic sampling filtered groups."""
    n = int(core.metrics["filtered"])
    if not n:
        return ""
    return (f" ({n} group(s) were filtered by {core.settings.algo_key}.use_dynamic_sampling because their rewards all agreed: the task "
            "is too easy or too hard for the policy; use a task with reward spread, or turn dynamic sampling off)")
