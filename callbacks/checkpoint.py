"""``DataPlaneCheckpoint``: trainer checkpoint bundles that carry the data plane, published atomically."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from screl.checkpoint.resume import DATA_PLANE, LIGHTNING_CKPT, write_controller_parts
from screl.checkpoint.store import CheckpointStore
from screl.checkpoint.writer import PublishedReadBackError
from screl.config import CheckpointingConfig
from screl.dataplane.errors import DataPlaneLostError

log = logging.getLogger(__name__)


class CheckpointSaveError(RuntimeError):
    """A checkpoint bundle could not be written; nothing of it was published and the run stops."""


class DataPlaneCheckpoint(Callback):
    """Every ``save_period`` steps (and at the end), after ``WeightSync`` closed the step, write the bundle
    ``<checkpoint_dir>/step_<n>/``: the Lightning checkpoint (model, optimizer, loops), the native
    TransferQueue snapshot and the controller state (replay index with its digest, the ownership ledger
    of unfinished groups, the prompt cursor, the sampler's dispatch position) captured under one
    data-plane barrier, ``rollout_recovery.pt`` and ``replacement_reserve.pt``. The bundle becomes the
    latest resumable one only once every part is durable; a failed save raises and leaves the previous
    bundle the latest. ``screl fit`` adds it when ``checkpointing.enabled``.
    """

    def __init__(self, config: CheckpointingConfig) -> None:
        if not config.checkpoint_dir:
            raise ValueError("DataPlaneCheckpoint needs checkpointing.checkpoint_dir")
        self.config = config
        self.store = CheckpointStore(config.checkpoint_dir, config.storage_options or None)
        self.last_saved: int | None = None
        self._committed: int | None = None  # several ranks: the step rank 0 last published (before the collective)

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        from screl.callbacks.weight_sync import WeightSync

        callbacks = list(trainer.callbacks)  # type: ignore[attr-defined]
        syncs = [i for i, cb in enumerate(callbacks) if isinstance(cb, WeightSync)]
        if not syncs or syncs[0] > callbacks.index(self):
            raise RuntimeError("DataPlaneCheckpoint must come after WeightSync in trainer.callbacks: a bundle is "
                               "written once the step is closed and the workers refit")

    @override
    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """``save_optimizer: false``: keep each optimizer's hyperparameters and parameter groups, drop its state (the
        moments), so the bundle is smaller and a resume loads a fresh optimizer through Lightning as usual."""
        if self.config.save_optimizer:
            return
        checkpoint["optimizer_states"] = [
            {**opt, "state": {}} if isinstance(opt, dict) and "state" in opt else opt
            for opt in checkpoint.get("optimizer_states", [])
        ]

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (isinstance(batch, dict) and batch.get("last_chunk")):
            return
        step = trainer.global_step
        if step % self.config.save_period == 0 or step >= trainer.max_steps > 0:
            self.save(trainer, step)

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        step = trainer.global_step
        if step > 0 and self.last_saved != step:
            self.save(trainer, step)

    def save(self, trainer: Trainer, step: int) -> None:
        """Write and publish bundle ``step_<step>``. A save that fails (the object store unreachable, a full disk)
        publishes nothing and stops the run with :class:`CheckpointSaveError`, naming the bundle, the cause and the
        bundle a resume will use: a run that cannot checkpoint would train on unprotected."""
        dm: Any = trainer.datamodule  # type: ignore[attr-defined]
        if dm is None:
            return
        metric = self._ranking_metric(trainer, step)  # before anything is written: a missing one fails here
        saved_before = self.last_saved
        try:
            self._save(trainer, dm, step, metric)
        except Exception as err:
            if isinstance(err, CheckpointSaveError):
                raise
            # the bundle is there, and a resume uses it: the store failed after the publish (its read-back or the
            # retention), or rank 0 published and the collective after it failed (a training rank was lost)
            store_failed = isinstance(err, PublishedReadBackError) or self.last_saved != saved_before
            if store_failed or self._committed == step:
                what, again = (("the store", "Once the store is reachable again, run the same command") if store_failed
                               else ("the training ranks", "Run the same command again"))
                raise CheckpointSaveError(
                    f"checkpoint bundle step_{step} was published to {self.store.url()}, but {what} failed right "
                    f"after: {type(err).__name__}: {err}. The run stops. {again}: it resumes from step_{step}.") from err
            last = f"step_{self.last_saved}" if self.last_saved is not None else "the newest bundle before it"
            again = "Run the same command again" if isinstance(err, DataPlaneLostError) else \
                "Once the store is writable again (space, credentials, endpoint), run the same command"
            raise CheckpointSaveError(  # not listing the store here: it may be what is unreachable
                f"checkpoint bundle step_{step} could not be saved to {self.store.url()}: {type(err).__name__}: "
                f"{err}. Nothing of it was published, and the run stops. {again}: it resumes from {last}.") from err

    def _save(self, trainer: Trainer, dm: Any, step: int, metric: dict[str, Any] | None) -> None:
        if trainer.world_size > 1:
            if not self._save_ranks(trainer, dm, step, metric):
                return
        elif dm.runtime is None:
            return
        else:
            with tempfile.TemporaryDirectory(prefix="screl-ckpt-") as tmp:
                ckpt = os.path.join(tmp, LIGHTNING_CKPT)
                trainer.save_checkpoint(ckpt, weights_only=False)  # the full state: optimizer, loops, callbacks
                with self.store.begin(step) as writer:
                    if os.path.isdir(ckpt):  # sharded (MegatronStrategy)
                        writer.write_dir(LIGHTNING_CKPT, ckpt)
                    else:
                        writer.write_file(LIGHTNING_CKPT, ckpt)
                    self._write_rollout_side(writer, dm, tmp, metric)
        self._published(trainer, step)

    def _save_ranks(self, trainer: Trainer, dm: Any, step: int, metric: dict[str, Any] | None) -> bool:
        """Several training processes: every rank writes its own share of the Lightning checkpoint (its model and
        optimizer shards under ``MegatronStrategy``) straight into the unpublished bundle, node by node; then
        rank 0 records those parts, writes the rollout side and publishes. A failure anywhere publishes nothing
        and raises on every rank."""
        if not dm._on_rank_zero(lambda: dm.runtime is not None):
            return False
        writer = self.store.begin(step) if trainer.is_global_zero else None
        try:
            url = dm._on_rank_zero(lambda: writer.staged_url(LIGHTNING_CKPT))  # type: ignore[union-attr]
            trainer.save_checkpoint(url, weights_only=False)  # a collective: every share is durable on return

            def publish() -> None:
                assert writer is not None
                with writer, tempfile.TemporaryDirectory(prefix="screl-ckpt-") as tmp:
                    writer.adopt(LIGHTNING_CKPT)
                    self._write_rollout_side(writer, dm, tmp, metric)
                self._committed = step

            dm._on_rank_zero(publish)
            return True
        except BaseException:
            if writer is not None:
                with contextlib.suppress(RuntimeError):  # already committed or aborted
                    writer.abort()
            raise

    def _ranking_metric(self, trainer: Trainer, step: int) -> dict[str, Any] | None:
        """``checkpointing.metric_name``'s value at this step, for the manifest (None without one)."""
        name = self.config.metric_name
        if name is None:
            return None
        key = name.split(":", 1)[1]
        logged = trainer.callback_metrics
        found = next((k for k in (key, f"train/{key}") if k in logged), None)
        if found is None:
            raise ValueError(f"checkpointing.metric_name={name!r}: step {step} logged neither {key!r} nor "
                             f"'train/{key}' (it logged {sorted(logged)}); nothing was saved for this step")
        return {"name": name, "key": found, "value": float(logged[found])}

    def _write_rollout_side(self, writer: Any, dm: Any, tmp: str, metric: dict[str, Any] | None) -> None:
        """The controller state and the data plane, captured under one barrier, and the manifest (rank 0), with
        ``metric`` (:meth:`_ranking_metric`) for retention."""
        dp_dir = os.path.join(tmp, DATA_PLANE) if self.config.save_data_plane else None
        remote = None if dp_dir is None else {"url": writer.staged_url(DATA_PLANE),
                                              "storage_options": writer.store.storage_options}
        state = dm.runtime.capture(dp_dir, remote)
        if dp_dir is not None:
            writer.write_dir(DATA_PLANE, dp_dir)
            writer.adopt(DATA_PLANE, new_only=True)  # the shares TransferQueue actors on other nodes uploaded
        write_controller_parts(writer, state)
        writer.commit({"trainer_version": state["trainer_version"], "train_steps": state["train_steps"],
                       "mode": state.get("mode", "authoritative") if dp_dir is not None else "shadow",
                       "replay_digest": state["replay_index"]["digest"],
                       "groups": len(state["replay_index"]["groups"]), "optimizer": self.config.save_optimizer,
                       **({"metric": metric} if metric is not None else {})})

    def _published(self, trainer: Trainer, step: int) -> None:
        self.last_saved = step
        if not trainer.is_global_zero:
            return
        if self.config.keep_top_k is not None:
            self.store.retain(self.config.keep_top_k, self.config.metric_name, self.config.higher_is_better)
        log.info("screl: checkpoint step_%d published to %s", step, self.store.url(f"step_{step}"))
