"""``WeightSync``: refit the generation workers after every optimizer step."""

from __future__ import annotations

import logging
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from screl.rollout.engines.buckets import bucket_to_wire

log = logging.getLogger(__name__)


class WeightSync(Callback):
    """After the chunk that closes an RL step: retire the step, bump the trainer version and push the
    policy's weights to the generation workers, then re-open the rollout pump.

    Always present: ``screl fit`` adds it, and ``RolloutDataModule`` refuses to run without it. On an
    exception anywhere in fit, it stops the controller, workers and data plane.

    Validation during training (``grpo.val_period``...): each finished validation comes back with a step's
    refit, and is logged as ``val/*`` at the step whose weights it validated; at the end of training the last
    ones (``val_at_end``) are waited for and logged.
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
        aborted = {"rollout/aborted_stale": float(info.get("aborted", 0)),
                   **{f"train/{k}": float(v) for k, v in info.get("rewards", {}).items()}}  # per reward function
        stage = getattr(pl_module, "stage_metrics", None)  # screl's modules write a batch's metrics at once
        if stage is not None:
            stage(aborted)
        else:
            pl_module.log_dict(aborted, batch_size=1)
        _log_validation(trainer, info.get("validation", []))

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        dm: Any = trainer.datamodule  # type: ignore[attr-defined]
        if hasattr(dm, "finish_validation"):
            _log_validation(trainer, dm.finish_validation())

    @override
    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        dm = getattr(trainer, "datamodule", None)
        if dm is not None and hasattr(dm, "shutdown"):
            try:
                dm.shutdown()
            except Exception as err:  # noqa: BLE001 - the original exception matters more
                log.warning("screl: shutdown after %r failed: %r", exception, err)


def _log_validation(trainer: Trainer, results: list[dict[str, Any]]) -> None:
    """``val/*`` of each finished validation, at the step (the weight version) it validated."""
    if not trainer.is_global_zero:
        return
    for result in results:
        for logger in trainer.loggers:
            logger.log_metrics(result["metrics"], step=int(result["version"]))
        log.info("screl: validation of version %d: %s", result["version"],
                 {k: round(v, 4) for k, v in result["metrics"].items()})


def _exported_weights(pl_module: LightningModule, dm: Any) -> Any:
    """The module's bucketed export when it has one (the trainer then never holds a second full copy of the
    weights; buckets of ``generation.refit_bucket_mb``, each put into the object store as it comes, as a
    ``WireBucket`` the workers read in place), else its one-dict ``export_weights()``."""
    module: Any = pl_module
    if getattr(dm, "broadcasts_weights", False):  # vLLM NCCL transfer: the trainer sends its HF module itself
        return module.model
    naming = getattr(dm, "refit_naming", "hf")
    kwargs = {} if naming == "hf" else {"naming": naming}  # the Megatron engine loads Megatron's own names
    if hasattr(module, "iter_export_weights"):  # numpy on the wire: workers read the object store without a copy
        return map(bucket_to_wire, module.iter_export_weights(int(dm.generation.refit_bucket_mb * 2**20), **kwargs))
    if hasattr(module, "export_weights"):
        return module.export_weights(**kwargs)
    raise TypeError(
        f"{type(pl_module).__name__} has neither iter_export_weights() nor export_weights(): WeightSync cannot refit"
    )
