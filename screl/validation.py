"""Every cross-block rule of a screl config, checked before any work starts.

``config_problems(cfg)`` takes the whole config as a plain mapping (the parsed YAML, defaults
filled in) and returns every problem at once; each names its dotted key, the offending value and
the fix. ``validate_config`` raises ``ConfigError`` listing them all.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from screl.data.sampler_config import (
    GATED_SAMPLERS,
    CustomSamplerConfig,
    InOrderSamplerConfig,
    SamplerConfig,
    SamplerConfigError,
    parse_sampler_config,
    required_buffer_capacity,
)

_MISSING = object()

#: Legacy async knobs and where they went (the spec's migration table).
LEGACY_MIGRATION = (
    "port it to `async_rl`: enabled -> implicit (use async_rl.sampler.max_lookahead_versions: 0 for sync); "
    "max_trajectory_age_steps: N -> async_rl.sampler {name: in_order, max_lookahead_versions: N}; "
    "warmup_generation_lead_steps -> async_rl.sampler.warmup_lookahead_versions; "
    "recompute_kv_cache_after_weight_updates -> async_rl.recompute_kv_cache_after_weight_updates; "
    "then set the legacy block to null"
)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a config."""

    key: str
    value: Any
    message: str
    fix: str

    def __str__(self) -> str:
        return f"{self.key} = {self.value!r}: {self.message}. Fix: {self.fix}"


class ConfigError(ValueError):
    """A config that cannot run; ``problems`` holds every problem found."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        lines = "\n".join(f"  {i}. {p}" for i, p in enumerate(problems, 1))
        super().__init__(f"the config has {len(problems)} problem(s):\n{lines}")


def get(cfg: Mapping[str, Any], dotted: str, default: Any = None) -> Any:
    """``cfg["a"]["b"]["c"]`` for ``"a.b.c"``, or ``default`` when any level is missing or None."""
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, Mapping) or part not in node or node[part] is None:
            return default
        node = node[part]
    return node


def _to_mapping(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_mapping(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: _to_mapping(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_mapping(v) for v in obj]
    return obj


def _model_kind(cfg: Mapping[str, Any]) -> str | None:
    """``"ppo"`` or ``"grpo"`` from ``model.class_path`` (None when no model is configured)."""
    class_path = get(cfg, "model.class_path")
    if not isinstance(class_path, str):
        return None
    return "ppo" if class_path.rsplit(".", 1)[-1].upper().endswith("PPO") else "grpo"


def _import_target(target: str) -> type | None:
    module, _, name = target.partition(":")
    try:
        return getattr(importlib.import_module(module), name, None)  # type: ignore[no-any-return]
    except ImportError:
        return None


def workflow_problem(target: str) -> str | None:
    """Why ``generation.workflow`` cannot be used (not importable, no ``run``), or None."""
    from screl.rollout.workflow import load_workflow

    try:
        load_workflow(target)
    except (ValueError, TypeError) as err:
        return str(err)
    return None


def _construct_problem(class_path: str, init_args: Mapping[str, Any]) -> str | None:
    """The ValueError message of building a small config object (a loss), or None when it builds."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
        cls(**dict(init_args))
    except (ValueError, TypeError) as err:
        return str(err).replace("\n", "; ")
    except (ImportError, AttributeError):
        return None  # the parser reports unknown classes itself
    return None


def sampler_declares(cls: type, attribute: str) -> bool:
    """Whether ``cls`` itself (not a base class) sets ``attribute`` to True."""
    return vars(cls).get(attribute) is True


def _sampler_capabilities(sampler: SamplerConfig) -> tuple[bool, bool]:
    """(supports_buffer_checkpoint, supports_training_claims) of the configured sampler."""
    if not isinstance(sampler, CustomSamplerConfig):
        return True, True
    cls = _import_target(sampler.target)
    if cls is None:
        return False, False
    return sampler_declares(cls, "supports_buffer_checkpoint"), sampler_declares(cls, "supports_training_claims")


def _fingerprint_path_problem(path: Any) -> str | None:
    if not isinstance(path, str) or not path:
        return "must be a non-empty dotpath string"
    if path != path.strip():
        return "has surrounding whitespace"
    if path in ("*", "**"):
        return "a bare wildcard would exclude the whole config"
    if any(seg == "" for seg in path.split(".")):
        return "has an empty dot segment"
    return None


