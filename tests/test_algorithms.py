"""The algorithm registry: what the CLI, the rules and the controller ask instead of testing names."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from screl.algorithms import (
    Algorithm,
    algorithm,
    algorithm_of_model,
    algorithm_of_run,
    register_algorithm,
    run_blocks,
)
from screl.config import GRPOConfig, PPOConfig, RunConfig
from screl.modules import GRPO, PPO, Distill, PolicyGradientModule
from screl.modules.ppo import PPO as PPO_BY_PATH

ROOT = Path(__file__).resolve().parents[1]


class MyPPO(PPO):
    """A user's PPO subclass: still PPO's step rules."""


def test_each_module_class_path_maps_to_its_algorithm() -> None:
    assert algorithm_of_model("screl.GRPO") is algorithm("grpo")
    assert algorithm_of_model("screl.modules.ppo.PPO") is algorithm("ppo")
    assert algorithm_of_model("screl.Distill") is algorithm("distill")
    assert algorithm_of_model("screl.modules.distill.Distill").name == "distill"
    assert algorithm_of_model("test_algorithms.MyPPO") is algorithm("ppo")
    assert algorithm_of_model("screl.models.TinyCausalLM") is None
    assert algorithm_of_model("no.such.Module") is None
    assert algorithm_of_model(None) is None


def test_the_algorithms_are_siblings_over_one_base_each_registered_with_its_block() -> None:
    for cls in (GRPO, PPO, Distill):
        assert issubclass(cls, PolicyGradientModule)
        assert not any(issubclass(cls, other) for other in (GRPO, PPO, Distill) if other is not cls), cls
        assert algorithm_of_model(f"{cls.__module__}.{cls.__qualname__}").name == cls.__name__.lower()
    assert PPO is PPO_BY_PATH  # screl.modules.PPO is the class the registry names
    assert run_blocks() == {"grpo": (GRPOConfig, "GRPO step settings."), "ppo": (PPOConfig, "PPO step settings.")}
    assert algorithm("distill").block is GRPOConfig  # Distill trains on the grpo block


def test_the_cli_declares_no_algorithm_block_of_its_own() -> None:
    cli = (ROOT / "screl" / "cli.py").read_text()
    declared = r'^\s+(GRPOConfig|PPOConfig),$|(type=|": )(GRPOConfig|PPOConfig)|"--(grpo|ppo)"|\("grpo", "ppo"'
    assert not re.search(declared, cli, re.M), "derive them from screl.algorithms.run_blocks()"
    assert re.search(declared, '        parser.add_argument("--grpo", type=GRPOConfig | None, default=None)', re.M)


def test_a_run_is_the_algorithm_of_its_block() -> None:
    assert algorithm_of_run(RunConfig(ppo=PPOConfig())).name == "ppo"
    assert algorithm_of_run(RunConfig(grpo=GRPOConfig())).name == "grpo"
    assert algorithm_of_run({"ppo": {"num_prompts_per_step": 2}}).name == "ppo"
    assert algorithm_of_run({}).name == "grpo"  # no block: GRPO's defaults
    ppo = algorithm("ppo")
    assert (ppo.step_may_shrink, ppo.needs_critic, ppo.samplers) == (False, True, ("in_order",))
    assert algorithm("grpo").step_may_shrink and not algorithm("grpo").needs_critic


def test_a_name_or_a_module_is_registered_once() -> None:
    spec = algorithm("grpo")
    with pytest.raises(ValueError, match=r"algorithm 'grpo' \(screl.modules.grpo.GRPO\) clashes with the registered"):
        register_algorithm(spec)
    other = Algorithm(name="grpo2", title="GRPO2", config_key="grpo", module=spec.module, step_may_shrink=True,
                      needs_critic=False, default_adv_estimator="grpo")
    with pytest.raises(ValueError, match=r"clashes with the registered \['grpo'\]"):
        register_algorithm(other)
    with pytest.raises(ValueError, match=r"unknown algorithm 'nope'; registered: \['distill', 'grpo', 'ppo'\]"):
        algorithm("nope")


def _toy_rule(c: Any) -> None:
    c.bad("grpo.num_prompts_per_step", c.P, "the toy algorithm's own rule ran", "nothing: it always runs")


def test_an_algorithms_own_rules_run_for_its_runs_and_no_other() -> None:
    """``Algorithm.rules``: each algorithm's rules live beside it and run only when its block or its model is the
    run's (PPO's critic rules, Distill's teacher rules, and a toy algorithm's, registered here for the test)."""
    from screl import algorithms
    from screl.rules import config_problems

    assert algorithm("ppo").rules == ("screl.rules.critic_rules:critic_rules",)
    assert algorithm("distill").rules == ("screl.rules.distill_rules:distill_rules",)
    assert algorithm("grpo").rules == ()
    toy = Algorithm(name="toy", title="Toy", config_key="grpo", module="tests.test_algorithms.Toy",
                    step_may_shrink=True, needs_critic=False, default_adv_estimator="grpo",
                    rules=("tests.test_algorithms:_toy_rule",))
    grpo = {"model": {"class_path": "screl.GRPO"}, "grpo": {"num_prompts_per_step": 3}}
    ppo = {"model": {"class_path": "screl.PPO"}, "ppo": {"num_prompts_per_step": 3}}
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(algorithms._REGISTRY, "toy", toy)
        own = [p for p in config_problems({**grpo, "model": {"class_path": toy.module}}) if "toy" in p.message]
        assert [(p.key, p.value) for p in own] == [("grpo.num_prompts_per_step", 3)]  # once, for the toy's model
        assert not [p for p in config_problems(grpo) if "toy" in p.message]
    critic = [p.key for p in config_problems(ppo) if "needs a critic" in p.message or "needs a value loss" in p.message]
    assert critic == ["model.init_args.value", "model.init_args.value_loss_fn"]
    assert not [p for p in config_problems(grpo) if "needs a critic" in p.message]


# what a test of the algorithm's identity looks like, outside the algorithm's own files
_NAME_TESTS = re.compile(
    r"\.(ppo|grpo) is (not )?None|[=!]= \"(ppo|grpo|PPO|GRPO|Distill|distill)\"|endswith\(\"PPO\"\)"
    r"|isinstance\([^)]*\b(PPO|GRPO|Distill)\b"
)
_OWN_FILES = {
    "screl/algorithms.py",  # the registry itself
    "screl/modules/grpo.py", "screl/modules/ppo.py", "screl/modules/distill.py",
    "screl/rules/distill_rules.py",  # Distill's own rules (Algorithm.rules)
    "screl/rules/critic_rules.py",  # PPO's own rules
}


def test_no_code_outside_an_algorithms_own_files_tests_which_algorithm_runs() -> None:
    found = []
    for folder in ("screl", "callbacks", "strategies"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel in _OWN_FILES:
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _NAME_TESTS.search(line):
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "ask screl.algorithms (algorithm_of_run / algorithm_of_model) instead:\n" + "\n".join(found)


def test_the_name_check_sees_a_name_test() -> None:
    assert _NAME_TESTS.search('    algo_key="grpo" if run.ppo is None else "ppo",')
    assert _NAME_TESTS.search('if model_kind(cfg) == "ppo":')
    assert not _NAME_TESTS.search("if run.algorithm.needs_critic:")


# what a test of the generation engine's name looks like (outside the engines' own package, screl/rollout/engines/)
_ENGINE_NAME_TESTS = re.compile(r"(?<!dp_)backend[\"')\]]{0,4} (==|!=|in|not in) |[=!]= \"(vllm|torch)\"")


def test_no_code_outside_the_engines_package_tests_which_engine_generates() -> None:
    found = []
    for folder in ("screl", "callbacks", "strategies"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("screl/rollout/engines/"):
                continue
            for number, line in enumerate(path.read_text().splitlines(), 1):
                if _ENGINE_NAME_TESTS.search(line):
                    found.append(f"{rel}:{number}: {line.strip()}")
    assert not found, "ask the engine's declared capabilities (engine_capabilities) instead:\n" + "\n".join(found)
    assert _ENGINE_NAME_TESTS.search('    if g.backend == "vllm" and g.min_new_tokens > 0:')
    assert _ENGINE_NAME_TESTS.search('    if gen.get("backend", "torch") != "torch":')
    assert not _ENGINE_NAME_TESTS.search('        if naming == "megatron":')
