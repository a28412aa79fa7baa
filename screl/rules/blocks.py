"""Typed views of a config's blocks, built once for the rules (:class:`screl.rules.context.RuleContext`).

A rule reads ``c.gen_cfg.temperature``, not ``gen.get("temperature", 1.0)``: every default lives in its config
dataclass alone. The view is lenient, since its whole point is to let the rules judge the values: each known key
keeps its value as written (a wrong type included), every other field takes its declared default (a nested block
its parent field's default, so ``ppo.adv_estimator`` without a ``name`` reads ``gae``), unknown keys are left to
the parser. A block that is not a mapping, or that its class refuses, is reported naming its key and reads as its
defaults, so every other rule still runs and the config fails listing every problem at once.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

__all__ = ["block_type", "field_default", "not_a_block", "typed_block"]

T = TypeVar("T")
Report = Callable[[str, Any, str, str], None]
"""Where a problem goes: ``(dotted key, value, message, fix)`` (``RuleContext.bad``)."""


def block_type(annotation: Any) -> tuple[type | None, bool]:
    """(the dataclass an annotation names, directly or in ``X | None``; whether None is allowed)."""
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return annotation, False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = typing.get_args(annotation)
        blocks = [a for a in args if dataclasses.is_dataclass(a) and isinstance(a, type)]
        if len(blocks) == 1 and all(a is type(None) or a is blocks[0] for a in args):
            return blocks[0], type(None) in args
    return None, False


def field_default(cls: type, name: str) -> Any:
    """The declared default of field ``name`` of dataclass ``cls`` (a fresh one from its ``default_factory``)."""
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name == name:
            if f.default is not dataclasses.MISSING:
                return f.default
            if f.default_factory is not dataclasses.MISSING:
                return f.default_factory()
            raise KeyError(f"{cls.__name__}.{name} has no default")
    raise KeyError(f"{cls.__name__} has no field {name!r}")


def not_a_block(cls: type | None, key: str, value: Any) -> tuple[str, str]:
    """(message, fix) for a value where a block of settings belongs (``async_rl: 5``)."""
    what = f" ({cls.__name__})" if cls is not None else ""
    return (f"must be a block of settings{what}, not a {type(value).__name__}",
            f"write its settings as `name: value` lines under `{key.rsplit('.', 1)[-1]}:`, or leave it out for the "
            "defaults")


def typed_block(cls: type[T], raw: Any, key: str, bad: Report, base: T | None = None) -> T:
    """Dataclass ``cls`` from the raw mapping at ``key`` (see the module docstring); ``base`` holds the defaults
    (``cls()`` when None). None reads as the defaults; a problem is reported through ``bad``."""
    default = base if base is not None else cls()
    if raw is None:
        return default
    if not isinstance(raw, Mapping):
        bad(key, raw, *not_a_block(cls, key, raw))
        return default
    try:
        hints = typing.get_type_hints(cls)
    except Exception:  # noqa: BLE001 - an annotation that cannot be resolved: its fields read as written
        hints = {}
    given: dict[str, Any] = {}
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name not in raw:
            continue
        sub, _ = block_type(hints.get(f.name))
        value = raw[f.name]
        given[f.name] = (typed_block(sub, value, f"{key}.{f.name}", bad, getattr(default, f.name))
                         if sub is not None else value)
    try:
        return dataclasses.replace(default, **given)  # type: ignore[type-var]
    except (TypeError, ValueError) as err:
        bad(key, dict(raw), f"cannot be read as {cls.__name__} ({err})", "correct the block as the message says")
        return default
