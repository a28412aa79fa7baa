"""The Megatron generation engine (``generation.backend: megatron``): megatron-core's ``GPTModel`` decodes
(docs/generation.md, "The Megatron backend").

The engine is the torch engine's request loop (batching, per-request seeds, logprobs, per-token weight versions,
stop rule, abort, pause, in-flight refits, stand-downs) over the policy's ``GPTModel``, built by the same
:class:`~screl.strategies.GPTModelProvider` mapping the trainer uses and decoding with megatron-core's static KV
cache (:class:`~screl.rollout.engines.megatron_decode.MegatronDecoder`). Two topologies:

- **In a generation worker** (``colocated.enabled: false``): its own ``GPTModel`` at tensor parallel size 1 (a
  one-process gloo group); a refit loads Megatron's own parameter names in the TP=1 layout, which the trainer
  gathers from any TP/PP layout (``iter_export_buckets(naming="megatron")``): no Hugging Face renaming, no q/k/v
  split.
- **Colocated** (``colocated.enabled: true``): the trainer's own ``GPTModel`` in the trainer's process; under
  tensor parallelism the other ranks follow each forward through a
  :class:`~screl.rollout.engines.megatron_decode.DecodeLink`. A refit is a version bump.
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Iterator
from typing import Any

import torch

from screl.models.spec import PolicySpec, resolve_dtype
from screl.rollout.engines.buckets import WeightBuckets
from screl.rollout.engines.megatron_decode import (
    DecodeLink,
    MegatronDecoder,
    eval_no_grad,
    unpadded_vocab_size,
)
from screl.rollout.engines.protocol import EngineCapabilities, EngineOptions
from screl.rollout.engines.stop_tokens import StopTokens, load_generation_config, stop_tokens
from screl.rollout.engines.torch_engine import TorchGenerationEngine

log = logging.getLogger(__name__)

ARGS_KEY = "data.init_args.generation.backend_args"


def inner_gpt_model(model: Any) -> Any:
    """The ``GPTModel`` inside the wrappers a strategy puts around it (Megatron's DDP, Float16Module)."""
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def policy_configs(policy: PolicySpec) -> tuple[Any, Any, str]:
    """The policy's Hugging Face config, generation config (or None) and parameter dtype, without loading weights
    where the spec can tell its architecture (``build_config``); else from the built model."""
    config = policy.build_config()
    dtype = str(getattr(policy, "dtype", "float32"))
    if config is not None:
        path = getattr(policy, "path", None)
        return config, load_generation_config(path) if isinstance(path, str) else None, dtype
    model = policy.build_model()
    return model.config, getattr(model, "generation_config", None), str(next(model.parameters()).dtype).removeprefix(
        "torch.")


def build_engine_model(policy: PolicySpec, device: str, seed: int | None) -> tuple[Any, Any, Any]:
    """A tensor-parallel-size-1 ``GPTModel`` of the policy in this process (a one-process gloo group and
    megatron-core's ``parallel_state``), on ``device``; with the policy's configs."""
    import torch.distributed as dist

    from screl.strategies import GPTModelProvider
    from screl.strategies.parallel import ParallelismConfig, initialize_model_parallel

    config, generation_config, dtype = policy_configs(policy)
    resolve_dtype(dtype)
    if not dist.is_initialized():
        store = os.path.join(tempfile.mkdtemp(prefix="screl-megatron-engine-"), "rendezvous")
        dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)
    elif dist.get_world_size() != 1:
        raise RuntimeError("the Megatron generation engine builds its own one-process group; this process already "
                           f"belongs to a group of {dist.get_world_size()}")
    initialize_model_parallel(ParallelismConfig(), seed=seed or 0, cpu=torch.device(device).type == "cpu")
    provider = GPTModelProvider.from_hf_config(config, params_dtype=dtype)
    model = provider().to(device)
    model.eval()
    model.requires_grad_(False)
    return model, config, generation_config


