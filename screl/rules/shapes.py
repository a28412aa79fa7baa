"""Blocks that must be blocks: a nested settings group written as a scalar or a list (``async_rl: 5``).

jsonargparse accepts a plain value in place of a whole group of settings, and the rules that read that group
then fail with an ``AttributeError`` instead of a problem. :func:`shape_problems` walks the typed blocks
(dataclasses, nested ones included) and reports each such value, naming its dotted key, before any rule runs.
Found by ``tests/test_config_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from typing import Any

from screl.rules.blocks import block_type, not_a_block
from screl.rules.context import Problem

__all__ = ["shape_problems"]


def _walk(value: Any, cls: type | None, key: str, nullable: bool, out: list[Problem]) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, Mapping):
        out.append(Problem(key, value, *not_a_block(cls, key, value)))
        return
    if cls is None:  # a block whose inside the parser checks (Lightning's trainer, model, data)
        return
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: nothing to check here
        return
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in value:
            sub, sub_nullable = block_type(hints.get(field.name))
            if sub is not None:
                _walk(value[field.name], sub, f"{key}.{field.name}", sub_nullable, out)


def shape_problems(config: Mapping[str, Any], blocks: Mapping[str, type | None]) -> list[Problem]:
    """A problem for every block of ``config`` (top-level key -> its dataclass, or None: any mapping) that is not a
    mapping, nested dataclass blocks included."""
    out: list[Problem] = []
    for key, cls in blocks.items():
        if key in config:
            _walk(config[key], cls, key, True, out)
    return out
