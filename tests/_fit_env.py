"""The environment of a ``screl fit`` a test starts as a subprocess: the test process's own, without the variables
a trainer that ran in it left behind. Lightning's launcher sets ``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR`` and
``MASTER_PORT`` in the process that ran it (and screl's file rendezvous ``SCREL_DIST_INIT_FILE``); a child that
inherits ``LOCAL_RANK`` takes its ranks for externally started ones and never starts rank 1 (a 2-rank recipe twin
hung 600 s after in-process Megatron runs in the same test worker)."""

from __future__ import annotations

import os

LAUNCH_VARS = frozenset({"LOCAL_RANK", "NODE_RANK", "RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                         "MASTER_ADDR", "MASTER_PORT", "SCREL_DIST_INIT_FILE"})


def fit_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """``os.environ`` without :data:`LAUNCH_VARS`, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    env.update(extra or {})
    return env
