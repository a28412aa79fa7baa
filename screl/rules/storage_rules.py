"""Rules on what a run keeps: a custom sampler's declarations, trainer checkpoints, periodic rollout
snapshots, recovery granularity."""

from __future__ import annotations

import math

from screl.data.sampler_config import CustomSamplerConfig
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
    ck = c.ck
    supports_ckpt, _ = sampler_capabilities(c.sampler) if c.sampler is not None else (True, True)
    if ck.get("enabled"):
        if not ck.get("checkpoint_dir"):
            c.bad("checkpointing.checkpoint_dir", ck.get("checkpoint_dir"), "checkpointing is enabled but has no "
                  "directory", "set a local path, s3://bucket/prefix or a shared filesystem path")
        if supports_ckpt and not ck.get("save_data_plane", True):
            c.bad("checkpointing.save_data_plane", False, "with a replay-capable sampler, completed unconsumed "
                  "groups would be lost on restart", "set checkpointing.save_data_plane: true")
        if ck.get("save_data_plane", True) and c.dp_backend != "simple":
            c.bad("data_plane.backend", c.dp_backend, "native data-plane checkpointing supports only the simple "
                  "backend", "set data_plane.backend: simple or checkpointing.save_data_plane: false")
    strategy = get(c.cfg, "trainer.strategy")
    megatron = isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("MegatronStrategy")
    if ck.get("enabled") and ck.get("save_optimizer", True) is False and megatron:
        c.bad("checkpointing.save_optimizer", False, "MegatronStrategy saves megatron's own (sharded) optimizer "
              "state, which screl does not strip yet", "set save_optimizer: true, or train without MegatronStrategy")
    if ck.get("save_period", 10) < 1:
        c.bad("checkpointing.save_period", ck.get("save_period"), "must be >= 1", "set save_period >= 1")
    keep = ck.get("keep_top_k")
    if keep is not None and keep < 1:
        c.bad("checkpointing.keep_top_k", keep, "must be >= 1 or null (keep all)", "set keep_top_k >= 1")
    metric = ck.get("metric_name")
    if metric is not None and (not str(metric).startswith("train:") or not str(metric)[len("train:"):]):
        c.bad("checkpointing.metric_name", metric, "bundles are ranked by a metric the training step logs",
              "set it to null or a `train:<metric>` name, e.g. train:reward")
    if metric is not None and "keep_top_k" in ck and keep is None:
        c.bad("checkpointing.metric_name", metric, "ranks bundles for keep_top_k, which is null (keep all)",
              "set keep_top_k, or metric_name: null")


def snapshot_rules(c: RuleContext) -> None:
    """Periodic rollout snapshots."""
    rc, ck = c.cfg.get("rollout_checkpointing") or {}, c.ck
    interval = rc.get("snapshot_attempt_interval_s")
    if interval is not None:
        if not (isinstance(interval, (int, float)) and interval > 0 and math.isfinite(interval)):
            c.bad("rollout_checkpointing.snapshot_attempt_interval_s", interval, "must be > 0 or null (off)",
                  "set a positive number of seconds")
        if not ck.get("enabled"):
            c.bad("checkpointing.enabled", ck.get("enabled", False), "periodic rollout snapshots anchor to trainer "
                  "checkpoints", "set checkpointing.enabled: true (or snapshot_attempt_interval_s: null)")
        elif not ck.get("save_data_plane", True):
            c.bad("checkpointing.save_data_plane", False, "periodic rollout snapshots save the data plane",
                  "set checkpointing.save_data_plane: true")
        if c.dp_backend != "simple":
            c.bad("data_plane.backend", c.dp_backend, "periodic snapshots need native TransferQueue save/load",
                  "set data_plane.backend: simple")
        if not get(c.cfg, "token_capture.enabled", True):
            c.bad("token_capture.enabled", False, "periodic rollout snapshots need token capture",
                  "set token_capture.enabled: true")
        if c.sampler is not None and not all(sampler_capabilities(c.sampler)):
            c.bad("async_rl.sampler", get(c.cfg, "async_rl.sampler"), "periodic snapshots need a sampler that "
                  "declares supports_buffer_checkpoint = True and supports_training_claims = True",
                  "use a built-in sampler or declare both on the custom class")
    for knob in ("keep_latest_k", "max_consecutive_failures"):
        if rc.get(knob, 2) < 1:
            c.bad(f"rollout_checkpointing.{knob}", rc.get(knob), "must be >= 1", "set it >= 1")
    for i, fp_path in enumerate(rc.get("extra_fingerprint_excluded_paths") or []):
        why = fingerprint_path_problem(fp_path)
        if why:
            c.bad(f"rollout_checkpointing.extra_fingerprint_excluded_paths.{i}", fp_path, why,
                  "write a dotpath such as `custom_algo.observability` or `env.workers.*.log_dir`")


def recovery_rules(c: RuleContext) -> None:
    rr = c.cfg.get("rollout_recovery") or {}
    overrides = {**(rr.get("task_source_granularity_overrides") or {}), **(rr.get("agent_granularity_overrides") or {})}
    non_default = rr.get("default_granularity", "sibling") != "sibling" or any(
        v != "sibling" for v in overrides.values())
    if non_default and not get(c.cfg, "token_capture.enabled", True):
        c.bad("rollout_recovery.default_granularity", rr.get("default_granularity"), "non-default recovery "
              "granularity needs token capture", "set token_capture.enabled: true")


