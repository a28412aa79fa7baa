"""Rules on the run itself: the algorithm block, the sampler and what it needs, losses, failure budgets,
batch sizes, generation."""

from __future__ import annotations

import importlib
from collections.abc import Mapping

from screl.algorithms import algorithm, block_keys
from screl.algos import adv_estimator_names, get_adv_estimator
from screl.data.sampler_config import InOrderSamplerConfig
from screl.data.sampler_factory import required_buffer_capacity
from screl.rollout.engines.registry import resolve_backend
from screl.rollout.moved import MovedPathError, moved_to
from screl.rollout.workflows.reward_transform import load_shaping_fn
from screl.rules.context import (
    LEGACY_MIGRATION,
    RuleContext,
    construct_problem,
    get,
    model_algorithm,
    rule_at,
    workflow_problem,
)


def algorithm_rules(c: RuleContext) -> None:
    present = [key for key in block_keys() if c.cfg.get(key) is not None]
    if len(present) > 1:
        c.bad(present[0], "<set>", f"{' and '.join(f'`{k}`' for k in present)} are mutually exclusive",
              "keep the block of the algorithm you run")
    elif not present:
        c.bad("grpo", None, "no algorithm block", "add a `grpo:` block (or `ppo:` for a PPO run)")
    model = model_algorithm(c.cfg)
    if model is not None and present == [c.algo_key] and model.config_key != c.algo_key:
        c.bad(c.algo_key, "<set>", f"model is a {model.title} module but the step settings are in `{c.algo_key}`",
              f"rename the block `{model.config_key}`, or use model.class_path: {_module_for_block(c.algo_key)}")
    key, algo = c.algo_key, c.algo_cfg
    for name in ("num_prompts_per_step", "num_generations_per_prompt"):
        value = getattr(algo, name)
        if not isinstance(value, int) or value < 1:
            c.bad(f"{key}.{name}", value, "must be an integer >= 1", f"set {key}.{name} >= 1")
    least = (model or c.algorithm).min_generations_per_prompt
    if algo.num_generations_per_prompt == 1 and least > 1:
        c.bad(f"{key}.num_generations_per_prompt", 1, f"{(model or c.algorithm).title}'s group baseline needs at "
              f"least {least} rollouts per prompt", f"set {key}.num_generations_per_prompt >= {least}")
    epochs = algo.max_num_epochs
    if not isinstance(epochs, int) or epochs <= 0:
        c.bad(f"{key}.max_num_epochs", epochs, "must be positive (there is no -1 = unbounded convention; "
              "<= 0 would train zero steps)", f"set a positive {key}.max_num_epochs and bound the run with "
              f"{key}.max_num_steps")
    steps = algo.max_num_steps
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        c.bad(f"{key}.max_num_steps", steps, "must be >= 1 or null", f"set {key}.max_num_steps >= 1")
    _unsupported_algorithm_knobs(c)


def _module_for_block(key: str) -> str:
    """The short class path of the block's own algorithm (``screl.PPO`` for ``ppo``)."""
    return "screl." + algorithm(key).module.rsplit(".", 1)[-1]


def _unsupported_algorithm_knobs(c: RuleContext) -> None:
    key, algo = c.algo_key, c.algo_cfg
    for legacy in ("async_grpo", "async_ppo"):
        if getattr(algo, legacy, None) is not None:
            c.bad(f"{key}.{legacy}", getattr(algo, legacy), "legacy async block: the single controller reads "
                  "`async_rl`", LEGACY_MIGRATION)
    _validation_rules(c)
    _dynamic_sampling_rules(c)
    _reward_transform_rules(c)


