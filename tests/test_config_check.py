"""`screl check`: every shipped config passes; one bad config per validation rule fails naming its key."""

from __future__ import annotations

import copy
import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from _check_helpers import load_config as _load
from _check_helpers import run_check as _run_check

from screl.cli import check, main

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").rglob("*.yaml"))


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT / "configs")) for p in CONFIGS])
def test_every_shipped_config_passes_check(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    needs_vllm = yaml.safe_load(path.read_text())["data"]["init_args"]["generation"].get("backend") == "vllm"
    if needs_vllm and importlib.util.find_spec("vllm") is None:  # valid but for vLLM itself, which .venv-vllm has
        assert check(["--config", str(path)]) == 2
        captured = capsys.readouterr()
        out = captured.out + captured.err
        assert "1 problem(s)" in out and "vLLM is not installed in this environment" in out, out
        return
    assert check(["--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "the config is valid" in out
    assert "rows per step" in out and "buffer capacity" in out and "IS correction" in out


def test_shipped_configs_cover_every_sampler_mode() -> None:
    names = {yaml.safe_load(p.read_text()).get("async_rl", {}).get("sampler", {}).get("name") for p in CONFIGS}
    assert {"in_order", "weight_fifo", "ready_first", "windowed"} <= names


def test_capacity_plan_figures(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("samplers/weight_fifo.yaml")
    cfg["grpo"]["num_prompts_per_step"] = 6
    cfg["grpo"]["num_generations_per_prompt"] = 3
    cfg["async_rl"]["sampler"]["max_staleness_versions"] = 2
    cfg["async_rl"]["max_buffered_rollouts"] = 18
    cfg["async_rl"]["min_groups_for_streaming_train"] = 4
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "groups per step      6" in out
    assert "rows per step        18  (6 x 3 generations)" in out
    assert "required 18, configured 18" in out  # 6 x (2 + 1)
    assert "staleness 0..2" in out
    assert "up to 2 chunk(s) per step" in out  # ceil(6 / 4)
    assert "IS correction        on" in out
    assert "for training" in out and "cores split" in out  # a staleness window: the phases overlap
    assert "1 worker(s), backend torch on cpu, 1 CPU / 0 GPU each; refits in 64 MiB buckets" in out


def test_the_plan_names_the_off_policy_correction(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")  # async lookahead 1, token TIS at 2.0
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "IS correction        on (token level, truncate at 2.0; decoupled PPO against the trainer's policy)" in out
    # naive PPO (clipping against the behaviour policy) is accepted as an async correction and named as such
    loss = cfg["model"]["init_args"]["loss_fn"]["init_args"]
    loss.update(use_importance_sampling_correction=False, proximal_policy="behaviour")
    del loss["is_truncation"]
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "IS correction        off (naive PPO: the ratio is clipped against the behaviour policy)" in out
    loss["use_importance_sampling_correction"] = True  # and an IS weight on top of it is refused
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc != 0 and "would correct twice" in out, out


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    node = cfg
    *parents, last = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value


def _delete(cfg: dict[str, Any], dotted: str) -> None:
    node = cfg
    *parents, last = dotted.split(".")
    for p in parents:
        node = node[p]
    del node[last]


IS_KEY = "model.init_args.loss_fn.init_args.use_importance_sampling_correction"
GEN_WORKFLOW = "data.init_args.generation.workflow"
GEN_BACKEND = "data.init_args.generation.backend"

# (rule id, base config, {dotted key: value (None deletes)}, key the error must name, words it must say)
BAD: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("policy_batch", "grpo_tiny.yaml", {"model.init_args.train_global_batch_size": 31},
     "model.init_args.train_global_batch_size", "8 x 4 = 32"),
    ("value_batch", "ppo.yaml", {"model.init_args.value_train_global_batch_size": 16},
     "model.init_args.value_train_global_batch_size", "8 x 4 = 32"),
    ("min_groups_gt_prompts", "grpo_tiny.yaml", {"async_rl.min_groups_for_streaming_train": 9},
     "async_rl.min_groups_for_streaming_train", "exceeds grpo.num_prompts_per_step"),
    ("buffer_capacity", "grpo_tiny.yaml", {"async_rl.max_buffered_rollouts": 15},
     "async_rl.max_buffered_rollouts", "required capacity 16"),
    ("buffer_capacity_warmup", "ppo.yaml", {"async_rl.max_buffered_rollouts": 16},
     "async_rl.max_buffered_rollouts", "warmup_lookahead_versions 2"),
    ("is_needed_lookahead", "grpo_tiny.yaml", {IS_KEY: False}, IS_KEY, "max_lookahead_versions=1"),
    ("is_needed_windowed", "samplers/windowed.yaml", {IS_KEY: False}, IS_KEY, "max_staleness_versions=1"),
    ("ready_first_needs_is", "samplers/ready_first.yaml", {IS_KEY: False}, IS_KEY, "ready_first"),
    ("ready_first_needs_is_w0", "samplers/ready_first.yaml",
     {IS_KEY: False, "async_rl.sampler.max_staleness_versions": 0}, IS_KEY, "stragglers"),
    ("stall_timeout_nonpositive", "grpo_tiny.yaml", {"async_rl.watchdog": {"stall_timeout_s": 0}},
     "async_rl.watchdog.stall_timeout_s", "must be a number of seconds > 0"),
    ("grpo_estimator_needs_values", "grpo_tiny.yaml", {"grpo.adv_estimator.name": "gae"}, "grpo.adv_estimator.name",
     "GRPO has no critic, and gae needs its values"),
    ("ppo_estimator_group_relative", "ppo.yaml", {"ppo.adv_estimator.name": "rloo"}, "ppo.adv_estimator.name",
     "rloo is group-relative"),
    ("estimator_unknown", "grpo_tiny.yaml", {"grpo.adv_estimator.name": "dr_grpo"}, "grpo.adv_estimator.name",
     "is not a registered advantage estimator (registered: ['gae', 'grpo', 'rloo'])"),
    ("estimator_not_importable", "grpo_tiny.yaml", {"grpo.adv_estimator.name": "tests.estimator_plugins:nope"},
     "grpo.adv_estimator.name", "cannot be imported"),
    ("estimator_not_a_function", "grpo_tiny.yaml",
     {"grpo.adv_estimator.name": "tests.estimator_plugins:NOT_A_FUNCTION"}, "grpo.adv_estimator.name",
     "is a int, not a function"),
    ("std_floor_negative", "grpo_tiny.yaml", {"grpo.adv_estimator": {"std_floor": -0.1}},
     "grpo.adv_estimator.std_floor", "must be >= 0"),
    ("epochs_nonpositive", "grpo_tiny.yaml", {"grpo.max_num_epochs": -1}, "grpo.max_num_epochs",
     "no -1 = unbounded"),
    ("legacy_async_grpo", "grpo_tiny.yaml", {"grpo.async_grpo": {"enabled": True, "max_trajectory_age_steps": 1}},
     "grpo.async_grpo", "max_trajectory_age_steps: N -> async_rl.sampler"),
    ("legacy_async_ppo", "ppo.yaml", {"ppo.async_ppo": {"enabled": True}}, "ppo.async_ppo", "port it to `async_rl`"),
    ("data_plane_required", "grpo_tiny.yaml", {"data_plane.enabled": False}, "data_plane.enabled", "TransferQueue"),
    ("grpo_and_ppo", "ppo.yaml", {"grpo": {"num_prompts_per_step": 8}}, "grpo", "mutually exclusive"),
    ("no_algo_block", "grpo_tiny.yaml", {"grpo": None}, "grpo", "no algorithm block"),
    ("ppo_needs_value", "ppo.yaml", {"model.init_args.value": None}, "model.init_args.value", "needs a critic"),
    ("ppo_needs_value_loss", "ppo.yaml", {"model.init_args.value_loss_fn": None}, "model.init_args.value_loss_fn",
     "needs a value loss"),
    ("ppo_needs_gae", "ppo.yaml", {"ppo.adv_estimator.name": "grpo"}, "ppo.adv_estimator.name", "from its critic's values"),
    ("ppo_needs_in_order", "ppo.yaml",
     {"async_rl.sampler": {"name": "weight_fifo", "max_staleness_versions": 1}}, "async_rl.sampler.name",
     "only the in_order sampler"),
    ("ppo_full_step_chunks", "ppo.yaml", {"async_rl.min_groups_for_streaming_train": 4},
     "async_rl.min_groups_for_streaming_train", "one full step per chunk"),
    ("ppo_zero_drop_budget", "ppo.yaml", {"async_rl.rollout_failure": {"max_skipped_prompts": 1}},
     "async_rl.rollout_failure.max_skipped_prompts", "PPO step"),
    ("ppo_offload", "ppo.yaml", {"model.init_args.offload_optimizer_for_logprob": False},
     "model.init_args.offload_optimizer_for_logprob", "off the device"),
    ("colocated_vllm", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.backend": "vllm"},
     "data.init_args.generation.colocated.enabled", "sleep/wake mode, which runs on a GPU only"),
    ("colocated_plain_engine", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True},
      "data.init_args.generation.backend": "tests.engine_plugins.PlainEngine"},
     "data.init_args.generation.colocated.enabled", "the PlainEngine engine does not declare colocated"),
    ("colocated_vllm", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.backend": "vllm"},
     "data.init_args.generation.colocated.enabled", "colocated vLLM needs vLLM's sleep/wake mode"),
    ("colocated_megatron_pipeline", "grpo_megatron_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.backend": "megatron",
      "trainer.strategy.init_args.parallelism": {"tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 2}},
     "data.init_args.generation.colocated.enabled", "pipeline, context and data parallelism are not built for it"),
    ("colocated_megatron_data_parallel", "grpo_megatron_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.backend": "megatron",
      "trainer.strategy.init_args.parallelism": {"tensor_model_parallel_size": 1}},
     "data.init_args.generation.colocated.enabled", "trainer world size 2"),
    ("colocated_full_step", "samplers/weight_fifo.yaml", {"data.init_args.generation.colocated": {"enabled": True}},
     "async_rl.min_groups_for_streaming_train", "stands down for the whole train step"),
    ("colocated_one_engine", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.num_workers": 2},
     "data.init_args.generation.num_workers", "a colocated engine is the trainer's process"),
    ("colocated_one_process", "grpo_ddp_tiny.yaml", {"data.init_args.generation.colocated": {"enabled": True}},
     "data.init_args.generation.colocated.enabled", "runs in one trainer process"),
    ("colocated_no_server", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.expose_http_server": True},
     "data.init_args.generation.expose_http_server", "a colocated engine has none yet"),
    ("colocated_device", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True}, "data.init_args.generation.device": "cuda"},
     "data.init_args.generation.device", "decodes on the trainer's device"),
    ("colocated_no_gpus_aside", "grpo_tiny.yaml",
     {"data.init_args.generation.colocated": {"enabled": True, "resources": {"gpus_per_node": 1}}},
     "data.init_args.generation.colocated.resources.gpus_per_node", "uses the trainer's devices"),
    ("vllm_async_engine", "grpo_tiny.yaml",
     {"data.init_args.generation.backend": "vllm", "data.init_args.generation.async_engine": False},
     "data.init_args.generation.async_engine", "async engine"),
    ("torch_async_engine", "grpo_tiny.yaml", {"data.init_args.generation.async_engine": False},
     "data.init_args.generation.async_engine", "screl has no synchronous engine"),
    ("mooncake_not_wired", "grpo_tiny.yaml", {"data_plane.backend": "mooncake_cpu"}, "data_plane.backend",
     "Mooncake storage is not wired into screl"),
    ("checkpoint_needs_data_plane", "grpo.yaml", {"checkpointing.save_data_plane": False},
     "checkpointing.save_data_plane", "lost on restart"),
    ("checkpoint_needs_dir", "grpo.yaml", {"checkpointing.checkpoint_dir": None}, "checkpointing.checkpoint_dir",
     "has no directory"),
    ("snapshots_need_checkpointing", "grpo_tiny.yaml",
     {"rollout_checkpointing.snapshot_attempt_interval_s": 60, "token_capture.enabled": True},
     "checkpointing.enabled", "anchor to trainer checkpoints"),
    ("snapshots_need_save_data_plane", "grpo.yaml",
     {"rollout_checkpointing.snapshot_attempt_interval_s": 60, "token_capture.enabled": True,
      "checkpointing.save_data_plane": False}, "checkpointing.save_data_plane", "periodic rollout snapshots"),
    ("snapshots_need_simple_backend", "grpo.yaml",
     {"rollout_checkpointing.snapshot_attempt_interval_s": 60, "token_capture.enabled": True,
      "data_plane.backend": "mooncake_cpu", "checkpointing.save_data_plane": False},
     "data_plane.backend", "native TransferQueue save/load"),
    ("snapshots_need_token_capture", "grpo.yaml", {"rollout_checkpointing.snapshot_attempt_interval_s": 60,
                                                    "token_capture.enabled": False},
     "token_capture.enabled", "need token capture"),
    ("snapshots_need_claims", "grpo.yaml",
     {"rollout_checkpointing.snapshot_attempt_interval_s": 60, "token_capture.enabled": True,
      "async_rl.sampler": {"name": "custom", "target": "sampler_plugins:NoClaims"}},
     "async_rl.sampler", "supports_training_claims = True"),
    ("fingerprint_path_empty_segment", "grpo_tiny.yaml",
     {"rollout_checkpointing.extra_fingerprint_excluded_paths": ["env..log_dir"]},
     "rollout_checkpointing.extra_fingerprint_excluded_paths.0", "empty dot segment"),
    ("fingerprint_path_bare_wildcard", "grpo_tiny.yaml",
     {"rollout_checkpointing.extra_fingerprint_excluded_paths": ["ok.path", "**"]},
     "rollout_checkpointing.extra_fingerprint_excluded_paths.1", "bare wildcard"),
    ("fingerprint_path_whitespace", "grpo_tiny.yaml",
     {"rollout_checkpointing.extra_fingerprint_excluded_paths": [" env.x"]},
     "rollout_checkpointing.extra_fingerprint_excluded_paths.0", "whitespace"),
    ("val_period_negative", "grpo_tiny.yaml", {"grpo.val_period": -5}, "grpo.val_period", "integer >= 0"),
    ("val_without_held_out_prompts", "grpo_tiny.yaml", {"grpo.val_period": 5}, "data.init_args.val_task",
     "holds out no prompts"),
    ("val_greedy_pass_at_k", "grpo_tiny.yaml", {"grpo.validation": {"num_samples": 4}},
     "grpo.validation.num_samples", "same completion"),
    ("val_temperature_negative", "ppo.yaml", {"ppo.validation": {"temperature": -1.0}},
     "ppo.validation.temperature", "must be >= 0"),
    ("val_max_prompts", "grpo_tiny.yaml", {"grpo.validation": {"max_prompts": 0}},
     "grpo.validation.max_prompts", "integer >= 1 or null"),
    ("reward_shaping_shapes_nothing", "grpo_tiny.yaml", {"grpo.reward_shaping": {"enabled": True}},
     "grpo.reward_shaping.enabled", "shapes nothing"),
    ("reward_shaping_buffer_too_long", "grpo_tiny.yaml",
     {"grpo.reward_shaping": {"enabled": True, "overlong_buffer_length": 17}},
     "grpo.reward_shaping.overlong_buffer_length", "exceeds the penalty's max_response_length (16)"),
    ("reward_shaping_fn_missing", "grpo_tiny.yaml",
     {"grpo.reward_shaping": {"enabled": True, "class_path": "my_pkg.shape"}},
     "grpo.reward_shaping.class_path", "cannot import it"),
    ("reward_scaling_empty_range", "grpo_tiny.yaml",
     {"grpo.reward_scaling": {"enabled": True, "source_min": 1.0, "source_max": 1.0}},
     "grpo.reward_scaling.source_max", "must exceed source_min"),
    ("dynamic_sampling_unstamped_shrink", "samplers/windowed.yaml", {"grpo.use_dynamic_sampling": True},
     "async_rl.rollout_failure.on_dropped_prompt", "waiting forever for a group that never comes"),
    ("dynamic_sampling_ppo_needs_replace", "ppo.yaml", {"ppo.use_dynamic_sampling": True},
     "async_rl.rollout_failure.on_dropped_prompt", "PPO trains full steps only"),
    ("dynamic_sampling_ppo_group_of_one", "ppo.yaml",
     {"ppo.use_dynamic_sampling": True, "ppo.num_generations_per_prompt": 1,
      "async_rl.rollout_failure": {"on_dropped_prompt": "replace"}},
     "ppo.num_generations_per_prompt", "a group of one always agrees"),
    ("custom_must_declare", "grpo_tiny.yaml",
     {"async_rl.sampler": {"name": "custom", "target": "sampler_plugins:InheritsCheckpoint"}},
     "async_rl.sampler.target", "on its own class"),
    ("custom_bad_target", "grpo_tiny.yaml", {"async_rl.sampler": {"name": "custom", "target": "no_colon"}},
     "async_rl.sampler.target", "package.module:ClassName"),
    ("drop_budget_unstamped", "samplers/windowed.yaml",
     {"async_rl.rollout_failure": {"max_consecutive_dropped_prompts": 2}},
     "async_rl.rollout_failure.max_skipped_prompts", "stamps target steps"),
    ("warmup_on_grpo", "grpo_tiny.yaml", {"async_rl.sampler.warmup_lookahead_versions": 2},
     "async_rl.sampler.warmup_lookahead_versions", "critic-warmup knob and has no effect on GRPO"),
    ("warmup_needs_start_step", "ppo.yaml", {"ppo.policy_training_start_step": 0},
     "async_rl.sampler.warmup_lookahead_versions", "policy_training_start_step > 0"),
    ("warmup_below_max", "ppo.yaml", {"async_rl.sampler.warmup_lookahead_versions": 0},
     "async_rl.sampler.warmup_lookahead_versions", "greater than or equal"),
    ("sampler_unknown_knob", "grpo_tiny.yaml", {"async_rl.sampler.max_staleness_versions": 1},
     "async_rl.sampler.max_staleness_versions", "not a knob of the 'in_order' sampler"),
    ("sampler_negative", "samplers/weight_fifo.yaml", {"async_rl.sampler.max_staleness_versions": -1},
     "async_rl.sampler.max_staleness_versions", ">= 0"),
    ("sampler_unknown_name", "grpo_tiny.yaml", {"async_rl.sampler": {"name": "fifo"}},
     "async_rl.sampler.name", "unknown sampler 'fifo'"),
    ("metric_name", "grpo.yaml", {"checkpointing.metric_name": "val:reward"}, "checkpointing.metric_name",
     "train:<metric>"),
    ("save_optimizer_megatron", "grpo_megatron_tiny.yaml",
     {"checkpointing": {"enabled": True, "checkpoint_dir": "runs/x", "save_optimizer": False}},
     "checkpointing.save_optimizer", "megatron's own (sharded) optimizer state"),
    ("recovery_needs_token_capture", "grpo_tiny.yaml", {"rollout_recovery.default_granularity": "prompt_group",
                                                        "token_capture.enabled": False},
     "rollout_recovery.default_granularity", "token capture"),
    ("backoff_order", "grpo_tiny.yaml", {"async_rl.rollout_failure": {"backoff_base_s": 5.0, "max_backoff_s": 1.0}},
     "async_rl.rollout_failure.max_backoff_s", "below backoff_base_s"),
    ("replace_needs_a_reserve", "grpo_tiny.yaml",
     {"async_rl.rollout_failure": {"on_dropped_prompt": "replace", "replacement_reserve_prompts": 0}},
     "async_rl.rollout_failure.replacement_reserve_prompts", "replace needs an integer >= 1"),
    ("replace_needs_attempts", "grpo_tiny.yaml",
     {"async_rl.rollout_failure": {"on_dropped_prompt": "replace", "max_replacement_attempts": 0}},
     "async_rl.rollout_failure.max_replacement_attempts", "replace needs an integer >= 1"),
    ("temperature_positive", "grpo_tiny.yaml", {"data.init_args.generation.temperature": 0.0},
     "data.init_args.generation.temperature", "must be > 0"),
    ("generation_threads_positive", "grpo_tiny.yaml", {"data.init_args.generation.num_threads": 0},
     "data.init_args.generation.num_threads", "must be >= 1 or null"),
    ("train_threads_positive", "grpo_tiny.yaml", {"data.init_args.train_num_threads": -2},
     "data.init_args.train_num_threads", "must be >= 1 or null"),
    ("loss_fn_own_checks", "grpo_tiny.yaml", {IS_KEY: False, "async_rl.sampler.max_lookahead_versions": 0},
     "model.init_args.loss_fn", "truncation needs IS correction"),
    ("group_size_one", "grpo_tiny.yaml", {"grpo.num_generations_per_prompt": 1},
     "grpo.num_generations_per_prompt", "at least 2 rollouts per prompt"),
    ("workflow_missing", "grpo_tiny.yaml", {"data.init_args.generation.workflow": "screl.rollout.workflows.workflow.Nope"},
     "data.init_args.generation.workflow", "cannot import the workflow class"),
    ("workflow_no_run", "grpo_tiny.yaml", {"data.init_args.generation.workflow": "screl.envs.CountLetter"},
     "data.init_args.generation.workflow", "has no run(items, generate) method"),
    # class paths from before screl/rollout/ split (screl/rollout/moved.py): refused, naming the new home
    ("moved_workflow_path", "grpo_tiny.yaml", {GEN_WORKFLOW: "screl.rollout.workflow.SingleTurnWorkflow"},
     GEN_WORKFLOW, "moved to screl.rollout.workflows.workflow.SingleTurnWorkflow"),
    ("moved_multiturn_path", "grpo_tool_tiny.yaml", {GEN_WORKFLOW: "screl.rollout.multiturn.MultiTurnWorkflow"},
     GEN_WORKFLOW, "moved to screl.rollout.workflows.multiturn.MultiTurnWorkflow"),
    ("moved_agent_path", "grpo_agent_tiny.yaml", {GEN_WORKFLOW: "screl.rollout.agent:AgentWorkflow"},
     GEN_WORKFLOW, "moved to screl.rollout.workflows.agent:AgentWorkflow"),
    ("moved_backend_path", "grpo_tiny.yaml", {GEN_BACKEND: "screl.rollout.torch_engine.TorchGenerationEngine"},
     GEN_BACKEND, "moved to screl.rollout.engines.torch_engine.TorchGenerationEngine"),
    ("moved_vllm_backend_path", "grpo_tiny.yaml", {GEN_BACKEND: "screl.rollout.vllm_engine.VLLMGenerationEngine"},
     GEN_BACKEND, "moved to screl.rollout.engines.vllm_engine.VLLMGenerationEngine"),
    ("moved_tool_parser_path", "grpo_agent_tiny.yaml",
     {"data.init_args.generation.http_server.tool_parser": "screl.rollout.tool_calls:HermesToolParser"},
     "data.init_args.generation.http_server.tool_parser", "moved to screl.rollout.server.tool_calls:HermesToolParser"),
    ("backend_unknown", "grpo_tiny.yaml", {"data.init_args.generation.backend": "my_pkg.Nope"},
     "data.init_args.generation.backend", "neither a built-in backend"),
    ("backend_not_an_engine", "grpo_tiny.yaml", {"data.init_args.generation.backend": "screl.envs.CountLetter"},
     "data.init_args.generation.backend", "does not implement the GenerationEngine protocol"),
    ("routing_replay_engine", "grpo_moe_tiny.yaml", {"data.init_args.generation.backend": "vllm"},
     "model.init_args.routing_replay", "does not return the experts it routed each token to"),
    ("routing_replay_plain_engine", "grpo_moe_tiny.yaml",
     {"data.init_args.generation.backend": "tests.engine_plugins.PlainEngine"},
     "model.init_args.routing_replay", "the PlainEngine engine does not declare routing_records"),
    ("routing_replay_colocated", "grpo_moe_tiny.yaml", {"data.init_args.generation.colocated": {"enabled": True}},
     "model.init_args.routing_replay", "its routing is the trainer's already"),
    ("routing_replay_multi_turn", "grpo_moe_tiny.yaml",
     {"data.init_args.generation.workflow": "screl.rollout.MultiTurnWorkflow"},
     "data.init_args.generation.workflow", "routing replay records single-turn completions only"),
    ("routing_replay_megatron", "grpo_moe_tiny.yaml",
     {"trainer.strategy": {"class_path": "screl.strategies.MegatronStrategy", "init_args": {}}},
     "model.init_args.routing_replay", "MegatronStrategy does not train mixture-of-experts policies"),
    ("routing_replay_static_decode", "grpo_moe_tiny.yaml",
     {"data.init_args.generation.backend_args": {"decode": "static"}},
     "data.init_args.generation.backend_args.decode", "through Hugging Face's forward"),
    ("megatron_backend_needs_strategy", "grpo_tiny.yaml", {"data.init_args.generation.backend": "megatron"},
     "data.init_args.generation.backend", "loads the policy as MegatronStrategy trains it"),
    ("megatron_backend_args", "grpo_megatron_tiny.yaml",
     {"data.init_args.generation.backend": "megatron", "data.init_args.generation.backend_args": {"decode": "hf"}},
     "data.init_args.generation.backend_args", "the megatron backend takes none"),
    ("nccl_on_cpu", "grpo_vllm_tiny.yaml", {"data.init_args.generation.backend_args": {"weight_transfer": "nccl"}},
     "data.init_args.generation.backend_args.weight_transfer", "the engines run on the CPU"),
    ("weight_transfer_unknown", "grpo_vllm_tiny.yaml",
     {"data.init_args.generation.backend_args": {"weight_transfer": "ipc"}},
     "data.init_args.generation.backend_args.weight_transfer", "must be nccl"),
    ("vllm_temperature", "grpo_vllm_tiny.yaml", {"data.init_args.generation.temperature": 2.5},
     "data.init_args.generation.temperature", "temperatures in [0, 2] only"),
    ("max_worker_restarts", "grpo_tiny.yaml", {"data.init_args.generation.max_worker_restarts": -2},
     "data.init_args.generation.max_worker_restarts", "must be an integer >= 0, or -1"),
    ("health_check_interval", "grpo_tiny.yaml", {"async_rl.watchdog": {"health_check_interval_s": 0}},
     "async_rl.watchdog.health_check_interval_s", "must be a number of seconds > 0"),
    ("drain_gate_recompute", "grpo_tiny.yaml",
     {"async_rl.in_flight_weight_updates": False, "async_rl.recompute_kv_cache_after_weight_updates": True},
     "async_rl.in_flight_weight_updates", "no KV cache to recompute"),
    ("drain_gate_sync", "grpo_tiny.yaml",
     {"async_rl.in_flight_weight_updates": False, "async_rl.sampler": {"name": "in_order", "max_lookahead_versions": 0}},
     "async_rl.in_flight_weight_updates", "no request is in flight at a refit"),
    ("deadline_positive", "grpo_tiny.yaml", {"data.init_args.generation.generation_timeout_s": 0},
     "data.init_args.generation.generation_timeout_s", "must be a number of seconds > 0"),
    ("deadline_order", "grpo_tiny.yaml",
     {"data.init_args.generation.generation_timeout_s": 60, "data.init_args.generation.rollout_timeout_s": 30},
     "data.init_args.generation.generation_timeout_s", "it would never fire"),
    ("stall_below_deadline", "grpo_tiny.yaml",
     {"data.init_args.generation.rollout_timeout_s": 300, "async_rl.watchdog": {"stall_timeout_s": 120}},
     "async_rl.watchdog.stall_timeout_s",
     "must exceed every request deadline (data.init_args.generation.rollout_timeout_s = 300)"),
    ("worker_cpus", "grpo_tiny.yaml", {"data.init_args.generation.num_cpus_per_worker": -1},
     "data.init_args.generation.num_cpus_per_worker", "must be a number >= 0"),
    ("worker_reserves_nothing", "grpo_tiny.yaml", {"data.init_args.generation.num_cpus_per_worker": 0},
     "data.init_args.generation.num_cpus_per_worker", "can land on any node"),
    ("worker_gpus", "grpo_tiny.yaml", {"data.init_args.generation.num_gpus_per_worker": -1},
     "data.init_args.generation.num_gpus_per_worker", "must be a number >= 0"),
    ("custom_resource_cpu", "grpo_tiny.yaml", {"data.init_args.generation.resources": {"CPU": 2}},
     "data.init_args.generation.resources.CPU", "not a custom resource"),
    ("custom_resource_amount", "grpo_tiny.yaml", {"data.init_args.generation.resources": {"rollout_node": 0}},
     "data.init_args.generation.resources.rollout_node", "must be a number > 0"),
    ("storage_resource", "grpo_tiny.yaml", {"data_plane.storage_node_resource": ""},
     "data_plane.storage_node_resource", "must be a Ray resource name"),
    ("refit_bucket", "grpo_tiny.yaml", {"data.init_args.generation.refit_bucket_mb": 0},
     "data.init_args.generation.refit_bucket_mb", "must be a number > 0"),
    ("gpus_idle_on_cpu", "grpo_tiny.yaml", {"data.init_args.generation.colocated.resources.gpus_per_node": 2},
     "data.init_args.generation.device", "would sit idle"),
    ("workflow_args_unknown", "grpo_tool_tiny.yaml", {"data.init_args.generation.workflow_args.max_rounds": 3},
     "data.init_args.generation.workflow_args", "MultiTurnWorkflow takes no argument(s) ['max_rounds']"),
    ("multi_turn_needs_env_task", "grpo_tool_tiny.yaml",
     {"data.init_args.task": {"class_path": "screl.envs.CountLetter", "init_args": {"letter": "a"}}},
     "data.init_args.task", "is not a screl.envs.environment.EnvTask"),
    ("multi_turn_max_turns", "grpo_tool_tiny.yaml", {"data.init_args.generation.workflow_args.max_turns": 0},
     "data.init_args.generation.workflow_args.max_turns", "must be an integer >= 1"),
    ("multi_turn_no_validation", "grpo_tool_tiny.yaml", {"grpo.val_period": 5},
     "grpo.val_period", "validation runs single-turn generations"),
    ("agent_needs_server", "grpo_agent_tiny.yaml", {"data.init_args.generation.expose_http_server": False},
     "data.init_args.generation.expose_http_server", "runs the agent against the OpenAI-compatible server"),
    ("agent_needs_agent", "grpo_agent_tiny.yaml", {"data.init_args.generation.workflow_args.agent": None},
     "data.init_args.generation.workflow_args.agent", "needs the agent function"),
    ("server_bind_needs_key", "grpo_agent_tiny.yaml", {"data.init_args.generation.http_server.host": "0.0.0.0"},
     "data.init_args.generation.http_server.host", "binds a non-loopback address without an API key"),
    ("lightning_ddp_listens", "grpo_tiny.yaml", {"trainer.strategy": "ddp"},
     "trainer.strategy", "torch's TCP store, which listens on every network interface"),
    ("lightning_ddp_class_listens", "grpo_tiny.yaml",
     {"trainer.strategy": {"class_path": "lightning.pytorch.strategies.DDPStrategy"}},
     "trainer.strategy", "screl.strategies.DDPStrategy is the same strategy"),
    ("spawned_ranks", "grpo_tiny.yaml", {"trainer.strategy": "ddp_spawn"},
     "trainer.strategy", "do not survive it"),
    ("spawned_screl_ddp", "grpo_ddp_tiny.yaml", {"trainer.strategy.init_args": {"start_method": "spawn"}},
     "trainer.strategy", "do not survive it"),
    ("sharded_strategy", "grpo_tiny.yaml", {"trainer.strategy": "fsdp"},
     "trainer.strategy", "leaves rank 0 no full copy"),
    ("ppo_data_parallel_needs_screl_ddp", "ppo_tiny.yaml", {"trainer.devices": 2},
     "trainer.strategy", "PPO over 2 processes reduces its advantages, loss normalizers and gradients"),
    ("ppo_minibatches_divide_the_step", "ppo.yaml", {"ppo.num_minibatches": 5},
     "ppo.num_minibatches", "must be >= 1 and divide the step's num_prompts_per_step x num_generations_per_prompt"),
    ("ppo_minibatches_positive", "ppo.yaml", {"ppo.num_minibatches": 0}, "ppo.num_minibatches", "must be >= 1"),
    # screl.Distill (screl/rules/distill_rules.py)
    ("distill_map_unknown_teacher", "distill_tiny.yaml",
     {"model.init_args.distillation.teacher_map": {"count": "cuont"}},
     "model.init_args.distillation.teacher_map.count", "names an unknown teacher (teachers: ['count'])"),
    ("distill_missing_default", "distill_tiny.yaml", {"model.init_args.distillation.default_teacher": None},
     "model.init_args.distillation.default_teacher", "no default teacher"),
    ("distill_tokenizer_differs", "distill_tiny.yaml",
     {"model.init_args.distillation.teachers": [{"name": "count", "policy": {
         "class_path": "screl.models.HFCausalLM", "init_args": {
             "path": "examples/distill/teachers/count", "tokenizer_path": "tests/data/digit_tokenizer"}}}]},
     "model.init_args.distillation.teachers[0].policy",
     "teacher 'count' (HFCausalLM(path='examples/distill/teachers/count', tokenizer_path='tests/data/digit_tokenizer'"
     ")) has a tokenizer that differs from the student's (TinyCausalLM(scale='tiny'))"),
    ("distill_estimator_unknown", "distill_tiny.yaml", {"model.init_args.distillation.estimator": "exact"},
     "model.init_args.distillation.estimator", "out of range"),
    ("distill_top_k_not_under_megatron", "distill_tiny.yaml",
     {"model.init_args.distillation.estimator": "top_k", "trainer.strategy": {
         "class_path": "screl.strategies.MegatronStrategy",
         "init_args": {"parallelism": {"tensor_model_parallel_size": 1}}}},
     "model.init_args.distillation.estimator", "MegatronStrategy shards over the tensor-parallel ranks"),
    ("distill_forward_kl_needs_top_k", "distill_tiny.yaml", {"model.init_args.distillation.kl_direction": "forward"},
     "model.init_args.distillation.kl_direction", "estimates the reverse KL only"),
    ("distill_teacher_on_cuda_without_a_gpu", "distill_tiny.yaml",
     {"model.init_args.distillation.teacher_device": "cuda"},
     "model.init_args.distillation.num_gpus_per_teacher", "needs a GPU share"),
    ("distill_teacher_replicas_zero", "distill_tiny.yaml", {"model.init_args.distillation.teacher_replicas": 0},
     "model.init_args.distillation.teacher_replicas", "out of range"),
]


