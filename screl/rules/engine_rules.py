"""The configured engine's own rules: each engine class names them in its capabilities (``config_rules``), so
the rules of one engine run only for it and no rule tests an engine's name."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

from screl.rules.context import RuleContext

__all__ = ["engine_rules"]


def engine_rules(c: RuleContext) -> None:
    """Run every rule the configured engine declares (an unresolvable backend is the generation rules' problem)."""
    if c.engine is None:
        return
    for path in c.engine.config_rules:
        _rule(path)(c)


def _rule(path: str) -> Callable[[RuleContext], Any]:
    module, _, name = path.partition(":")
    rule: Callable[[RuleContext], Any] = getattr(importlib.import_module(module), name)
    return rule
