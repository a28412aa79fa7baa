"""The capacity plan ``screl check`` prints for a valid config: the algorithm, the sampler and its staleness,
chunks, drops, the refit and its deadlines, the devices, threads, validation and recovery, one line each. Pure
reading of the config (no Ray, nothing started); every figure comes from the same objects the run builds."""

from __future__ import annotations

from typing import Any

from screl.config import SHADOW_MODE_NOTE, GenerationConfig, RunConfig, from_dict
from screl.config_distill import distill_plan_name
from screl.threads import ThreadPlan, thread_plan


def _generation_line(cfg: dict[str, Any]) -> str:
    from screl.controller.resources import worker_resources

    g = from_dict(GenerationConfig, cfg["data"]["init_args"].get("generation") or {})
    if g.colocated.enabled:
        return (f"colocated: one {g.backend} engine in the trainer's process, decoding with the trainer's module on "
                "its device (no worker process, no weight copy); a refit is a version bump")
    res = worker_resources(g)
    custom = "".join(f" + {v:g} {k}" for k, v in res.custom.items())
    where = " (only on nodes offering " + ", ".join(res.custom) + ")" if res.custom else ""
    return (f"{g.num_workers} worker(s), backend {g.backend} on {g.device}, {res.num_cpus:g} CPU / {res.num_gpus:g} "
            f"GPU{custom} each{where}; refits in {g.refit_bucket_mb:g} MiB buckets")


def _devices_line(cfg: dict[str, Any]) -> str:
    """The device map (:mod:`screl.placement`): per node the trainer's, the inference and the left-over GPUs."""
    from screl.placement import device_map

    return device_map(cfg).describe()


def _refit_line(cfg: dict[str, Any], run: RunConfig) -> str:
    """How a refit meets in-flight requests, and the per-request deadlines (the plan's ``refit`` line)."""
    from screl.rollout.engines.registry import engine_capabilities, engine_title

    g = from_dict(GenerationConfig, cfg["data"]["init_args"].get("generation") or {})
    a = run.async_rl
    if g.colocated.enabled:
        how = ("colocated: the engine stands down for each train step (KV caches freed); " +
               ("the requests in flight finish first (drain gate)" if not a.in_flight_weight_updates else
                "requests in flight across it re-prefill under the new weights at the wake"))
    elif not a.in_flight_weight_updates:
        how = ("drain gate: each refit waits for the in-flight requests to finish under the old weights, so no "
               "sample spans two versions; generation runs dry for the longest request at every step")
    elif a.recompute_kv_cache_after_weight_updates:
        how = "in flight: requests continue under the new weights, their KV cache recomputed"
    else:
        how = "in flight: requests continue under the new weights on their old KV cache"
    limits = [f"{k} {v:g} s" for k, v in (("generation", g.generation_timeout_s), ("rollout", g.rollout_timeout_s))
              if v is not None]
    paused = "stood-down and paused time excluded" if g.colocated.enabled else "paused time excluded"
    line = how + ("; deadlines: " + ", ".join(limits) + f" ({paused})" if limits else "")
    if g.min_new_tokens > 0 and engine_capabilities(g.backend).eos_masked_logprobs:
        line += (f"; note: the {engine_title(g.backend)} engine's logprobs of the first {g.min_new_tokens} tokens are "
                 "of the EOS-masked distribution, the trainer's are not (train/logprob_mismatch shows the gap; "
                 "min_new_tokens: 0 avoids it)")
    return line


def _correction_line(loss_args: dict[str, Any]) -> str:
    """How the loss corrects for stale rollouts (the plan's ``IS correction`` line)."""
    if loss_args.get("proximal_policy") == "behaviour":
        return "off (naive PPO: the ratio is clipped against the behaviour policy)"
    if not loss_args.get("use_importance_sampling_correction", False):
        return "off"
    level, trunc = loss_args.get("is_level", "token"), loss_args.get("is_truncation")
    bound = "untruncated" if trunc is None else f"{loss_args.get('is_mode', 'truncate')} at {trunc}"
    return f"on ({level} level, {bound}; decoupled PPO against the trainer's policy)"


def _thread_plan(cfg: dict[str, Any], run: RunConfig) -> ThreadPlan:
    data = cfg["data"]["init_args"]
    generation = from_dict(GenerationConfig, data.get("generation") or {})
    return thread_plan(generation, run, data.get("train_num_threads"))


