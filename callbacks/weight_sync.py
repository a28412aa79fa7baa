"""``WeightSync``: refit the generation workers after every optimizer step."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

log = logging.getLogger(__name__)


class WeightSync(Callback):
    """After the chunk that closes an RL step: retire the step, bump the trainer version and push the
    policy's weights to the generation workers, then re-open the rollout pump.

    Always present: ``screl fit`` adds it, and ``RolloutDataModule`` refuses to run without it. On an
    exception anywhere in fit, it stops the controller, workers and data plane.
    """

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (isinstance(batch, dict) and batch.get("last_chunk")):
            return
        dm = trainer.datamodule  # type: ignore[attr-defined]
        # a step that left the policy unchanged (PPO critic warmup) refits nothing
        refit = bool(getattr(pl_module, "refit_due", True))
        info = dm.complete_step(_exported_weights(pl_module, dm) if refit else None)
        pl_module.log("rollout/aborted_stale", float(info.get("aborted", 0)), batch_size=1)

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "shutdown"):
            try:
                dm.shutdown()
            except Exception as err:  # noqa: BLE001 - the original exception matters more
                log.warning("screl: shutdown after %r failed: %r", exception, err)


def _exported_weights(pl_module: LightningModule, dm: Any) -> Any:
    """The module's bucketed export when it has one (the trainer then never holds a second full copy of the
    weights; buckets of ``generation.refit_bucket_mb``), else its one-dict ``export_weights()``."""
    module: Any = pl_module
    if hasattr(module, "iter_export_weights"):
        return module.iter_export_weights(int(dm.generation.refit_bucket_mb * 2**20))
    if hasattr(module, "export_weights"):
        return module.export_weights()
    raise TypeError(
        f"{type(pl_module).__name__} has neither iter_export_weights() nor export_weights(): WeightSync cannot refit"
    )