@pytest.mark.parametrize(("rule", "base", "changes", "key", "words"), BAD, ids=[b[0] for b in BAD])
def test_bad_config_fails_check_naming_its_key(
    rule: str, base: str, changes: dict[str, Any], key: str, words: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = copy.deepcopy(_load(base))
    for dotted, value in changes.items():
        if value is None:
            _delete(cfg, dotted)
        else:
            _set(cfg, dotted, value)
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc != 0, f"{rule}: check passed\n{out}"
    lines = [line for line in out.splitlines() if f"{key} = " in line or f"{key}: " in line]
    assert lines, f"{rule}: no problem names {key!r}:\n{out}"
    assert any(words in line for line in lines), f"{rule}: {words!r} not said about {key}:\n{out}"
    assert any("Fix:" in line for line in lines) or "see `screl fit --help`" in out


def test_the_plan_names_the_teachers(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = _run_check(_load("distill_tiny.yaml"), tmp_path, capsys)
    assert rc == 0, out
    assert "algorithm            Distill (GRPO steps; teachers ['count'], map {}, default 'count', reward_weight 0.0)" in out


def test_three_problems_are_all_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["grpo"]["max_num_epochs"] = 0
    cfg["data_plane"]["enabled"] = False
    cfg["async_rl"]["max_buffered_rollouts"] = 4
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 2
    assert "3 problem(s)" in out
    for key in ("grpo.max_num_epochs", "data_plane.enabled", "async_rl.max_buffered_rollouts"):
        assert f"{key} = " in out


def test_type_errors_fail_before_work(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["checkpointing"] = {"enabled": "maybe"}
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    with pytest.raises(SystemExit, match="2"):
        check(["--config", str(path)])
    assert "checkpointing.enabled" in capsys.readouterr().err


def test_fit_rejects_a_bad_config_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "run")
    cfg["data_plane"]["enabled"] = False
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(path)]) == 2
    assert "data_plane.enabled" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