def _validation_rules(c: RuleContext) -> None:
    key, algo = c.algo_key, c.algo_cfg
    period = algo.val_period
    if not isinstance(period, int) or isinstance(period, bool) or period < 0:
        c.bad(f"{key}.val_period", period, "must be an integer >= 0 (0: off)", f"set {key}.val_period: 0 or N >= 1")
    v, vkey = algo.validation, f"{key}.validation"
    n, temp = v.num_samples, v.temperature
    if not isinstance(n, int) or n < 1:
        c.bad(f"{vkey}.num_samples", n, "must be an integer >= 1", "set num_samples >= 1")
    if not isinstance(temp, (int, float)) or temp < 0:
        c.bad(f"{vkey}.temperature", temp, "must be >= 0 (0: greedy)", "set temperature >= 0")
    elif isinstance(n, int) and n > 1 and temp == 0:
        c.bad(f"{vkey}.num_samples", n, "greedy validation (temperature 0) gives every sample the same completion",
              "set validation.temperature > 0 for pass@k, or num_samples: 1")
    top_p = v.top_p
    if not isinstance(top_p, (int, float)) or not 0 < top_p <= 1:
        c.bad(f"{vkey}.top_p", top_p, "must be in (0, 1]", "set top_p in (0, 1]")
    for knob in ("max_new_tokens", "max_prompts"):
        value = getattr(v, knob)
        if value is not None and (not isinstance(value, int) or value < 1):
            c.bad(f"{vkey}.{knob}", value, "must be an integer >= 1 or null", f"set {knob} >= 1 or null")
    if (period or algo.val_at_start or algo.val_at_end) and _held_out_count(c) == 0:
        c.bad("data.init_args.val_task", None, f"validation is on ({key}.val_period / val_at_start / val_at_end) "
              "but the task holds out no prompts (Task.val_prompts() is empty)",
              "give data.init_args.val_task, or hold prompts out of the task (e.g. CountLetter holdout: 20)")


def _held_out_count(c: RuleContext) -> int | None:
    """How many validation prompts the config gives (None: unknown, e.g. a task that cannot be built here)."""
    data = get(c.cfg, "data.init_args", None) or {}
    if data.get("val_task") is not None:
        return None
    task = data.get("task") or {}
    path, args = task.get("class_path"), task.get("init_args") or {}
    if not isinstance(path, str) or any(isinstance(a, Mapping) for a in args.values()):
        return None
    module, _, name = path.rpartition(".")
    try:
        return len(getattr(importlib.import_module(module), name)(**dict(args)).val_prompts())
    except Exception:  # noqa: BLE001 - the datamodule reports it, naming the task, when the run is built
        return None


def _dynamic_sampling_rules(c: RuleContext) -> None:
    key = c.algo_key
    if not c.algo_cfg.use_dynamic_sampling:
        return
    if c.G < 2:
        c.bad(f"{key}.num_generations_per_prompt", c.G, "dynamic sampling drops groups whose rewards all agree, "
              "and a group of one always agrees", f"set {key}.num_generations_per_prompt >= 2")
    dropped = c.rf_cfg.on_dropped_prompt
    replace = dropped == "replace"
    if not c.algorithm.step_may_shrink and not replace:
        c.bad("async_rl.rollout_failure.on_dropped_prompt", dropped,
              f"{c.algorithm.title} trains full steps only, so a filtered group's slot must be refilled",
              "set async_rl.rollout_failure.on_dropped_prompt: replace")
    if c.rules is not None and not c.rules.supports_drop_budgets and not replace:
        c.bad("async_rl.rollout_failure.on_dropped_prompt", dropped,
              f"the {c.rules.name} sampler does not stamp target steps: a filtered group would leave its gate "
              "waiting forever for a group that never comes", "set async_rl.rollout_failure.on_dropped_prompt: "
              "replace (filtered slots are refilled from the reserve), or use sampler in_order")


def _reward_transform_rules(c: RuleContext) -> None:
    key, sh, sc = c.algo_key, c.algo_cfg.reward_shaping, c.algo_cfg.reward_scaling
    if sh.enabled:
        buf, fn = sh.overlong_buffer_length, sh.class_path
        if not (isinstance(buf, int) and buf >= 0):
            c.bad(f"{key}.reward_shaping.overlong_buffer_length", buf, "must be an integer >= 0", "set it >= 0")
        if not buf and not fn:
            c.bad(f"{key}.reward_shaping.enabled", True, "shaping is on but shapes nothing",
                  "set overlong_buffer_length > 0 and/or class_path, or enabled: false")
        length = sh.max_response_length or c.gen_cfg.max_new_tokens
        if isinstance(buf, int) and buf > length:
            c.bad(f"{key}.reward_shaping.overlong_buffer_length", buf, f"exceeds the penalty's max_response_length "
                  f"({length})", f"set it <= {length}")
        if fn and moved_to(str(fn)) is None:  # a moved path: moved_path_rules names its new home
            try:
                load_shaping_fn(str(fn), f"{key}.reward_shaping.class_path")
            except ValueError as err:
                c.bad(f"{key}.reward_shaping.class_path", fn, str(err).split(": ", 1)[-1],
                      "name an importable fn(reward, response_length, finish_reason)")
    if sc.enabled and not sc.source_max > sc.source_min:
        c.bad(f"{key}.reward_scaling.source_max", sc.source_max, f"must exceed source_min ({sc.source_min})",
              "give a non-empty source range")


