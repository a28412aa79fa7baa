"""Periodic rollout snapshots: the controller's state between trainer checkpoints (docs/checkpointing.md).

Every ``rollout_checkpointing.snapshot_attempt_interval_s`` :class:`SnapshotPump` attempts one, anchored to
``<checkpoint_dir>/bootstrap/`` before the first step (created with the config's fail-closed fingerprint, or checked
against it) and to the durable bundle ``step_N`` after step N. An attempt is skipped when that bundle is not durable
yet (``missing_trainer_anchor``; ``save_period: 1`` gives full coverage) or when nothing in the data plane changed
since the last snapshot; ``max_consecutive_failures`` failed attempts in a row stop the run.

Invariant: the state is captured under the data-plane barrier, with the open step's claims rolled back in the
persisted copy (a restart retrains that step), so every row it counts is in the TransferQueue snapshot published
beside it. The pump sees its controller only as :class:`SnapshotSource`, so this module does not import the
controller that starts it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from typing import Any, Protocol

from screl.checkpoint import (
    BOOTSTRAP_ANCHOR,
    CheckpointStore,
    MissingAnchorError,
    SnapshotManifest,
    begin_snapshot,
    prune_bootstrap_snapshots,
    trainer_anchor,
    write_bootstrap_anchor,
)
from screl.checkpoint.resume import DATA_PLANE, write_controller_parts
from screl.config import CheckpointingConfig, RolloutCheckpointingConfig

log = logging.getLogger(__name__)


class SnapshotSource(Protocol):
    """What the pump uses of :class:`screl.controller.RolloutController`."""

    @property
    def train_steps(self) -> int: ...

    @property
    def mutation_version(self) -> int: ...

    async def capture(self, data_plane_dir: str | None, open_step: str = "reject",
                      remote: dict[str, Any] | None = None) -> dict[str, Any]: ...


class SnapshotPump:
    """Attempts rollout snapshots on a timer for one controller."""

    def __init__(
        self,
        ctl: SnapshotSource,
        checkpointing: CheckpointingConfig,
        config: RolloutCheckpointingConfig,
        config_dict: dict[str, Any],
    ) -> None:
        self.ctl = ctl
        self.config = config
        self.config_dict = config_dict
        self.store = CheckpointStore(str(checkpointing.checkpoint_dir), checkpointing.storage_options or None)
        self.last_mutation = -1
        self.failures = 0
        self.outcomes: dict[str, int] = {}

    async def run(self) -> None:
        assert self.config.snapshot_attempt_interval_s is not None
        while True:
            await asyncio.sleep(self.config.snapshot_attempt_interval_s)
            try:
                outcome = await self.attempt()
                self.failures = 0
            except Exception as err:  # noqa: BLE001 - any store's error (botocore's are not OSErrors): counted, bounded
                # by max_consecutive_failures, then raised with its cause
                self.failures += 1
                outcome = "failed:io_error"
                log.warning("screl: rollout snapshot failed (%d in a row): %r", self.failures, err)
                if self.failures >= self.config.max_consecutive_failures:
                    raise RuntimeError(
                        f"{self.failures} rollout snapshots failed in a row "
                        f"(rollout_checkpointing.max_consecutive_failures={self.config.max_consecutive_failures}); "
                        f"last error: {err!r}"
                    ) from err
            self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1

    async def attempt(self) -> str:
        """One attempt; returns ``completed`` or ``skipped:<reason>``."""
        ctl = self.ctl
        if ctl.mutation_version == self.last_mutation:
            return "skipped:no_data_plane_mutations"
        step = ctl.train_steps
        loop = asyncio.get_running_loop()
        fingerprint: str | None = None
        if step == 0:
            anchor = BOOTSTRAP_ANCHOR
            made = await loop.run_in_executor(
                None, write_bootstrap_anchor, self.store, self.config_dict, self.config.extra_fingerprint_excluded_paths
            )
            fingerprint = made.fingerprint
        else:
            anchor = trainer_anchor(step)
        try:
            writer = await loop.run_in_executor(None, begin_snapshot, self.store, anchor)
        except MissingAnchorError:
            return "skipped:missing_trainer_anchor"
        with tempfile.TemporaryDirectory(prefix="screl-snapshot-") as tmp, writer:
            dp_dir = os.path.join(tmp, DATA_PLANE)
            state = await ctl.capture(dp_dir, open_step="rollback",
                                      remote={"url": writer.staged_url(DATA_PLANE),
                                              "storage_options": self.store.storage_options})
            if state["train_steps"] != step:
                writer.abort()
                return "skipped:trainer_state_changed"

            def publish() -> None:
                writer.write_dir(DATA_PLANE, dp_dir)
                writer.adopt(DATA_PLANE, new_only=True)  # the shares TransferQueue actors on other nodes uploaded
                write_controller_parts(writer, state)
                header = SnapshotManifest(
                    base_train_step=step, trainer_version=state["trainer_version"],
                    sampler_dispatch_index=int(state["dispatch_index"]), mutation_version=state["mutation_version"],
                    rolled_back_train_group_count=int(state["rolled_back_groups"]),
                    current_epoch=int(state["epoch"]), bootstrap_fingerprint=fingerprint,
                )
                writer.commit(header, keep_latest_k=self.config.keep_latest_k)
                if step > 0:
                    prune_bootstrap_snapshots(self.store)

            await loop.run_in_executor(None, publish)
        self.last_mutation = state["mutation_version"]
        return "completed"
