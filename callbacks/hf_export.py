"""``HFExport``: the live policy written as a Hugging Face folder during and at the end of training (docs/export.md)."""

from __future__ import annotations

import logging
import os
from typing import Any

from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override

from screl.export.hf_folder import DTYPES, write_hf_folder
from screl.export.record import RECORD_KEY, export_record

log = logging.getLogger(__name__)

__all__ = ["HFExport", "HubPushError"]


class HubPushError(RuntimeError):
    """The upload to the Hugging Face hub failed; the local export it was to upload is complete."""


class HFExport(Callback):
    """Write the policy as a folder ``transformers`` and vLLM load (``AutoModelForCausalLM.from_pretrained(DIR)``):
    ``<out_dir>/step_<n>/`` every ``every_n_steps`` steps and ``<out_dir>/final/`` when training ends.

    Every rank takes part in gathering the weights (under ``MegatronStrategy`` a collective); rank 0 writes.
    The callback also stores the run's policy spec and generation settings in every checkpoint it is part of,
    which is what ``screl export`` reads to rebuild the model from a bundle.

    Args:
        every_n_steps: Export every this many RL steps (0: never during training).
        at_end: Export when training ends, to ``<out_dir>/final/``.
        out_dir: Where; None: ``<trainer.default_root_dir>/export``.
        dtype: ``bf16`` or ``fp32``: the weights' dtype in the folder.
        push_to_hub: A hub repository id (``org/name``): after the final export is written, upload it with
            ``huggingface_hub`` (credentials as ``huggingface_hub`` finds them: ``HF_TOKEN``, the login).
        max_shard_size: ``model.safetensors`` is split above this size.
    """

    def __init__(self, every_n_steps: int = 0, at_end: bool = True, out_dir: str | None = None, dtype: str = "bf16",
                 push_to_hub: str | None = None, max_shard_size: str = "5GB") -> None:
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 0:
            raise ValueError(f"HFExport: every_n_steps={every_n_steps!r} must be an integer >= 0 (0: only at the end)")
        if dtype not in DTYPES:
            raise ValueError(f"HFExport: dtype={dtype!r}: expected bf16 or fp32")
        self.every_n_steps, self.at_end, self.out_dir, self.dtype = every_n_steps, at_end, out_dir, dtype
        self.push_to_hub, self.max_shard_size = push_to_hub, max_shard_size
        self.record: dict[str, Any] = {}
        self.last_export: str | None = None

    @property
    @override
    def state_key(self) -> str:
        return RECORD_KEY

    @override
    def state_dict(self) -> dict[str, Any]:
        """The run's record (policy spec, critic spec, generation settings): ``screl export`` reads it."""
        return dict(self.record)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore: the record is the live run's (taken at ``setup``)."""

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        generation = getattr(getattr(trainer, "datamodule", None), "generation", None)
        self.record = export_record(pl_module, generation)
        if self.out_dir is None:
            self.out_dir = os.path.join(str(trainer.default_root_dir), "export")

    @override
    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if not (isinstance(batch, dict) and batch.get("last_chunk")) or not self.every_n_steps:
            return
        if trainer.global_step % self.every_n_steps == 0:
            self.export(trainer, pl_module, f"step_{trainer.global_step}")

    @override
    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.at_end or trainer.global_step == 0:
            return
        out = self.export(trainer, pl_module, "final")
        if self.push_to_hub and trainer.is_global_zero:
            push_folder(out, self.push_to_hub)

    def export(self, trainer: Trainer, pl_module: LightningModule, name: str) -> str:
        """Write ``<out_dir>/<name>/`` from the live module (every rank gathers, rank 0 writes); returns it."""
        assert self.out_dir is not None, "HFExport.export() runs after setup()"
        out = os.path.join(self.out_dir, name)
        module: Any = pl_module
        policy = module.export_weights()  # a collective under MegatronStrategy: every rank
        critic = module.export_critic_weights() if self.record.get("value") else None
        if trainer.is_global_zero:
            write_hf_folder(self.record, policy, out, dtype=self.dtype, critic=critic,
                            max_shard_size=self.max_shard_size,
                            provenance={"source": "HFExport", "step": int(trainer.global_step)})
            log.info("screl: exported the policy at step %d to %s", trainer.global_step, out)
        trainer.strategy.barrier("HFExport")
        self.last_export = out
        return out


def push_folder(folder: str, repo_id: str) -> None:
    """Upload ``folder`` to the hub repository ``repo_id`` (made if missing, private); :class:`HubPushError` names
    the repository and says the local export is complete."""
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        api.create_repo(repo_id, exist_ok=True, private=True)
        api.upload_folder(folder_path=folder, repo_id=repo_id, commit_message="screl HFExport")
    except Exception as err:  # noqa: BLE001 - offline, no token, no permission: one message for all
        raise HubPushError(
            f"HFExport: pushing to the Hugging Face hub repo {repo_id!r} failed ({type(err).__name__}: {err}). The "
            f"local export is complete at {folder}: upload it once the hub is reachable (and HF_TOKEN set) with "
            f"`hf upload {repo_id} {folder}`") from err
    log.warning("screl: pushed %s to the hub repo %s", folder, repo_id)