def sampler_block_rules(c: RuleContext) -> None:
    for key, msg in c.sampler_errors:
        c.bad(key, get(c.cfg, key), msg, "see `screl fit --help` for each sampler's knobs")
    P, m = c.P, c.min_groups_raw
    if not isinstance(m, int) or m < 1:
        c.bad("async_rl.min_groups_for_streaming_train", m, "must be an integer >= 1",
              f"set it between 1 and {c.algo_key}.num_prompts_per_step ({P})")
    elif m > P:
        c.bad("async_rl.min_groups_for_streaming_train", m,
              f"exceeds {c.algo_key}.num_prompts_per_step ({P}): a step could never be assembled", f"set it <= {P}")
    for knob in ("max_inflight_prompts", "max_buffered_rollouts"):
        v = getattr(c.async_cfg, knob)
        if v is not None and (not isinstance(v, int) or v < 1):
            c.bad(f"async_rl.{knob}", v, "must be an integer >= 1 or null (derived)", f"set async_rl.{knob} >= 1")
    if c.sampler is None or c.rules is None:
        return
    need = required_buffer_capacity(c.sampler, P, c.min_groups)
    have = c.async_cfg.max_buffered_rollouts
    if isinstance(have, int) and 1 <= have < need:
        c.bad("async_rl.max_buffered_rollouts", have,
              f"below the {c.rules.name} sampler's required capacity {need} ({c.rules.capacity_rule()}): "
              "the rollout pump would deadlock", f"set async_rl.max_buffered_rollouts >= {need}")
    _sampler_needs_rules(c)


def _sampler_needs_rules(c: RuleContext) -> None:
    """What the configured sampler needs from the rest of the config (its own rule hooks say)."""
    assert c.sampler is not None and c.rules is not None
    loss_is = get(c.cfg, "model.init_args.loss_fn.init_args.use_importance_sampling_correction")
    if loss_is is None:  # unset: off (the loss's default)
        loss_is = bool(get(c.cfg, "model.init_args.loss_fn.use_importance_sampling_correction"))
    proximal = get(c.cfg, "model.init_args.loss_fn.init_args.proximal_policy")
    needed = c.rules.correction_needed()  # naive PPO (clipping against the behaviour policy) is a correction too
    if needed is not None and not loss_is and proximal != "behaviour":
        c.bad("model.init_args.loss_fn.init_args.use_importance_sampling_correction", loss_is, *needed)
    budget = c.rf_cfg.max_skipped_prompts + c.rf_cfg.max_consecutive_dropped_prompts
    if budget > 0 and not c.rules.supports_drop_budgets and c.rf_cfg.on_dropped_prompt != "replace":
        c.bad("async_rl.rollout_failure.max_skipped_prompts", budget,
              f"drop budgets need a sampler that stamps target steps; {c.rules.name} would wait forever for a "
              "dropped group", "use sampler in_order, set on_dropped_prompt: replace, or set both drop budgets to 0")
    warm = c.sampler.warmup_lookahead_versions if isinstance(c.sampler, InOrderSamplerConfig) else None
    if warm is not None and not getattr(c.algo_cfg, "policy_training_start_step", None):
        if c.algorithm.needs_critic:
            c.bad("async_rl.sampler.warmup_lookahead_versions", warm,
                  f"requires {c.algo_key}.policy_training_start_step > 0 (it is the lookahead during critic warmup)",
                  f"set {c.algo_key}.policy_training_start_step > 0 or remove the knob")
        else:
            c.bad("async_rl.sampler.warmup_lookahead_versions", warm,
                  f"is a critic-warmup knob and has no effect on {c.algorithm.title}", "remove it")


