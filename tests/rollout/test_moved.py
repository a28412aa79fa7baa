"""Class paths from before ``screl/rollout/`` split into ``engines/``, ``server/`` and ``workflows/``
(``screl/rollout/moved.py``): refused wherever a config's class path is resolved, naming the new home, and never
served by a re-export; ``screl check`` and ``screl fit`` report each once."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest
import yaml
from _check_helpers import load_config, run_check

from screl.cli import main
from screl.config_generation import DEFAULT_WORKFLOW
from screl.rollout.engines.registry import BUILTIN_BACKENDS, resolve_backend
from screl.rollout.moved import MOVED, MovedPathError, moved_to
from screl.rollout.server.tool_calls import resolve_tool_parser
from screl.rollout.workflows.reward_transform import load_shaping_fn
from screl.rollout.workflows.workflow import load_workflow

ROOT = Path(__file__).resolve().parents[2]
WORKFLOW, BACKEND = "data.init_args.generation.workflow", "data.init_args.generation.backend"
OLD_WORKFLOW, NEW_WORKFLOW = "screl.rollout.workflow.SingleTurnWorkflow", "screl.rollout.workflows.workflow.SingleTurnWorkflow"
OLD_ENGINE, NEW_ENGINE = ("screl.rollout.torch_engine.TorchGenerationEngine",
                          "screl.rollout.engines.torch_engine.TorchGenerationEngine")


@pytest.mark.parametrize(("old", "new"), [
    (OLD_WORKFLOW, NEW_WORKFLOW),
    ("screl.rollout.multiturn.MultiTurnWorkflow", "screl.rollout.workflows.multiturn.MultiTurnWorkflow"),
    ("screl.rollout.agent:AgentWorkflow", "screl.rollout.workflows.agent:AgentWorkflow"),
    (OLD_ENGINE, NEW_ENGINE),
    ("screl.rollout.vllm_engine.VLLMGenerationEngine", "screl.rollout.engines.vllm_engine.VLLMGenerationEngine"),
    ("screl.rollout.engine.GenerationEngine", "screl.rollout.engines.protocol.GenerationEngine"),
    ("screl.rollout.backends.resolve_backend", "screl.rollout.engines.registry.resolve_backend"),
    ("screl.rollout.backends.WireBucket", "screl.rollout.engines.buckets.WireBucket"),  # backends.py split in two
    ("screl.rollout.server.PolicyServer", "screl.rollout.server.server.PolicyServer"),
    ("screl.rollout.chat", "screl.rollout.workflows.chat"),
])
def test_an_old_path_names_its_new_home(old: str, new: str) -> None:
    assert moved_to(old) == new


@pytest.mark.parametrize("path", [
    DEFAULT_WORKFLOW, *BUILTIN_BACKENDS.values(), *BUILTIN_BACKENDS, *MOVED.values(),
    "screl.rollout.MultiTurnWorkflow", "screl.rollout.AgentWorkflow", "screl.rollout.EngineCapabilities",
    "screl.rollout.faults.HangsOnceEngine", "screl.rollout.server.server.PolicyServer",
    "screl.rollout.server.server_routes", "screl.rollout.server.server_requests.Job",
    "screl.rollout.server.tool_calls:HermesToolParser", "tests.engine_plugins.PlainEngine",
])
def test_a_current_path_is_not_moved(path: str) -> None:
    assert moved_to(path) is None


@pytest.mark.parametrize("old", sorted(MOVED))
def test_the_old_module_is_gone_and_the_new_home_exists(old: str) -> None:
    new = MOVED[old]
    if old.count(".") == 2:  # a module, moved whole
        assert importlib.util.find_spec(new) is not None, new
        module = old
    else:  # a name of a split module
        home, _, name = new.rpartition(".")
        assert hasattr(importlib.import_module(home), name), new
        module = old.rpartition(".")[0]
    if module == "screl.rollout.server":  # now the server's package: it re-exports nothing of server.py
        assert not hasattr(importlib.import_module(module), "PolicyServer")
    else:
        assert importlib.util.find_spec(module) is None, f"{module} is importable: a re-export shim?"


def test_the_package_level_names_stay() -> None:
    import screl.rollout as rollout
    from screl.rollout.engines.protocol import EngineCapabilities, EngineOptions, GenerationEngine
    from screl.rollout.workflows.agent import AgentWorkflow
    from screl.rollout.workflows.multiturn import MultiTurnWorkflow

    assert rollout.EngineCapabilities is EngineCapabilities and rollout.EngineOptions is EngineOptions
    assert rollout.GenerationEngine is GenerationEngine
    assert rollout.MultiTurnWorkflow is MultiTurnWorkflow and rollout.AgentWorkflow is AgentWorkflow
    assert rollout.TorchGenerationEngine is resolve_backend("torch")
    assert load_workflow(DEFAULT_WORKFLOW).__name__ == "SingleTurnWorkflow"


def test_every_resolver_refuses_an_old_path_naming_the_new_home() -> None:
    with pytest.raises(MovedPathError, match=re.escape(f"{BACKEND} = {OLD_ENGINE!r}: moved to {NEW_ENGINE}")):
        resolve_backend(OLD_ENGINE)
    with pytest.raises(MovedPathError, match=re.escape(f"{WORKFLOW} = {OLD_WORKFLOW!r}: moved to {NEW_WORKFLOW}")):
        load_workflow(OLD_WORKFLOW)
    with pytest.raises(MovedPathError, match=re.escape("moved to screl.rollout.server.tool_calls:HermesToolParser")):
        resolve_tool_parser("screl.rollout.tool_calls:HermesToolParser")
    with pytest.raises(MovedPathError, match=re.escape("moved to screl.rollout.workflows.chat.plain_messages")):
        load_shaping_fn("screl.rollout.chat.plain_messages")


def test_check_reports_each_old_path_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("grpo_tiny.yaml")
    cfg["data"]["init_args"]["generation"].update(workflow=OLD_WORKFLOW, backend=OLD_ENGINE)
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 2, out
    assert f"{WORKFLOW} = {OLD_WORKFLOW!r}: moved to {NEW_WORKFLOW}. Fix: write {NEW_WORKFLOW}" in out
    assert f"{BACKEND} = {OLD_ENGINE!r}: moved to {NEW_ENGINE}. Fix: write {NEW_ENGINE}" in out
    assert "2 problem(s)" in out, out  # the backend and workflow rules leave a moved path to the moved-path rule


def test_fit_refuses_an_old_path_before_starting_anything(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("grpo_tiny.yaml")
    cfg["trainer"]["default_root_dir"] = str(tmp_path / "run")
    cfg["data"]["init_args"]["generation"]["workflow"] = OLD_WORKFLOW
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["fit", "--config", str(path)]) == 2
    assert f"moved to {NEW_WORKFLOW}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


# the files that name old paths on purpose: the table, its rule and the rules' documentation
_ON_PURPOSE = {"screl/rollout/moved.py", "screl/rules/moved_rules.py", "docs/config-rules.md"}


def test_no_shipped_file_names_an_old_path() -> None:
    files = [*(ROOT / "configs").rglob("*.yaml"), *(ROOT / "docs").rglob("*.md"), ROOT / "README.md",
             *(p for d in ("screl", "callbacks", "strategies", "examples") for p in (ROOT / d).rglob("*.py")),
             *(p for p in (ROOT / "bench").rglob("*") if p.suffix in (".py", ".md") and "results" not in p.parts)]
    found = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        if rel in _ON_PURPOSE:
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for token in re.findall(r"screl\.rollout(?:\.\w+)+(?::\w+)?", line):
                if moved_to(token) is not None:
                    found.append(f"{rel}:{number}: {token} -> {moved_to(token)}")
    assert not found, "\n".join(found)
