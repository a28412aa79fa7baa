"""The config rules read the typed blocks (``screl.rules.blocks``), so every default lives in one place: the
config dataclasses. A rule that restates a default (``gen.get("temperature", 1.0)``) drifts from it unnoticed
(``rollout_checkpointing.max_consecutive_failures`` once read as 2 here, 3 in the dataclass)."""

from __future__ import annotations

import ast
import copy
import dataclasses
from pathlib import Path
from typing import Any

import pytest
from _check_helpers import load_config

from screl.config import AsyncRLConfig, CheckpointingConfig, RolloutCheckpointingConfig
from screl.config_algo import GRPOConfig, PPOConfig
from screl.config_generation import GenerationConfig
from screl.rules import config_problems
from screl.rules.blocks import field_default, typed_block
from screl.rules.context import RuleContext

RULES = Path(__file__).resolve().parents[2] / "screl" / "rules"
_EMPTY = (None, "")


def _literal_default(node: ast.expr) -> bool:
    """A default that restates a value: a number, a bool, a non-empty string or container (None, "" and empty
    containers only stand for "absent")."""
    if isinstance(node, ast.Constant):
        return node.value not in _EMPTY
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return bool(node.elts)
    if isinstance(node, ast.Dict):
        return bool(node.keys)
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True  # -1
    return False