def loss_rules(c: RuleContext) -> None:
    """The loss's own constructor checks (cheap to build)."""
    loss_cfg = get(c.cfg, "model.init_args.loss_fn")
    if isinstance(loss_cfg, Mapping) and isinstance(loss_cfg.get("class_path"), str):
        loss_problem = construct_problem(loss_cfg["class_path"], loss_cfg.get("init_args") or {})
        if loss_problem:
            c.bad("model.init_args.loss_fn", loss_cfg.get("init_args"), loss_problem,
                  "change the loss_fn init_args as the message says")


def failure_rules(c: RuleContext) -> None:
    rf = c.rf_cfg
    stall = c.async_cfg.watchdog.stall_timeout_s
    if stall is not None and not (isinstance(stall, (int, float)) and stall > 0):
        c.bad("async_rl.watchdog.stall_timeout_s", stall, "must be a number of seconds > 0, or null (off)",
              "set e.g. stall_timeout_s: 600")
    if rf.max_backoff_s < rf.backoff_base_s:
        c.bad("async_rl.rollout_failure.max_backoff_s", rf.max_backoff_s, "is below backoff_base_s "
              f"({rf.backoff_base_s})", "set max_backoff_s >= backoff_base_s")
    frac = rf.min_step_batch_fraction
    if not (isinstance(frac, (int, float)) and 0 < frac <= 1):
        c.bad("async_rl.rollout_failure.min_step_batch_fraction", frac, "must be in (0, 1]", "set e.g. 0.9")
    for knob in ("max_infra_attempts", "max_data_attempts"):
        if getattr(rf, knob) < 1:
            c.bad(f"async_rl.rollout_failure.{knob}", getattr(rf, knob), "must be >= 1", f"set {knob} >= 1")
    for knob in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
        if getattr(rf, knob) < 0:
            c.bad(f"async_rl.rollout_failure.{knob}", getattr(rf, knob), "must be >= 0", f"set {knob} >= 0")
    if rf.on_dropped_prompt == "replace":
        for knob in ("max_replacement_attempts", "replacement_reserve_prompts"):
            v = getattr(rf, knob)
            if not isinstance(v, int) or v < 1:
                c.bad(f"async_rl.rollout_failure.{knob}", v, "on_dropped_prompt: replace needs an integer >= 1",
                      f"set {knob} >= 1, or on_dropped_prompt: shrink")


def batch_rules(c: RuleContext) -> None:
    if not c.dp_cfg.enabled:
        c.bad("data_plane.enabled", False, "the single controller moves every rollout through TransferQueue",
              "set data_plane.enabled: true")
    if c.dp_backend != "simple":
        c.bad("data_plane.backend", c.dp_backend, "TransferQueue's Mooncake storage is not wired into screl (its "
              "transfer engine is not installed here); the run would use SimpleStorage", "set data_plane.backend: simple")
    node_res = c.dp_cfg.storage_node_resource
    if node_res is not None and (not isinstance(node_res, str) or not node_res or node_res in ("CPU", "GPU")):
        c.bad("data_plane.storage_node_resource", node_res, "must be a Ray resource name that the storage nodes "
              "offer (a custom one, e.g. head_node)", "set it to a resource given to ray start --resources, or null")
    P, G = c.P, c.G
    tgbs = get(c.cfg, "model.init_args.train_global_batch_size")
    if tgbs is not None and tgbs != P * G:
        c.bad("model.init_args.train_global_batch_size", tgbs, f"one RL step is one batch of num_prompts_per_step "
              f"x num_generations_per_prompt = {P} x {G} = {P * G} rows", f"set it to {P * G} or null (derived)")
    vgbs = get(c.cfg, "model.init_args.value_train_global_batch_size")
    if vgbs is not None and vgbs != P * G:
        c.bad("model.init_args.value_train_global_batch_size", vgbs, f"the critic trains on the whole step: "
              f"{P} x {G} = {P * G} rows", f"set it to {P * G} or null (derived)")


