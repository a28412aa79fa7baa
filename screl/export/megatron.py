"""A ``MegatronStrategy`` bundle's policy merged back to Hugging Face names, in this one process.

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


def _provider(record: Mapping[str, Any]) -> Any:
    """The policy's ``GPTModelProvider``, as ``MegatronStrategy`` derived it from the spec (fp32 master weights)."""
    from screl.strategies import GPTModelProvider

    spec = spec_from_dict(record.get("policy"), "the run's policy spec (model.init_args.policy)")
    config = spec.build_config()
    if config is None:
        config = spec.build_model().config
    try:
        return GPTModelProvider.from_hf_config(config, params_dtype="float32")
    except ValueError as err:
        raise ExportError(f"the policy spec does not map onto Megatron ({err})") from err


def megatron_policy_weights(ckpt_dir: str, record: Mapping[str, Any]) -> tuple[dict[str, Tensor], bool]:
    """The policy's full weights in Hugging Face names out of the ``dist_checkpointing`` directory ``ckpt_dir``,
    and whether it holds a critic too (PPO)."""
    from megatron.core import dist_checkpointing

    from screl.strategies.parallel import ParallelismConfig, destroy_model_parallel, initialize_model_parallel
    from screl.strategies.weights import export_weights

    provider = _provider(record)
    with _one_process_group():
        initialize_model_parallel(ParallelismConfig(), seed=0, cpu=not torch.cuda.is_available())
        try:
            module = provider(pre_process=True, post_process=True)
            prefix = f"{POLICY_PATH}."
            loaded = dist_checkpointing.load({"state_dict": module.sharded_state_dict(prefix=prefix)}, ckpt_dir)
            state = {k[len(prefix):]: v for k, v in loaded["state_dict"].items() if k.startswith(prefix)}
            missing, unexpected = module.load_state_dict(state, strict=False)
            missing = [k for k in missing if not k.endswith("_extra_state")]
            if missing or unexpected:
                raise ExportError(f"{ckpt_dir}: the policy's shards do not fit the spec's architecture (missing "
                                  f"{missing[:4]}, unexpected {unexpected[:4]})")
            weights = export_weights(module, naming="hf")
        finally:
            destroy_model_parallel()
    return {k: v.detach().cpu() for k, v in weights.items()}, record.get("value") is not None
