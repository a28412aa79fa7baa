"""What ``screl fit`` starts before it imports Lightning: the local Ray cluster.

Starting Ray is mostly waiting for its processes (the GCS, the raylet and their helpers) to come up, and the
driver's first seconds go to importing Lightning and torch and parsing the config; the run only needs Ray at its
first batch. So ``screl fit`` begins Ray's start at once, in a thread, with the ``ray`` block its config files
and command line give (:func:`screl.dataplane.cluster.prestart_local_ray`), and the rollout side takes that cluster
over when its arguments are the ones it asks for. Nothing is started early where Ray's start depends on more than
the ``ray`` block, or might not be screl's to make:

* a launched rank (``LOCAL_RANK``/``RANK`` set: Lightning's launcher, torchrun) or a process that multiprocessing
  spawned (it re-imports the CLI with its parent's arguments): the first process starts Ray;
* a cluster to join (``ray.address``) or GPUs on the machine (their share for Ray comes from the device map);
* a ``ray`` setting this module does not read (``--ray=...``, ``--print_config``), or a config it cannot read:
  the config's own parsing reports that, and Ray starts where it always did.

``SCREL_RAY_PRESTART=0`` turns it off.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from screl.config import RayConfig
from screl.placement_env import node_gpu_ids

LAUNCHED_RANK_VARS = ("LOCAL_RANK", "RANK", "SCREL_DIST_INIT_FILE")
RAY_KEYS = tuple(f.name for f in dataclasses.fields(RayConfig))
OFF_VAR = "SCREL_RAY_PRESTART"


def _option(args: list[str], i: int) -> tuple[str, str | None, int]:
    """``--key=value`` or ``--key value`` at ``args[i]``: (key, value, index of the next argument)."""
    arg = args[i]
    if "=" in arg:
        key, value = arg.split("=", 1)
        return key, value, i + 1
    if i + 1 < len(args) and not args[i + 1].startswith("--"):
        return arg, args[i + 1], i + 2
    return arg, None, i + 1


def ray_block(args: Sequence[str]) -> dict[str, Any] | None:
    """The ``ray`` block ``screl fit args`` ends up with (the defaults, the ``--config`` files in order, then
    ``--ray.KEY`` options), or None when the arguments hold something this reading does not cover."""
    import yaml

    block: dict[str, Any] = dataclasses.asdict(RayConfig())
    args = list(args)
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            i += 1
            continue
        key, value, i = _option(args, i)
        if key == "--config":
            if value is None:
                return None
            try:
                cfg = yaml.safe_load(Path(value).read_text())
            except (OSError, yaml.YAMLError):
                return None
            ray = (cfg or {}).get("ray") if isinstance(cfg, dict) else None
            if ray is None:
                continue
            if not isinstance(ray, dict) or set(ray) - set(RAY_KEYS):
                return None
            block.update(ray)
        elif key.startswith("--ray.") and key[len("--ray."):] in RAY_KEYS and value is not None:
            block[key[len("--ray."):]] = yaml.safe_load(value)
        elif key.startswith("--ray") or key.startswith("--print_config") or key in ("-h", "--help"):
            return None
    return block


def cli_command(argv: Sequence[str]) -> str | None:
    """The ``screl`` subcommand ``argv`` (``sys.argv``) runs (``fit``, ``check``, ...), None when it is not the
    ``screl`` CLI (``pytest``, a script importing it)."""
    return argv[1] if len(argv) >= 2 and Path(argv[0]).name in ("screl", "cli.py") else None


def prestart_for_command(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> bool:
    """Begin Ray's start when ``argv`` (``sys.argv``) is a ``screl fit`` that may (see the module); returns
    whether it did."""
    env = os.environ if environ is None else environ
    if cli_command(argv) != "fit":
        return False
    if env.get(OFF_VAR) == "0" or any(env.get(v) for v in LAUNCHED_RANK_VARS) or node_gpu_ids(env):
        return False
    if multiprocessing.parent_process() is not None:
        return False
    block = ray_block(argv[2:])
    if block is None or block["address"] is not None:
        return False
    if not isinstance(block["num_cpus"], int) or not isinstance(block["namespace"], str):
        return False
    from screl.dataplane.cluster import prestart_local_ray

    verbose = "--verbose" in argv or env.get("SCREL_VERBOSE") == "1"
    prestart_local_ray(block["num_cpus"], block["namespace"], log_to_driver=verbose, gpu_ids=())  # no GPUs here
    return True
