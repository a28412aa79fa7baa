"""Module paths that moved when ``screl/rollout/`` split into ``engines/``, ``server/`` and ``workflows/``.

A config that still names an old class path (``generation.workflow: screl.rollout.workflow.SingleTurnWorkflow``)
is refused with the new home, never served through a re-export: the old modules are gone. Every place that
resolves a class path from a config asks :func:`refuse_moved` first, and the config rules report each such
value (``screl.rules.moved_rules``). Imports nothing, so any layer may ask it.
"""

from __future__ import annotations

__all__ = ["MOVED", "MovedPathError", "moved_to", "refuse_moved"]

_ENGINES = ("torch_engine", "static_decode", "megatron_engine", "megatron_decode", "vllm_engine", "vllm_transfer",
            "stop_tokens", "weight_copy", "routing")
_SERVER = ("server", "openai_api", "openai_schema", "responses_api", "openai_stream", "server_sessions", "tool_calls")
_WORKFLOWS = ("workflow", "multiturn", "agent", "trajectory", "reward_transform", "chat")
_BUCKETS = ("iter_buckets", "WeightBuckets", "as_buckets", "bucket_nbytes", "WireBucket", "bucket_to_wire",
            "bucket_from_wire", "merge_buckets")

#: Old path -> new path: a module (its every name moved with it), or a ``module.name`` where a module split.
MOVED: dict[str, str] = {
    "screl.rollout.engine": "screl.rollout.engines.protocol",
    "screl.rollout.backends": "screl.rollout.engines.registry",
    **{f"screl.rollout.backends.{n}": f"screl.rollout.engines.buckets.{n}" for n in _BUCKETS},
    **{f"screl.rollout.{m}": f"screl.rollout.engines.{m}" for m in _ENGINES},
    **{f"screl.rollout.{m}": f"screl.rollout.server.{m}" for m in _SERVER},
    **{f"screl.rollout.{m}": f"screl.rollout.workflows.{m}" for m in _WORKFLOWS},
}
#: the new homes and packages: ``screl.rollout.server`` is a package now, and its modules are no old paths
_NEW = frozenset({*MOVED.values(), "screl.rollout.engines", "screl.rollout.server", "screl.rollout.workflows"})


def moved_to(path: str) -> str | None:
    """The new home of ``path`` (a module, ``package.module.Class`` or ``package.module:Class``, written back the
    same way) when it moved, else None."""
    if not isinstance(path, str):
        return None
    dotted = path.strip().replace(":", ".")
    if dotted in _NEW:
        return None
    if dotted in MOVED:
        return MOVED[dotted]
    module, _, name = dotted.rpartition(".")
    if module not in MOVED or (module in _NEW and _is_module(dotted)):
        return None  # a module of the package that replaced the old file is new, not moved
    return f"{MOVED[module]}{':' if ':' in path else '.'}{name}"


class MovedPathError(ValueError):
    """A config names a class path whose module moved; ``new`` is its new home."""

    def __init__(self, key: str, path: str, new: str) -> None:
        self.key, self.path, self.new = key, path, new
        super().__init__(f"{key} = {path!r}: moved to {new}")


def refuse_moved(path: str, key: str) -> None:
    """Raise :class:`MovedPathError` when ``path`` (the value of config key ``key``) names a moved module."""
    new = moved_to(path)
    if new is not None:
        raise MovedPathError(key, path, new)


def _is_module(dotted: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(dotted) is not None
    except (ImportError, ValueError):
        return False
