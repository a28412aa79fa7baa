"""Blocks that must be blocks: a nested settings group written as a scalar or a list (``async_rl: 5``).

jsonargparse accepts a plain value in place of a whole group of settings, and the rules that read that group
then fail with an ``AttributeError`` instead of a problem. :func:`shape_problems` walks the typed blocks
(dataclasses, nested ones included) and reports each such value, naming its dotted key, before any rule runs.
Found by ``tests/test_config_fuzz.py``.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from screl.rules.context import Problem

__all__ = ["shape_problems"]


def _block_type(annotation: Any) -> tuple[type | None, bool]:
    """(the dataclass an annotation names, directly or in ``X | None``; whether None is allowed)."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        blocks = [a for a in args if dataclasses.is_dataclass(a) and isinstance(a, type)]
        if len(blocks) == 1 and all(a is type(None) or a is blocks[0] for a in args):
            return blocks[0], type(None) in args
    return None, False


def _walk(value: Any, cls: type | None, key: str, nullable: bool, out: list[Problem]) -> None:
    if value is None and nullable:
        return
    if not isinstance(value, Mapping):
        what = f" ({cls.__name__})" if cls is not None else ""
        out.append(Problem(key, value, f"must be a block of settings{what}, not a {type(value).__name__}",
                           f"write its settings as `name: value` lines under `{key.rsplit('.', 1)[-1]}:`, or "
                           "leave it out for the defaults"))
        return
    if cls is None:  # a block whose inside the parser checks (Lightning's trainer, model, data)
        return
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: nothing to check here
        return
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name in value:
            sub, sub_nullable = _block_type(hints.get(field.name))
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
