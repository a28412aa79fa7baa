"""LoRA in the LightningModules (``model.init_args.lora``): the checkpoint holds the adapters, not the base.

A LoRA run's Lightning checkpoint keeps, under ``state_dict``, the adapters only (``model.*lora_A*``, ...: the
frozen base is the policy spec's, rebuilt by every run), their optimizer state (the optimizer holds nothing else)
and a record (:data:`screl.models.lora.RECORD`): the settings, the base spec and the SHA-256 of the base weights. A
resume checks the record against its own base (another base is refused, naming both) and puts its own base weights
back beside the adapters before Lightning's strict load. How the adapters train and what a refit sends:
:mod:`screl.models.lora`.
"""

from __future__ import annotations

from typing import Any

from screl.models.lora import (
    BROADCAST_REFUSAL,
    COLOCATED_REFUSAL,
    KEY,
    MEGATRON_REFUSAL,
    RECORD,
    LoRASettings,
    base_fingerprint,
    base_state_items,
    check_base,
    is_adapter_key,
    lora_record,
    settings_of,
)

__all__ = ["BROADCAST_REFUSAL", "COLOCATED_REFUSAL", "MEGATRON_REFUSAL", "LoRAHooks"]


_POLICY = "model."
"""The policy's prefix in the module's state dict."""


class LoRAHooks:
    """The hooks of a module whose policy may carry LoRA adapters (``self.lora``: None without): the checkpoint's
    content, and the generation topologies that would bypass the merged refit refused at the fit's start."""

    lora: LoRASettings | None
    model: Any
    policy_spec: Any
    _base_sha256: str | None = None

    def base_sha256(self) -> str:
        """The SHA-256 of the frozen base weights (computed once: they never change)."""
        if self._base_sha256 is None:
            self._base_sha256 = base_fingerprint(base_state_items(self.model))
        return self._base_sha256

    trainer: Any

    def on_fit_start(self) -> None:
        """Refuse the topologies where an engine would decode the trainer's adapted module rather than the merged
        weights: colocated generation (the engine shares the module: its static-cache path reads the base layers'
        weights, not the adapters) and vLLM's NCCL transfer (it sends the module's own, peft-named, parameters)."""
        dm = getattr(self.trainer, "datamodule", None) if self.lora is not None else None
        if dm is None:
            return
        if getattr(dm, "colocated", False) is True:
            raise ValueError(COLOCATED_REFUSAL)
        backend_args = getattr(getattr(dm, "generation", None), "backend_args", None) or {}
        if backend_args.get("weight_transfer") == "nccl":
            raise ValueError(BROADCAST_REFUSAL)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Keep the adapters (and anything beside the policy: a PPO critic), drop the frozen base; add the record."""
        if self.lora is None:
            return
        state = checkpoint["state_dict"]
        for key in [k for k in state if k.startswith(_POLICY) and not is_adapter_key(k)]:
            del state[key]
        checkpoint[RECORD] = lora_record(self.lora, repr(self.policy_spec), self.base_sha256())

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        """Check the checkpoint was written by a run of the same kind on the same base, then put this run's base
        weights beside the adapters (Lightning's load is strict)."""
        record = checkpoint.get(RECORD)
        if self.lora is None:
            if record is not None:
                raise ValueError(f"the checkpoint holds LoRA adapters ({KEY}: {record['settings']}) and no full "
                                 f"policy; this run trains the full policy. Set {KEY} as the checkpoint's run did")
            return
        if record is None:
            raise ValueError(f"{KEY} is set but the checkpoint holds a full fine-tune's policy (no LoRA adapters); "
                             f"resume it without {KEY}, or start a fresh run in a new checkpointing.checkpoint_dir")
        check_base(record, repr(self.policy_spec), self.base_sha256())
        stored = settings_of(record)
        if stored != self.lora:
            raise ValueError(f"{KEY}: the checkpoint's adapters were trained with {stored.to_json()}, this run sets "
                             f"{self.lora.to_json()}; resume with the same settings")
        state = checkpoint["state_dict"]
        for key, value in self.model.state_dict().items():
            if not is_adapter_key(key):
                state[_POLICY + key] = value
