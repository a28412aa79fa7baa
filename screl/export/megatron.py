"""A ``MegatronStrategy`` bundle's policy (and a PPO run's critic) merged back to Hugging Face names, in one process.

Its Lightning checkpoint is a ``dist_checkpointing`` directory whose shards are keyed by their place in the full
tensor, so it loads at any layout: here the policy is built at tensor- and pipeline-parallel size 1 under a
one-process gloo group, the shards are read into it whatever tensor/pipeline size wrote them, and
``screl.strategies.weights.export_weights`` (the refit's mapping) gives the Hugging Face state dict.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import Tensor

from screl.export.record import ExportError, spec_from_dict

__all__ = ["megatron_policy_weights"]

POLICY_PATH = "model"
"""Where ``MegatronStrategy`` checkpoints the policy (the LightningModule's ``model``)."""
CRITIC_PATH = "critic"
"""Where it checkpoints a PPO run's critic (the LightningModule's ``critic``)."""


@contextlib.contextmanager
def _one_process_group() -> Iterator[None]:
    """A gloo group of this one process (the existing one when it is a group of one)."""
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise ExportError("screl export merges a MegatronStrategy checkpoint in one process: run it outside a "
                              f"distributed job (this process is one of {dist.get_world_size()} ranks)")
        yield
        return
    with tempfile.TemporaryDirectory(prefix="screl-export-pg-") as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()


def _provider(record: Mapping[str, Any], key: str = "policy") -> Any:
    """The ``GPTModelProvider`` of the record's policy (or critic: ``key="value"``) spec, as ``MegatronStrategy``
    derived it (fp32 master weights)."""
    from screl.strategies import GPTModelProvider

    spec = spec_from_dict(record.get(key), f"the run's {key} spec (model.init_args.{key})")
    config = spec.build_config()
    if config is None:
        config = spec.build_model().config
    try:
        return GPTModelProvider.from_hf_config(config, params_dtype="float32")
    except ValueError as err:
        raise ExportError(f"the {key} spec does not map onto Megatron ({err})") from err


def megatron_policy_weights(ckpt_dir: str,
                            record: Mapping[str, Any]) -> tuple[dict[str, Tensor], dict[str, Tensor] | None]:
    """The policy's full weights in Hugging Face names out of the ``dist_checkpointing`` directory ``ckpt_dir``, and a
    PPO run's critic (``screl.strategies.MegatronValueModel`` under ``critic.``) in ``screl.models.ValueModel``'s
    names (None without one)."""
    from screl.strategies.parallel import ParallelismConfig, destroy_model_parallel, initialize_model_parallel
    from screl.strategies.weights import export_weights

    provider = _provider(record)
    with _one_process_group():
        initialize_model_parallel(ParallelismConfig(), seed=0, cpu=not torch.cuda.is_available())
        try:
            module = provider(pre_process=True, post_process=True)
            _load(module, POLICY_PATH, ckpt_dir, "the policy")
            weights = {k: v.detach().cpu() for k, v in export_weights(module, naming="hf").items()}
            critic = _critic_weights(ckpt_dir, record) if record.get("value") is not None else None
        finally:
            destroy_model_parallel()
    return weights, critic


def _load(module: Any, path: str, ckpt_dir: str, what: str) -> None:
    """``module``'s shards at ``path.`` in the checkpoint, read at this (one-process) layout."""
    from megatron.core import dist_checkpointing

    prefix = f"{path}."
    loaded = dist_checkpointing.load({"state_dict": module.sharded_state_dict(prefix=prefix)}, ckpt_dir)
    state = {k[len(prefix):]: v for k, v in loaded["state_dict"].items() if k.startswith(prefix)}
    missing, unexpected = module.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ExportError(f"{ckpt_dir}: {what}'s shards do not fit the spec's architecture (missing {missing[:4]}, "
                          f"unexpected {unexpected[:4]})")


def _critic_weights(ckpt_dir: str, record: Mapping[str, Any]) -> dict[str, Tensor]:
    """PPO's critic: its ``GPTModel`` trunk (the value spec's architecture) and its replicated head, merged."""
    from screl.strategies import MegatronValueModel

    trunk = _provider(record, "value")(pre_process=True, post_process=True)
    critic = MegatronValueModel(trunk, torch.nn.Linear(trunk.config.hidden_size, 1))
    _load(critic, CRITIC_PATH, ckpt_dir, "the critic")
    return critic.export_hf_state()
