"""What a starting run resumes from, fetched to local disk (no Ray, no Lightning)."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

from screl.checkpoint.restore import select_restore
from screl.checkpoint.store import CheckpointStore

log = logging.getLogger(__name__)

LIGHTNING_CKPT = "lightning.ckpt"
CONTROLLER_STATE = "controller_state.pt"
DATA_PLANE = "data_plane"


@dataclass(frozen=True)
class Resume:
    """A trainer bundle fetched locally: the Lightning checkpoint, the controller state and the data plane."""

    step: int
    ckpt_path: str
    controller_state: dict[str, Any]
    data_plane_dir: str | None
    source_url: str


def fetch_resume(
    checkpoint_dir: str,
    local_root: str,
    *,
    restore_mode: str = "latest",
    snapshots_enabled: bool = False,
    config: dict[str, Any] | None = None,
    extra_excluded_paths: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
) -> Resume | None:
    """The bundle to resume from (per ``restore_mode``), downloaded under ``local_root``; None = fresh start."""
    store = CheckpointStore(checkpoint_dir, storage_options or None)
    plan = select_restore(store, restore_mode, snapshots_enabled, config or {},  # type: ignore[arg-type]
                          extra_excluded_paths or ())
    for note in plan.notes:
        log.warning("screl resume: %s", note)
    if plan.bundle is None:
        return None
    bundle = plan.bundle
    local = os.path.join(local_root, f"step_{bundle.step}")
    os.makedirs(local, exist_ok=True)
    ckpt = os.path.join(local, LIGHTNING_CKPT)
    store.download_file(bundle, LIGHTNING_CKPT, ckpt)
    state = store.read_torch(bundle, CONTROLLER_STATE, weights_only=False)
    dp_dir: str | None = None
    if any(name.startswith(DATA_PLANE + "/") for name in bundle.parts):
        dp_dir = os.path.join(local, DATA_PLANE)
        store.download_dir(bundle, DATA_PLANE, dp_dir)
    return Resume(bundle.step, ckpt, state, dp_dir, bundle.url)
