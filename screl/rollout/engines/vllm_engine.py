"""The vLLM generation backend (``generation.backend: vllm``): one ``AsyncLLM`` per generation worker, on an event
loop of its own (a daemon thread of the worker; vLLM's EngineCore is a child process of the worker). What it does,
knob by knob: docs/generation.md, "What the vLLM backend does" and the sections after it.

Each sample is its own vLLM request (``n=1``), so it can be aborted and scheduled on its own; vLLM batches
continuously, so the worker hands each group straight to :meth:`VLLMGenerationEngine.submit`. A refit pauses in
``keep`` mode (``clear_cache`` = ``recompute_kv_cache_after_weight_updates``; under the drain gate the worker pauses
in ``wait`` mode first), streams the buckets in place through
:class:`~screl.rollout.engines.vllm_worker.ScrelWorkerExtension` (vLLM's layerwise reload, ``collective_rpc`` calls
of at most 16 MiB: :mod:`screl.rollout.engines.vllm_buckets`), labels the new version and resumes. The engine
arguments screl sets and checks: :mod:`screl.rollout.engines.vllm_args`.

Invariants: each token's weight version comes from vLLM's ``weight_versions`` spans; each request's ``cache_salt``
is ``screl-v<weight version at dispatch>``, so prefix caching never serves a request dispatched after a refit a block
computed under older weights; vLLM stops on :mod:`screl.rollout.engines.stop_tokens`'s ids only (its ``generation_config``
is an empty one of screl's); logprobs are ``processed_logprobs``, the torch backend's ``log_softmax(logits / T)``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import glob
import logging
import os
import tempfile
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from screl.config_generation import vllm_engine_args
from screl.models.spec import PolicySpec
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
from screl.rollout.engines.stop_tokens import StopTokens, load_generation_config, stop_tokens
from screl.rollout.engines.vllm_args import (
    apply_weight_transfer,
    async_engine_args,
    check_options,
    set_cpu_environment,
)
from screl.rollout.engines.vllm_buckets import bucket_pieces

log = logging.getLogger(__name__)


def cache_salt(version: int) -> str:
    """vLLM's ``cache_salt`` of a request dispatched under weight ``version`` (1-128 characters, no ``@ / \\``)."""
    return f"screl-v{version}"


