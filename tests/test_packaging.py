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


# pyproject.toml's package-dir: screl.callbacks and screl.strategies live in the top-level folders
_PACKAGE_DIRS = {"screl.callbacks": ROOT / "callbacks", "screl.strategies": ROOT / "strategies",
                 "screl": ROOT / "screl"}


def _module_file(name: str) -> Path | None:
    """The project file that `import name` runs last (a module or a package's __init__), None outside the project."""
    for prefix, folder in sorted(_PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if name == prefix or name.startswith(prefix + "."):
            base = folder.joinpath(*name[len(prefix):].lstrip(".").split(".")) if name != prefix else folder
            for candidate in (base.with_suffix(".py"), base / "__init__.py"):
                if candidate.is_file():
                    return candidate
            return None
    return None


def _module_name(path: Path) -> str:
    for prefix, folder in sorted(_PACKAGE_DIRS.items(), key=lambda kv: -len(kv[0])):
        if path.is_relative_to(folder):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            return ".".join([prefix, *parts])
    raise AssertionError(path)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _runtime_imports(tree: ast.AST) -> list[ast.Import | ast.ImportFrom]:
    """Every import that runs: at module level, in functions and classes; not those under `if TYPE_CHECKING:`."""
    found: list[ast.Import | ast.ImportFrom] = []
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
            continue
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))
    return found


def _file_graph() -> dict[Path, set[Path]]:
    files = [p for folder in ("screl", "callbacks", "strategies") for p in sorted((ROOT / folder).rglob("*.py"))]
    graph: dict[Path, set[Path]] = {}
    for path in files:
        module = _module_name(path)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        targets: set[Path | None] = set()
        for node in _runtime_imports(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                targets.update(_module_file(alias.name) for alias in node.names)
                continue
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:  # `from pkg import sub` imports the submodule; `from mod import name`, mod
                targets.add(_module_file(f"{base}.{alias.name}") or _module_file(base))
        graph[path] = {t for t in targets if t is not None and t != path}
    return graph


def _cycles(graph: dict[Path, set[Path]]) -> list[list[Path]]:
    """One cycle per strongly connected component of more than one file (Tarjan), as a closed chain of files."""
    index: dict[Path, int] = {}
    low: dict[Path, int] = {}
    on_stack: set[Path] = set()
    stack: list[Path] = []
    components: list[list[Path]] = []

    def visit(v: Path) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    chains: list[list[Path]] = []
    for component in components:  # the shortest cycle through each file of the component, each cycle once
        members = set(component)
        for start in sorted(component):
            chain = _shortest_cycle(graph, members, start)
            if not any(set(chain) == set(known) and len(chain) == len(known) for known in chains):
                chains.append(chain)
    return chains


def _shortest_cycle(graph: dict[Path, set[Path]], members: set[Path], start: Path) -> list[Path]:
    parents: dict[Path, Path] = {}
    frontier = [start]
    while frontier:
        for f in frontier:
            if start in graph[f]:
                chain = [f]
                while chain[-1] != start:
                    chain.append(parents[chain[-1]])
                return [*reversed(chain), start]
        nxt = []
        for f in frontier:
            for w in sorted(graph[f] & members):
                if w not in parents and w != start:
                    parents[w] = f
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


def test_no_import_cycles_between_project_files() -> None:
    """No file of screl/, callbacks/ or strategies/ imports itself back through other project files.

    Counted: runtime imports, at module level and inside functions (a deferred import still ties the two files
    together). Not counted: imports under `if TYPE_CHECKING:`, which never run. `from pkg import sub` is an edge to
    pkg/sub.py; an import of a module is an edge to that module's file alone, not to its parent packages' __init__.
    """
    graph = _file_graph()
    # the resolver sees the package-dir mapping, imports inside functions and `from package import submodule`
    assert ROOT / "callbacks" / "weight_sync.py" in graph[ROOT / "callbacks" / "checkpoint.py"]
    assert ROOT / "strategies" / "__init__.py" in graph[ROOT / "screl" / "modules" / "megatron_compute.py"]
    assert ROOT / "screl" / "data" / "core_drops.py" in graph[ROOT / "screl" / "data" / "core.py"]
    cycles = _cycles(graph)
    for chain in cycles:
        print(" -> ".join(str(p.relative_to(ROOT)) for p in chain))
    assert cycles == [], "\n".join(" -> ".join(str(p.relative_to(ROOT)) for p in c) for c in cycles)


def test_no_file_over_450_lines_and_no_function_over_50() -> None:
    """Rooms stay readable: a file of screl/, callbacks/ or strategies/ past 450 lines, or a function past 50 (its
    def line to its last, decorators aside), is split by responsibility instead."""
    import ast

    long_files, long_functions = [], []
    for folder in ("screl", "callbacks", "strategies"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            text = path.read_text()
            rel = path.relative_to(ROOT)
            if len(text.splitlines()) > 450:
                long_files.append(f"{rel}: {len(text.splitlines())} lines")
            for node in ast.walk(ast.parse(text)):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    length = (node.end_lineno or node.lineno) - node.lineno + 1
                    if length > 50:
                        long_functions.append(f"{rel}:{node.lineno} {node.name}: {length} lines")
    assert long_files == [] and long_functions == [], "\n".join(long_files + long_functions)
