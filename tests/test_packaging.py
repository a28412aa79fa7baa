"""Packaging and module boundaries that import-linter cannot see (the package-dir mapped folders)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_callbacks_and_strategies_install_as_screl_subpackages() -> None:
    import screl.callbacks
    import screl.strategies

    assert Path(screl.callbacks.__file__).parent == ROOT / "callbacks"
    assert Path(screl.strategies.__file__).parent == ROOT / "strategies"
    from screl.callbacks import WeightSync

    assert WeightSync.__module__ == "screl.callbacks.weight_sync"


@pytest.mark.parametrize("stmt", ["import callbacks", "from strategies import MegatronStrategy"])
def test_bare_top_level_imports_are_banned_by_ruff(stmt: str, tmp_path: Path) -> None:
    bad = tmp_path / "uses_bare.py"
    bad.write_text(stmt + "\n")
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", "check", "--no-cache", "--config", str(ROOT / "pyproject.toml"),
         "--select", "TID251", str(bad)],
        capture_output=True, text=True, timeout=60,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "TID251" in proc.stdout and "a second copy of every class" in proc.stdout


def _imports(folder: Path) -> set[str]:
    names: set[str] = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
    return names


def test_strategies_never_import_ray_or_the_controller() -> None:
    forbidden = ("ray", "screl.controller", "screl.rollout", "screl.dataplane")
    hits = sorted(n for n in _imports(ROOT / "strategies") if n.split(".")[0] == "ray" or n.startswith(forbidden[1:]))
    assert hits == []


def test_callbacks_do_not_import_ray() -> None:
    assert sorted(n for n in _imports(ROOT / "callbacks") if n.split(".")[0] == "ray") == []
