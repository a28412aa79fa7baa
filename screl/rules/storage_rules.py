"""Rules on what a run keeps: a custom sampler's declarations, trainer checkpoints, periodic rollout
snapshots, recovery granularity."""

from __future__ import annotations

import math

from screl.config import RolloutRecoveryConfig
from screl.data.sampler_config import CustomSamplerConfig
from screl.rules.blocks import field_default
from screl.rules.context import (
    RuleContext,
    fingerprint_path_problem,
    get,
    import_target,
    sampler_capabilities,
)


def custom_sampler_rules(c: RuleContext) -> None:
    if not isinstance(c.sampler, CustomSamplerConfig):
        return
    cls = import_target(c.sampler.target)
    if cls is None:
        c.bad("async_rl.sampler.target", c.sampler.target, "cannot be imported", "give an importable "
              "'package.module:ClassName'")
    elif "supports_buffer_checkpoint" not in vars(cls):
        c.bad("async_rl.sampler.target", c.sampler.target, "a custom sampler must declare "
              "`supports_buffer_checkpoint` (True or False) on its own class; inherited values do not count",
              f"add `supports_buffer_checkpoint = False` (or True, if it restores buffered groups) to "
              f"{cls.__name__}")


def checkpoint_rules(c: RuleContext) -> None:
    ck = c.ck_cfg
    supports_ckpt, _ = sampler_capabilities(c.sampler) if c.sampler is not None else (True, True)
    if ck.enabled:
        if not ck.checkpoint_dir:
            c.bad("checkpointing.checkpoint_dir", ck.checkpoint_dir, "checkpointing is enabled but has no "
                  "directory", "set a local path, s3://bucket/prefix or a shared filesystem path")
        if supports_ckpt and not ck.save_data_plane:
            c.bad("checkpointing.save_data_plane", False, "with a replay-capable sampler, completed unconsumed "
                  "groups would be lost on restart", "set checkpointing.save_data_plane: true")
        if ck.save_data_plane and c.dp_backend != "simple":
            c.bad("data_plane.backend", c.dp_backend, "native data-plane checkpointing supports only the simple "
                  "backend", "set data_plane.backend: simple or checkpointing.save_data_plane: false")
    strategy = get(c.cfg, "trainer.strategy")
    megatron = isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("MegatronStrategy")
    if ck.enabled and ck.save_optimizer is False and megatron:
        c.bad("checkpointing.save_optimizer", False, "MegatronStrategy saves megatron's own (sharded) optimizer "
              "state, which screl does not strip yet", "set save_optimizer: true, or train without MegatronStrategy")
    if ck.save_period < 1:
        c.bad("checkpointing.save_period", ck.save_period, "must be >= 1", "set save_period >= 1")
    keep = ck.keep_top_k
    if keep is not None and keep < 1:
        c.bad("checkpointing.keep_top_k", keep, "must be >= 1 or null (keep all)", "set keep_top_k >= 1")
    metric = ck.metric_name
    if metric is not None and (not str(metric).startswith("train:") or not str(metric)[len("train:"):]):
        c.bad("checkpointing.metric_name", metric, "bundles are ranked by a metric the training step logs",
              "set it to null or a `train:<metric>` name, e.g. train:reward")
    if metric is not None and keep is None:  # null as written: the default keeps some
        c.bad("checkpointing.metric_name", metric, "ranks bundles for keep_top_k, which is null (keep all)",
              "set keep_top_k, or metric_name: null")


def snapshot_rules(c: RuleContext) -> None:
    """Periodic rollout snapshots."""
    rc, ck = c.snapshot_cfg, c.ck_cfg
    interval = rc.snapshot_attempt_interval_s
    if interval is not None:
        if not (isinstance(interval, (int, float)) and interval > 0 and math.isfinite(interval)):
            c.bad("rollout_checkpointing.snapshot_attempt_interval_s", interval, "must be > 0 or null (off)",
                  "set a positive number of seconds")
        if not ck.enabled:
            c.bad("checkpointing.enabled", ck.enabled, "periodic rollout snapshots anchor to trainer "
                  "checkpoints", "set checkpointing.enabled: true (or snapshot_attempt_interval_s: null)")
        elif not ck.save_data_plane:
            c.bad("checkpointing.save_data_plane", False, "periodic rollout snapshots save the data plane",
                  "set checkpointing.save_data_plane: true")
        if c.dp_backend != "simple":
            c.bad("data_plane.backend", c.dp_backend, "periodic snapshots need native TransferQueue save/load",
                  "set data_plane.backend: simple")
        if not c.capture_cfg.enabled:
            c.bad("token_capture.enabled", False, "periodic rollout snapshots need token capture",
                  "set token_capture.enabled: true")
        if c.sampler is not None and not all(sampler_capabilities(c.sampler)):
            c.bad("async_rl.sampler", get(c.cfg, "async_rl.sampler"), "periodic snapshots need a sampler that "
                  "declares supports_buffer_checkpoint = True and supports_training_claims = True",
                  "use a built-in sampler or declare both on the custom class")
    for knob in ("keep_latest_k", "max_consecutive_failures"):
        if getattr(rc, knob) < 1:
            c.bad(f"rollout_checkpointing.{knob}", getattr(rc, knob), "must be >= 1", "set it >= 1")
    for i, fp_path in enumerate(rc.extra_fingerprint_excluded_paths or []):
        why = fingerprint_path_problem(fp_path)
        if why:
            c.bad(f"rollout_checkpointing.extra_fingerprint_excluded_paths.{i}", fp_path, why,
                  "write a dotpath such as `custom_algo.observability` or `env.workers.*.log_dir`")


def recovery_rules(c: RuleContext) -> None:
    rr = c.recovery_cfg
    overrides = {**(rr.task_source_granularity_overrides or {}), **(rr.agent_granularity_overrides or {})}
    default = field_default(RolloutRecoveryConfig, "default_granularity")
    non_default = rr.default_granularity != default or any(v != default for v in overrides.values())
    if non_default and not c.capture_cfg.enabled:
        c.bad("rollout_recovery.default_granularity", rr.default_granularity, "non-default recovery "
              "granularity needs token capture", "set token_capture.enabled: true")


