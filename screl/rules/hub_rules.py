"""Every model a config names by hub id or folder (policy, critic, teachers, reward models) can be loaded: checked
without downloading (:func:`screl.models.hub.model_source_problem`)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from screl.rules.context import RuleContext

SOURCE_KEYS = ("path", "tokenizer_path")


def _hub_spec(class_path: str) -> bool:
    """Whether ``class_path`` is a model spec whose files come from a folder or a hub id (``HubFiles``)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return False  # an unloadable class path is another rule's problem
    from screl.models.hub import HubFiles

    return isinstance(cls, type) and issubclass(cls, HubFiles)


def _specs(node: Any, key: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(dotted key of init_args, init_args)`` of every hub-file spec in the config."""
    if isinstance(node, Mapping):
        path = node.get("class_path")
        args = node.get("init_args")
        if isinstance(path, str) and isinstance(args, Mapping) and _hub_spec(path):
            yield f"{key}.init_args", args
        for k, v in node.items():
            yield from _specs(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _specs(v, f"{key}[{i}]")


def model_source_rules(c: RuleContext) -> None:
    from screl.models.hub import hub_cache, model_source_problem

    for where, args in _specs(c.cfg, ""):
        revision = args.get("revision")
        for name in SOURCE_KEYS:
            value = args.get(name)
            if not isinstance(value, str):
                continue
            problem = model_source_problem(value, revision=revision if isinstance(revision, str) else None)
            if problem is not None:
                c.bad(f"{where}.{name}", value, f"cannot be loaded: {problem}",
                      f"fetch it into the Hugging Face cache ({hub_cache()}) with `hf download {value}` where the hub "
                      "is reachable, fix the id or revision, or give a local checkpoint folder")
