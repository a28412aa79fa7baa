"""What a starting run resumes from, fetched to local disk (no Ray, no Lightning)."""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass
from typing import Any

from screl.checkpoint.pickle_scan import check_pickles_under
from screl.checkpoint.restore import RestorePlan, select_restore
from screl.checkpoint.store import CheckpointStore, CorruptPartError, PublishedDir

log = logging.getLogger(__name__)

LIGHTNING_CKPT = "lightning.ckpt"
CONTROLLER_STATE = "controller_state.pt"
DATA_PLANE = "data_plane"


def write_controller_parts(writer: Any, state: dict[str, Any]) -> None:
    """The controller state captured at the data-plane barrier, and its sidecars, as bundle or snapshot parts."""
    writer.write_torch(CONTROLLER_STATE, state)
    writer.write_torch("replay_buffer_metadata.pt", state["replay_index"])
    writer.write_torch("rollout_recovery.pt", {"ledger": state["ledger"], "in_flight": state["in_flight"],
                                               "admitted": state["admitted"]})
    writer.write_torch("replacement_reserve.pt", state["replacement_reserve"])


@dataclass(frozen=True)
class Resume:
    """What a run resumes from, on local disk: the Lightning checkpoint (None for a bootstrap snapshot: the
    model starts fresh), the controller state and the TransferQueue snapshot."""

    step: int
    ckpt_path: str | None
    controller_state: dict[str, Any]
    data_plane_dir: str | None
    source_url: str
    source: str
    data_plane_remote: dict[str, Any] | None = None
    """The published ``data_plane/`` (``url``, ``storage_options``, ``digests``: relative path -> SHA-256), for
    TransferQueue actors on other nodes to fetch their own copy (``screl.dataplane.snapshot``)."""
    optimizer_saved: bool = True
    """False when the bundle was written with ``checkpointing.save_optimizer: false`` (no optimizer moments)."""


def fetch_resume(
    checkpoint_dir: str,
    local_root: str,
    *,
    restore_mode: str = "latest",
    snapshots_enabled: bool = False,
    config: dict[str, Any] | None = None,
    extra_excluded_paths: list[str] | None = None,
    storage_options: dict[str, Any] | None = None,
    rollout_side: bool = True,
) -> Resume | None:
    """Select per ``restore_mode`` (read-only) and download under ``local_root``; None = a fresh start.

    A trainer bundle gives everything; a periodic snapshot under it replaces the rollout state (newer
    progress); a bootstrap snapshot gives the rollout state of a run that never finished a step.
    ``rollout_side=False`` (training ranks other than 0): only the Lightning checkpoint is downloaded, whole
    (a sharded one is a directory: each rank reads its shards from its own copy, no shared disk needed).

    Every part of the chosen bundle is read and checked against the manifest's size and SHA-256 before anything
    loads, on every rank (so all ranks make the same choice). A part that fails refuses that bundle (or snapshot):
    a warning names the file and the check, and the selection runs again without it, down to the previous
    published bundle; with none left, :class:`~screl.checkpoint.restore.NoUsableBundleError` lists every refusal.
    A part that passes its checks but holds more than tensors (a tampered bundle) is refused without fallback.
    """
    store = CheckpointStore(checkpoint_dir, storage_options or None)
    refused: dict[str, str] = {}
    while True:
        plan = select_restore(
            store, restore_mode, snapshots_enabled, config or {}, extra_excluded_paths or (),  # type: ignore[arg-type]
            refused=refused,
        )
        if plan.source == "fresh":
            for note in plan.notes:
                log.warning("screl resume: %s", note)
            log.warning("screl: nothing to resume in %s: a fresh start", store.url())
            return None
        step = plan.bundle.step if plan.bundle is not None else 0
        local = os.path.join(local_root, f"step_{step}" + ("_snapshot" if plan.snapshot is not None else ""))
        try:
            resume = _fetch(store, plan, local, rollout_side)
        except CorruptPartError as err:
            shutil.rmtree(local, ignore_errors=True)
            refused[err.relpath] = str(err)
            log.warning("screl resume: refusing %s (%s failed its %s check); looking for an older one: %s",
                        store.url(err.relpath), err.part, err.check, err)
            continue
        for note in plan.notes:
            log.warning("screl resume: %s", note)
        return resume


def _fetch(store: CheckpointStore, plan: RestorePlan, local: str, rollout_side: bool) -> Resume:
    """Download and check what ``plan`` names (CorruptPartError: a part failed its size or SHA-256)."""
    rollout: PublishedDir | None = plan.snapshot if plan.snapshot is not None else plan.bundle
    assert rollout is not None
    step = plan.bundle.step if plan.bundle is not None else 0
    os.makedirs(local, exist_ok=True)
    ckpt: str | None = None
    if plan.bundle is not None:
        ckpt = os.path.join(local, LIGHTNING_CKPT)
        if any(name.startswith(LIGHTNING_CKPT + "/") for name in plan.bundle.parts):  # sharded (MegatronStrategy)
            store.download_dir(plan.bundle, LIGHTNING_CKPT, ckpt)
        else:
            store.download_file(plan.bundle, LIGHTNING_CKPT, ckpt)
        # the rest of the bundle (optimizer shards, controller state, data plane, replay index, ledger, reserve):
        # every rank checks all of it, so that a refusal is the same decision on every rank
        skip = [n for n in plan.bundle.parts if n == LIGHTNING_CKPT or n.startswith(LIGHTNING_CKPT + "/")]
        if rollout_side and rollout is plan.bundle:
            skip += [n for n in plan.bundle.parts if n == CONTROLLER_STATE or n.startswith(DATA_PLANE + "/")]
        store.verify(plan.bundle, skip)
    state = store.read_torch(rollout, CONTROLLER_STATE) if rollout_side else {}
    dp_dir: str | None = None
    remote: dict[str, Any] | None = None
    if rollout_side and any(name.startswith(DATA_PLANE + "/") for name in rollout.parts):
        dp_dir = os.path.join(local, DATA_PLANE)
        store.download_dir(rollout, DATA_PLANE, dp_dir)
        check_pickles_under(dp_dir, f"{rollout.url}/{DATA_PLANE}")  # TransferQueue unpickles these
        remote = {"url": store.url(f"{rollout.relpath}/{DATA_PLANE}"), "storage_options": store.storage_options,
                  "digests": {name[len(DATA_PLANE) + 1:]: part.sha256 for name, part in rollout.parts.items()
                              if name.startswith(DATA_PLANE + "/")}}
    if rollout_side and plan.snapshot is not None:
        store.verify(plan.snapshot, [n for n in plan.snapshot.parts
                                     if n == CONTROLLER_STATE or n.startswith(DATA_PLANE + "/")])
    optimizer_saved = plan.bundle is None or plan.bundle.metadata.get("optimizer", True) is not False
    return Resume(step, ckpt, state, dp_dir, rollout.url, plan.source, remote, optimizer_saved)