class MegatronGenerationEngine(TorchGenerationEngine):
    """:class:`~screl.rollout.engines.protocol.GenerationEngine` on a Megatron ``GPTModel`` (see the module docstring).

    Args:
        policy: The policy spec (its tokenizer, and its architecture through ``GPTModelProvider.from_hf_config``).
        device: ``cpu`` or ``cuda`` (a worker's own model).
        model: Decode with this ``GPTModel`` (colocated: the trainer's own) instead of building one.
        link: Colocated under tensor parallelism: the followers' link (this engine is the leader).
        autocast: With ``model``: the dtype its forward passes compute in (fp32 masters under ``bf16-mixed``).
        Others: as :class:`~screl.rollout.engines.torch_engine.TorchGenerationEngine`'s.
    """

    capabilities = EngineCapabilities(
        streams_weight_buckets=True, weight_naming="megatron", colocated=True, colocated_tensor_parallel=True,
        config_rules=("screl.rules.megatron_generation_rules:megatron_backend_rules",),
        why_not=(("vision_inputs", "the megatron engine takes token ids only"),),
    )

    @classmethod
    def _colocated_args(cls, options: EngineOptions, link: Any) -> dict[str, Any]:
        """Colocated on the trainer's ``GPTModel`` shard: the other tensor-parallel ranks follow it through
        ``link``."""
        return {"link": link}

    @classmethod
    def from_options(cls, policy: PolicySpec, options: EngineOptions) -> MegatronGenerationEngine:
        """The engine a worker builds (``generation.backend: megatron``); it takes no ``backend_args``."""
        if options.args:
            raise ValueError(f"{ARGS_KEY}={dict(options.args)!r}: the megatron backend takes none (its model is "
                             "the policy's GPTModel at tensor parallel size 1)")
        if options.record_routing:
            raise ValueError("model.init_args.routing_replay: the megatron engine does not record MoE routing (it "
                             "decodes dense GPTModels); use backend: torch")
        return cls(policy, device=options.device, num_threads=options.num_threads,
                   max_batch_size=options.max_batch_size,
                   recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
                   seed=options.seed)

    def __init__(
        self,
        policy: PolicySpec,
        device: str = "cpu",
        num_threads: int | None = 1,
        max_batch_size: int | None = None,
        recompute_kv_cache_after_weight_updates: bool = False,
        seed: int | None = None,
        version: int = 0,
        model: Any = None,
        link: DecodeLink | None = None,
        autocast: torch.dtype | None = None,
    ) -> None:
        self._init_settings(policy, num_threads, max_batch_size, recompute_kv_cache_after_weight_updates, model,
                            autocast)
        self.link = link
        if model is not None:
            self.model = inner_gpt_model(model)
            config, generation_config, _ = policy_configs(policy)
        else:
            self.model, config, generation_config = build_engine_model(policy, device, seed)
        self.device = next(self.model.parameters()).device
        self.decode_path = "megatron"
        self.routing = None  # no MoE: GPTModelProvider maps dense models only
        log.info("screl: the megatron engine decodes a GPTModel with megatron-core's static KV cache (%s)",
                 "the trainer's module" if self.shared else "its own, tensor parallel size 1")
        stops: StopTokens = stop_tokens(self.tokenizer, generation_config, config)
        self._init_state(unpadded_vocab_size(self.model), stops, seed, version)

    def end_followers(self) -> None:
        """Colocated under tensor parallelism: send the other ranks back to training (between forward passes)."""
        if self.link is not None:
            with self._model_lock:
                self.link.end()

    # -- the torch engine's hooks ----------------------------------------------------------------------
    def _new_decoder(self) -> MegatronDecoder:
        return MegatronDecoder(self.model, self.vocab_size, link=self.link)

    def _release(self, batch: Any) -> None:
        decoder = batch.static
        batch.static = None
        if decoder is not None:
            with self._model_lock:  # the link's calls are one at a time, like the forwards
                decoder.free()

    @contextlib.contextmanager
    def _forwarding(self) -> Iterator[None]:
        with self._model_lock, eval_no_grad(self.model, self.autocast):
            yield

    def update_weights(self, weights: WeightBuckets, version: int) -> None:
        """Load Megatron-named full tensors (``iter_export_buckets(naming="megatron")``), bucket by bucket, in
        place, between decode steps; every parameter must arrive over the refit (else ``KeyError``, and a refit
        that failed after a copy leaves the engine refusing to generate until a complete one)."""
        from screl.strategies.weights import load_megatron_bucket, megatron_parameter_names

        if self.shared:
            raise RuntimeError("a colocated engine decodes with the trainer's module: a refit is a version bump "
                               "(set_version), never a weight copy")
        expected = set(megatron_parameter_names(self.model))
        given: set[str] = set()

        def load(bucket: Any) -> int:
            given.update(load_megatron_bucket(self.model, bucket))
            return len(bucket)

        self._refit(weights, version, load, lambda: sorted(expected - given))