def generation_rules(c: RuleContext) -> None:
    gen, key = c.gen_cfg, "data.init_args.generation"
    backend = gen.backend
    workflow = gen.workflow
    resolvable = workflow is not None and moved_to(str(workflow)) is None  # moved_path_rules names a moved one's home
    workflow_error = workflow_problem(str(workflow)) if resolvable else None
    if workflow_error is not None:
        c.bad(f"{key}.workflow", workflow, workflow_error, "name an importable class with a run(items, generate) "
              "method, e.g. screl.rollout.workflows.workflow.SingleTurnWorkflow")
    if not gen.async_engine:
        c.bad(f"{key}.async_engine", False, "screl has no synchronous engine: every backend runs an async engine "
              "(vLLM's AsyncLLM, the torch engine's request loop), colocated or not", "set async_engine: true")
    try:
        resolve_backend(str(backend))
    except MovedPathError:
        pass  # moved_path_rules names its new home
    except ValueError as err:
        why = str(err).removeprefix(f"{key}.backend={backend!r}").lstrip(": ")
        c.bad(f"{key}.backend", backend, why, "use backend: torch, or the class path of an "
              "engine implementing screl.rollout.GenerationEngine (see docs/extending.md)")
    _sampling_rules(c)
    _resource_rules(c)


def _resource_rules(c: RuleContext) -> None:
    gen, key = c.gen_cfg, "data.init_args.generation"
    v = gen.refit_bucket_mb
    if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0:
        c.bad(f"{key}.refit_bucket_mb", v, "must be a number > 0", "set refit_bucket_mb > 0")
    cpus = gen.num_cpus_per_worker
    if isinstance(cpus, bool) or not isinstance(cpus, (int, float)) or cpus < 0:
        c.bad(f"{key}.num_cpus_per_worker", cpus, "must be a number >= 0", "set num_cpus_per_worker > 0")
    elif cpus == 0 and not (gen.resources or gen.num_gpus_per_worker):
        c.bad(f"{key}.num_cpus_per_worker", 0, "a worker that reserves nothing can land on any node, any number "
              "of them on one", "set num_cpus_per_worker > 0, or place the workers with resources or "
              "num_gpus_per_worker")
    g = gen.num_gpus_per_worker
    if g is not None and (isinstance(g, bool) or not isinstance(g, (int, float)) or g < 0):
        c.bad(f"{key}.num_gpus_per_worker", g, "must be a number >= 0 or null (derived)",
              "set num_gpus_per_worker >= 0 or null")
    custom = gen.resources or {}
    if not isinstance(custom, dict):
        c.bad(f"{key}.resources", custom, "must be a mapping of Ray resource name to amount",
              "write resources: {rollout_node: 1}")
        custom = {}
    for name, amount in custom.items():
        if name in ("CPU", "GPU", "memory", "object_store_memory"):
            c.bad(f"{key}.resources.{name}", amount, f"{name} is not a custom resource",
                  "set it with num_cpus_per_worker / num_gpus_per_worker instead" if name in ("CPU", "GPU")
                  else "drop it: Ray sizes memory itself")
        elif isinstance(amount, bool) or not isinstance(amount, (int, float)) or amount <= 0:
            c.bad(f"{key}.resources.{name}", amount, "must be a number > 0", f"set resources.{name} > 0")
    gpus = (gen.num_gpus_per_worker or 0) + gen.colocated.resources.gpus_per_node
    on_device = c.engine is not None and c.engine.on_generation_device
    if on_device and gen.device == "cpu" and gpus > 0:
        c.bad(f"{key}.device", "cpu", "GPUs are set aside for generation (num_gpus_per_worker or "
              f"colocated.resources.gpus_per_node) but the {c.engine_name} engine runs on the CPU: they would sit idle",
              "set device: cuda, or set the GPU counts to 0")


def _sampling_rules(c: RuleContext) -> None:
    gen, key = c.gen_cfg, "data.init_args.generation"
    if gen.temperature <= 0:
        c.bad(f"{key}.temperature", gen.temperature, "must be > 0 (logprobs of a greedy policy are "
              "undefined for importance sampling)", "set temperature > 0")
    top_p = gen.top_p
    if not 0 < top_p <= 1:
        c.bad(f"{key}.top_p", top_p, "must be in (0, 1]", "set top_p: 1.0")
    if gen.min_new_tokens > gen.max_new_tokens:
        c.bad(f"{key}.min_new_tokens", gen.min_new_tokens, f"exceeds max_new_tokens ({gen.max_new_tokens})",
              "set min_new_tokens <= max_new_tokens")
    if gen.num_workers < 1:
        c.bad(f"{key}.num_workers", gen.num_workers, "must be >= 1", "set num_workers >= 1")
    for k, value in ((f"{key}.num_threads", gen.num_threads),
                     ("data.init_args.train_num_threads", get(c.cfg, "data.init_args.train_num_threads"))):
        if value is not None and value < 1:
            c.bad(k, value, "must be >= 1 or null", f"set {k.rsplit('.', 1)[-1]}: null (automatic) or >= 1")