def _help(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """What ``screl <args>`` prints, in this process (it must exit 0)."""
    from screl.cli import ScrelCLI

    capsys.readouterr()
    try:
        ScrelCLI(args=args)
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr()
    else:
        raise AssertionError(f"{args} did not exit")
    return capsys.readouterr().out


def test_help_describes_the_knobs(capsys: pytest.CaptureFixture[str]) -> None:
    # the console entry point itself once; the subcommands' help in this process
    top = subprocess.run([sys.executable, "-m", "screl.cli", "--help"], capture_output=True, text=True, timeout=120)
    assert top.returncode == 0
    assert "screl check" in top.stdout and "fit" in top.stdout
    fit = _help(["fit", "--help"], capsys)
    assert "Hard cap on groups holding data-plane room" in fit  # async_rl.max_buffered_rollouts
    assert "--async_rl.sampler" in fit and "over_sampling_ratio" in fit
    assert "Prompt groups per RL step" in _help(["fit", "--grpo.help", "GRPOConfig"], capsys)


@pytest.mark.parametrize(("config", "temperature"), [("grpo_tiny.yaml", 0.6), ("ppo_tiny.yaml", 1.3)])
def test_the_generation_temperature_reaches_the_models_logprobs(config: str, temperature: float) -> None:
    """The trainer recomputes logprobs at the engine's temperature (a mismatch skews every IS weight)."""
    from screl.cli import ScrelCLI

    cli = ScrelCLI(args=["--config", str(ROOT / "configs" / config),
                         "--data.init_args.generation.temperature", str(temperature)], run=False)
    assert cli.datamodule.generation.temperature == temperature
    assert cli.model.temperature == temperature


def test_the_plan_says_how_a_refit_meets_requests_in_flight(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")  # async lookahead 1
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "refit                in flight: requests continue under the new weights on their old KV cache\n" in out
    cfg["async_rl"]["in_flight_weight_updates"] = False  # the drain gate, with its throughput cost
    cfg["data"]["init_args"]["generation"].update(generation_timeout_s=30, rollout_timeout_s=60)
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert ("refit                drain gate: each refit waits for the in-flight requests to finish under the old "
            "weights, so no sample spans two versions; generation runs dry for the longest request at every step; "
            "deadlines: generation 30 s, rollout 60 s (paused time excluded)") in out


def test_the_torch_backend_args_are_checked_all_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["data"]["init_args"]["generation"]["backend_args"] = {"decode": "fast", "beam": 4, "cuda_graphs": True}
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc != 0
    assert "data.init_args.generation.backend_args.decode = 'fast': must be one of auto, static, hf" in out, out
    assert "data.init_args.generation.backend_args.beam = 4: the torch backend takes only backend_args.decode" in out
    assert ("data.init_args.generation.backend_args.cuda_graphs = True: CUDA graphs need a CUDA device (device: cpu)"
            in out), out
    cfg["data"]["init_args"]["generation"]["backend_args"] = {"decode": "hf"}
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed in this venv")
def test_the_vllm_backend_without_vllm_installed_fails_check(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["data"]["init_args"]["generation"]["backend"] = "vllm"
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc != 0
    assert "data.init_args.generation.backend = 'vllm': vLLM is not installed in this environment" in out, out
    assert "bash .ci/vllm-venv" in out


def test_metric_name_needs_keep_top_k(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo.yaml")
    cfg["checkpointing"].update(metric_name="train:reward", keep_top_k=None)
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 2 and "checkpointing.metric_name" in out and "ranks bundles for keep_top_k" in out, out
    cfg["checkpointing"]["keep_top_k"] = 2
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out


def test_the_default_buffer_lets_windowed_dispatch_run_ahead(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """windowed needs one streaming chunk of buffer, but the buffer counts in-flight groups too: a default of that
    minimum would gate its ungated dispatch. The default is room for the in-flight bound, and the plan says so."""
    cfg = _load("samplers/windowed.yaml")
    cfg["async_rl"].pop("max_buffered_rollouts", None)
    cfg["async_rl"].pop("max_inflight_prompts", None)
    cfg["async_rl"]["min_groups_for_streaming_train"] = 4
    cfg["async_rl"]["sampler"].update(max_staleness_versions=2, over_sampling_ratio=None)
    groups = cfg["grpo"]["num_prompts_per_step"]
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert f"in-flight bound      {3 * groups} prompt groups" in out
    assert (f"buffer capacity      required 4, configured {3 * groups} groups (default: room for the in-flight "
            "bound") in out
    cfg["async_rl"]["max_buffered_rollouts"] = 5  # an explicit value is the user's
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0 and "required 4, configured 5 groups (max_buffered_rollouts)" in out, out


def test_the_plan_says_what_a_failed_sibling_costs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _load("grpo_tiny.yaml")
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0 and "recovery             token capture on: sibling (finished siblings are kept" in out, out
    cfg["token_capture"] = {"enabled": False}
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0 and "token capture off: a failed or restarted sibling regenerates its whole group" in out, out


def test_the_plan_warns_of_shadow_mode_checkpoints(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A checkpointed run whose custom sampler cannot restore buffered groups: valid, and the plan says what its
    bundles will and will not hold (the built-in samplers and a declaring custom one: no such line)."""
    cfg = _load("grpo.yaml")
    cfg["async_rl"]["sampler"] = {"name": "custom", "target": "tests.sampler_plugins:NoReplay",
                                  "max_lookahead_versions": 1}
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert "SHADOW MODE: custom sampler does not declare supports_buffer_checkpoint = True" in out
    cfg["async_rl"]["sampler"]["target"] = "tests.sampler_plugins:DeclaresCheckpoint"
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0 and "SHADOW MODE" not in out, out


def test_an_estimator_from_outside_screl_is_accepted_by_its_path(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["grpo"]["adv_estimator"] = {"name": "tests.estimator_plugins:mean_baseline"}
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out


def test_an_engine_from_outside_screl_passes_check_with_the_features_it_declares(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _load("grpo_tiny.yaml")
    cfg["data"]["init_args"]["generation"]["backend"] = "tests.engine_plugins.PlainEngine"
    rc, out = _run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
