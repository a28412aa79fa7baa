"""Engines are reached through the registry: no code outside ``screl/rollout/engines/`` imports one engine's module.

The rest of screl asks the registry (``resolve_backend``, ``engine_capabilities``) and the engine class what it can
do, so a new engine is its own files plus its declared capabilities. The engine-independent parts of the package
(the protocol, the registry, weight buckets, the stop rule, ...) may be imported anywhere.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ENGINES = ROOT / "screl" / "rollout" / "engines"

GENERIC = {"__init__", "protocol", "registry", "buckets", "stop_tokens", "routing", "weight_copy", "request_loop"}
"""The modules of the engines package that belong to no one engine."""

ALLOWED = {
    # the package's documented export (``from screl.rollout import TorchGenerationEngine``), a lazy import
    ("screl/rollout/__init__.py", "torch_engine"),
    # an engine itself: the torch engine with a fault injected, named by class path in the failure tests' configs
    ("screl/rollout/faults.py", "torch_engine"),
    # vLLM's NCCL weight transfer, trainer side (unverified on a GPU); to move behind the engine class
    ("screl/controller/runtime.py", "vllm_transfer"),
}
"""``(file, engine module)`` imports kept on purpose, each with its reason."""


def engine_modules() -> set[str]:
    return {p.stem for p in ENGINES.glob("*.py")} - GENERIC


def imported_engine_modules(source: str, specific: set[str]) -> list[tuple[int, str]]:
    """``(line, module)`` for each import of a module in ``specific`` of the engines package."""
    prefix = "screl.rollout.engines"
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith(prefix + "."):
                module = name[len(prefix) + 1:].split(".")[0]
                if module in specific:
                    found.append((node.lineno, module))
    return sorted(set(found))


def test_no_code_outside_the_engines_package_imports_one_engines_module() -> None:
    specific = engine_modules()
    assert {"torch_engine", "megatron_engine", "megatron_decode", "vllm_engine"} <= specific
    found, used = [], set()
    for folder in ("screl", "callbacks", "strategies"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel.startswith("screl/rollout/engines/"):
                continue
            for line, module in imported_engine_modules(path.read_text(), specific):
                if (rel, module) in ALLOWED:
                    used.add((rel, module))
                else:
                    found.append(f"{rel}:{line}: imports screl.rollout.engines.{module}")
    assert not found, "reach engines through screl.rollout.engines.registry and the engine class:\n" + "\n".join(found)
    assert used == ALLOWED, f"allowed imports no longer made (drop them from ALLOWED): {sorted(ALLOWED - used)}"


def test_the_import_check_sees_every_form_of_import() -> None:
    specific = {"megatron_engine", "torch_engine"}
    source = (
        "from screl.rollout.engines.megatron_engine import inner_gpt_model\n"
        "import screl.rollout.engines.torch_engine\n"
        "from screl.rollout.engines import (\n    protocol,\n    torch_engine,\n)\n"
        "from screl.rollout.engines.registry import resolve_backend\n"
        "def f():\n    from screl.rollout.engines.megatron_engine import X\n"
    )
    assert imported_engine_modules(source, specific) == [
        (1, "megatron_engine"), (2, "torch_engine"), (3, "torch_engine"), (9, "megatron_engine")]
