"""Every model a config names by hub id or folder (policy, critic, teachers, reward models) can be loaded: checked
without downloading (:func:`screl.models.hub.model_source_problem`)."""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any

from screl.rules.context import RuleContext

SOURCE_KEYS = ("path", "tokenizer_path")


def class_of(class_path: str) -> type | None:
    """The class ``class_path`` names, or None when it cannot be loaded (another rule's problem)."""
    module, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError):
        return None
    return cls if isinstance(cls, type) else None


def _hub_spec(class_path: str) -> bool:
    """Whether ``class_path`` is a model spec whose files come from a folder or a hub id (``HubFiles``)."""
    from screl.models.hub import HubFiles

    cls = class_of(class_path)
    return cls is not None and issubclass(cls, HubFiles)


def class_blocks(node: Any, key: str = "") -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """``(dotted key of init_args, class path, init_args)`` of every ``class_path`` block in the config."""
    if isinstance(node, Mapping):
        path = node.get("class_path")
        args = node.get("init_args")
        if isinstance(path, str) and isinstance(args, Mapping):
            yield f"{key}.init_args", path, args
        for k, v in node.items():
            yield from class_blocks(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from class_blocks(v, f"{key}[{i}]")


def _specs(node: Any, key: str) -> Iterator[tuple[str, Mapping[str, Any]]]:
    """``(dotted key of init_args, init_args)`` of every hub-file spec in the config."""
    for where, path, args in class_blocks(node, key):
        if _hub_spec(path):
            yield where, args


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


def system_prompt_rules(c: RuleContext) -> None:
    """A model spec's ``system_prompt`` is rendered only through its chat template: without one it would be dropped."""
    import inspect

    for where, path, args in class_blocks(c.cfg):
        cls = class_of(path)
        if cls is None or args.get("system_prompt") is None:
            continue
        params = inspect.signature(cls).parameters
        if "chat_template" not in params or "system_prompt" not in params:
            continue
        on = args.get("chat_template", params["chat_template"].default)
        if on is False:
            c.bad(f"{where}.system_prompt", args["system_prompt"], "is ignored: without chat_template the prompts are "
                  "given to the model as raw text, with no system turn to put it in",
                  f"set {where}.chat_template: true, or drop system_prompt")
