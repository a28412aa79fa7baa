"""Fixture ``trl_peer``: the shared definitions of the TRL benchmark peer (bench/trl_peer.py), read without trl."""

from __future__ import annotations

import ast
import os
from pathlib import Path
from typing import Any

import pytest

_NAMES = {"SPECIAL_TOKENS", "CHARS", "MODEL_KWARGS", "SMALL_KWARGS", "reward_count_a", "reward_add"}


def _peer_path() -> Path | None:
    """``$SCREL_TRL_PEER``, else the repository's copy ``bench/trl_peer.py`` (kept byte-identical to the shared
    ``../shared/bench/trl_peer.py`` by ``test_the_repositorys_peer_is_the_shared_one``)."""
    env = os.environ.get("SCREL_TRL_PEER")
    candidates = [Path(env)] if env else []
    repo = Path(__file__).resolve().parents[2]
    candidates += [repo / "bench" / "trl_peer.py", repo.parent / "shared" / "bench" / "trl_peer.py"]
    return next((p for p in candidates if p.is_file()), None)


def _peer_definitions() -> dict[str, Any] | None:
    """The peer's constants and reward functions, or None when the file is not around."""
    path = _peer_path()
    if path is None:
        return None
    tree = ast.parse(path.read_text())
    keep: list[ast.stmt] = []
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id in _NAMES for t in node.targets
        ):
            keep.append(node)
        elif isinstance(node, ast.FunctionDef) and node.name in _NAMES:
            keep.append(node)
    ns: dict[str, Any] = {}
    exec(compile(ast.Module(body=keep, type_ignores=[]), str(path), "exec"), ns)  # noqa: S102
    return {k: ns[k] for k in _NAMES if k in ns}


@pytest.fixture(scope="session")
def trl_peer() -> dict[str, Any]:
    """The peer's SPECIAL_TOKENS, CHARS, MODEL_KWARGS, SMALL_KWARGS, reward_count_a, reward_add."""
    defs = _peer_definitions()
    if defs is None:
        raise FileNotFoundError("bench/trl_peer.py is missing (or $SCREL_TRL_PEER points nowhere)")
    return defs
