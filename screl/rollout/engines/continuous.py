"""The torch engine's continuous decode path (``backend_args.decode: continuous``; docs/generation.md).

:class:`ContinuousDecoder` is sized once per engine: a :class:`~.kv_cache.SlotKVCache` of up to ``max_rows`` slots
from the ``kv_cache_gb`` budget, the forward passes of :class:`~.slot_forward.SlotForward`. A ``generate`` call's
rows (:class:`_Call`) join the running batch between decode steps as slots free up, and a finished row leaves at
once, its slot reused. Prefills take at most ``prefill_tokens`` positions a step: a prompt longer than what is left
of that budget goes into its slot in chunks over several steps (its later chunks attend to its cached positions:
:func:`~.sdpa_attention.chunk_attention`), and the row draws its first token at the step its last chunk lands, so a
long prompt never stalls the running rows for more than a budget's worth of prefill. Tokens
are drawn, recorded and stopped on the device (:class:`~.slot_state.SlotState`) and reach the host every
``sync_every`` steps, or at once when an abort or a pause waits.

The RL contract is the static path's: a row's tokens come from its own seeded uniforms by the same sampling math
(the same tokens for the same seeds), each token's logprob is ``log_softmax(logits / T)`` and carries the version of
the forward pass that made it, an abort finishes a row between steps with its tokens so far while the others go on,
a refit lands between steps (the rows go on on their KV cache, or re-prefill under the new weights with
``recompute_kv_cache``), and a stand-down frees the KV cache (:meth:`ContinuousDecoder.release`), its rows
re-prefilling after the wake.

Concurrent ``generate`` calls share one scheduler (:meth:`ContinuousDecoder.run`): each hands its rows to the run
in progress, or starts one when none runs, and waits for its own rows only, counted as parked by the loop's pauses
(the run counts as the running call). The run takes the handed rows in between steps, so they join the running
batch as slots free up, and it ends when every row handed to it has finished. Runs go one after another to the
engine's one decode thread, so one run at a time holds the KV cache. An error in the run fails every call waiting
on it.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Mapping
from typing import Any

import torch

from screl.rollout.engines.decode_graphs import DecodeGraphs, graphs_enabled
from screl.rollout.engines.kv_cache import SlotKVCache, slots_for_budget
from screl.rollout.engines.protocol import GenerationRequest
from screl.rollout.engines.sdpa_attention import ATTENTION_PATH
from screl.rollout.engines.slot_forward import SlotForward
from screl.rollout.engines.slot_state import LENGTH, PREFILLING, RUNNING, STOPPED, SlotState
from screl.rollout.engines.torch_sampling import Row, needs_filter

log = logging.getLogger(__name__)

IDLE_S = 5.0
"""Seconds the decode thread waits for another run before it leaves."""

CONTINUOUS_DEFAULTS = {"kv_cache_gb": 1.0, "max_rows": 256, "max_len": None, "prefill_tokens": 2048, "sync_every": 4,
                       "cuda_graphs": "auto"}
"""The continuous path's ``backend_args`` and their defaults (``max_len`` None: the model's context length)."""


def held_kv_cache_gib(args: Mapping[str, Any]) -> float | None:
    """The KV cache a torch engine with these ``backend_args`` holds from its start (``kv_cache_gib`` of its
    capabilities): ``kv_cache_gb`` on the continuous path (``auto`` included: it is the path on a GPU, the only
    device a KV cache can share with a trainer), None on the batched ones (allocated as they go)."""
    if args.get("decode", "auto") not in ("continuous", "auto"):
        return None
    value = args.get("kv_cache_gb", CONTINUOUS_DEFAULTS["kv_cache_gb"])
    return float(value) if isinstance(value, (int, float)) else None


class ContinuousDecoder:
    """The engine's continuous decode path (see the module docstring)."""

    def __init__(self, model: Any, *, device: torch.device, dtype: torch.dtype, vocab_size: int,
                 args: dict[str, Any]) -> None:
        self.forward = SlotForward(model)
        max_len = args.get("max_len") or int(model.config.max_position_embeddings)
        shape = self.forward.cache_shape(int(max_len), dtype)
        slots = slots_for_budget(shape, float(args["kv_cache_gb"]), int(args["max_rows"]))
        if slots < int(args["max_rows"]):  # a short cache decodes few rows at a time: say so, with the fix
            log.warning("screl: the continuous path's KV cache holds %d of backend_args.max_rows=%d rows: "
                        "backend_args.kv_cache_gb=%g GB over %.1f MiB a slot of %d positions (backend_args.max_len; "
                        "default: the model's context length); raise kv_cache_gb or lower max_len to the longest "
                        "prompt + max_new_tokens", slots, int(args["max_rows"]), float(args["kv_cache_gb"]),
                        shape.slot_bytes() / 2**20, shape.max_len)
        self.cache = SlotKVCache(shape, slots, device)
        capture = graphs_enabled(args.get("cuda_graphs", "auto"), device)
        self.graphs = DecodeGraphs(self.forward, self.cache, vocab_size, capture=capture)
        self.prefill_tokens, self.sync_every = int(args["prefill_tokens"]), int(args["sync_every"])
        if self.prefill_tokens < 1 or self.sync_every < 1:
            raise ValueError(f"backend_args.prefill_tokens ({self.prefill_tokens}) and backend_args.sync_every "
                             f"({self.sync_every}) must be >= 1")
        self.vocab_size, self.device = vocab_size, device
        self._driving: _Call | None = None  # the run taking rows now
        self._join = threading.Condition()  # guards _driving, its joining rows, _runs and _thread
        self._runs: deque[tuple[Any, _Call]] = deque()  # runs waiting for the decode thread
        self._thread: threading.Thread | None = None
        self.merged_calls = 0  # calls whose rows joined another call's run (a figure for tests and logs)

    def describe(self) -> str:
        """The start-up line: attention path, KV cache (size, dtype), rows, prefill budget, host reads."""
        return (f"attention {ATTENTION_PATH}; {self.cache.describe()}; up to {self.cache.slots} rows, prefills of "
                f"at most {self.prefill_tokens} tokens a step (longer prompts in chunks), {self.graphs.describe()}, "
                f"tokens to the host every {self.sync_every} steps")

    def check(self, req: GenerationRequest) -> None:
        """Refuse a request longer than a slot."""
        need = len(req.prompt_token_ids) + req.sampling.max_new_tokens
        if need > self.cache.shape.max_len:
            raise ValueError(f"generate: request {req.request_id!r} needs {need} positions and a KV-cache slot holds "
                             f"{self.cache.shape.max_len} (backend_args.max_len)")

    def release(self) -> None:
        self.graphs.drop()
        self.cache.release()

    def make(self) -> None:
        self.cache.make()

    def run(self, loop: Any, rows: list[Row]) -> None:
        """Decode ``rows`` to their ends under ``loop``'s gates (its lock, pauses, aborts, stand-downs): handed to
        the run in progress when there is one, else to a new run on its own thread; returns when they have all
        finished (raises when the run failed)."""
        with self._join:
            call = self._driving
            if call is None or not call.open:
                call = self._driving = _Call(self, loop)
                loop.driver_starts()  # counted as running from now: a pause waits for it
                self._runs.append((loop, call))
                if self._thread is None:  # one decode thread, kept while runs come
                    self._thread = threading.Thread(target=self._decode_thread, name="screl-continuous-decode",
                                                    daemon=True)
                    self._thread.start()
                self._join.notify_all()
            else:
                self.merged_calls += 1
            call.joining.extend(rows)
        loop.wait_parked(lambda: call.done(rows))
        if call.error is not None and any(r.finish is None for r in rows):
            raise RuntimeError(f"generate: the continuous decode run failed ({type(call.error).__name__}: "
                               f"{call.error})") from call.error

    def _decode_thread(self) -> None:
        """Runs the runs handed to it, one after another; leaves after :data:`IDLE_S` without one (a new run
        starts it again), so an idle engine holds no thread."""
        while True:
            with self._join:
                if not self._join.wait_for(lambda: bool(self._runs), IDLE_S):
                    self._thread = None
                    return
                loop, call = self._runs.popleft()
            self._drive(loop, call)

    def _drive(self, loop: Any, call: _Call) -> None:
        """One run on the decode thread: it holds the KV cache until every row handed to it has finished."""
        try:
            try:
                call.run()
            finally:
                call.leave(everyone=True)
        except BaseException as err:  # every call waiting on the run raises it (run)
            call.error = err
        finally:
            with self._join:  # closed after the error is set: a waiting call that sees it closed sees the error
                call.open = False
                if self._driving is call:
                    self._driving = None
            loop.driver_ends()