def restated_defaults(source: str, filename: str) -> list[str]:
    """``x.get(key, <literal>)``, ``get(x, "a.b", <literal>)`` and ``getattr(x, key, <literal>)`` calls (a key
    from a loop too: ``for knob, default in ...: rf.get(knob, 1)``)."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr == "get" and len(node.args) == 2:
            key, default = node.args
        elif isinstance(func, ast.Name) and func.id in ("get", "getattr") and len(node.args) == 3:
            key, default = node.args[1:]
        else:
            continue
        if _literal_default(default):
            found.append(f"{filename}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_guard_finds_restated_defaults() -> None:
    source = ('a = gen.get("temperature", 1.0)\nb = get(cfg, "trainer.devices", 1)\nc = rf.get("k", -1)\n'
              'd = getattr(v, "k", True)\ne = x.get("k")\nf = get(cfg, "a.b", None)\ng = s.get("class_path", "")\n'
              'h = x.get(name, 3)\n')
    found = restated_defaults(source, "x.py")
    assert [line.split(": ", 1)[0] for line in found] == ["x.py:1", "x.py:2", "x.py:3", "x.py:4", "x.py:8"], found


def test_no_rule_restates_a_default() -> None:
    found = [hit for path in sorted(RULES.glob("*.py"))
             for hit in restated_defaults(path.read_text(), str(path.relative_to(RULES.parents[1])))]
    assert not found, "read these from the typed blocks (RuleContext) instead:\n" + "\n".join(found)


def test_field_default_reads_the_dataclass() -> None:
    assert field_default(GRPOConfig, "num_prompts_per_step") == 8
    assert field_default(AsyncRLConfig, "sampler") == {"name": "in_order", "max_lookahead_versions": 1}
    assert field_default(PPOConfig, "adv_estimator").name == "gae"
    with pytest.raises(KeyError, match="GRPOConfig has no field 'nope'"):
        field_default(GRPOConfig, "nope")


def _build(cls: type, raw: Any, key: str) -> tuple[Any, list[tuple[str, Any, str, str]]]:
    problems: list[tuple[str, Any, str, str]] = []
    return typed_block(cls, raw, key, lambda *p: problems.append(p)), problems


def test_a_typed_block_keeps_what_is_written_and_fills_the_rest() -> None:
    block, problems = _build(PPOConfig, {"num_prompts_per_step": "eight", "adv_estimator": {"gamma": 0.9},
                                         "validation": None, "zz_unknown": 1}, "ppo")
    assert problems == []
    assert block.num_prompts_per_step == "eight"  # as written: the rules judge it
    assert block.num_generations_per_prompt == 4
    assert (block.adv_estimator.name, block.adv_estimator.gamma) == ("gae", 0.9)  # the field's own default block
    assert block.validation == field_default(PPOConfig, "validation")


def test_a_block_that_is_not_a_block_is_a_problem_and_reads_as_defaults() -> None:
    block, problems = _build(AsyncRLConfig, {"rollout_failure": 5, "max_buffered_rollouts": 7}, "async_rl")
    assert block.max_buffered_rollouts == 7
    assert block.rollout_failure == field_default(AsyncRLConfig, "rollout_failure")
    assert [(k, v) for k, v, *_ in problems] == [("async_rl.rollout_failure", 5)]
    assert "must be a block of settings (RolloutFailureConfig), not a int" in problems[0][2]


def test_every_bad_block_is_listed_and_the_other_rules_still_run() -> None:
    problems = config_problems({"grpo": {"max_num_epochs": 0}, "async_rl": 5, "checkpointing": [1],
                                "data": {"init_args": {"generation": "fast"}}, "data_plane": {"enabled": False}})
    keys = [p.key for p in problems]
    for key in ("async_rl", "checkpointing", "data.init_args.generation", "grpo.max_num_epochs",
                "data_plane.enabled"):
        assert key in keys, problems
    assert keys.index("async_rl") < keys.index("grpo.max_num_epochs")  # the blocks first, then the rules


@pytest.mark.parametrize("key", ["grpo", "async_rl", "data_plane", "checkpointing", "rollout_checkpointing",
                                 "rollout_recovery", "token_capture", "async_rl.rollout_failure", "async_rl.watchdog",
                                 "grpo.validation", "grpo.reward_shaping", "grpo.adv_estimator",
                                 "data.init_args.generation", "data.init_args.generation.colocated",
                                 "data.init_args.generation.colocated.resources",
                                 "data.init_args.generation.http_server"])
def test_a_scalar_for_a_block_is_reported_naming_it(key: str) -> None:
    cfg = copy.deepcopy(load_config("grpo_tiny.yaml"))  # as written: no defaults filled in
    *parents, last = key.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[last] = 5
    problems = config_problems(cfg)
    assert [p.message for p in problems if p.key == key] == [
        f"must be a block of settings ({type(field_default_block(key)).__name__}), not a int"], problems


def field_default_block(key: str) -> Any:
    """The default block at ``key`` of a GRPO run (its typed view when nothing is written)."""
    node: Any = RuleContext({"grpo": {}})
    first, *rest = key.split(".")
    views = {"grpo": "algo_cfg", "async_rl": "async_cfg", "data_plane": "dp_cfg", "checkpointing": "ck_cfg",
             "rollout_checkpointing": "snapshot_cfg", "rollout_recovery": "recovery_cfg", "token_capture": "capture_cfg"}
    if first == "data":
        node, rest = node.gen_cfg, rest[2:]
    else:
        node = getattr(node, views[first])
    for part in rest:
        node = getattr(node, part)
    return node


def test_the_context_reads_defaults_from_the_dataclasses() -> None:
    c = RuleContext({"grpo": {"num_generations_per_prompt": 2}})
    assert (c.P, c.G) == (field_default(GRPOConfig, "num_prompts_per_step"), 2)
    assert c.gen_cfg == GenerationConfig()
    assert c.ck_cfg == CheckpointingConfig()
    assert c.snapshot_cfg.max_consecutive_failures == RolloutCheckpointingConfig().max_consecutive_failures
    assert c.rf_cfg is c.async_cfg.rollout_failure
    assert c.problems == []


@pytest.mark.parametrize("knob", [f.name for f in dataclasses.fields(RolloutCheckpointingConfig)
                                  if f.name in ("keep_latest_k", "max_consecutive_failures")])
def test_an_unset_knob_is_its_default_not_a_problem(knob: str) -> None:
    assert not [p for p in config_problems({"grpo": {}, "rollout_checkpointing": {}}) if knob in p.key]
    bad = config_problems({"grpo": {}, "rollout_checkpointing": {knob: 0}})
    assert [p.key for p in bad if knob in p.key] == [f"rollout_checkpointing.{knob}"]
