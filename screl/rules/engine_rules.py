"""The configured engine's own rules: each engine class names them in its capabilities (``config_rules``), so
the rules of one engine run only for it and no rule tests an engine's name."""

from __future__ import annotations

from screl.rules.context import RuleContext, rule_at

__all__ = ["engine_rules"]


def engine_rules(c: RuleContext) -> None:
    """Run every rule the configured engine declares (an unresolvable backend is the generation rules' problem)."""
    if c.engine is None:
        return
    for path in c.engine.config_rules:
        rule_at(path)(c)
