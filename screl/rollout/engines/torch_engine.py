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

This module is the request loop (batching, pause/abort gates, refits between steps); the rows, batch tensors and
sampling are :mod:`.torch_sampling`'s, the model, its decode path and a refit's tensors :mod:`.torch_model`'s,
the Hugging Face forward passes :mod:`.torch_forward`'s.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch

from screl.models.spec import PolicySpec
from screl.models.vision import is_vision_model
from screl.rollout.engines.buckets import WeightBuckets, as_buckets
from screl.rollout.engines.protocol import (
    EngineCapabilities,
    EngineOptions,
    GenerationRequest,
    GenerationResult,
    PauseMode,
)
from screl.rollout.engines.routing import RoutingRecorder
from screl.rollout.engines.static_decode import StaticDecoder
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
from screl.rollout.engines.torch_sampling import (
    Batch,
    Row,
    batch_params,
    check_prompt,
    new_row,
    row_result,
    sample_step,
)


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
        self.model: Any
        self.model, self.device = load_model(policy, device, model)
        self.decode_path = choose_decode_path(self.model, decode)
        self.routing = RoutingRecorder(self.model) if record_routing else None
        self.vision = is_vision_model(self.model)
        if self.vision and self.decode_path != "hf":
            raise ValueError(f"a vision-language policy decodes through Hugging Face's forward: set {DECODE_KEY}=hf")
        if self.routing is not None and self.decode_path != "hf":
            raise ValueError(f"routing replay records the experts through Hugging Face's forward: set {DECODE_KEY}=hf")
        self._hf = HFForward(self.model, self.device, self.routing, self.vision)
        self._init_state(int(self.model.get_output_embeddings().weight.shape[0]),
                         stop_tokens(self.tokenizer, getattr(self.model, "generation_config", None), self.model.config),
                         seed, version)
        if self.vision:
            self._banned = banned_tokens(self.model, self.vocab_size, self.device)

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
                   model=model, autocast=autocast, **cls._colocated_args(options, link))

    @classmethod
    def _colocated_args(cls, options: EngineOptions, link: Any) -> dict[str, Any]:
        """What this engine's colocated build takes beyond the shared settings (its decode path)."""
        return {"decode": str(options.args.get("decode", "auto"))}

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
        tensors = ModelTensors(self.model)
        self._refit(weights, version, tensors.load, tensors.missing)

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
        return [row_result(r, end, self.stop_tokens) for r in rows]

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

    def _checkpoint(self, rows: list[Row], batch: Batch | None = None) -> None:
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

    def _new_row(self, req: GenerationRequest) -> Row:
        check_prompt(req, self.vocab_size)
        if req.vision is not None and not self.vision:
            raise ValueError(f"generate: request {req.request_id!r} carries images, and {type(self.model).__name__} "
                             "has no vision tower (use a vision-language policy: screl.models.HFVisionLM)")
        return new_row(req, self.stop_tokens, self._seed_rng, self.routing)

    def _run_batch(self, rows: list[Row]) -> None:
        self._checkpoint(rows)
        if all(r.finish is not None for r in rows):
            return
        batch = batch_params(rows, self.device, self.vocab_size)
        try:
            self._decode_batch(rows, batch)
        finally:
            self._release(batch)

    def _decode_batch(self, rows: list[Row], batch: Batch) -> None:
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

    def _release(self, batch: Batch) -> None:
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

    def _prefill(self, rows: list[Row], batch: Batch) -> torch.Tensor:
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
        return self._hf.prefill(rows, batch, ids, attn, [len(s) for s in seqs])

    def _decode(self, rows: list[Row], batch: Batch) -> torch.Tensor:
        """One cached step on each row's last token (finished rows decode a dummy token, ignored)."""
        last = [r.tokens[-1] if r.finish is None else self.pad_token_id for r in rows]
        if batch.static is not None:
            return batch.static.step(torch.tensor(last, dtype=torch.long, device=self.device))
        return self._hf.step(rows, batch, last)

    def _sample_step(self, rows: list[Row], batch: Batch, logits: torch.Tensor, version: int) -> None:
        """Sample one token for every unfinished row and record logprob, version and finish."""
        sample_step(rows, batch, logits, version, self.vocab_size, self._banned)
