"""The Megatron generation engine (``generation.backend: megatron``): megatron-core's ``GPTModel`` decodes
(docs/generation.md, "The Megatron backend").

The engine holds the torch engine's request loop (:class:`~screl.rollout.engines.request_loop.RequestLoop`:
batching, per-request seeds, logprobs, per-token weight versions, stop rule, abort, pause, in-flight refits,
stand-downs) and is its decode steps over the policy's ``GPTModel``, built by the same
:class:`~screl.strategies.GPTModelProvider` mapping the trainer uses and decoding with megatron-core's static KV
cache (:class:`~screl.rollout.engines.megatron_decode.MegatronDecoder`). Two topologies:

- **In a generation worker** (``colocated.enabled: false``): its own ``GPTModel`` at tensor parallel size 1 (a
  one-process gloo group); a refit loads Megatron's own parameter names in the TP=1 layout, which the trainer
  gathers from any TP/PP layout (``iter_export_buckets(naming="megatron")``): no Hugging Face renaming, no q/k/v
  split.
- **Colocated** (``colocated.enabled: true``): the trainer's own ``GPTModel`` in the trainer's process; under
  tensor parallelism the other ranks follow each forward through a
  :class:`~screl.rollout.engines.megatron_decode.DecodeLink` (:meth:`MegatronGenerationEngine.link_ranks` builds it
  on every rank). A refit is a version bump.
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
from screl.rollout.engines.loop_engine import LoopEngine
from screl.rollout.engines.megatron_decode import (
    DecodeLink,
    MegatronDecoder,
    TensorParallelRanks,
    decode_module,
    eval_no_grad,
    unpadded_vocab_size,
)
from screl.rollout.engines.protocol import (
    BackendArgs,
    EngineCapabilities,
    EngineOptions,
    GenerationRequest,
)
from screl.rollout.engines.request_loop import RequestLoop, apply_threads, pad_token
from screl.rollout.engines.stop_tokens import StopTokens, load_generation_config, stop_tokens
from screl.rollout.engines.torch_sampling import Batch, Row, refuse_images, sample_step

log = logging.getLogger(__name__)


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


class MegatronGenerationEngine(LoopEngine):
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
        streams_weight_buckets=True, streams_tokens=True, weight_naming="megatron", colocated=True,
        colocated_tensor_parallel=True,
        backend_args=BackendArgs(open=False, note="its model is the policy's GPTModel at tensor parallel size 1"),
        config_rules=("screl.rules.megatron_generation_rules:megatron_backend_rules",),
        why_not=(("vision_inputs", "the megatron engine takes token ids only"),),
    )
    vision = False
    """Requests carry token ids only (``GenerationRequest.vision`` is refused)."""

    @classmethod
    def from_options(cls, policy: PolicySpec, options: EngineOptions) -> MegatronGenerationEngine:
        """The engine a worker builds (``generation.backend: megatron``); it takes no ``backend_args``."""
        cls.capabilities.backend_args.resolve(options.args, "megatron")
        if options.record_routing:
            raise ValueError("model.init_args.routing_replay: the megatron engine does not record MoE routing (it "
                             "decodes dense GPTModels); use backend: torch")
        return cls(policy, device=options.device, num_threads=options.num_threads,
                   max_batch_size=options.max_batch_size,
                   recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
                   seed=options.seed)

    @classmethod
    def on_trainer_module(cls, policy: PolicySpec, options: EngineOptions, *, model: Any,
                          autocast: torch.dtype | None, link: Any = None) -> MegatronGenerationEngine:
        """The colocated engine on the trainer's ``GPTModel`` shard: the other tensor-parallel ranks follow it
        through ``link`` (:meth:`link_ranks`)."""
        return cls(policy, num_threads=None, max_batch_size=options.max_batch_size, seed=options.seed,
                   recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
                   model=model, autocast=autocast, link=link)

    @classmethod
    def link_ranks(cls, module: Any, autocast: torch.dtype | None, world_size: int) -> TensorParallelRanks:
        """Every rank: the link of a colocated engine across the trainer's tensor-parallel ranks (a gloo group of its
        own, so its broadcasts never meet the trainer's collectives); rank 0's engine leads it."""
        import torch.distributed as dist

        link = DecodeLink(dist.new_group(list(range(world_size)), backend="gloo"), src=0)
        return TensorParallelRanks(link, inner_gpt_model(module), autocast)  # each follower decodes its own copy

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
        apply_threads(num_threads, max_batch_size, type(self).__name__)
        self.policy, self.max_batch_size = policy, max_batch_size
        self.recompute_kv_cache = recompute_kv_cache_after_weight_updates
        self.tokenizer = policy.build_tokenizer()
        self.shared = model is not None
        self.autocast = autocast if model is not None else None
        self.link = link
        if model is not None:
            self.model = decode_module(inner_gpt_model(model), self.autocast)
            config, generation_config, _ = policy_configs(policy)
        else:
            self.model, config, generation_config = build_engine_model(policy, device, seed)
        self.device = next(self.model.parameters()).device
        self.decode_path = "megatron"
        self.routing = None  # no MoE: GPTModelProvider maps dense models only
        log.info("screl: the megatron engine decodes a GPTModel with megatron-core's static KV cache (%s)",
                 "the trainer's module" if self.shared else "its own, tensor parallel size 1")
        self.vocab_size = unpadded_vocab_size(self.model)
        self.stop_tokens: StopTokens = stop_tokens(self.tokenizer, generation_config, config)
        self.eos_token_ids = self.stop_tokens.ids
        self.pad_token_id = pad_token(self.tokenizer, self.stop_tokens)
        self.loop = RequestLoop(self, device=self.device, vocab_size=self.vocab_size, stops=self.stop_tokens,
                                pad_token_id=self.pad_token_id, seed=seed, version=version,
                                max_batch_size=max_batch_size, recompute_kv_cache=self.recompute_kv_cache)

    # -- the protocol, on the request loop ---------------------------------------------------------------
    @property
    def version(self) -> int:
        """The weight version now loaded."""
        return self.loop.version

    def set_version(self, version: int) -> None:
        """Set the weight version label (between decode steps)."""
        self.loop.set_version(version)

    def end_followers(self) -> None:
        """Colocated under tensor parallelism: send the other ranks back to training (between forward passes)."""
        if self.link is not None:
            with self.loop.lock:
                self.link.end()

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

        self.loop.refit(weights, version, load, lambda: sorted(expected - given))

    # -- the request loop's decode steps -------------------------------------------------------------------
    def _check_request(self, req: GenerationRequest) -> None:
        refuse_images(req, self.vision, self.model)

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        with eval_no_grad(self.model, self.autocast):
            yield

    def _start(self, rows: list[Row], batch: Batch, ids: torch.Tensor, attn: torch.Tensor,
               capacity: int) -> torch.Tensor:
        batch.static = MegatronDecoder(self.model, self.vocab_size, link=self.link)
        return batch.static.start(ids, attn, capacity)

    def _step(self, rows: list[Row], batch: Batch, last: list[int]) -> torch.Tensor:
        return batch.static.step(torch.tensor(last, dtype=torch.long, device=self.device))

    def _sample_step(self, rows: list[Row], batch: Batch, logits: torch.Tensor, version: int) -> None:
        sample_step(rows, batch, logits, version, self.vocab_size, None)

    def _release(self, batch: Batch) -> None:
        decoder = batch.static
        batch.static = None
        if decoder is not None:
            with self.loop.lock:  # the link's calls are one at a time, like the forwards
                decoder.free()