def algorithm_pairing_rules(c: RuleContext) -> None:
    """What the run's algorithm declares: its advantage estimators, its critic (or none), its samplers, full
    steps; then the critic's own knobs."""
    algo, key = c.algorithm, c.algo_key
    for knob, ok, fix in (("std_floor", lambda v: v >= 0, "set it to 0 (none) or e.g. 0.1"),
                          ("warn_abs_advantage", lambda v: v > 0, "set it to e.g. 10")):
        value = getattr(c.algo_cfg.adv_estimator, knob)
        if isinstance(value, (int, float)) and not ok(value):
            c.bad(f"{key}.adv_estimator.{knob}", value, "must be >= 0" if knob == "std_floor" else "must be > 0", fix)
    _adv_estimator_rule(c)
    if not algo.needs_critic:
        for knob in ("value", "value_loss_fn"):
            if get(c.cfg, f"model.init_args.{knob}") is not None:
                c.bad(f"model.init_args.{knob}", "<set>", f"a {algo.title} run has no critic", "remove it, or run PPO")
        return
    if algo.samplers is not None and c.sampler is not None and c.sampler.name not in algo.samplers:
        c.bad("async_rl.sampler.name", c.sampler.name, f"{algo.title} runs support only the "
              f"{' or '.join(algo.samplers)} sampler", f"set async_rl.sampler.name: {algo.samplers[0]}")
    if not algo.step_may_shrink:
        _full_step_rules(c)


def algorithm_own_rules(c: RuleContext) -> None:
    """The rules the run's algorithm registers as its own (``Algorithm.rules``): those of its block's algorithm and
    of its model's when that trains on the same block (a ``Distill`` model on ``grpo``), each once. A model of
    another block's algorithm is already refused (``algorithm_rules``): its rules would read the wrong block."""
    model = model_algorithm(c.cfg)
    own = [c.algorithm, *([model] if model is not None and model.config_key == c.algo_key else [])]
    for path in dict.fromkeys(r for a in own for r in a.rules):
        rule_at(path)(c)


def _adv_estimator_rule(c: RuleContext) -> None:
    """``adv_estimator.name`` is registered, and of the kind the algorithm computes (from values with a critic,
    from the group's rewards without one)."""
    algo, key = c.algorithm, c.algo_key
    field, name = f"{key}.adv_estimator.name", c.algo_cfg.adv_estimator.name
    fitting = adv_estimator_names(needs_values=algo.needs_critic)
    unknown = f"is not a registered advantage estimator (registered: {adv_estimator_names()})"
    fix = f"set {field} to one of {fitting}, or your function as 'package.module:fn'"
    if not isinstance(name, str):
        c.bad(field, name, unknown, fix)
        return
    try:
        needs_values = get_adv_estimator(name).needs_values
    except ValueError as err:  # a path says why it does not load; a bare name is simply not registered
        c.bad(field, name, str(err) if ":" in name else unknown, fix)
        return
    if needs_values != algo.needs_critic:
        why = (f"{algo.title} has no critic, and {name} needs its values" if needs_values
               else f"{algo.title} computes advantages from its critic's values, and {name} is group-relative")
        c.bad(field, name, why, f"set {field} to one of {fitting}")


def _full_step_rules(c: RuleContext) -> None:
    """An algorithm that trains full steps only: no streamed chunks and no drop budgets."""
    title = c.algorithm.title
    if c.min_groups != c.P:
        c.bad("async_rl.min_groups_for_streaming_train", c.min_groups, f"{title} trains one full step per chunk "
              "(the critic has no split train API)", f"set it to {c.algo_key}.num_prompts_per_step ({c.P})")
    for knob in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
        if getattr(c.rf_cfg, knob) != 0:
            c.bad(f"async_rl.rollout_failure.{knob}", getattr(c.rf_cfg, knob), f"a drop would shorten a {title} step that "
                  "the critic shards against its configured batch size", "set it to 0")