class _Call:
    """One run of the continuous path: the rows of every ``generate`` call handed to it while it ran."""

    def __init__(self, dec: ContinuousDecoder, loop: Any) -> None:
        self.dec, self.loop, self.cache = dec, loop, dec.cache
        self.rows: list[Row] = []
        self.state = SlotState(self.cache.slots, 1, dec.vocab_size, dec.device)  # grows to the rows' max_new_tokens
        self.filtered = False
        self.pending: deque[Row] = deque()
        self.joining: list[Row] = []  # rows handed to the run, not taken in yet (guarded by dec._join)
        self.open = True  # takes joining calls (guarded by dec._join); False once it decided to stop
        self.finished = 0  # rows finished when the waiting calls were last woken
        self.error: BaseException | None = None
        self.slotted: dict[int, Row] = {}
        self.step0: dict[int, int] = {}  # slot -> index in step_versions of its first token not on the host yet
        self.cache_version: dict[int, int] = {}  # slot -> version its KV cache was made under
        self.filling: dict[int, int] = {}  # slot -> positions in its KV cache, while its prefill is not complete
        self.step_versions: list[int] = []  # the version of each step's forward pass
        self.unsynced = 0  # steps since the host last read the tokens
        self.dropped = False  # a stand-down freed the KV cache: the slotted rows re-prefill

    def run(self) -> None:
        self.dec.forward.ready()
        while True:
            self.take_joined()
            if self.unsynced and (self.unsynced >= self.dec.sync_every or self.loop.gate_pending()):
                self.sync()
            self.loop._checkpoint(self.rows, on_drop=self.drop)
            self.leave()
            finished = sum(r.finish is not None for r in self.rows)
            if finished != self.finished:  # a waiting call may have all its rows now (finished, aborted)
                self.finished = finished
                self.loop.notify()  # only then: a woken waiter would take the GIL from the decode steps
            with self.dec._join:
                if not self.joining and all(r.finish is not None for r in self.rows):
                    self.open = False
                    return
            with self.loop._forwarding():
                logits = self.step(self.loop.version)
            self.state.sample(logits, self.filtered, None)
            self.unsynced += 1

    def take_joined(self) -> None:
        """The rows handed to the run since the last step go to the back of the queue (the sampling state grows to
        their ``max_new_tokens``, the filter turns on for their top-k/top-p)."""
        with self.dec._join:
            rows, self.joining = self.joining, []
        if not rows:
            return
        self.state.grow(max(r.sampling.max_new_tokens for r in rows))
        self.filtered = self.filtered or needs_filter(rows, self.dec.vocab_size)
        self.rows.extend(rows)
        self.pending.extend(rows)

    def done(self, rows: list[Row]) -> bool:
        """Whether a waiting call can return: its rows all finished (tokens on the host), or the run ended."""
        return not self.open or all(r.finish is not None for r in rows)

    def drop(self) -> None:
        """A stand-down (under the loop's gate): free the KV cache; the rows re-prefill after the wake."""
        self.dropped = True
        self.dec.release()

    def step(self, version: int) -> torch.Tensor:
        """One forward pass: a decode step of the running rows, then prefill chunks within the step's budget (rows
        part way in and re-prefills, in the order they began, then new rows); logits of every slot in use."""
        self.step_versions.append(version)
        for slot in self._stale(version):
            self._start_fill(slot, version)
        hi_old = self.cache.in_use()
        decoded = None
        running = [slot for slot in self.slotted if slot not in self.filling]
        if hi_old and running:
            keys = min(self.cache.shape.max_len, max(self.cache.lengths[:hi_old]) + 1)
            decoded = self.dec.graphs.decode(self.state.feed, self.state.pos, hi_old, keys)
            self.state.advance(hi_old)
            for slot in running:
                self.cache.lengths[slot] = min(self.cache.lengths[slot] + 1, self.cache.shape.max_len)
        prefilled = self._fill(version)
        if decoded is not None and not prefilled and self.cache.in_use() == hi_old:
            return decoded  # a plain decode step: no [rows, vocab] copy
        logits = torch.zeros(self.cache.in_use(), self.dec.vocab_size, device=self.dec.device)
        if decoded is not None:
            logits[:hi_old] = decoded
        for slot, row_logits in prefilled.items():
            logits[slot] = row_logits
        return logits

    def _stale(self, version: int) -> list[int]:
        """The slots to re-prefill now: all after a stand-down, those of older weights under ``recompute``."""
        stale = [s for s, v in self.cache_version.items() if v != version] if self.loop.recompute_kv_cache else []
        if not (self.dropped or stale):
            return []
        self.sync()  # the host needs every token so far
        self.leave()
        self.dec.make()
        self.dec.forward.ready()  # after a stand-down the weights may have been freed and trained
        redo = list(self.slotted) if self.dropped else [s for s in stale if s in self.slotted]
        self.dropped = False
        return redo

    def _start_fill(self, slot: int, version: int) -> None:
        """``slot``'s row goes into the KV cache from position 0 under ``version``: it neither draws nor advances
        until its last chunk lands (its decode-step writes at ``pos`` are overwritten by its next chunk)."""
        self.filling[slot] = 0
        self.step0[slot] = len(self.step_versions) - 1  # set again when it runs: it draws nothing until then
        self.cache_version[slot] = version
        self.cache.lengths[slot] = 0
        self.state.pos[slot] = 0
        self.state.code[slot] = PREFILLING

    def _fill(self, version: int) -> dict[int, torch.Tensor]:
        """Prefill chunks within the step's budget: the rows part way in (oldest first), then new rows while slots
        are free; at least one chunk a step. Returns the logits of the rows whose prefill completed."""
        out: dict[int, torch.Tensor] = {}
        budget = self.dec.prefill_tokens
        for slot in list(self.filling):
            if budget <= 0:
                return out
            budget -= self._chunk(slot, budget, out)
        while budget > 0 and self.pending and self.cache.free_slots:
            row = self.pending.popleft()
            if row.finish is not None:  # aborted before it joined
                continue
            slot = self.cache.take()
            self.slotted[slot] = row
            if row.start_version is None:
                row.start_version = version
            self.state.join(slot, row)
            self._start_fill(slot, version)
            budget -= self._chunk(slot, budget, out)
        return out

    def _chunk(self, slot: int, budget: int, out: dict[int, torch.Tensor]) -> int:
        """The next at most ``budget`` positions of ``slot``'s row into its KV cache; on its last chunk the row's
        logits go to ``out`` and it runs from this step (its first new token is this step's draw). Returns the
        positions written."""
        row = self.slotted[slot]
        seq = list(row.req.prompt_token_ids) + row.tokens
        start = self.filling[slot]
        n = min(len(seq) - start, budget)
        ids = torch.tensor(seq[start:start + n], dtype=torch.long, device=self.dec.device)
        logits = self.dec.forward.prefill(self.cache, slot, ids, start)
        if start + n < len(seq):
            self.filling[slot] = start + n
            self.state.pos[slot] = start + n
            return n
        del self.filling[slot]
        self.state.pos[slot] = len(seq)
        self.state.code[slot] = RUNNING
        self.step0[slot] = len(self.step_versions) - 1
        out[slot] = logits
        return n

    def sync(self) -> None:
        """Bring the tokens drawn since the last read to the host rows; mark the rows the device finished."""
        if not self.slotted:
            self.unsynced = 0
            return
        lo = min(len(r.tokens) for r in self.slotted.values())
        up = max(len(r.tokens) for r in self.slotted.values()) + self.unsynced + 1
        counts, codes, tokens, logprobs = self.state.read(self.cache.in_use(), lo, up)
        for slot, row in self.slotted.items():
            have, n = len(row.tokens), counts[slot]
            row.tokens.extend(tokens[slot][have - lo: n - lo])
            row.logprobs.extend(logprobs[slot][have - lo: n - lo])
            row.versions.extend(self.step_versions[self.step0[slot]: self.step0[slot] + n - have])
            self.step0[slot] += n - have
            if row.finish is None and codes[slot] == STOPPED:
                row.finish, row.stop_token = "stop", row.tokens[-1]
            elif row.finish is None and codes[slot] == LENGTH:
                row.finish = "length"
        self.unsynced = 0

    def leave(self, everyone: bool = False) -> None:
        """Finished rows (or, at the end, all) hand their slots back at once."""
        for slot, row in list(self.slotted.items()):
            if row.finish is not None or everyone:
                del self.slotted[slot]
                self.cache_version.pop(slot, None)
                self.filling.pop(slot, None)
                self.cache.give_back(slot)
                self.state.leave(slot)
