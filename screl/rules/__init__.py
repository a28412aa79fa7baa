"""Every cross-block rule of a screl config, checked before any work starts.

``config_problems(cfg)`` takes the whole config as a plain mapping (the parsed YAML, defaults
filled in) and returns every problem at once; each names its dotted key, the offending value and
the fix. ``validate_config`` raises ``ConfigError`` listing them all.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from screl.rules.agent_rules import agent_rules, server_limit_rules
from screl.rules.colocated_rules import colocated_rules
from screl.rules.context import (
    ConfigError,
    Problem,
    RuleContext,
    get,
    sampler_declares,
    to_mapping,
    workflow_problem,
)
from screl.rules.engine_rules import engine_rules
from screl.rules.hub_rules import model_source_rules, system_prompt_rules
from screl.rules.lora_rules import lora_rules
from screl.rules.model_rules import model_memory_rules, precision_rules
from screl.rules.moe_rules import routing_replay_rules
from screl.rules.moved_rules import moved_path_rules
from screl.rules.optimizer_rules import distributed_optimizer_rules
from screl.rules.placement_rules import placement_rules
from screl.rules.rollout_rules import deadline_rules, refit_rules, worker_health_rules
from screl.rules.run_rules import (
    algorithm_own_rules,
    algorithm_pairing_rules,
    algorithm_rules,
    batch_rules,
    failure_rules,
    generation_rules,
    loss_rules,
    sampler_block_rules,
)
from screl.rules.storage_rules import (
    checkpoint_rules,
    custom_sampler_rules,
    recovery_rules,
    snapshot_rules,
)
from screl.rules.trainer_rules import strategy_rules
from screl.rules.vlm_rules import vlm_rules

#: Every rule, one per config block, in the order their problems are listed (an algorithm's own rules,
#: ``Algorithm.rules``, come after the rules every algorithm shares).
RULES = (
    moved_path_rules,
    algorithm_rules,
    strategy_rules,
    distributed_optimizer_rules,
    precision_rules,
    model_source_rules,
    lora_rules,
    system_prompt_rules,
    model_memory_rules,
    sampler_block_rules,
    loss_rules,
    failure_rules,
    batch_rules,
    generation_rules,
    engine_rules,
    routing_replay_rules,
    vlm_rules,
    colocated_rules,
    placement_rules,
    agent_rules,
    server_limit_rules,
    deadline_rules,
    refit_rules,
    worker_health_rules,
    algorithm_pairing_rules,
    algorithm_own_rules,
    custom_sampler_rules,
    checkpoint_rules,
    snapshot_rules,
    recovery_rules,
)


def config_problems(config: Mapping[str, Any] | Any) -> list[Problem]:
    """Every problem of a whole screl config (the parsed YAML with defaults), in a stable order."""
    ctx = RuleContext(to_mapping(config))
    for rule in RULES:
        rule(ctx)
    return ctx.problems


def validate_config(config: Mapping[str, Any] | Any) -> None:
    """Raise ``ConfigError`` listing every problem of ``config``; return quietly when it is sound."""
    problems = config_problems(config)
    if problems:
        raise ConfigError(problems)


__all__ = [
    "RULES",
    "ConfigError",
    "Problem",
    "RuleContext",
    "config_problems",
    "get",
    "sampler_declares",
    "validate_config",
    "workflow_problem",
]
