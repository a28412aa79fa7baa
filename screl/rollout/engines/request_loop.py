"""The request loop the torch and Megatron engines share: a component each engine holds, not a base class.

:class:`RequestLoop` owns everything about a ``generate`` call that does not depend on the model: per-request seeds,
chunking into batches of ``max_batch_size``, left-padded prefills, the decode loop with its per-token weight
versions, the pause/abort gates between steps, stand-downs (a colocated engine's KV caches freed while the trainer
trains), in-flight refits and the weight-version label. The engine that holds it is its :class:`DecodeSteps`: the
model's forward context, a batch's prefill and one decode step, sampling, and a batch's release. Refits load through
the engine's own loader (:meth:`RequestLoop.refit` keeps them atomic between decode steps).

Invariant: one forward pass or one weight load at a time (``RequestLoop.lock``); a step's tokens carry the version of
the forward pass that produced their logits.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch

from screl.rollout.engines.buckets import WeightBuckets, as_buckets
from screl.rollout.engines.protocol import GenerationRequest, GenerationResult, PauseMode
from screl.rollout.engines.routing import RoutingRecorder
from screl.rollout.engines.stop_tokens import StopTokens
from screl.rollout.engines.torch_sampling import Batch, Row, batch_params, check_prompt, new_row, row_result


class DecodeSteps(Protocol):
    """What a :class:`RequestLoop` asks of the engine that holds it (the engine's model side)."""

    def _check_request(self, req: GenerationRequest) -> None:
        """Refuse a request the model cannot take (images for a text-only model); the prompt is checked already."""
        ...

    def _forward_context(self) -> contextlib.AbstractContextManager[Any]:
        """One forward pass's context (grad mode, compute dtype, module mode); the loop holds its lock around it."""
        ...

    def _start(self, rows: list[Row], batch: Batch, ids: torch.Tensor, attn: torch.Tensor,
               capacity: int) -> torch.Tensor:
        """Prefill ``ids`` ``[rows, width]`` (left-padded, ``attn`` 1 on real tokens) with room for ``capacity``
        positions; the last position's logits ``[rows, vocab]``."""
        ...

    def _step(self, rows: list[Row], batch: Batch, last: list[int]) -> torch.Tensor:
        """One cached decode step on each row's ``last`` token; logits ``[rows, vocab]``."""
        ...

    def _sample_step(self, rows: list[Row], batch: Batch, logits: torch.Tensor, version: int) -> None:
        """Sample one token for every unfinished row and record its logprob, version and finish."""
        ...

    def _release(self, batch: Batch) -> None:
        """A batch is done (finished, aborted, failed) or parked by a stand-down: free its KV cache."""
        ...


def apply_threads(num_threads: int | None, max_batch_size: int | None, engine: str) -> None:
    """The process settings an engine on the loop takes first: torch's intra-op threads, and its batch size check."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    if max_batch_size is not None and max_batch_size < 1:
        raise ValueError(f"{engine}(max_batch_size={max_batch_size}) must be >= 1 or None.")


def pad_token(tokenizer: Any, stops: StopTokens) -> int:
    """The id prompts are left-padded with: the tokenizer's pad token, else the smallest stop token (else 0)."""
    pad = tokenizer.pad_token_id
    return int(pad) if pad is not None else min(stops.ids, default=0)


class RequestLoop:
    """Batches, gates and refits of one engine (see the module docstring).

    Args:
        steps: The engine's model side.
        device: Where the batch tensors go.
        vocab_size: Sampled logit columns (prompt ids are checked against it).
        stops: The stop rule (:mod:`screl.rollout.engines.stop_tokens`).
        pad_token_id: The left-padding token.
        seed: Seeds the seeds of requests without ``SamplingParams.seed`` (None: nondeterministic).
        version: Initial weight version label.
        max_batch_size: Requests decoded together; a larger ``generate`` call runs in chunks.
        recompute_kv_cache: Re-prefill in-flight sequences when the weights changed since their prefill.
        routing: Records each fed position's MoE routing (rollout routing replay), or None.
    """

    def __init__(self, steps: DecodeSteps, *, device: torch.device, vocab_size: int, stops: StopTokens,
                 pad_token_id: int, seed: int | None, version: int, max_batch_size: int | None,
                 recompute_kv_cache: bool, routing: RoutingRecorder | None = None) -> None:
        self.steps, self.device, self.vocab_size, self.stop_tokens = steps, device, vocab_size, stops
        self.pad_token_id, self.routing = pad_token_id, routing
        self.max_batch_size, self.recompute_kv_cache = max_batch_size, recompute_kv_cache
        self._seed_rng = random.Random(seed) if seed is not None else random.SystemRandom()
        self._version = version
        self._torn_refit: str | None = None  # why the weights mix two versions (a refit failed midway)
        self.lock = threading.Lock()  # one forward pass or one weight load at a time
        self._cond = threading.Condition()  # guards everything below
        self._inflight: dict[str, Row] = {}  # the requests in flight (decoding, parked or waiting), by id
        self._aborted: set[str] = set()
        self._pause_mode: PauseMode | None = None
        self._active = 0  # generate calls decoding now (not parked, not waiting to start)
        self._stood_down = False  # paused with the KV caches freed (colocated: the trainer has the module)
        self._busy_s = 0.0  # seconds with a call running (decoding, not parked), up to _busy_since
        self._busy_since: float | None = None
        self._tokens_out = 0  # tokens of the rows every call returned
        self.continuous: Callable[[RequestLoop, list[Row]], None] | None = None
        """Runs a call's rows instead of the batches (the torch engine's continuous path)."""

    def _shift(self, calls: int) -> None:
        """Calls running change by ``calls`` (under ``_cond``); the busy clock runs while any does."""
        self._active += calls
        now = time.perf_counter()
        if self._active > 0 and self._busy_since is None:
            self._busy_since = now
        elif self._active == 0 and self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = None

    @property
    def busy_s(self) -> float:
        """Seconds the engine has had a call running (decoding: parked, stood-down and idle time excluded), over its
        life; a colocated run's generation phase is the sum of its deltas (``rollout/engine_busy_s``)."""
        with self._cond:
            running = time.perf_counter() - self._busy_since if self._busy_since is not None else 0.0
            return self._busy_s + running

    @property
    def tokens_out(self) -> int:
        """Tokens the engine has returned (every call's rows, aborted ones' partial tokens included), over its life."""
        with self._cond:
            return self._tokens_out

    # ------------------------------------------------------------------------------ version, refits

    @property
    def version(self) -> int:
        return self._version

    def set_version(self, version: int) -> None:
        with self.lock:
            self._version = version

    def refit(self, weights: WeightBuckets, version: int, load: Callable[[Mapping[str, torch.Tensor]], int],
              missing: Callable[[], list[str]]) -> None:
        """Load ``weights`` bucket by bucket with ``load`` (returns the tensors it copied) under the model lock, then
        refuse a refit that left ``missing()`` tensors; a failure after a copy marks the weights torn."""
        copied = 0
        with self.lock, torch.no_grad():
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

    # ------------------------------------------------------------------------ abort, pause, stand-down

    def abort(self, request_ids: Sequence[str]) -> None:
        with self._cond:
            self._aborted.update(set(request_ids) & self._inflight.keys())
            self._cond.notify_all()

    def pause(self, mode: PauseMode = "keep", timeout: float | None = None) -> None:
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
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    def stand_down(self, timeout: float | None = None, drain: bool = False) -> None:
        with self._cond:
            self._stood_down = True
        self.pause("wait" if drain else "keep", timeout)

    def wake(self) -> None:
        with self._cond:
            self._stood_down = False
        self.resume()

    @property
    def stood_down(self) -> bool:
        return self._stood_down

    @property
    def in_flight(self) -> frozenset[str]:
        """The ids of the requests in the engine now (decoding, parked or waiting to start)."""
        with self._cond:
            return frozenset(self._inflight)

    # ------------------------------------------------------------------------------------ generate

    def generate(self, requests: Sequence[GenerationRequest]) -> list[GenerationResult]:
        """Generate all requests, ``max_batch_size`` at a time; results in request order."""
        if not requests:
            return []
        if self._torn_refit is not None:
            raise RuntimeError(f"generate: {self._torn_refit}")
        rows = [self._new_row(r) for r in requests]
        ids = [r.request_id for r in requests]
        self._enter(ids, rows)
        try:
            if self.continuous is not None:
                self.continuous(self, rows)
            size = self.max_batch_size or len(rows)
            for i in range(0, len(rows) if self.continuous is None else 0, size):
                self._run_batch(rows[i : i + size])
        finally:
            self._exit(ids, sum(len(r.tokens) for r in rows))
        end = self._version
        return [row_result(r, end, self.stop_tokens) for r in rows]

    def _new_row(self, req: GenerationRequest) -> Row:
        check_prompt(req, self.vocab_size)
        self.steps._check_request(req)
        return new_row(req, self.stop_tokens, self._seed_rng, self.routing)

    def _enter(self, ids: list[str], rows: list[Row]) -> None:
        with self._cond:
            if len(set(ids)) != len(ids) or self._inflight.keys() & set(ids):
                dup = sorted({i for i in ids if ids.count(i) > 1} | (self._inflight.keys() & set(ids)))
                raise ValueError(f"generate: request ids already in flight or repeated: {dup[:5]}.")
            self._inflight.update(zip(ids, rows, strict=True))
            self._cond.wait_for(lambda: self._pause_mode is None)
            self._shift(1)

    def _exit(self, ids: list[str], tokens: int = 0) -> None:
        with self._cond:
            self._tokens_out += tokens
            self._shift(-1)
            for i in ids:
                self._inflight.pop(i, None)
            self._aborted.difference_update(ids)
            self._cond.notify_all()

    def partial_tokens(self, request_ids: Sequence[str]) -> dict[str, list[int]]:
        """The tokens each of these in-flight requests has on the host so far (every decode step on the batched
        paths; every ``sync_every`` steps on the continuous one); ids not in flight are left out."""
        with self._cond:
            rows = [(i, self._inflight[i]) for i in request_ids if i in self._inflight]
        return {i: list(r.tokens) for i, r in rows}  # a copy: the decode thread appends to the row's list

    def gate_pending(self) -> bool:
        """Whether an abort or a pause waits for the next checkpoint (the continuous path reads its tokens first)."""
        with self._cond:
            return bool(self._aborted) or self._pause_mode == "keep"

    def driver_starts(self) -> None:
        """A decode thread that runs calls' rows for them (the continuous path) counts as a running call from now."""
        with self._cond:
            self._shift(1)

    def driver_ends(self) -> None:
        with self._cond:
            self._shift(-1)
            self._cond.notify_all()

    def wait_parked(self, done: Callable[[], bool]) -> None:
        """A call whose rows a decode thread runs waits for ``done()``, not counted as running meanwhile (a pause
        waits for the decode thread, which parks, drains or aborts the rows as the pause asks)."""
        with self._cond:
            self._shift(-1)
            self._cond.notify_all()
            try:
                self._cond.wait_for(done)
            finally:
                self._shift(1)

    def notify(self) -> None:
        """Wake the calls waiting on the loop (a decode thread finished some of their rows)."""
        with self._cond:
            self._cond.notify_all()

    def _checkpoint(self, rows: list[Row], batch: Batch | None = None,
                    on_drop: Callable[[], None] | None = None) -> None:
        """Between steps: park while paused in ``keep`` mode (a stand-down frees the batch's KV cache first, or
        calls ``on_drop``), then apply aborts."""
        with self._cond:
            if self._pause_mode == "keep":
                if self._stood_down and batch is not None:
                    self.steps._release(batch)
                    batch.dropped = True
                if self._stood_down and on_drop is not None:
                    on_drop()
                self._shift(-1)
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._pause_mode != "keep")
                self._shift(1)
            for r in rows:
                if r.finish is None and r.req.request_id in self._aborted:
                    r.finish = "abort"

    def _run_batch(self, rows: list[Row]) -> None:
        self._checkpoint(rows)
        if all(r.finish is not None for r in rows):
            return
        batch = batch_params(rows, self.device, self.vocab_size)
        try:
            self._decode_batch(rows, batch)
        finally:
            self.steps._release(batch)

    def _decode_batch(self, rows: list[Row], batch: Batch) -> None:
        with self._forwarding():
            version = self._version
            logits = self._prefill(rows, batch)
        for r in rows:
            r.start_version = version
        cache_version = version
        while True:
            self.steps._sample_step(rows, batch, logits, version)
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
                    last = [r.tokens[-1] if r.finish is None else self.pad_token_id for r in rows]
                    logits = self.steps._step(rows, batch, last)  # finished rows decode a dummy token, ignored

    @contextlib.contextmanager
    def _forwarding(self) -> Iterator[None]:
        """One forward pass: the model lock, then the engine's forward context."""
        with self.lock, self.steps._forward_context():
            yield

    def _prefill(self, rows: list[Row], batch: Batch) -> torch.Tensor:
        """Forward the full sequences (prompt + tokens so far), left-padded; logits of the last position."""
        seqs = [list(r.req.prompt_token_ids) + r.tokens for r in rows]
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_token_id, dtype=torch.long)
        attn = torch.zeros((len(seqs), width), dtype=torch.long)
        for i, s in enumerate(seqs):
            ids[i, width - len(s) :] = torch.tensor(s, dtype=torch.long)
            attn[i, width - len(s) :] = 1
        capacity = width + max(r.sampling.max_new_tokens - len(r.tokens) for r in rows)
        return self.steps._start(rows, batch, ids.to(self.device), attn.to(self.device), capacity)
