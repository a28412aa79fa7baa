"""A ``MegatronStrategy`` checkpoint written by 2 spawned gloo ranks (file:// rendezvous, loopback only): at TP=2 a PPO
run's, the tiny policy and a critic on the tiny trunk; at PP=2 the policy's two stages; perturbed weights, saved as the strategy saves them
(``dist_checkpointing``, the policy under ``model.``, the ``MegatronValueModel`` under ``critic.``, HFExport's record
in the common part)."""

from __future__ import annotations

import os
import tempfile
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def perturbed_policy() -> Any:
    from screl.models import TinyCausalLM

    model = TinyCausalLM().build_model()
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return model


def perturbed_critic() -> Any:
    """PPO's critic (``screl.models.ValueModel``) on the tiny trunk, every weight perturbed (the head too: it starts
    at zero)."""
    from screl.models import TinyCausalLM, ValueModel

    critic = ValueModel(TinyCausalLM())
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in critic.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return critic


LAYOUTS = {"tp2": {"tensor_model_parallel_size": 2}, "pp2": {"pipeline_model_parallel_size": 2}}
"""The two ranks' layouts: tensor parallel (policy and critic), or two pipeline stages (the policy: screl's PPO
refuses pipeline parallelism, whose first stage could not hold the critic's head)."""


def save_job(rank: int, ckpt_dir: str, layout: str = "tp2") -> None:
    from megatron.core import parallel_state
    from screl.strategies import GPTModelProvider, MegatronValueModel, load_hf_weights
    from screl.strategies import checkpoint as ckpt
    from screl.strategies.parallel import ParallelismConfig, destroy_model_parallel, initialize_model_parallel

    from screl.export.record import spec_to_dict
    from screl.models import TinyCausalLM

    hf, hf_critic = perturbed_policy(), perturbed_critic()
    initialize_model_parallel(ParallelismConfig(**LAYOUTS[layout]), seed=0, cpu=True)
    provider = GPTModelProvider.from_hf_config(hf.config, params_dtype="float32")
    module = provider(pre_process=parallel_state.is_pipeline_first_stage(),
                      post_process=parallel_state.is_pipeline_last_stage())
    load_hf_weights(module, hf.state_dict())
    state = module.sharded_state_dict(prefix="model.")
    value = None
    if layout == "tp2":  # PPO's critic beside the policy
        critic = MegatronValueModel.from_hf(provider(pre_process=True, post_process=True),
                                            hf_critic.trunk.state_dict(), hf_critic.head)
        state = {**state, **critic.sharded_state_dict(prefix="critic.")}
        value = spec_to_dict(TinyCausalLM())
    record = {"format": 1, "policy": spec_to_dict(TinyCausalLM()), "value": value, "generation": {"temperature": 1.0}}
    ckpt.save_checkpoint({"state_dict": state, "callbacks": {"HFExport": record}, "global_step": 3}, ckpt_dir)
    destroy_model_parallel()


def _entry(rank: int, world: int, init_file: str, ckpt_dir: str, layout: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        save_job(rank, ckpt_dir, layout)
    finally:
        dist.destroy_process_group()


def write_checkpoint(ckpt_dir: str, layout: str) -> None:
    """The checkpoint of ``layout`` (``LAYOUTS``), written by 2 spawned ranks."""
    os.makedirs(os.path.dirname(ckpt_dir), exist_ok=True)
    init_file = tempfile.mktemp(dir=os.path.dirname(ckpt_dir), prefix="pg_")
    mp.spawn(_entry, args=(2, init_file, ckpt_dir, layout), nprocs=2, join=True)
