"""What an export needs to know about a run besides its weights: the policy's spec (which model class, which
tokenizer), PPO's critic spec and the run's generation settings.

The record is plain values (it rides in a Lightning checkpoint, which screl loads with ``weights_only=True``):
``HFExport`` stores it as its callback state (``checkpoint["callbacks"]["HFExport"]``), so every bundle of a run
with that callback carries it. A bundle without it is exported with the run's ``config.yaml`` (``--config``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Mapping
from typing import Any

from screl.models.spec import PolicySpec

__all__ = ["RECORD_FORMAT", "RECORD_KEY", "ExportError", "export_record", "record_from_config", "spec_from_dict",
           "spec_to_dict"]

RECORD_KEY = "HFExport"
"""The callback state key under which a Lightning checkpoint carries the record."""
RECORD_FORMAT = 1
GENERATION_KEYS = ("temperature", "top_p", "top_k", "max_new_tokens")
"""The run's generation settings the exported ``generation_config.json`` carries (with the stop tokens)."""


class ExportError(ValueError):
    """An export that cannot go on: the message names the file or key and the fix. Nothing was written."""


def spec_to_dict(spec: PolicySpec) -> dict[str, Any]:
    """``{class_path, init_args}`` of a spec (its settings: ``PolicySpec._fields``), as a config names it."""
    cls = type(spec)
    return {"class_path": f"{cls.__module__}.{cls.__qualname__}", "init_args": dict(spec._fields())}


def spec_from_dict(value: Any, where: str) -> PolicySpec:
    """The spec that ``value`` (``{class_path, init_args}``) names; ``where`` names its source in errors."""
    if not isinstance(value, Mapping) or not isinstance(value.get("class_path"), str):
        raise ExportError(f"{where}: expected {{class_path, init_args}} naming a PolicySpec, got {value!r}")
    module_name, _, name = value["class_path"].rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ExportError(f"{where}: cannot import {value['class_path']!r} ({err}); install the package that "
                          "defines it") from err
    if not (isinstance(cls, type) and issubclass(cls, PolicySpec)):
        raise ExportError(f"{where}: {value['class_path']!r} is not a screl.models.PolicySpec")
    try:
        return cls(**dict(value.get("init_args") or {}))  # type: ignore[no-any-return]
    except (TypeError, ValueError, OSError) as err:
        raise ExportError(f"{where}: {value['class_path']}({value.get('init_args')}) failed: {err}") from err


def export_record(module: Any, generation: Any = None) -> dict[str, Any]:
    """The record of a live run: ``module``'s policy spec (``policy_spec``), its critic's (PPO) and ``generation``
    (the data module's ``GenerationConfig``, or None)."""
    policy = getattr(module, "policy_spec", None)
    if not isinstance(policy, PolicySpec):
        raise ExportError(f"HFExport: {type(module).__name__} has no policy_spec (a screl PolicySpec): nothing to "
                          "export. Use it with screl's algorithms (screl.GRPO, screl.PPO, ...)")
    critic = getattr(module, "critic", None)
    value = getattr(critic, "spec", None) if critic is not None else None
    gen = {k: getattr(generation, k) for k in GENERATION_KEYS if hasattr(generation, k)} if generation else {}
    return {"format": RECORD_FORMAT, "policy": spec_to_dict(policy),
            "value": spec_to_dict(value) if isinstance(value, PolicySpec) else None, "generation": gen}


def record_from_config(path: str) -> dict[str, Any]:
    """The record of a run's ``config.yaml`` (``screl fit`` writes it into the run's log folder): the
    ``model.init_args.policy`` and ``value`` blocks and ``data.init_args.generation``."""
    import yaml

    if not os.path.isfile(path):
        raise ExportError(f"--config {path}: no such file (the run's config.yaml, beside its metrics.csv)")
    with open(path) as f:
        cfg = yaml.safe_load(f) or {}
    if "fit" in cfg and "model" not in cfg:
        cfg = cfg["fit"]
    model = ((cfg.get("model") or {}).get("init_args") or {})
    if not isinstance(model.get("policy"), Mapping):
        raise ExportError(f"--config {path}: no model.init_args.policy block (the policy's spec) in it")
    gen = ((cfg.get("data") or {}).get("init_args") or {}).get("generation") or {}
    return {"format": RECORD_FORMAT, "policy": dict(model["policy"]),
            "value": dict(model["value"]) if isinstance(model.get("value"), Mapping) else None,
            "generation": {k: gen[k] for k in GENERATION_KEYS if k in gen}}