def config_problems(config: Mapping[str, Any] | Any) -> list[Problem]:  # noqa: C901 - one flat list of rules
    """Every problem of a whole screl config (the parsed YAML with defaults), in a stable order."""
    cfg: Mapping[str, Any] = _to_mapping(config)
    problems: list[Problem] = []

    def bad(key: str, value: Any, message: str, fix: str) -> None:
        problems.append(Problem(key, value, message, fix))

    # --- algorithm block -------------------------------------------------------------------
    grpo, ppo = cfg.get("grpo"), cfg.get("ppo")
    kind = _model_kind(cfg)
    if grpo is not None and ppo is not None:
        bad("grpo", "<set>", "`grpo` and `ppo` are mutually exclusive", "keep the block of the algorithm you run")
    elif grpo is None and ppo is None:
        bad("grpo", None, "no algorithm block", "add a `grpo:` block (or `ppo:` for a PPO run)")
    algo_key = "ppo" if ppo is not None and grpo is None else "grpo"
    algo: Mapping[str, Any] = (ppo if algo_key == "ppo" else grpo) or {}
    if kind == "ppo" and algo_key == "grpo" and grpo is not None:
        bad("grpo", "<set>", "model is a PPO module but the step settings are in `grpo`", "rename the block `ppo`")
    if kind == "grpo" and algo_key == "ppo":
        bad("ppo", "<set>", "model is a GRPO module but the step settings are in `ppo`",
            "rename the block `grpo`, or use model.class_path: screl.PPO")

    P = algo.get("num_prompts_per_step", 8)
    G = algo.get("num_generations_per_prompt", 4)
    for name, value, low in (("num_prompts_per_step", P, 1), ("num_generations_per_prompt", G, 1)):
        if not isinstance(value, int) or value < low:
            bad(f"{algo_key}.{name}", value, f"must be an integer >= {low}", f"set {algo_key}.{name} >= {low}")
    if algo_key == "grpo" and isinstance(G, int) and G == 1:
        bad("grpo.num_generations_per_prompt", G, "GRPO's group baseline needs at least two rollouts per prompt",
            "set grpo.num_generations_per_prompt >= 2")
    P = P if isinstance(P, int) and P >= 1 else 1
    G = G if isinstance(G, int) and G >= 1 else 1
    epochs = algo.get("max_num_epochs", 1)
    if not isinstance(epochs, int) or epochs <= 0:
        bad(f"{algo_key}.max_num_epochs", epochs, "must be positive (there is no -1 = unbounded convention; "
            "<= 0 would train zero steps)", f"set a positive {algo_key}.max_num_epochs and bound the run with "
            f"{algo_key}.max_num_steps")
    steps = algo.get("max_num_steps")
    if steps is not None and (not isinstance(steps, int) or steps < 1):
        bad(f"{algo_key}.max_num_steps", steps, "must be >= 1 or null", f"set {algo_key}.max_num_steps >= 1")
    for legacy in ("async_grpo", "async_ppo"):
        if algo.get(legacy) is not None:
            bad(f"{algo_key}.{legacy}", algo.get(legacy), "legacy async block: the single controller reads "
                "`async_rl`", LEGACY_MIGRATION)
    for knob in ("val_period",):
        if algo.get(knob, 0):
            bad(f"{algo_key}.{knob}", algo.get(knob), "validation is not supported on the single controller",
                f"set {algo_key}.{knob}: 0")
    for knob in ("val_at_start", "val_at_end", "use_dynamic_sampling"):
        if algo.get(knob):
            what = "dynamic sampling is not implemented" if knob == "use_dynamic_sampling" else (
                "validation is not supported on the single controller")
            bad(f"{algo_key}.{knob}", True, what, f"set {algo_key}.{knob}: false")
    for knob in ("reward_shaping", "reward_scaling"):
        if get(algo, f"{knob}.enabled", False):
            bad(f"{algo_key}.{knob}.enabled", True, f"{knob.replace('_', ' ')} is not implemented (it would be "
                "silently skipped)", f"set {algo_key}.{knob}.enabled: false and shape rewards in the task's "
                "reward function")
    adv_name = get(algo, "adv_estimator.name", "gae" if algo_key == "ppo" else "grpo")

    # --- sampler -------------------------------------------------------------------------------
    sampler: SamplerConfig | None
    try:
        sampler = parse_sampler_config(get(cfg, "async_rl.sampler", {"name": "in_order"}))
    except SamplerConfigError as err:
        sampler = None
        for key, msg in err.problems:
            bad(key, get(cfg, key), msg, "see `screl fit --help` for each sampler's knobs")
    window = sampler.window if sampler is not None else 0
    async_rl = cfg.get("async_rl") or {}
    min_groups = async_rl.get("min_groups_for_streaming_train")
    min_groups = P if min_groups is None else min_groups
    if not isinstance(min_groups, int) or min_groups < 1:
        bad("async_rl.min_groups_for_streaming_train", min_groups, "must be an integer >= 1",
            f"set it between 1 and {algo_key}.num_prompts_per_step ({P})")
        min_groups = P
    elif min_groups > P:
        bad("async_rl.min_groups_for_streaming_train", min_groups,
            f"exceeds {algo_key}.num_prompts_per_step ({P}): a step could never be assembled",
            f"set it <= {P}")
    for knob in ("max_inflight_prompts", "max_buffered_rollouts"):
        v = async_rl.get(knob)
        if v is not None and (not isinstance(v, int) or v < 1):
            bad(f"async_rl.{knob}", v, "must be an integer >= 1 or null (derived)", f"set async_rl.{knob} >= 1")
    if sampler is not None:
        need = required_buffer_capacity(sampler, P, min_groups)
        have = async_rl.get("max_buffered_rollouts")
        if isinstance(have, int) and have >= 1 and have < need:
            window_key = (
                "warmup_lookahead_versions" if isinstance(sampler, InOrderSamplerConfig)
                and sampler.warmup_lookahead_versions is not None else "window"
            )
            bad("async_rl.max_buffered_rollouts", have,
                f"below the {sampler.name} sampler's required capacity {need} "
                f"(num_prompts_per_step {P} x ({window_key} {sampler.peak_window} + 1) for gated samplers): "
                "the rollout pump would deadlock", f"set async_rl.max_buffered_rollouts >= {need}")
        loss_is = get(cfg, "model.init_args.loss_fn.init_args.use_importance_sampling_correction", None)
        if loss_is is None:
            loss_is = get(cfg, "model.init_args.loss_fn.use_importance_sampling_correction", False)
        is_key = "model.init_args.loss_fn.init_args.use_importance_sampling_correction"
        if sampler.name == "ready_first" and not loss_is:
            bad(is_key, loss_is, "the ready_first sampler trains late stragglers from older policies",
                "set it to true")
        elif window > 0 and sampler.name in ("in_order", "weight_fifo", "windowed") and not loss_is:
            knob = "max_lookahead_versions" if sampler.name == "in_order" else "max_staleness_versions"
            bad(is_key, loss_is, f"async_rl.sampler.{knob}={window} admits off-policy data, which needs "
                "importance-sampling correction", f"set it to true, or async_rl.sampler.{knob}: 0 for sync")
        budget = get(cfg, "async_rl.rollout_failure.max_skipped_prompts", 0) + get(
            cfg, "async_rl.rollout_failure.max_consecutive_dropped_prompts", 0)
        if budget > 0 and sampler.name not in ("in_order", "custom"):
            bad("async_rl.rollout_failure.max_skipped_prompts", budget,
                f"drop budgets need a sampler that stamps target steps; {sampler.name} would wait forever for a "
                "dropped group", "use sampler in_order, or set both drop budgets to 0")
        warm = sampler.warmup_lookahead_versions if isinstance(sampler, InOrderSamplerConfig) else None
        start = algo.get("policy_training_start_step", 0) or 0
        if warm is not None and start == 0:
            if algo_key == "ppo":
                bad("async_rl.sampler.warmup_lookahead_versions", warm,
                    "requires ppo.policy_training_start_step > 0 (it is the lookahead during critic warmup)",
                    "set ppo.policy_training_start_step > 0 or remove the knob")
            else:
                bad("async_rl.sampler.warmup_lookahead_versions", warm,
                    "is a PPO critic-warmup knob and has no effect on GRPO", "remove it")

    # --- the loss: its own constructor checks (cheap to build) -----------------------------------
    loss_cfg = get(cfg, "model.init_args.loss_fn")
    if isinstance(loss_cfg, Mapping) and isinstance(loss_cfg.get("class_path"), str):
        loss_problem = _construct_problem(loss_cfg["class_path"], loss_cfg.get("init_args") or {})
        if loss_problem:
            bad("model.init_args.loss_fn", loss_cfg.get("init_args"), loss_problem,
                "change the loss_fn init_args as the message says")

    # --- rollout failure budgets ---------------------------------------------------------------
    rf = async_rl.get("rollout_failure") or {}
    if rf.get("max_backoff_s", 30.0) < rf.get("backoff_base_s", 1.0):
        bad("async_rl.rollout_failure.max_backoff_s", rf.get("max_backoff_s"), "is below backoff_base_s "
            f"({rf.get('backoff_base_s')})", "set max_backoff_s >= backoff_base_s")
    frac = rf.get("min_step_batch_fraction", 0.9)
    if not (isinstance(frac, (int, float)) and 0 < frac <= 1):
        bad("async_rl.rollout_failure.min_step_batch_fraction", frac, "must be in (0, 1]", "set e.g. 0.9")
    for knob in ("max_infra_attempts", "max_data_attempts"):
        if rf.get(knob, 1) < 1:
            bad(f"async_rl.rollout_failure.{knob}", rf.get(knob), "must be >= 1", f"set {knob} >= 1")
    for knob in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
        if rf.get(knob, 0) < 0:
            bad(f"async_rl.rollout_failure.{knob}", rf.get(knob), "must be >= 0", f"set {knob} >= 0")
    if rf.get("on_dropped_prompt") == "replace":
        bad("async_rl.rollout_failure.on_dropped_prompt", "replace", "replacing dropped prompts from a reserve is "
            "not implemented yet (it would silently shrink the step instead)", "set on_dropped_prompt: shrink")

    # --- data plane ------------------------------------------------------------------------------
    if not get(cfg, "data_plane.enabled", True):
        bad("data_plane.enabled", False, "the single controller moves every rollout through TransferQueue",
            "set data_plane.enabled: true")
    backend = get(cfg, "data_plane.backend", "simple")

    # --- batch sizes -----------------------------------------------------------------------------
    tgbs = get(cfg, "model.init_args.train_global_batch_size")
    if tgbs is not None and tgbs != P * G:
        bad("model.init_args.train_global_batch_size", tgbs, f"one RL step is one batch of num_prompts_per_step x "
            f"num_generations_per_prompt = {P} x {G} = {P * G} rows", f"set it to {P * G} or null (derived)")
    vgbs = get(cfg, "model.init_args.value_train_global_batch_size")
    if vgbs is not None and vgbs != P * G:
        bad("model.init_args.value_train_global_batch_size", vgbs, f"the critic trains on the whole step: "
            f"{P} x {G} = {P * G} rows", f"set it to {P * G} or null (derived)")

    # --- generation --------------------------------------------------------------------------------
    gen = get(cfg, "data.init_args.generation", None) or get(cfg, "data.generation", {}) or {}
    gen_key = "data.init_args.generation"
    gen_backend = gen.get("backend", "torch")
    colocated = get(gen, "colocated.enabled", False)
    if colocated and gen_backend != "megatron":
        bad(f"{gen_key}.colocated.enabled", True, f"colocated generation is supported only with backend megatron "
            f"(got {gen_backend})", "set colocated.enabled: false and give generation its own resources")
    if colocated and gen_backend == "megatron" and min_groups != P:
        bad("async_rl.min_groups_for_streaming_train", min_groups, "colocated generation stands down for the "
            "whole train step, so each step must be one full batch", f"set it to num_prompts_per_step ({P})")
    workflow = gen.get("workflow")
    workflow_error = workflow_problem(str(workflow)) if workflow is not None else None
    if workflow_error is not None:
        bad(f"{gen_key}.workflow", workflow, workflow_error,
            "name an importable class with a run(items, generate) method, e.g. "
            "screl.rollout.workflow.SingleTurnWorkflow")
    if gen_backend == "vllm" and not colocated and not gen.get("async_engine", True):
        bad(f"{gen_key}.async_engine", False, "non-colocated vLLM generation needs the async engine",
            "set async_engine: true")
    if gen.get("temperature", 1.0) <= 0:
        bad(f"{gen_key}.temperature", gen.get("temperature"), "must be > 0 (logprobs of a greedy policy are "
            "undefined for importance sampling)", "set temperature > 0")
    top_p = gen.get("top_p", 1.0)
    if not 0 < top_p <= 1:
        bad(f"{gen_key}.top_p", top_p, "must be in (0, 1]", "set top_p: 1.0")
    if gen.get("min_new_tokens", 0) > gen.get("max_new_tokens", 16):
        bad(f"{gen_key}.min_new_tokens", gen.get("min_new_tokens"), f"exceeds max_new_tokens "
            f"({gen.get('max_new_tokens')})", "set min_new_tokens <= max_new_tokens")
    if gen.get("num_workers", 1) < 1:
        bad(f"{gen_key}.num_workers", gen.get("num_workers"), "must be >= 1", "set num_workers >= 1")
    for key, value in ((f"{gen_key}.num_threads", gen.get("num_threads")),
                       ("data.init_args.train_num_threads", get(cfg, "data.init_args.train_num_threads"))):
        if value is not None and value < 1:
            bad(key, value, "must be >= 1 or null", f"set {key.rsplit('.', 1)[-1]}: null (automatic) or >= 1")

    # --- PPO ---------------------------------------------------------------------------------------
    if algo_key == "ppo":
        for knob in ("ppo_epochs", "critic_ppo_epochs"):
            if algo.get(knob, 1) < 1:
                bad(f"ppo.{knob}", algo.get(knob), "must be >= 1", f"set ppo.{knob} >= 1")
        if adv_name != "gae":
            bad("ppo.adv_estimator.name", adv_name, "PPO needs GAE advantages", "set ppo.adv_estimator.name: gae")
        if get(cfg, "model.init_args.value") is None:
            bad("model.init_args.value", None, "a PPO run needs a critic", "add model.init_args.value")
        if get(cfg, "model.init_args.value_loss_fn") is None:
            bad("model.init_args.value_loss_fn", None, "a PPO run needs a value loss",
                "add model.init_args.value_loss_fn (screl.algos.ClippedValueLoss)")
        if sampler is not None and sampler.name != "in_order":
            bad("async_rl.sampler.name", sampler.name, "PPO runs support only the in_order sampler",
                "set async_rl.sampler.name: in_order")
        if min_groups != P:
            bad("async_rl.min_groups_for_streaming_train", min_groups, "PPO trains one full step per chunk (the "
                "critic has no split train API)", f"set it to ppo.num_prompts_per_step ({P})")
        for knob in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
            if rf.get(knob, 0) != 0:
                bad(f"async_rl.rollout_failure.{knob}", rf.get(knob), "a drop would shorten a PPO step that the "
                    "critic shards against its configured batch size", "set it to 0")
        if not get(cfg, "model.init_args.offload_optimizer_for_logprob", True):
            bad("model.init_args.offload_optimizer_for_logprob", False, "PPO keeps the policy optimizer off the "
                "device while the critic runs", "set it to true")
    else:
        if adv_name != "grpo":
            bad("grpo.adv_estimator.name", adv_name, "GRPO uses group-relative advantages",
                "set grpo.adv_estimator.name: grpo (GAE needs a critic: use ppo)")
        for knob in ("value", "value_loss_fn"):
            if get(cfg, f"model.init_args.{knob}") is not None:
                bad(f"model.init_args.{knob}", "<set>", "a GRPO run has no critic", "remove it, or run PPO")

    # --- checkpointing -----------------------------------------------------------------------------
    ck = cfg.get("checkpointing") or {}
    supports_ckpt, supports_claims = _sampler_capabilities(sampler) if sampler is not None else (True, True)
    if isinstance(sampler, CustomSamplerConfig):
        cls = _import_target(sampler.target)
        if cls is None:
            bad("async_rl.sampler.target", sampler.target, "cannot be imported", "give an importable "
                "'package.module:ClassName'")
        elif "supports_buffer_checkpoint" not in vars(cls):
            bad("async_rl.sampler.target", sampler.target, "a custom sampler must declare "
                "`supports_buffer_checkpoint` (True or False) on its own class; inherited values do not count",
                f"add `supports_buffer_checkpoint = False` (or True, if it restores buffered groups) to "
                f"{cls.__name__}")
    if ck.get("enabled"):
        if not ck.get("checkpoint_dir"):
            bad("checkpointing.checkpoint_dir", ck.get("checkpoint_dir"), "checkpointing is enabled but has no "
                "directory", "set a local path, s3://bucket/prefix or a shared filesystem path")
        if supports_ckpt and not ck.get("save_data_plane", True):
            bad("checkpointing.save_data_plane", False, "with a replay-capable sampler, completed unconsumed "
                "groups would be lost on restart", "set checkpointing.save_data_plane: true")
        if ck.get("save_data_plane", True) and backend != "simple":
            bad("data_plane.backend", backend, "native data-plane checkpointing supports only the simple "
                "backend", "set data_plane.backend: simple or checkpointing.save_data_plane: false")
    if ck.get("save_period", 10) < 1:
        bad("checkpointing.save_period", ck.get("save_period"), "must be >= 1", "set save_period >= 1")
    keep = ck.get("keep_top_k")
    if keep is not None and keep < 1:
        bad("checkpointing.keep_top_k", keep, "must be >= 1 or null (keep all)", "set keep_top_k >= 1")
    metric = ck.get("metric_name")
    if metric is not None and not str(metric).startswith("train:"):
        bad("checkpointing.metric_name", metric, "there is no validation loop to produce it",
            "set it to null or a `train:<metric>` name")

    # --- periodic rollout snapshots ----------------------------------------------------------------
    rc = cfg.get("rollout_checkpointing") or {}
    interval = rc.get("snapshot_attempt_interval_s")
    if interval is not None:
        if not (isinstance(interval, (int, float)) and interval > 0 and math.isfinite(interval)):
            bad("rollout_checkpointing.snapshot_attempt_interval_s", interval, "must be > 0 or null (off)",
                "set a positive number of seconds")
        if not ck.get("enabled"):
            bad("checkpointing.enabled", ck.get("enabled", False), "periodic rollout snapshots anchor to trainer "
                "checkpoints", "set checkpointing.enabled: true (or snapshot_attempt_interval_s: null)")
        elif not ck.get("save_data_plane", True):
            bad("checkpointing.save_data_plane", False, "periodic rollout snapshots save the data plane",
                "set checkpointing.save_data_plane: true")
        if backend != "simple":
            bad("data_plane.backend", backend, "periodic snapshots need native TransferQueue save/load",
                "set data_plane.backend: simple")
        if not get(cfg, "token_capture.enabled", False):
            bad("token_capture.enabled", False, "periodic rollout snapshots need token capture",
                "set token_capture.enabled: true")
        if not (supports_ckpt and supports_claims):
            bad("async_rl.sampler", get(cfg, "async_rl.sampler"), "periodic snapshots need a sampler that "
                "declares supports_buffer_checkpoint = True and supports_training_claims = True",
                "use a built-in sampler or declare both on the custom class")
    if rc.get("keep_latest_k", 2) < 1:
        bad("rollout_checkpointing.keep_latest_k", rc.get("keep_latest_k"), "must be >= 1", "set it >= 1")
    if rc.get("max_consecutive_failures", 3) < 1:
        bad("rollout_checkpointing.max_consecutive_failures", rc.get("max_consecutive_failures"), "must be >= 1",
            "set it >= 1")
    for i, fp_path in enumerate(rc.get("extra_fingerprint_excluded_paths") or []):
        why = _fingerprint_path_problem(fp_path)
        if why:
            bad(f"rollout_checkpointing.extra_fingerprint_excluded_paths.{i}", fp_path, why,
                "write a dotpath such as `custom_algo.observability` or `env.workers.*.log_dir`")

    # --- rollout recovery -------------------------------------------------------------------------
    rr = cfg.get("rollout_recovery") or {}
    non_default = rr.get("default_granularity", "sibling") != "sibling" or any(
        v != "sibling" for v in {**(rr.get("task_source_granularity_overrides") or {}),
                                 **(rr.get("agent_granularity_overrides") or {})}.values())
    if non_default and not get(cfg, "token_capture.enabled", False):
        bad("rollout_recovery.default_granularity", rr.get("default_granularity"), "non-default recovery "
            "granularity needs token capture", "set token_capture.enabled: true")
    return problems


def validate_config(config: Mapping[str, Any] | Any) -> None:
    """Raise ``ConfigError`` listing every problem of ``config``; return quietly when it is sound."""
    problems = config_problems(config)
    if problems:
        raise ConfigError(problems)


def groups_window(sampler: SamplerConfig) -> int:
    """The lookahead (gated) or staleness (windowed) window of a sampler config."""
    return sampler.peak_window


__all__ = [
    "ConfigError",
    "GATED_SAMPLERS",
    "Problem",
    "config_problems",
    "get",
    "groups_window",
    "sampler_declares",
    "validate_config",
]
