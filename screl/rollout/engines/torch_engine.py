"""A generation engine on a Hugging Face causal LM in plain torch (CPU or GPU).

Batched sampling with a KV cache: prompts are left-padded (attention mask + position ids), then one
token per step is decoded for the whole batch. Sampling is our own loop (not ``model.generate``) so
that logprobs, per-token weight versions, stop handling and ``min_new_tokens`` are exact.

Decoding runs, where the model supports them (Qwen2, Qwen3 and Llama layouts), on the continuous path
(:mod:`screl.rollout.engines.continuous`: an engine-wide KV cache, rows joining and leaving between steps, CUDA
graphs) with ``decode`` (``generation.backend_args.decode``) ``continuous``, or ``auto`` on a CUDA device; on the
static-cache path (:mod:`screl.rollout.engines.static_decode`) with ``static``, or ``auto`` on a CPU; else on the
Hugging Face forward with its dynamic cache (``hf``, or ``auto`` on other models). All give the same logits to fp32
round-off; the engine logs which one it runs.

Determinism: each request draws its uniforms from its own ``torch.Generator`` seeded by
``SamplingParams.seed`` and samples by inverse CDF, so a request's tokens depend on its seed, prompt
and weights, not on its batch mates. Give siblings of a group different seeds.

This module is the engine's model side; the request loop (batching, pause/abort gates, refits between steps) is the
:class:`~screl.rollout.engines.request_loop.RequestLoop` it holds (the Megatron engine holds one too); the rows,
batch tensors and sampling are :mod:`.torch_sampling`'s, the model, its decode path and a refit's tensors
:mod:`.torch_model`'s, the Hugging Face forward passes :mod:`.torch_forward`'s.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from screl.models.spec import PolicySpec
from screl.models.vision import is_vision_model
from screl.rollout.engines.buckets import WeightBuckets
from screl.rollout.engines.continuous import CONTINUOUS_DEFAULTS, ContinuousDecoder
from screl.rollout.engines.decode_graphs import GRAPH_SETTINGS
from screl.rollout.engines.loop_engine import LoopEngine
from screl.rollout.engines.protocol import (
    BackendArgs,
    EngineCapabilities,
    EngineOptions,
    GenerationRequest,
    GenerationResult,
)
from screl.rollout.engines.request_loop import RequestLoop, apply_threads, pad_token
from screl.rollout.engines.routing import RoutingRecorder
from screl.rollout.engines.sdpa_attention import ATTENTION_PATH
from screl.rollout.engines.static_decode import STATIC_ATTENTION_PATH, StaticDecoder, static_decode_support
from screl.rollout.engines.stop_tokens import StopTokens, stop_tokens
from screl.rollout.engines.torch_forward import HFForward
from screl.rollout.engines.torch_model import (
    DECODE_KEY,
    DECODE_PATHS,
    ModelTensors,
    banned_tokens,
    choose_decode_path,
    load_model,
)
from screl.rollout.engines.torch_sampling import Batch, Row, refuse_images, sample_step

log = logging.getLogger(__name__)


class TorchGenerationEngine(LoopEngine):
    """The torch implementation of :class:`~screl.rollout.engines.protocol.GenerationEngine`.

    Args:
        policy: Spec to build the model and tokenizer from (weights then come via ``update_weights``).
        device: Torch device for the model (``"cpu"``, ``"cuda"``, ``"cuda:1"``).
        num_threads: Torch intra-op threads for this process (``None`` leaves the setting alone).
        max_batch_size: Requests decoded together; a larger ``generate`` call runs in chunks.
        recompute_kv_cache_after_weight_updates: When weights change mid-generation, re-prefill the
            in-flight sequences under the new weights (else the old KV cache is kept, PipelineRL style).
        seed: Seeds the seeds of requests without ``SamplingParams.seed`` (``None``: nondeterministic).
        version: Initial weight version label.
        decode: ``auto`` (on a CUDA device the continuous path, on a CPU the static-cache path, where the model
            supports them, else Hugging Face's forward), ``static`` (that path, an error on a model it cannot
            run), ``continuous`` (:mod:`.continuous`) or ``hf``.
        model: Decode with this module instead of building one (colocated generation: the trainer's own
            module, :mod:`screl.rollout.colocated`). It is used as it is: not moved, not frozen; each forward pass
            runs it in eval mode and restores its mode after.
        autocast: With ``model``: the dtype its forward passes compute in (a trainer's fp32 master weights decode
            in the engine's bf16, as the trainer computes under ``bf16-mixed``). None: the module's own dtype.
    """

    capabilities = EngineCapabilities(
        whole_call_batches=True, streams_weight_buckets=True, streams_tokens=True, colocated=True,
        vision_inputs=True, routing_records=True,
        backend_args=BackendArgs(defaults={"decode": "auto", **CONTINUOUS_DEFAULTS},
                                 choices={"decode": DECODE_PATHS, "cuda_graphs": GRAPH_SETTINGS}, open=False),
        config_rules=("screl.rules.rollout_rules:torch_backend_rules",),
        kv_cache_gib="screl.rollout.engines.continuous:held_kv_cache_gib",
    )

    @classmethod
    def from_options(cls, policy: PolicySpec, options: EngineOptions) -> TorchGenerationEngine:
        """The engine a worker builds (``generation.backend: torch``); its one ``backend_args`` key is ``decode``."""
        args = TorchGenerationEngine.capabilities.backend_args.resolve(options.args, "torch")  # a subclass may declare less
        return cls(
            policy,
            device=options.device,
            num_threads=options.num_threads,
            max_batch_size=options.max_batch_size,
            recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
            seed=options.seed,
            decode=args["decode"],
            record_routing=options.record_routing,
            continuous=args,
        )

    @classmethod
    def on_trainer_module(cls, policy: PolicySpec, options: EngineOptions, *, model: Any,
                          autocast: torch.dtype | None, link: Any = None) -> TorchGenerationEngine:
        """The colocated engine: it decodes with ``model`` (the trainer's module) in the trainer's threads."""
        args = TorchGenerationEngine.capabilities.backend_args.resolve(options.args, "torch")  # a subclass may declare less
        return cls(policy, num_threads=None, max_batch_size=options.max_batch_size, seed=options.seed,
                   recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
                   model=model, autocast=autocast, decode=str(args["decode"]), continuous=args)

    def __init__(
        self,
        policy: PolicySpec,
        device: str = "cpu",
        num_threads: int | None = 1,
        max_batch_size: int | None = None,
        recompute_kv_cache_after_weight_updates: bool = False,
        seed: int | None = None,
        version: int = 0,
        decode: str = "auto",
        model: torch.nn.Module | None = None,
        autocast: torch.dtype | None = None,
        record_routing: bool = False,
        continuous: Mapping[str, Any] | None = None,
    ) -> None:
        apply_threads(num_threads, max_batch_size, type(self).__name__)
        self.policy, self.max_batch_size = policy, max_batch_size
        self.recompute_kv_cache = recompute_kv_cache_after_weight_updates
        self.tokenizer = policy.build_tokenizer()
        self.shared = model is not None
        self.autocast = autocast if model is not None else None
        self.model: Any
        self.model, self.device = load_model(policy, device, model)
        self.decode_path = self._decode_path(decode)
        self.routing = RoutingRecorder(self.model) if record_routing else None
        self.vision = is_vision_model(self.model)
        if self.vision and self.decode_path != "hf":
            raise ValueError(f"a vision-language policy decodes through Hugging Face's forward: set {DECODE_KEY}=hf")
        if self.routing is not None and self.decode_path != "hf":
            raise ValueError(f"routing replay records the experts through Hugging Face's forward: set {DECODE_KEY}=hf")
        self._hf = HFForward(self.model, self.device, self.routing, self.vision)
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.stop_tokens: StopTokens = stop_tokens(self.tokenizer, getattr(self.model, "generation_config", None),
                                                   self.model.config)
        self.eos_token_ids = self.stop_tokens.ids  # the one stop rule (screl.rollout.engines.stop_tokens)
        self.pad_token_id = pad_token(self.tokenizer, self.stop_tokens)
        self.loop = RequestLoop(self, device=self.device, vocab_size=self.vocab_size, stops=self.stop_tokens,
                                pad_token_id=self.pad_token_id, seed=seed, version=version,
                                max_batch_size=max_batch_size, recompute_kv_cache=self.recompute_kv_cache,
                                routing=self.routing)
        if self.vision:
            self._banned = banned_tokens(self.model, self.vocab_size, self.device)
        if self.decode_path == "continuous":
            self._start_continuous({**CONTINUOUS_DEFAULTS, **(continuous or {})})

    def _decode_path(self, decode: str) -> str:
        """``continuous`` (asked for, or ``auto`` on a CUDA device for a model the path runs), else
        :func:`choose_decode_path`'s (``auto`` on a CPU: ``static``, which prefills a batch in one forward pass
        and is faster there at small shapes: bench/results/engine_gpu_cpu.json)."""
        why = static_decode_support(self.model)
        if decode == "auto" and self.device.type == "cuda" and why is None and not is_vision_model(self.model):
            log.info("screl: the torch engine decodes on its continuous path (%s=auto on %s)", DECODE_KEY,
                     self.device)
            return "continuous"
        if decode != "continuous":
            return choose_decode_path(self.model, decode)
        if why is not None:
            raise ValueError(f"{DECODE_KEY}=continuous: {why}; set it to auto or hf")
        return "continuous"

    def _start_continuous(self, args: dict[str, Any]) -> None:
        """Size the continuous path's KV cache once (in the compute dtype, never fp32 masters) and log it."""
        dtype = self.autocast if self.autocast is not None else self.model.get_input_embeddings().weight.dtype
        self.continuous = ContinuousDecoder(self.model, device=self.device, dtype=dtype, vocab_size=self.vocab_size,
                                            args=args)
        self.loop.continuous = self.continuous.run
        # concurrent calls join one run, so the worker submits each group as it comes (submit)
        self.capabilities = dataclasses.replace(type(self).capabilities, continuous_batching=True)
        log.info("screl: the torch engine decodes %s on its continuous path (%s=continuous): %s",
                 type(self.model).__name__, DECODE_KEY, self.continuous.describe())

    continuous: ContinuousDecoder | None = None
    """The continuous decode path (``decode: continuous``): its KV cache is the engine's, sized once."""

    vision = False
    """A vision-language model (set from the model): requests may carry images (``GenerationRequest.vision``)."""
    _banned: torch.Tensor | None = None
    """Tokens never sampled: a vision-language model's image placeholders (``[vocabulary]`` bool)."""

    @property
    def attention_path(self) -> str:
        """What computes its attention, in the start-up line's words (the decode path's)."""
        if self.decode_path == "continuous":
            return ATTENTION_PATH
        if self.decode_path == "static":
            return STATIC_ATTENTION_PATH
        return f"Hugging Face's attention ({getattr(self.model.config, '_attn_implementation', None)})"

    # ----------------------------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        """The weight version now loaded."""
        return self.loop.version

    def set_version(self, version: int) -> None:
        """Set the weight version label (between decode steps)."""
        self.loop.set_version(version)

    def update_weights(self, weights: WeightBuckets, version: int) -> None:
        """Copy the weights into the model in place between decode steps and set the version.

        ``weights``: one state dict, or an iterable of buckets (state-dict pieces, as a refit sends them),
        consumed lazily: each bucket is checked (names in the model, shapes) and copied before the next is
        drawn, and none is kept, so a refit holds one bucket at a time, never a merged copy. Keys must match
        the model's; tied parameters may be given under any one of their names. After the last bucket, every
        persistent tensor must have been given (over all buckets), else ``KeyError``.

        Decoding waits for the whole refit (no forward pass sees a mix of two versions). A refit that fails
        keeps the old version label; if it failed after a bucket was copied, the weights are a mix and the
        engine refuses to generate until a complete refit succeeds.
        """
        tensors = ModelTensors(self.model)
        self.loop.refit(weights, version, tensors.load, tensors.missing)

    def submit(self, requests: Sequence[GenerationRequest]) -> concurrent.futures.Future[list[GenerationResult]]:
        """The continuous path: start ``requests`` now (they join the rows decoding, :mod:`.continuous`); the
        future resolves once all have finished or been aborted (``generate`` on a thread of its own)."""
        if self.continuous is None:
            raise RuntimeError(f"submit: the torch engine batches calls whole unless {DECODE_KEY}=continuous; "
                               "call generate")
        future: concurrent.futures.Future[list[GenerationResult]] = concurrent.futures.Future()
        batch = list(requests)

        def call() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self.generate(batch))
            except BaseException as err:  # the caller gets it from the future
                future.set_exception(err)

        threading.Thread(target=call, name="screl-generate-call", daemon=True).start()
        return future

    def stand_down(self, timeout: float | None = None, drain: bool = False) -> None:
        """:meth:`LoopEngine.stand_down`, and the continuous path's KV cache handed back while the trainer trains."""
        super().stand_down(timeout, drain)
        if self.continuous is not None:
            self.continuous.release()

    def wake(self) -> None:
        """:meth:`LoopEngine.wake`, the continuous path's KV cache re-made first."""
        if self.continuous is not None:
            self.continuous.make()
        super().wake()

    # ----------------------------------------------------------- the request loop's decode steps

    def _check_request(self, req: GenerationRequest) -> None:
        refuse_images(req, self.vision, self.model)
        if self.continuous is not None:
            self.continuous.check(req)

    @contextlib.contextmanager
    def _forward_context(self) -> Iterator[None]:
        """One forward pass (the loop holds the model lock): no autograd, and (``autocast``) the engine's dtype.

        A shared module (colocated) on Hugging Face's forward runs in eval mode (its mode restored after) and under
        ``no_grad`` rather than ``inference_mode``: a buffer that forward updates (a dynamic RoPE table) must stay
        usable by the trainer's autograd. The static-cache path calls the layers' functions on the parameters
        themselves (no module mode, no buffer written), so it keeps ``inference_mode`` either way."""
        hf_shared = self.shared and self.decode_path == "hf"
        amp = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
               else contextlib.nullcontext())
        with (torch.no_grad() if hf_shared else torch.inference_mode()), amp:
            training = hf_shared and self.model.training
            if training:
                self.model.eval()
            try:
                yield
            finally:
                if training:
                    self.model.train()

    def _start(self, rows: list[Row], batch: Batch, ids: torch.Tensor, attn: torch.Tensor,
               capacity: int) -> torch.Tensor:
        if self.decode_path != "hf":
            batch.static = StaticDecoder(self.model)
            return batch.static.start(ids, attn, capacity)
        lengths = [len(r.req.prompt_token_ids) + len(r.tokens) for r in rows]
        return self._hf.prefill(rows, batch, ids, attn, lengths)

    def _step(self, rows: list[Row], batch: Batch, last: list[int]) -> torch.Tensor:
        if batch.static is not None:
            return batch.static.step(torch.tensor(last, dtype=torch.long, device=self.device))
        return self._hf.step(rows, batch, last)

    def _sample_step(self, rows: list[Row], batch: Batch, logits: torch.Tensor, version: int) -> None:
        """Sample one token for every unfinished row and record logprob, version and finish."""
        sample_step(rows, batch, logits, version, self.vocab_size, self._banned)

    def _release(self, batch: Batch) -> None:
        """A batch is done (finished, aborted or failed): drop its KV cache."""
        batch.cache = batch.static = batch.attn = batch.next_pos = None