class VLLMGenerationEngine:
    """:class:`~screl.rollout.engines.protocol.GenerationEngine` on a vLLM ``AsyncLLM`` (see the module docstring).

    Args:
        policy: The policy spec; an :class:`~screl.models.HFCausalLM` directory is served as is, any other spec
            (e.g. :class:`~screl.models.TinyCausalLM`) is built and saved to a temporary directory first.
        engine_args: ``AsyncEngineArgs`` fields (``backend_args``: ``dtype``, ``max_model_len``,
            ``gpu_memory_utilization``, ``enforce_eager``, ``tensor_parallel_size``, ...), over the defaults of
            ``device`` (``screl.config_generation.VLLM_DEFAULTS``).
        device: ``cpu`` or ``cuda`` (``cuda:N``): picks the defaults (vLLM itself runs where its build runs).
        recompute_kv_cache_after_weight_updates: Clear the KV cache when pausing for a refit (in-flight
            requests are re-prefilled under the new weights).
        seed: Seeds requests that carry no seed of their own.
        num_threads: On CPU, the OpenMP threads of the EngineCore process, left unbound to cores
            (``VLLM_CPU_OMP_THREADS_BIND=nobind`` unless that is set): the trainer shares the cores. None: vLLM's
            default, one thread bound to each core.
        version: Initial weight version label.
    """

    capabilities = EngineCapabilities(
        continuous_batching=True, streams_weight_buckets=True, weight_transfers=("object_store", "nccl"),
        on_generation_device=False, claims_gpu_memory_share=True, eos_masked_logprobs=True,
        # backend_args: any vLLM engine argument (BackendArgs' open default); screl's defaults for them depend on
        # the device: screl.config_generation.VLLM_DEFAULTS (FIXED_ENGINE_ARGS are refused by check_options)
        config_rules=("screl.rules.rollout_rules:vllm_rules",),
        why_not=(
            ("colocated", "colocated vLLM needs vLLM's sleep/wake mode, which runs on a GPU only: not built yet"),
            ("routing_records", "the vllm engine does not return the experts it routed each token to (vLLM's CPU "
                                "build does not expose them; a GPU build would need its router's top-k ids per "
                                "token back in the output)"),
            ("streams_tokens", "the vllm engine asks vLLM for final outputs only (RequestOutputKind.FINAL_ONLY: no "
                               "per-step outputs to build for training rollouts), so a streamed reply's text comes "
                               "when it is done"),
            ("vision_inputs", "vLLM's CPU build (vllm-cpu 0.32) does not run the Qwen2-VL family here "
                              "(docs/multimodal.md)"),
        ),
    )

    @classmethod
    def from_options(cls, policy: PolicySpec, options: EngineOptions) -> VLLMGenerationEngine:
        """The engine a worker builds: ``backend_args`` are vLLM engine arguments."""
        check_options(options)
        return cls(policy, engine_args=dict(options.args), seed=options.seed, num_threads=options.num_threads,
                   device=options.device,
                   recompute_kv_cache_after_weight_updates=options.recompute_kv_cache_after_weight_updates)

    def __init__(
        self,
        policy: PolicySpec,
        engine_args: Mapping[str, Any] | None = None,
        recompute_kv_cache_after_weight_updates: bool = False,
        seed: int | None = None,
        num_threads: int | None = None,
        version: int = 0,
        device: str = "cpu",
    ) -> None:
        set_cpu_environment(num_threads)
        self.recompute_kv_cache = recompute_kv_cache_after_weight_updates
        self._seed = seed or 0
        self._counter = 0
        self._version = version
        self._paused = False
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self._torn_refit: str | None = None  # why the weights mix two versions (a refit failed midway)
        # one refit at a time: a refit is many RPCs (start, pieces, finish), and the worker may be asked for two at
        # once (a restarted worker's catch-up push and the next step's refit); interleaved, one's finish ends the
        # other's layerwise reload and the other's buckets then reach vLLM's processed tensors
        self._refit_lock = threading.Lock()
        self._ckpt_names: set[str] | None = None
        args = vllm_engine_args(device, engine_args)
        model_dir, gen_cfg, model_cfg = self._model_dir(policy)
        self._model_path = model_dir
        self.stop_tokens: StopTokens = stop_tokens(policy.build_tokenizer(), gen_cfg, model_cfg)
        # vLLM's generation_config: a generation_config.json without EOS ids or sampling defaults, so vLLM stops
        # on stop_token_ids alone and samples as asked (whatever the model directory's generation_config.json says)
        self._no_gen_cfg = tempfile.TemporaryDirectory(prefix="screl-vllm-generation-config-")
        with open(os.path.join(self._no_gen_cfg.name, "generation_config.json"), "w") as f:
            f.write("{}\n")
        apply_weight_transfer(args)
        self.tensor_parallel_size = int(args.get("tensor_parallel_size") or 1)
        self.prefix_caching = bool(args["enable_prefix_caching"])
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="screl-vllm", daemon=True)
        self._thread.start()
        self.llm = self._call(self._build(model_dir, args))
        self.set_version(version)

    def _model_dir(self, policy: PolicySpec) -> tuple[str, Any, Any]:
        """The directory vLLM loads, with the model's generation config and config (for the stop rule)."""
        path = getattr(policy, "path", None)
        if isinstance(path, str) and getattr(policy, "gguf_file", None) is None and os.path.isdir(path):
            return path, load_generation_config(path), policy.build_config()
        self._tmp = tempfile.TemporaryDirectory(prefix="screl-vllm-model-")
        model = policy.build_model()
        model.save_pretrained(self._tmp.name, safe_serialization=True)
        return self._tmp.name, getattr(model, "generation_config", None), model.config

    async def _build(self, model_dir: str, args: dict[str, Any]) -> Any:
        from vllm.v1.engine.async_llm import AsyncLLM

        engine_args = async_engine_args(model_dir, args, self._seed, self._no_gen_cfg.name)
        return AsyncLLM.from_engine_args(engine_args)

    def _call(self, coro: Any, timeout: float | None = None) -> Any:
        """Run ``coro`` on the engine's loop and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    # ----------------------------------------------------------------------------------- protocol

    @property
    def version(self) -> int:
        return self._version

    def submit(self, requests: Sequence[GenerationRequest]) -> concurrent.futures.Future[list[GenerationResult]]:
        """Start generating ``requests`` now; the future resolves once all have finished or been aborted."""
        if self._torn_refit is not None:
            raise RuntimeError(f"generate: {self._torn_refit}")
        return asyncio.run_coroutine_threadsafe(self._generate_all(list(requests)), self._loop)

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        result: list[GenerationResult] = self.submit(requests).result()
        return result

    async def _generate_all(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def _generate_one(self, req: GenerationRequest) -> GenerationResult:
        from vllm.inputs import TokensPrompt

        start = self._version
        final = None
        prompt = TokensPrompt(prompt_token_ids=list(req.prompt_token_ids))
        if self.prefix_caching:
            prompt["cache_salt"] = cache_salt(start)
        async for out in self.llm.generate(prompt, self._sampling(req.sampling), req.request_id,
                                           priority=req.priority):
            final = out
        if final is None or not final.outputs:  # aborted before it was scheduled
            return GenerationResult(req.request_id, list(req.prompt_token_ids), [], [], "abort", [], start, start)
        c = final.outputs[0]
        tokens = list(c.token_ids)
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs or [], tokens, strict=True)]
        versions = self._token_versions(getattr(c, "weight_versions", None), len(tokens), start)
        reason: FinishReason = c.finish_reason if c.finish_reason in ("stop", "length") else "abort"
        stop = None
        if reason == "stop":  # vLLM's stop_reason: the stop token id (None for its own EOS, which it has none of)
            stop = int(c.stop_reason) if isinstance(c.stop_reason, int) else (tokens[-1] if tokens else None)
        kind = None if stop is None else self.stop_tokens.kind(stop, req.sampling.ignore_eos)
        return GenerationResult(req.request_id, list(req.prompt_token_ids), tokens, logprobs, reason, versions,
                                versions[0] if versions else start, versions[-1] if versions else self._version,
                                stop_token_id=stop, stop_kind=kind,
                                num_cached_tokens=getattr(final, "num_cached_tokens", None))

    def _token_versions(self, spans: Any, n: int, start: int) -> list[int]:
        """Per-token versions from vLLM's ``(version, start, end)`` spans (tokens outside any span: ``start``)."""
        versions = [start] * n
        for span in spans or []:
            label = str(span.version)
            v = int(label) if label.lstrip("-").isdigit() else start
            for i in range(max(0, span.start), min(n, span.end)):
                versions[i] = v
        return versions

    def _sampling(self, sp: SamplingParams) -> Any:
        from vllm import SamplingParams as VSamplingParams
        from vllm.sampling_params import RequestOutputKind

        stops = sorted(self.stop_tokens.for_request(sp.stop_token_ids, sp.ignore_eos))
        seed = sp.seed
        if seed is None:
            self._counter += 1
            seed = self._seed * 1_000_003 + self._counter
        return VSamplingParams(
            n=1, max_tokens=sp.max_new_tokens, min_tokens=sp.min_new_tokens, temperature=sp.temperature,
            top_p=sp.top_p, top_k=sp.top_k or 0, seed=seed, stop_token_ids=stops, ignore_eos=sp.ignore_eos,
            logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def abort(self, request_ids: Sequence[str]) -> None:
        if request_ids:
            self._call(self.llm.abort(list(request_ids)))

    def pause(self, mode: PauseMode = "keep", clear_cache: bool | None = None) -> None:
        """vLLM's ``pause_generation``; ``clear_cache`` None: ``recompute_kv_cache_after_weight_updates``."""
        if mode not in ("abort", "wait", "keep"):
            raise ValueError(f"pause(mode={mode!r}): expected 'abort', 'wait' or 'keep'.")
        clear = self.recompute_kv_cache if clear_cache is None else clear_cache
        self._call(self.llm.pause_generation(mode=mode, clear_cache=clear))
        self._paused = True

    def resume(self) -> None:
        self._call(self.llm.resume_generation())
        self._paused = False

    @property
    def paused(self) -> bool:
        return self._paused

    def update_weights(self, weights: WeightBuckets, version: int) -> None:
        """Pause (keep), load ``weights`` bucket by bucket in place, label ``version``, resume (unless the caller
        holds a pause).

        ``weights``: one state dict, or an iterable of buckets drawn lazily (one bucket in this process at a
        time). After the last bucket every tensor of the served checkpoint must have come, and every parameter
        of vLLM's model been loaded, else ``KeyError``. A refit that fails keeps the old version label; once a
        bucket reached vLLM the weights may mix two versions, and the engine refuses to generate until a
        complete refit succeeds. Concurrent calls run one after the other.
        """
        with self._refit_lock:
            held = self._paused
            if not held:
                self.pause("keep")
            try:
                self._refit(weights, version)
                # no prefix-cache reset: blocks of older versions stay until evicted, and no request salted with
                # the new version can hit them (cache_salt)
                self._call(self.llm.update_weight_version(str(version)))
                self._version = version
            finally:
                if not held:
                    self.resume()

    def _refit(self, weights: WeightBuckets, version: int) -> None:
        """The buckets into vLLM's model (paused): start, one RPC per bucket, finish, completeness checks."""
        given: set[str] = set()
        sent = 0
        try:
            self._call(self.llm.collective_rpc("screl_refit_start"))
            try:
                for bucket in as_buckets(weights):
                    twice = sorted(set(bucket) & given)
                    if twice:
                        raise ValueError(f"update_weights: weight buckets overlap on {twice[:5]}")
                    given.update(bucket)
                    sent += 1
                    for piece in bucket_pieces(bucket):
                        self._call(self.llm.collective_rpc("screl_refit_piece", args=piece))
                    del bucket, piece  # the next bucket is drawn with this one released
            finally:
                unloaded = self._call(self.llm.collective_rpc("screl_refit_finish"))
            missing = sorted(self._checkpoint_names() - given)
            if missing:
                raise KeyError(f"update_weights: missing keys: {missing[:5]} ({len(missing)} in all).")
            not_loaded = sorted({n for rank in unloaded for n in rank})
            if not_loaded:
                raise KeyError(f"update_weights: vLLM parameters no bucket loaded: {not_loaded[:5]} "
                               f"({len(not_loaded)} in all).")
        except BaseException as err:
            if sent:
                self._torn_refit = (
                    f"a refit to version {version} failed after {sent} bucket(s) reached vLLM "
                    f"({type(err).__name__}: {err}); the weights mix two versions until a complete refit"
                )
            raise
        self._torn_refit = None

    def _checkpoint_names(self) -> set[str]:
        """The tensor names of the checkpoint the engine serves (what a complete refit gives), read once from
        its safetensors headers."""
        if self._ckpt_names is None:
            from safetensors import safe_open

            names: set[str] = set()
            for path in sorted(glob.glob(os.path.join(self._model_path, "*.safetensors"))):
                with safe_open(path, "pt") as f:
                    names.update(f.keys())
            self._ckpt_names = names
        return self._ckpt_names

    def set_version(self, version: int) -> None:
        """Relabel the loaded weights (no load): between scheduler steps, KV cache kept."""
        held = self._paused
        if not held:
            self.pause("keep", clear_cache=False)
        try:
            self._call(self.llm.update_weight_version(str(version)))
            self._version = version
        finally:
            if not held:
                self.resume()

    def weight_transfer(self, method: str, payload: Any = None) -> None:
        """One call of vLLM's native weight transfer (``screl.rollout.engines.vllm_transfer``; needs
        ``backend_args.weight_transfer: nccl``): ``init`` / ``start`` / ``update`` / ``finish`` (payload: the
        version label or None)."""
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        calls = {
            "init": lambda: self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=payload)),
            "start": lambda: self.llm.start_weight_update(),
            "update": lambda: self.llm.update_weights(WeightTransferUpdateRequest(update_info=payload)),
            "finish": lambda: self.llm.finish_weight_update(payload),
        }
        if method not in calls:
            raise ValueError(f"weight_transfer({method!r}): expected one of {sorted(calls)}")
        self._call(calls[method]())

    def shutdown(self) -> None:
        """Stop the engine (its EngineCore process) and the loop thread."""
        llm, self.llm = self.llm, None
        try:
            if llm is not None:
                llm.shutdown()
                del llm  # collected now, while its modules are alive (not by __del__ at interpreter exit)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if self._tmp is not None:
                self._tmp.cleanup()
            self._no_gen_cfg.cleanup()