def capacity_plan(cfg: dict[str, Any]) -> str:
    """The human summary ``screl check`` prints for a valid config."""
    run = RunConfig.from_dict(cfg["data"]["init_args"]["run"])
    sampler = run.sampler
    algo_name = run.algorithm.title
    distill = (cfg.get("model") or {}).get("init_args", {}).get("distillation") if isinstance(cfg.get("model"), dict) else None
    if isinstance(distill, dict):  # screl.Distill: GRPO's step, the teachers' objective (docs/distillation.md)
        algo_name = distill_plan_name(distill)
    knobs = {k: v for k, v in vars(sampler).items() if k != "name"}
    loss = (cfg.get("model") or {}).get("init_args", {}).get("loss_fn") or {}
    loss_args = loss.get("init_args", loss) if isinstance(loss, dict) else {}
    steps = run.algo.max_num_steps
    staleness = run.sampler_rules.describe()
    chunks = -(-run.groups_per_step // run.min_groups)
    ck = run.checkpointing
    lines = [
        f"algorithm            {algo_name}",
        f"groups per step      {run.groups_per_step}  (num_prompts_per_step)",
        f"rows per step        {run.rows_per_step}  ({run.groups_per_step} x {run.algo.num_generations_per_prompt}"
        " generations)",
        f"sampler              {sampler.name} {knobs}",
        f"lookahead/staleness  {staleness}",
        f"buffer capacity      required {run.required_capacity}, configured {run.max_buffered_rollouts} groups"
        + (" (max_buffered_rollouts)" if run.async_rl.max_buffered_rollouts is not None else
           " (default: room for the in-flight bound; set max_buffered_rollouts to change it)"),
        f"in-flight bound      {run.max_inflight_prompts} prompt groups (max_inflight_prompts)",
        f"streaming            >= {run.min_groups} groups per chunk, up to {chunks} chunk(s) per step",
        f"IS correction        {_correction_line(loss_args)}",
        f"max steps            {steps if steps is not None else 'epochs x batches / trainer.max_steps'}",
        f"checkpointing        {'on -> ' + str(ck.checkpoint_dir) if ck.enabled else 'off'}"
        + (f"; SHADOW MODE: {run.sampler.name} sampler {SHADOW_MODE_NOTE}"
           if ck.enabled and run.shadow_checkpoints else ""),
        f"torch threads        {_thread_plan(cfg, run).describe()}",
        f"generation           {_generation_line(cfg)}",
        f"devices              {_devices_line(cfg)}",
        f"refit                {_refit_line(cfg, run)}",
        f"dropped groups       {_drops_line(run)}",
        f"recovery             {_recovery_line(run)}",
        f"validation           {_validation_line(run)}",
        f"trainer memory       {trainer_memory_line(cfg)}",
    ]
    return "\n".join(lines)


def trainer_memory_line(cfg: dict[str, Any]) -> str:
    """The plan's estimate of one training process's peak memory (:func:`screl.modules.memory_plan.config_estimate`),
    from the policy's config (no weights are loaded)."""
    from screl.modules.memory_plan import config_estimate

    estimate, note = config_estimate(cfg)
    return note if estimate is None else estimate.describe() + note


def _validation_line(run: RunConfig) -> str:
    a, v = run.algo, run.algo.validation
    when = [w for w, on in (("the initial weights", a.val_at_start), (f"every {a.val_period} steps", a.val_period),
                            ("the final weights", a.val_at_end)) if on]
    if not when:
        return "off"
    how = "greedy" if v.temperature == 0 else f"temperature {v.temperature:g}"
    return (f"{', '.join(when)}: {v.num_samples} sample(s) per held-out prompt, {how}, pass at reward >= "
            f"{v.pass_threshold:g}; the next refit waits for it")


def _recovery_line(run: RunConfig) -> str:
    """What a failed, abandoned or restarted sibling costs its group (``token_capture``, ``rollout_recovery``)."""
    if not run.token_capture.enabled:
        return ("token capture off: a failed or restarted sibling regenerates its whole group (prompt_group); no "
                "finished generation is kept")
    rr = run.rollout_recovery
    overrides = len(rr.task_source_granularity_overrides) + len(rr.agent_granularity_overrides)
    what = {"sibling": "finished siblings are kept, only unfinished ones are generated again",
            "prompt_group": "a group with an unfinished sibling is generated again whole"}[rr.default_granularity]
    return f"token capture on: {rr.default_granularity} ({what})" + (f"; {overrides} override(s)" if overrides else "")


def _drops_line(run: RunConfig) -> str:
    """What happens to a group that is dropped (after its retries) or filtered (dynamic sampling)."""
    f = run.async_rl.rollout_failure
    what = "zero-variance groups filtered (dynamic sampling); " if run.algo.use_dynamic_sampling else ""
    if f.on_dropped_prompt == "replace":
        return (f"{what}slots refilled from a reserve of >= {f.replacement_reserve_prompts} spare prompts (whole "
                f"batches of {run.groups_per_step} held back), <= {f.max_replacement_attempts} per slot")
    floor = (f">= {f.min_step_batch_fraction:g} of a step" if run.algorithm.step_may_shrink
             else f"never ({run.algorithm.title} trains full steps)")
    return f"{what}the step shrinks, {floor}"
