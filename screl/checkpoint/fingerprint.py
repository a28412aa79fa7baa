"""The bootstrap fingerprint: which configuration a pre-first-step rollout snapshot belongs to.

Fail-closed: the *identity* is the whole run configuration (the nested mapping ``screl fit`` parsed)
minus a built-in denylist of operational keys (logging, placement, checkpoint location, runtime ports,
timeouts, optimizer settings that act only from the first step, credentials) and the run's
``rollout_checkpointing.extra_fingerprint_excluded_paths``. Any other key, including one a plugin adds,
counts. The fingerprint is the SHA-256 of the canonical JSON of
``{schema_version, excluded_paths: sorted(denylist ∪ extras), config: identity}``; because the exclusion
list is hashed too, the same extras must be configured on the original run and on the restart.

Path patterns are dot-separated; each segment is a case-sensitive shell pattern matched against one key
(``*`` any single key, ``*_token`` a suffix, ``?``/``[..]``), ``**`` matches zero or more whole levels,
and list elements are addressed by their index (``workers.*.log_dir``). A matching path removes the node
and its subtree (an excluded list element is replaced by ``"<excluded>"`` so indices stay stable).

The bootstrap anchor ``<checkpoint_dir>/bootstrap/manifest.json`` stores the fingerprint and the identity
(credentials are never in it: they are denylisted), so a rejected restart names the changed dotpaths.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from fnmatch import fnmatchcase
from functools import lru_cache
from typing import Any

from screl.checkpoint.store import MANIFEST_NAME, CheckpointStore

__all__ = [
    "BOOTSTRAP_MANIFEST",
    "DEFAULT_EXCLUDED_PATHS",
    "FINGERPRINT_SCHEMA_VERSION",
    "BootstrapAnchor",
    "FingerprintMismatchError",
    "bootstrap_fingerprint",
    "compatibility_identity",
    "excluded_paths",
    "path_matches",
    "read_bootstrap_anchor",
    "validate_bootstrap_anchor",
    "validate_excluded_paths",
    "write_bootstrap_anchor",
]

FINGERPRINT_SCHEMA_VERSION = 1
BOOTSTRAP_MANIFEST = f"bootstrap/{MANIFEST_NAME}"
EXCLUDED_LIST_ELEMENT = "<excluded>"
MAX_LISTED_CHANGES = 20
MAX_VALUE_CHARS = 160

#: Operational keys of the run blocks; each is excluded at the top level and under ``data.init_args.run``
#: (where the CLI links the same blocks into the DataModule).
_RUN_BLOCK_OPERATIONAL = (
    "checkpointing",
    "rollout_checkpointing",
    "ray",
    "async_rl.event_log",
    "async_rl.rollout_failure.backoff_base_s",
    "async_rl.rollout_failure.max_backoff_s",
    "data_plane.num_storage_units",
)

_CREDENTIAL_KEYS = (
    "api_key",
    "apikey",
    "password",
    "passwd",
    "secret",
    "token",
    "credentials",
    "private_key",
    "*_api_key",
    "*_apikey",
    "*_password",
    "*_secret",
    "*_private_key",
    # token-shaped credentials; a bare `*_token` would also hide `pad_token`/`eos_token`, which are semantic
    "hf_token",
    "*_auth_token",
    "auth_token",
    "*_access_token",
    "access_token",
    "*_api_token",
    "api_token",
    "*_session_token",
    "session_token",
    "*_refresh_token",
    "refresh_token",
    "*_bearer_token",
    "bearer_token",
    "aws_access_key_id",
    "aws_secret_access_key",
    "secret_access_key",
    "storage_options",
)

#: The built-in denylist for screl's configuration layout (LightningCLI ``trainer``/``model``/``data`` plus
#: the top-level run blocks).
DEFAULT_EXCLUDED_PATHS: tuple[str, ...] = (
    # jsonargparse / LightningCLI bookkeeping
    "config",
    "ckpt_path",
    "weights_only",
    # the Lightning Trainer: logging, progress, checkpoint location, cluster size
    "trainer.logger",
    "trainer.callbacks",
    "trainer.default_root_dir",
    "trainer.enable_progress_bar",
    "trainer.log_every_n_steps",
    "trainer.enable_model_summary",
    "trainer.enable_checkpointing",
    "trainer.profiler",
    "trainer.devices",
    "trainer.num_nodes",
    "trainer.max_steps",
    "**.max_num_steps",
    "trainer.max_epochs",
    "trainer.max_time",
    # optimizer settings act only from the first step
    "model.init_args.learning_rate",
    "model.init_args.weight_decay",
    "model.init_args.max_grad_norm",
    "optimizer",
    "lr_scheduler",
    # the DataModule's runtime knobs and generation placement/throughput
    "data.init_args.step_timeout_s",
    "data.init_args.run_dir",
    "data.init_args.train_num_threads",
    "data.init_args.generation.num_workers",
    "data.init_args.generation.num_threads",
    "data.init_args.generation.device",
    "data.init_args.generation.max_batch_size",
    "data.init_args.generation.batch_window_s",
    "data.init_args.generation.injected_latency_s",
    "data.init_args.generation.colocated",
    *_RUN_BLOCK_OPERATIONAL,
    *(f"data.init_args.run.{p}" for p in _RUN_BLOCK_OPERATIONAL),
    # runtime ports and log directories at any depth
    "**.port",
    "**.ports",
    "**.*_port",
    "**.*_ports",
    "**.log_dir",
    # credentials at any depth
    *(f"**.{key}" for key in _CREDENTIAL_KEYS),
)


class FingerprintMismatchError(ValueError):
    """The configuration no longer matches the bootstrap anchor (nothing was modified)."""


# -- path patterns -----------------------------------------------------------------------------------
def validate_excluded_paths(paths: Iterable[str]) -> tuple[str, ...]:
    """Check ``extra_fingerprint_excluded_paths``; ValueError lists every bad entry and why."""
    if isinstance(paths, str):
        raise ValueError(
            f"extra_fingerprint_excluded_paths must be a list of dotpaths, got the string {paths!r}"
        )
    problems = []
    out = []
    for path in paths:
        if not isinstance(path, str):
            problems.append(f"{path!r}: not a string")
        elif not path:
            problems.append("'': empty path")
        elif path != path.strip():
            problems.append(f"{path!r}: leading or trailing whitespace")
        elif any(seg == "" for seg in path.split(".")):
            problems.append(f"{path!r}: empty segment (leading, trailing or doubled '.')")
        elif any(seg != seg.strip() for seg in path.split(".")):
            problems.append(f"{path!r}: whitespace around a segment")
        elif all(set(seg) == {"*"} for seg in path.split(".")):
            problems.append(f"{path!r}: matches everything at some level; name the keys to exclude")
        else:
            out.append(path)
    if problems:
        raise ValueError(
            "invalid rollout_checkpointing.extra_fingerprint_excluded_paths: " + "; ".join(problems)
        )
    return tuple(out)


def excluded_paths(extra: Iterable[str] = ()) -> tuple[str, ...]:
    """``sorted(denylist ∪ extras)`` (extras validated)."""
    return tuple(sorted(set(DEFAULT_EXCLUDED_PATHS) | set(validate_excluded_paths(extra))))


@lru_cache(maxsize=1 << 16)
def _match(pattern: tuple[str, ...], path: tuple[str, ...]) -> bool:
    if not pattern:
        return not path
    head = pattern[0]
    if head == "**":
        return _match(pattern[1:], path) or (bool(path) and _match(pattern, path[1:]))
    return bool(path) and fnmatchcase(path[0], head) and _match(pattern[1:], path[1:])


def path_matches(pattern: str, dotpath: str | Sequence[str]) -> bool:
    """Whether ``pattern`` (glob dotpath) matches ``dotpath`` (a dotpath or its segments) exactly."""
    segments = tuple(dotpath.split(".")) if isinstance(dotpath, str) else tuple(dotpath)
    return _match(tuple(pattern.split(".")), segments)


# -- identity and fingerprint ------------------------------------------------------------------------
_DROP = object()


def _identity(value: Any, path: tuple[str, ...], patterns: tuple[tuple[str, ...], ...]) -> Any:
    """``value`` without excluded nodes, as plain JSON (Paths and enums as their values, non-finite floats
    as strings); excluded nodes are dropped before they are converted."""
    if path and any(_match(p, path) for p in patterns):
        return _DROP
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            kept = _identity(item, (*path, str(key)), patterns)
            if kept is not _DROP:
                out[str(key)] = kept
        return out
    if isinstance(value, (list, tuple)):
        items = [_identity(item, (*path, str(i)), patterns) for i, item in enumerate(value)]
        return [EXCLUDED_LIST_ELEMENT if item is _DROP else item for item in items]
    if isinstance(value, enum.Enum):
        return _identity(value.value, path, patterns)
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _identity({f.name: getattr(value, f.name) for f in dataclasses.fields(value)}, path, patterns)
    if type(value).__name__ == "Namespace" and hasattr(value, "__dict__"):  # jsonargparse's Namespace
        return _identity({k: v for k, v in vars(value).items() if k != "__path__"}, path, patterns)
    raise TypeError(
        f"config value at {'.'.join(path) or '<root>'} is a {type(value).__name__},"
        " which has no stable JSON form;"
        " convert it to plain data or exclude its path"
    )


def compatibility_identity(
    config: Mapping[str, Any], extra_excluded_paths: Iterable[str] = ()
) -> dict[str, Any]:
    """The configuration with every excluded path (built-in denylist and extras) removed."""
    patterns = tuple(tuple(p.split(".")) for p in excluded_paths(extra_excluded_paths))
    identity = _identity(config, (), patterns)
    if not isinstance(identity, dict):
        raise TypeError(f"config must be a mapping, got {type(config).__name__}")
    return identity


def _canonical(obj: Any) -> bytes:
    return json.dumps(
        obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode()


def _digest(identity: Mapping[str, Any], paths: Sequence[str]) -> str:
    body = {"schema_version": FINGERPRINT_SCHEMA_VERSION, "excluded_paths": sorted(paths), "config": identity}
    return hashlib.sha256(_canonical(body)).hexdigest()


def bootstrap_fingerprint(config: Mapping[str, Any], extra_excluded_paths: Iterable[str] = ()) -> str:
    """SHA-256 (hex) of the canonical JSON of the schema version, the exclusions and the identity."""
    extras = tuple(extra_excluded_paths)
    return _digest(compatibility_identity(config, extras), excluded_paths(extras))


# -- the bootstrap anchor ----------------------------------------------------------------------------
@dataclass(frozen=True)
class BootstrapAnchor:
    """``bootstrap/manifest.json``: the trainer-version-0 anchor and its compatibility identity."""

    fingerprint: str
    identity: Mapping[str, Any]
    excluded_paths: tuple[str, ...]
    schema_version: int = FINGERPRINT_SCHEMA_VERSION

    def to_json(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version,
            "base_train_step": 0,
            "trainer_version": 0,
            "bootstrap_fingerprint": self.fingerprint,
            "excluded_paths": list(self.excluded_paths),
            "bootstrap_identity": dict(self.identity),
        }

    @classmethod
    def from_config(
        cls, config: Mapping[str, Any], extra_excluded_paths: Iterable[str] = ()
    ) -> BootstrapAnchor:
        extras = tuple(extra_excluded_paths)
        paths = excluded_paths(extras)
        identity = compatibility_identity(config, extras)
        return cls(_digest(identity, paths), identity, paths)


def _as_store(store: CheckpointStore | str) -> CheckpointStore:
    return store if isinstance(store, CheckpointStore) else CheckpointStore(store)


def read_bootstrap_anchor(store: CheckpointStore | str) -> BootstrapAnchor | None:
    """The stored anchor, None when there is none (ValueError when it is unreadable)."""
    store = _as_store(store)
    try:
        data = store.read_json(BOOTSTRAP_MANIFEST)
    except FileNotFoundError:
        return None
    where = store.url(BOOTSTRAP_MANIFEST)
    if not isinstance(data, dict):
        raise ValueError(f"{where} is not a JSON object")
    fingerprint, identity, paths = (
        data.get("bootstrap_fingerprint"),
        data.get("bootstrap_identity"),
        data.get("excluded_paths"),
    )
    schema = data.get("schema_version")
    if (
        not isinstance(fingerprint, str)
        or not isinstance(identity, dict)
        or not isinstance(paths, list)
        or isinstance(schema, bool)
        or not isinstance(schema, int)
    ):
        raise ValueError(
            f"{where} is not a valid bootstrap manifest (needs schema_version, bootstrap_fingerprint,"
            " bootstrap_identity, excluded_paths)"
        )
    return BootstrapAnchor(fingerprint, identity, tuple(str(p) for p in paths), schema)


def write_bootstrap_anchor(
    store: CheckpointStore | str, config: Mapping[str, Any], extra_excluded_paths: Iterable[str] = ()
) -> BootstrapAnchor:
    """Create ``bootstrap/manifest.json`` atomically, or validate the existing one (never overwritten).

    ``store`` is a :class:`CheckpointStore` or a local checkpoint directory.
    """
    store = _as_store(store)
    existing = validate_bootstrap_anchor(store, config, extra_excluded_paths)
    if existing is not None:
        return existing
    anchor = BootstrapAnchor.from_config(config, extra_excluded_paths)
    store.write_json_atomic(BOOTSTRAP_MANIFEST, anchor.to_json())
    return anchor


def validate_bootstrap_anchor(
    store: CheckpointStore | str, config: Mapping[str, Any], extra_excluded_paths: Iterable[str] = ()
) -> BootstrapAnchor | None:
    """Read-only check of the stored anchor against ``config``; None when there is no anchor.

    Raises:
        FingerprintMismatchError: listing up to 20 changed dotpaths as ``path: old -> new``.
    """
    store = _as_store(store)
    stored = read_bootstrap_anchor(store)
    if stored is None:
        return None
    current = BootstrapAnchor.from_config(config, extra_excluded_paths)
    if stored.fingerprint == current.fingerprint and stored.schema_version == current.schema_version:
        return stored
    raise FingerprintMismatchError(_mismatch_message(store, stored, current))


def _flatten(node: Any, prefix: str, out: dict[str, Any]) -> dict[str, Any]:
    if isinstance(node, dict) and node:
        for key, value in node.items():
            _flatten(value, f"{prefix}.{key}" if prefix else str(key), out)
    elif isinstance(node, list) and node:
        for i, value in enumerate(node):
            _flatten(value, f"{prefix}.{i}" if prefix else str(i), out)
    else:
        out[prefix] = node
    return out


_ABSENT = object()


def _show(value: Any) -> str:
    if value is _ABSENT:
        return "<absent>"
    text = json.dumps(value, sort_keys=True, ensure_ascii=False)
    return text if len(text) <= MAX_VALUE_CHARS else text[: MAX_VALUE_CHARS - 1] + "…"


def changed_paths(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """``(dotpath, old, new)`` for every leaf that differs (``_ABSENT`` where missing), sorted."""
    a, b = _flatten(dict(old), "", {}), _flatten(dict(new), "", {})
    changes = []
    for path in sorted(set(a) | set(b)):
        va, vb = a.get(path, _ABSENT), b.get(path, _ABSENT)
        if va is _ABSENT or vb is _ABSENT or _canonical(va) != _canonical(vb):
            changes.append((path, va, vb))
    return changes


def _covered(dotpath: str, patterns: tuple[tuple[str, ...], ...]) -> bool:
    """Whether a pattern matches ``dotpath`` or an ancestor (the node sits in an excluded subtree)."""
    segments = tuple(dotpath.split("."))
    return any(_match(p, segments[:n]) for p in patterns for n in range(1, len(segments) + 1))


def _mismatch_message(store: CheckpointStore, stored: BootstrapAnchor, current: BootstrapAnchor) -> str:
    hidden = tuple(tuple(p.split(".")) for p in set(stored.excluded_paths) | set(current.excluded_paths))
    changes = [c for c in changed_paths(stored.identity, current.identity) if not _covered(c[0], hidden)]
    lines = [
        f"the configuration does not match the bootstrap rollout state in {store.url('bootstrap')}"
        f" (fingerprint {stored.fingerprint[:12]}… stored, {current.fingerprint[:12]}… now)."
    ]
    if stored.schema_version != current.schema_version:
        lines.append(f"The fingerprint schema changed ({stored.schema_version} -> {current.schema_version}).")
    added = sorted(set(current.excluded_paths) - set(stored.excluded_paths))
    removed = sorted(set(stored.excluded_paths) - set(current.excluded_paths))
    if added or removed:
        lines.append(f"Excluded paths differ: added {added}, removed {removed}.")
    if changes:
        lines.append(f"Changed paths ({len(changes)}):")
        lines += [
            f"  {path}: {_show(old)} -> {_show(new)}" for path, old, new in changes[:MAX_LISTED_CHANGES]
        ]
        if len(changes) > MAX_LISTED_CHANGES:
            lines.append(f"  and {len(changes) - MAX_LISTED_CHANGES} more")
    lines.append(
        "If a changed value cannot affect prompts, generation, rewards, lineage or the interpretation of"
        " persisted rollout data, add its dotpath to rollout_checkpointing.extra_fingerprint_excluded_paths"
        " (on the original run as well as the restart); otherwise choose a new checkpointing.checkpoint_dir"
        " to start a fresh bootstrap lineage. Existing checkpoint state was not modified."
    )
    return "\n".join(lines)
