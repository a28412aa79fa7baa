"""A generation engine on a Hugging Face causal LM in plain torch (CPU or GPU).

Batched sampling with a KV cache: prompts are left-padded (attention mask + position ids), then one
token per step is decoded for the whole batch. Sampling is our own loop (not ``model.generate``) so
that logprobs, per-token weight versions, stop handling and ``min_new_tokens`` are exact.

Decoding runs on the model's static-cache path (:mod:`screl.rollout.engines.static_decode`) where the model supports it
(Qwen2 and Llama layouts) and ``decode`` (``generation.backend_args.decode``) is ``auto`` or ``static``; else on
the Hugging Face forward with its dynamic cache (``hf``, or ``auto`` on other models). Both give the same logits
to fp32 round-off; the engine logs which one it runs.

Determinism: each request draws its uniforms from its own ``torch.Generator`` seeded by
``SamplingParams.seed`` and samples by inverse CDF, so a request's tokens depend on its seed, prompt
and weights, not on its batch mates. Give siblings of a group different seeds.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from screl.config_generation import TORCH_DECODE_PATHS
from screl.models.spec import PolicySpec
from screl.models.vision import is_vision_model, mrope_positions, vision_token_ids
from screl.models.vision_inputs import VisionInputs
from screl.rollout.engines.buckets import WeightBuckets, as_buckets
from screl.rollout.engines.protocol import (
    EngineCapabilities,
    EngineOptions,
    FinishReason,
    GenerationRequest,
    GenerationResult,
    PauseMode,
    SamplingParams,
)
from screl.rollout.engines.routing import RoutingRecorder
from screl.rollout.engines.static_decode import StaticDecoder, static_decode_support
from screl.rollout.engines.stop_tokens import StopTokens, stop_tokens
from screl.rollout.engines.weight_copy import copy_bucket

log = logging.getLogger(__name__)

DECODE_PATHS = TORCH_DECODE_PATHS
DECODE_KEY = "data.init_args.generation.backend_args.decode"


@dataclass
class _Row:
    """Decode state of one request."""

    req: GenerationRequest
    uniforms: torch.Tensor
    stop_ids: frozenset[int]
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish: FinishReason | None = None
    start_version: int | None = None
    stop_token: int | None = None
    routing: torch.Tensor | None = None  # [positions, MoE layers, top_k]: see screl.rollout.engines.routing

    @property
    def sampling(self) -> SamplingParams:
        return self.req.sampling


@dataclass
class _Batch:
    """Per-batch tensors of the sampling parameters and the KV-cache state."""

    temps: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    min_new: torch.Tensor
    stop_mask: torch.Tensor
    uniforms: torch.Tensor  # [rows, steps]: each row's draws, padded with its last
    cache: Any = None
    static: Any = None  # the static-cache path's decoder (StaticDecoder, or the Megatron engine's)
    attn: torch.Tensor | None = None
    next_pos: torch.Tensor | None = None
    dropped: bool = False  # the KV cache was freed in a stand-down: re-prefill before the next step
    rope_delta: torch.Tensor | None = None  # a vision-language model: each row's multimodal rotary offset [rows, 1]


class TorchGenerationEngine:
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
        decode: ``auto`` (the static-cache path where the model supports it, else Hugging Face's forward),
            ``static`` (that path, an error on a model it cannot run) or ``hf``.
        model: Decode with this module instead of building one (colocated generation: the trainer's own
            module, :mod:`screl.rollout.colocated`). It is used as it is: not moved, not frozen; each forward pass
            runs it in eval mode and restores its mode after.
        autocast: With ``model``: the dtype its forward passes compute in (a trainer's fp32 master weights decode
            in the engine's bf16, as the trainer computes under ``bf16-mixed``). None: the module's own dtype.
    """

    @classmethod
    def from_options(cls, policy: PolicySpec, options: EngineOptions) -> TorchGenerationEngine:
        """The engine a worker builds (``generation.backend: torch``); its one ``backend_args`` key is ``decode``."""
        unknown = sorted(set(options.args) - {"decode"})
        if unknown:
            raise ValueError(
                f"data.init_args.generation.backend_args={dict(options.args)!r}: the torch backend takes only "
                f"'decode' ({'|'.join(DECODE_PATHS)}), not {unknown}"
            )
        return cls(
            policy,
            device=options.device,
            num_threads=options.num_threads,
            max_batch_size=options.max_batch_size,
            recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
            seed=options.seed,
            decode=options.args.get("decode", "auto"),
            record_routing=options.record_routing,
        )

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
    ) -> None:
        self._init_settings(policy, num_threads, max_batch_size, recompute_kv_cache_after_weight_updates, model,
                            autocast)
        self.device = torch.device(device)
        if model is not None:
            self.model: Any = model
            self.device = next(model.parameters()).device
        else:
            self.model = policy.build_model()
            self.model.to(self.device)  # transformers' wrapped .to
            self.model.eval()
            self.model.requires_grad_(False)
        params = inspect.signature(self.model.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.decode_path = self._decode_path(decode)
        self.routing = RoutingRecorder(self.model) if record_routing else None
        self.vision = is_vision_model(self.model)
        if self.vision and self.decode_path != "hf":
            raise ValueError(f"a vision-language policy decodes through Hugging Face's forward: set {DECODE_KEY}=hf")
        if self.routing is not None and self.decode_path != "hf":
            raise ValueError(f"routing replay records the experts through Hugging Face's forward: set {DECODE_KEY}=hf")
        self._init_state(int(self.model.get_output_embeddings().weight.shape[0]),
                         stop_tokens(self.tokenizer, getattr(self.model, "generation_config", None), self.model.config),
                         seed, version)
        if self.vision:
            banned = torch.zeros(self.vocab_size, dtype=torch.bool)
            banned[[t for t in vision_token_ids(self.model.config) if t < self.vocab_size]] = True
            self._banned = banned.to(self.device)

    def _init_settings(self, policy: PolicySpec, num_threads: int | None, max_batch_size: int | None,
                       recompute_kv_cache: bool, model: Any, autocast: torch.dtype | None) -> None:
        """The settings every engine on this request loop takes first: threads, batch size, re-prefill, the policy's
        tokenizer, and whether it decodes with a module it shares (``model``, computing in ``autocast``)."""
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        if max_batch_size is not None and max_batch_size < 1:
            raise ValueError(f"{type(self).__name__}(max_batch_size={max_batch_size}) must be >= 1 or None.")
        self.policy = policy
        self.max_batch_size = max_batch_size
        self.recompute_kv_cache = recompute_kv_cache
        self.tokenizer = policy.build_tokenizer()
        self.shared = model is not None
        self.autocast = autocast if model is not None else None

    def _init_state(self, vocab_size: int, stops: StopTokens, seed: int | None, version: int) -> None:
        """The vocabulary, the stop rule, the seeds and the request/pause/refit state (every engine on this loop)."""
        self.vocab_size = vocab_size
        self.stop_tokens: StopTokens = stops
        self.eos_token_ids = self.stop_tokens.ids  # the one stop rule (screl.rollout.engines.stop_tokens)
        pad = self.tokenizer.pad_token_id
        self.pad_token_id = int(pad) if pad is not None else min(self.eos_token_ids, default=0)
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._version = version
        self._torn_refit: str | None = None  # why the weights mix two versions (a refit failed midway)
        self._model_lock = threading.Lock()  # one forward pass or one weight load at a time
        self._cond = threading.Condition()  # guards everything below
        self._inflight: set[str] = set()
        self._aborted: set[str] = set()
        self._pause_mode: PauseMode | None = None
        self._active = 0  # generate calls decoding now (not parked, not waiting to start)
        self._stood_down = False  # paused with the KV caches freed (colocated: the trainer has the module)

    def _decode_path(self, decode: str) -> str:
        """``static`` or ``hf`` from the setting, logged once (never a silent choice)."""
        if decode not in DECODE_PATHS:
            raise ValueError(f"{DECODE_KEY}={decode!r}: expected one of {DECODE_PATHS}")
        if decode == "hf":
            log.info("screl: the torch engine decodes with Hugging Face's forward (%s=hf)", DECODE_KEY)
            return "hf"
        why = static_decode_support(self.model)
        if why is not None:
            if decode == "static":
                raise ValueError(f"{DECODE_KEY}=static: {why}; set it to auto or hf")
            log.info("screl: the torch engine decodes with Hugging Face's forward: the static-cache path cannot run "
                     "this model (%s)", why)
            return "hf"
        log.info("screl: the torch engine decodes %s on its static-cache path (%s=%s)",
                 type(self.model).__name__, DECODE_KEY, decode)
        return "static"

    # ----------------------------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        """The weight version now loaded."""
        return self._version

    def set_version(self, version: int) -> None:
        """Set the weight version label (between decode steps)."""
        with self._model_lock:
            self._version = version

    vision = False
    """A vision-language model (set from the model): requests may carry images (``GenerationRequest.vision``)."""
    _banned: torch.Tensor | None = None
    """Tokens never sampled: a vision-language model's image placeholders (``[vocabulary]`` bool)."""

    @classmethod
    def on_trainer_module(cls, policy: PolicySpec, options: EngineOptions, *, model: Any,
                          autocast: torch.dtype | None, link: Any = None) -> TorchGenerationEngine:
        """The colocated engine: it decodes with ``model`` (the trainer's module) in the trainer's threads."""
        return cls(policy, num_threads=None, max_batch_size=options.max_batch_size, seed=options.seed,
                   recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates,
                   decode=str(options.args.get("decode", "auto")), model=model, autocast=autocast)

    capabilities = EngineCapabilities(
        whole_call_batches=True, streams_weight_buckets=True, colocated=True, vision_inputs=True,
        routing_records=True, config_rules=("screl.rules.rollout_rules:torch_backend_rules",),
    )

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
        names: dict[str, torch.Tensor] = dict(self.model.named_parameters(remove_duplicate=False))
        names.update(dict(self.model.named_buffers(remove_duplicate=False)))
        loaded: set[int] = set()  # ids of the tensors given so far (a tied tensor counts under any name)
        given: set[str] = set()

        def missing() -> list[str]:
            persistent = set(self.model.state_dict())
            return sorted(k for k, t in names.items() if id(t) not in loaded and k in persistent)

        self._refit(weights, version, lambda bucket: copy_bucket(bucket, names, given, loaded), missing)

    def _refit(self, weights: WeightBuckets, version: int, load: Callable[[Mapping[str, torch.Tensor]], int],
               missing: Callable[[], list[str]]) -> None:
        """Load ``weights`` bucket by bucket with ``load`` (returns the tensors it copied) under the model lock, then
        refuse a refit that left ``missing()`` tensors; a failure after a copy marks the weights torn."""
        copied = 0
        with self._model_lock, torch.no_grad():
            try:
                for bucket in as_buckets(weights):
                    copied += load(bucket)
                    del bucket  # the next bucket is drawn with this one released (no other local holds it)
                absent = missing()
                if absent:
                    raise KeyError(f"update_weights: missing keys: {absent[:5]} ({len(absent)} in all).")
            except BaseException as err:
                if copied:
                    self._torn_refit = (
                        f"a refit to version {version} failed after {copied} tensor(s) were copied "
                        f"({type(err).__name__}: {err}); the weights mix two versions until a complete refit"
                    )
                raise
            self._version = version
            self._torn_refit = None

    def abort(self, request_ids: Sequence[str]) -> None:
        """Finish these in-flight requests at the next step with their partial tokens."""
        with self._cond:
            self._aborted.update(set(request_ids) & self._inflight)
            self._cond.notify_all()

    def pause(self, mode: PauseMode = "keep", timeout: float | None = None) -> None:
        """Stop generating until :meth:`resume` (see the protocol); returns when no batch is decoding.

        Raises:
            TimeoutError: the engine did not become quiet within ``timeout`` seconds (it stays paused).
        """
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause(mode={mode!r}): expected 'abort', 'wait' or 'keep'.")
        with self._cond:
            self._pause_mode = mode
            if mode == "abort":
                self._aborted.update(self._inflight)
            self._cond.notify_all()
            if not self._cond.wait_for(lambda: self._active == 0, timeout):
                raise TimeoutError(
                    f"pause(mode={mode!r}): {self._active} generate call(s) still running after {timeout} s."
                )

    def resume(self) -> None:
        """Let waiting and parked ``generate`` calls continue."""
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        """Whether the engine is paused."""
        return self._pause_mode is not None

    def stand_down(self, timeout: float | None = None, drain: bool = False) -> None:
        """Pause in ``keep`` mode and free the KV caches of the parked batches (colocated generation, while the
        trainer trains the module this engine decodes with); returns when no forward pass runs. The parked
        requests re-prefill under the weights of the :meth:`wake` (their tokens after it carry its version).
        ``drain``: pause in ``wait`` mode instead (the drain gate): the requests in flight finish first."""
        with self._cond:
            self._stood_down = True
        self.pause("wait" if drain else "keep", timeout)

    def wake(self) -> None:
        """End a :meth:`stand_down`: parked batches re-prefill and decode on."""
        with self._cond:
            self._stood_down = False
        self.resume()

    @property
    def stood_down(self) -> bool:
        return self._stood_down

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate all requests, ``max_batch_size`` at a time; results in request order."""
        if not requests:
            return []
        if self._torn_refit is not None:
            raise RuntimeError(f"generate: {self._torn_refit}")
        rows = [self._new_row(r) for r in requests]
        ids = [r.request_id for r in requests]
        self._enter(ids)
        try:
            size = self.max_batch_size or len(rows)
            for i in range(0, len(rows), size):
                self._run_batch(rows[i : i + size])
        finally:
            self._exit(ids)
        end = self._version
        return [self._result(r, end) for r in rows]

    # ------------------------------------------------------------------------- pause/abort gates

    def _enter(self, ids: list[str]) -> None:
        with self._cond:
            if len(set(ids)) != len(ids) or self._inflight & set(ids):
                dup = sorted({i for i in ids if ids.count(i) > 1} | (self._inflight & set(ids)))
                raise ValueError(f"generate: request ids already in flight or repeated: {dup[:5]}.")
            self._inflight.update(ids)
            self._cond.wait_for(lambda: self._pause_mode is None)
            self._active += 1

    def _exit(self, ids: list[str]) -> None:
        with self._cond:
            self._active -= 1
            self._inflight.difference_update(ids)
            self._aborted.difference_update(ids)
            self._cond.notify_all()

    def _checkpoint(self, rows: list[_Row], batch: _Batch | None = None) -> None:
        """Between steps: park while paused in ``keep`` mode (a stand-down frees the batch's KV cache first),
        then apply aborts."""
        with self._cond:
            if self._pause_mode == "keep":
                if self._stood_down and batch is not None:
                    self._release(batch)
                    batch.dropped = True
                self._active -= 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._pause_mode != "keep")
                self._active += 1
            for r in rows:
                if r.finish is None and r.req.request_id in self._aborted:
                    r.finish = "abort"

    # -------------------------------------------------------------------------------- decoding

    def _new_row(self, req: GenerationRequest) -> _Row:
        if len(req.prompt_token_ids) == 0:
            raise ValueError(f"generate: request {req.request_id!r} has an empty prompt.")
        bad = [t for t in req.prompt_token_ids if not 0 <= int(t) < self.vocab_size]
        if bad:
            raise ValueError(
                f"generate: request {req.request_id!r} has token ids outside the vocabulary: {bad[:5]}."
            )
        if req.vision is not None and not self.vision:
            raise ValueError(f"generate: request {req.request_id!r} carries images, and {type(self.model).__name__} "
                             "has no vision tower (use a vision-language policy: screl.models.HFVisionLM)")
        sp = req.sampling
        seed = sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)
        gen = torch.Generator().manual_seed(seed)
        uniforms = torch.rand(sp.max_new_tokens, generator=gen, dtype=torch.float64)
        stop = self.stop_tokens.for_request(sp.stop_token_ids, sp.ignore_eos)
        routing = self.routing.empty(len(req.prompt_token_ids) + sp.max_new_tokens) if self.routing else None
        return _Row(req=req, uniforms=uniforms, stop_ids=stop, routing=routing)

    def _batch_params(self, rows: list[_Row]) -> _Batch:
        dev, n_vocab = self.device, self.vocab_size
        stop_mask = torch.zeros(len(rows), n_vocab, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids = [t for t in r.stop_ids if 0 <= t < n_vocab]
            stop_mask[i, ids] = True
        steps = max(len(r.uniforms) for r in rows)
        uniforms = torch.stack([torch.cat([r.uniforms, r.uniforms[-1:].expand(steps - len(r.uniforms))])
                                for r in rows]).to(dev)
        return _Batch(
            uniforms=uniforms,
            temps=torch.tensor([r.sampling.temperature for r in rows], dtype=torch.float32, device=dev),
            top_p=torch.tensor([r.sampling.top_p for r in rows], dtype=torch.float32, device=dev),
            top_k=torch.tensor([r.sampling.top_k or n_vocab for r in rows], dtype=torch.long, device=dev),
            min_new=torch.tensor([r.sampling.min_new_tokens for r in rows], dtype=torch.long, device=dev),
            stop_mask=stop_mask.to(dev),
        )

    def _run_batch(self, rows: list[_Row]) -> None:
        self._checkpoint(rows)
        if all(r.finish is not None for r in rows):
            return
        batch = self._batch_params(rows)
        try:
            self._decode_batch(rows, batch)
        finally:
            self._release(batch)

    def _decode_batch(self, rows: list[_Row], batch: _Batch) -> None:
        with self._forwarding():
            version = self._version
            logits = self._prefill(rows, batch)
        for r in rows:
            r.start_version = version
        cache_version = version
        while True:
            self._sample_step(rows, batch, logits, version)
            self._checkpoint(rows, batch)
            if all(r.finish is not None for r in rows):
                return
            with self._forwarding():
                version = self._version
                if batch.dropped or (self.recompute_kv_cache and version != cache_version):
                    batch.dropped = False
                    logits = self._prefill(rows, batch)
                    cache_version = version
                else:
                    logits = self._decode(rows, batch)

    def _release(self, batch: _Batch) -> None:
        """A batch is done (finished, aborted or failed): drop its KV cache."""
        batch.cache = batch.static = batch.attn = batch.next_pos = None

    def _new_decoder(self) -> Any:
        """The decoder of a batch on the static-cache path (``start``/``step``, :class:`StaticDecoder`)."""
        return StaticDecoder(self.model)

    @contextlib.contextmanager
    def _forwarding(self) -> Iterator[None]:
        """One forward pass: the model lock, no autograd, and (``autocast``) the engine's compute dtype.

        A shared module (colocated) on Hugging Face's forward runs in eval mode (its mode restored after) and under
        ``no_grad`` rather than ``inference_mode``: a buffer that forward updates (a dynamic RoPE table) must stay
        usable by the trainer's autograd. The static-cache path calls the layers' functions on the parameters
        themselves (no module mode, no buffer written), so it keeps ``inference_mode`` either way."""
        hf_shared = self.shared and self.decode_path == "hf"
        amp = (torch.autocast(self.device.type, dtype=self.autocast) if self.autocast is not None
               else contextlib.nullcontext())
        with self._model_lock, (torch.no_grad() if hf_shared else torch.inference_mode()), amp:
            training = hf_shared and self.model.training
            if training:
                self.model.eval()
            try:
                yield
            finally:
                if training:
                    self.model.train()

    def _prefill(self, rows: list[_Row], batch: _Batch) -> torch.Tensor:
        """Forward the full sequences (prompt + tokens so far), left-padded; logits of the last position."""
        seqs = [list(r.req.prompt_token_ids) + r.tokens for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, width - len(s) :] = 1
        ids, attn = ids.to(self.device), attn.to(self.device)
        if self.decode_path != "hf":  # a decoder of its own (static, megatron)
            batch.static = self._new_decoder()
            capacity = width + max(r.sampling.max_new_tokens - len(r.tokens) for r in rows)
            return batch.static.start(ids, attn, capacity)
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        images: dict[str, torch.Tensor] = {}
        if self.vision:
            pos, images = self._vision_prefill(rows, ids, attn, batch)
        with self._recording(rows, [len(s) for s in seqs], width):
            out = self.model(
                input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1, **images
            )
        batch.cache = self._out_cache(out)
        batch.attn = attn
        batch.next_pos = attn.sum(-1)
        return out.logits[:, -1, :].float()

    def _decode(self, rows: list[_Row], batch: _Batch) -> torch.Tensor:
        """One cached step on each row's last token (finished rows decode a dummy token, ignored)."""
        last = [r.tokens[-1] if r.finish is None else self.pad_token_id for r in rows]
        if batch.static is not None:
            return batch.static.step(torch.tensor(last, dtype=torch.long, device=self.device))
        assert batch.attn is not None and batch.next_pos is not None
        ids = torch.tensor(last, dtype=torch.long, device=self.device)[:, None]
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((len(rows), 1))], dim=1)
        pos = batch.next_pos[:, None]
        if batch.rope_delta is not None:  # the multimodal rotary position: the same for its three sections
            pos = (pos + batch.rope_delta)[None].expand(3, -1, -1)
        batch.next_pos = batch.next_pos + 1
        kwargs = {self._cache_kw: batch.cache}
        fed = [len(r.req.prompt_token_ids) + len(r.tokens) if r.finish is None else 0 for r in rows]
        with self._recording(rows, fed, 1):
            out = self.model(input_ids=ids, attention_mask=batch.attn, position_ids=pos, use_cache=True, **kwargs)
        batch.cache = self._out_cache(out)
        return out.logits[:, -1, :].float()

    def _vision_prefill(self, rows: list[_Row], ids: torch.Tensor, attn: torch.Tensor,
                        batch: _Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A vision-language model's prefill: the multimodal rotary positions of the left-padded batch (its decode
        offsets kept in ``batch``) and the rows' images, in row order, for the model's own forward."""
        inputs = [r.req.vision for r in rows if r.req.vision is not None]
        vision = VisionInputs.concat(inputs) if inputs else None
        grid = vision.image_grid_thw.to(self.device) if vision is not None else None
        pos, batch.rope_delta = mrope_positions(self.model, ids, attn, grid)  # type: ignore[arg-type]
        if vision is None:
            return pos, {}
        return pos, {"pixel_values": vision.pixel_values.to(self.device), "image_grid_thw": grid}  # type: ignore[dict-item]

    def _recording(self, rows: list[_Row], lengths: list[int], width: int) -> Any:
        """Record the routing of this forward pass into the rows (a MoE policy under routing replay)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.forward([r.routing for r in rows], lengths, width)  # type: ignore[misc]

    @staticmethod
    def _out_cache(out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values

    def _sample_step(self, rows: list[_Row], batch: _Batch, logits: torch.Tensor, version: int) -> None:
        """Sample one token for every unfinished row and record logprob, version and finish."""
        step = len(next(r for r in rows if r.finish is None).tokens)
        greedy = batch.temps == 0
        scaled = logits / torch.where(greedy, torch.ones_like(batch.temps), batch.temps)[:, None]
        logp = torch.log_softmax(scaled, dim=-1)
        proc = scaled.masked_fill(batch.stop_mask & (step < batch.min_new)[:, None], float("-inf"))
        if self._banned is not None:
            proc = proc.masked_fill(self._banned, float("-inf"))
        proc = _filter_top_k_top_p(proc, batch.top_k, batch.top_p)
        probs = torch.softmax(proc, dim=-1).double()
        cdf = probs.cumsum(dim=-1)
        u = batch.uniforms[:, min(step, batch.uniforms.shape[1] - 1)]
        target = ((1.0 - u) * cdf[:, -1])[:, None]
        sampled = torch.searchsorted(cdf, target).squeeze(1).clamp(max=self.vocab_size - 1)
        tokens = torch.where(greedy, proc.argmax(dim=-1), sampled)
        tok_logp = logp.gather(1, tokens[:, None]).squeeze(1)
        for r, t, lp in zip(rows, tokens.tolist(), tok_logp.tolist(), strict=True):
            if r.finish is not None:
                continue
            r.tokens.append(t)
            r.logprobs.append(lp)
            r.versions.append(version)
            if t in r.stop_ids and len(r.tokens) > r.sampling.min_new_tokens:
                r.finish, r.stop_token = "stop", t
            elif len(r.tokens) >= r.sampling.max_new_tokens:
                r.finish = "length"

    def _result(self, r: _Row, end_version: int) -> GenerationResult:
        return GenerationResult(
            request_id=r.req.request_id,
            prompt_token_ids=[int(t) for t in r.req.prompt_token_ids],
            token_ids=r.tokens,
            logprobs=r.logprobs,
            finish_reason=r.finish or "abort",
            weight_versions=r.versions,
            start_version=r.start_version if r.start_version is not None else end_version,
            end_version=end_version,
            stop_token_id=r.stop_token if r.finish == "stop" else None,
            stop_kind=(self.stop_tokens.kind(r.stop_token, r.sampling.ignore_eos)
                       if r.finish == "stop" and r.stop_token is not None else None),
            routing=(r.routing[: len(r.req.prompt_token_ids) + len(r.tokens)].clone()
                     if r.routing is not None else None),
            vision=r.req.vision,
        )


def _filter_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k, then outside its top-p nucleus."""
    n_vocab = logits.shape[-1]
    if bool((top_k >= n_vocab).all()) and bool((top_p >= 1).all()):
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    ranks = torch.arange(n_vocab, device=logits.device)[None, :]
    drop_sorted = ranks >= top_k[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop_sorted, float("-inf")), dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    drop_sorted |= (mass_before >= top_p[:, None]) & (ranks > 0)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))
