"""Decoding on a Megatron ``GPTModel`` with megatron-core's own KV cache, and the link that makes every
tensor-parallel rank take part in it (docs/generation.md, "The Megatron backend").

:class:`MegatronDecoder` is the Megatron engine's counterpart of :class:`~screl.rollout.engines.static_decode.StaticDecoder`:
``start`` prefills a batch of left-padded sequences and ``step`` decodes one token per row, both through
``GPTModel.forward`` with a ``StaticInferenceContext``. Invariant: its logits equal Hugging Face's and Megatron's own
full forward to fp32 round-off (``tests/rollout/test_megatron_engine.py``).

Under tensor parallelism every rank of the model's tensor-parallel group must run the same forward:
:class:`DecodeLink` carries the leader's calls (rank 0 of the group, where the engine runs) to the followers over a
process group of its own, and :func:`serve_decode` is the followers' loop.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from screl.rollout.engines.decode_copy import DecodeCopy

_START, _STEP, _FREE, _END = 1, 2, 3, 4
_HEADER = 6  # op, batch id, rows, width, capacity, spare


def unpadded_vocab_size(model: Any) -> int:
    """The tokenizer's vocabulary size a ``GPTModelProvider`` recorded on the model (before Megatron's padding)."""
    from screl.strategies.provider import UNPADDED_VOCAB_ATTR

    size = getattr(model, UNPADDED_VOCAB_ATTR, None)
    if size is None:
        raise ValueError(f"{type(model).__name__} carries no {UNPADDED_VOCAB_ATTR}: build it with GPTModelProvider")
    return int(size)


class MegatronDecoder:
    """Prefill and decode of one batch on a ``GPTModel`` (the model's own parameters, in eval mode).

    ``StaticInferenceContext`` is megatron-core's static-batching KV cache: one slot per position, shared by the
    batch's rows, so left padding keeps every row's newest token in the same slot. Padding is masked by an explicit
    attention mask, in the prefill and in every decode step; RoPE sees each row's positions shifted by its padding,
    which leaves attention unchanged (it depends on relative positions only). The output layer runs at each row's
    last position only (``materialize_only_last_token_logits``: a prefill computes ``[rows, vocab]`` logits, never
    ``[rows, width, vocab]``); under tensor parallelism they are gathered over the vocabulary, and the vocabulary
    padding Megatron adds is cut off.

    Args:
        model: The ``GPTModel`` (this rank's shard under tensor parallelism).
        vocab_size: Logit columns to keep (the unpadded vocabulary).
        link: Under tensor parallelism on the leader: each call is sent to the followers first.
        batch_id: The id followers know this batch's cache by (the leader's link assigns it).
    """

    def __init__(self, model: Any, vocab_size: int, link: DecodeLink | None = None, batch_id: int | None = None):
        self.model = model
        self.vocab_size = vocab_size
        self.link = link
        self.batch_id = link.new_batch_id() if link is not None and batch_id is None else (batch_id or 0)
        self._ctx: Any = None
        self._valid: Tensor | None = None  # [rows, capacity]: cache slots that hold a real token

    def start(self, ids: Tensor, attention_mask: Tensor, capacity: int) -> Tensor:
        """Prefill ``ids`` ``[rows, width]`` (left-padded, ``attention_mask`` 1 on real tokens) with room for
        ``capacity`` positions; returns the last position's logits ``[rows, vocab]`` (float32)."""
        from megatron.core.inference.contexts import StaticInferenceContext

        rows, width = ids.shape
        if capacity < width:
            raise ValueError(f"capacity {capacity} is shorter than the prompts ({width})")
        if self.link is not None:
            self.link.send(_START, self.batch_id, ids, attention_mask, capacity)
        dev = ids.device
        self._ctx = StaticInferenceContext(rows, capacity)
        # the output layer at the last position only: the prefill's logits are [rows, 1, vocab], never
        # [rows, width, vocab] (megatron-core's default for this context; set so no version can change it)
        self._ctx.materialize_only_last_token_logits = True
        valid = torch.zeros((rows, capacity), dtype=torch.bool, device=dev)
        valid[:, :width] = attention_mask.bool()
        self._valid = valid
        allowed = torch.ones((width, width), dtype=torch.bool, device=dev).tril()[None] & valid[:, None, :width]
        allowed |= torch.eye(width, dtype=torch.bool, device=dev)[None]  # a pad query attends to itself: no NaN
        return self._forward(ids, ~allowed[:, None])

    def step(self, ids: Tensor) -> Tensor:
        """Decode one token per row (``ids`` ``[rows]``); returns the logits ``[rows, vocab]`` (float32)."""
        assert self._ctx is not None and self._valid is not None, "start() first"
        offset = self._ctx.sequence_len_offset
        if offset >= self._valid.shape[1]:
            raise RuntimeError(f"the KV cache is full ({offset} positions)")
        if self.link is not None:
            self.link.send(_STEP, self.batch_id, ids)
        self._valid[:, offset] = True
        self._ctx.enable_decode_mode()
        return self._forward(ids[:, None], ~self._valid[:, None, None, : offset + 1])

    def free(self) -> None:
        """Drop the KV cache (the followers drop theirs)."""
        if self._ctx is not None and self.link is not None:
            self.link.send(_FREE, self.batch_id)
        self._ctx = self._valid = None

    def _forward(self, ids: Tensor, masked: Tensor) -> Tensor:
        assert self._ctx is not None
        rows, n = ids.shape
        offset = self._ctx.sequence_len_offset
        pos = torch.arange(offset, offset + n, device=ids.device).expand(rows, n)
        logits = self.model(ids, pos, masked, inference_context=self._ctx, runtime_gather_output=True)
        self._ctx.sequence_len_offset += n
        if logits.shape[1] != 1:
            raise RuntimeError(f"the output layer ran at {logits.shape[1]} positions per row, expected the last only")
        return logits[:, 0, : self.vocab_size].float()  # type: ignore[no-any-return]


class DecodeLink:
    """The leader's decode calls, broadcast to the other ranks of a tensor-parallel group.

    Each ``start``/``step`` is broadcast before the leader runs it, ``free`` drops a batch's cache, and ``end`` sends
    the followers back to training (:func:`serve_decode` is their loop).

    Args:
        group: A process group of the tensor-parallel ranks for the link alone (so its broadcasts never meet the
            trainer's own collectives); the leader is its rank ``src``.
        src: The leader's global rank.
        device: Where the broadcast tensors live (the backend's device: CPU for gloo).
    """

    def __init__(self, group: Any, src: int, device: torch.device | str = "cpu") -> None:
        self.group, self.src, self.device = group, src, torch.device(device)
        self._ids = itertools.count(1)
        self.closed = False

    def close(self) -> None:
        """Leader, at shutdown: no follower serves any more; a later decode call fails at once instead of waiting
        for one (a dropped cache needs no call)."""
        self.closed = True

    def new_batch_id(self) -> int:
        return next(self._ids)

    def send(self, op: int, batch_id: int, ids: Tensor | None = None, mask: Tensor | None = None,
             capacity: int = 0) -> None:
        """Leader: one call (``ids``/``mask`` as the followers must see them)."""
        if self.closed:
            if op in (_FREE, _END):
                return
            raise RuntimeError("the colocated engine's decode link is closed (the run is shutting down)")
        rows, width = (ids.shape[0], ids.shape[-1]) if ids is not None else (0, 0)
        header = torch.tensor([op, batch_id, rows, width, capacity, 0], dtype=torch.long, device=self.device)
        dist.broadcast(header, self.src, group=self.group)
        if ids is not None:
            dist.broadcast(ids.to(self.device, torch.long).contiguous(), self.src, group=self.group)
        if mask is not None:
            dist.broadcast(mask.to(self.device, torch.long).contiguous(), self.src, group=self.group)

    def end(self) -> None:
        """Leader: the followers leave :func:`serve_decode` (dropping every cache)."""
        self.send(_END, 0)

    def receive(self) -> tuple[int, int, Tensor | None, Tensor | None, int]:
        """Follower: the next call (op, batch id, ids, mask, capacity)."""
        header = torch.empty(_HEADER, dtype=torch.long, device=self.device)
        dist.broadcast(header, self.src, group=self.group)
        op, batch_id, rows, width, capacity, _ = (int(x) for x in header.tolist())
        ids = mask = None
        if op == _START:
            ids = torch.empty((rows, width), dtype=torch.long, device=self.device)
            dist.broadcast(ids, self.src, group=self.group)
            mask = torch.empty((rows, width), dtype=torch.long, device=self.device)
            dist.broadcast(mask, self.src, group=self.group)
        elif op == _STEP:
            ids = torch.empty((rows,), dtype=torch.long, device=self.device)
            dist.broadcast(ids, self.src, group=self.group)
        return op, batch_id, ids, mask, capacity


def serve_decode(link: DecodeLink, model: Any, forwarding: Callable[[], contextlib.AbstractContextManager[Any]],
                 device: torch.device | str = "cpu") -> int:
    """Follower: run the leader's decode calls on this rank's shard until it sends ``end``; returns the number of
    forward passes run. ``forwarding``: the context each forward runs in (eval mode, no autograd, autocast), as the
    leader's engine runs its own."""
    vocab = unpadded_vocab_size(model)
    decoders: dict[int, MegatronDecoder] = {}
    forwards = 0
    while True:
        op, batch_id, ids, mask, capacity = link.receive()
        if op == _END:
            decoders.clear()
            return forwards
        if op == _FREE:
            decoders.pop(batch_id, None)
            continue
        assert ids is not None
        with forwarding():
            if op == _START:
                assert mask is not None
                decoder = decoders[batch_id] = MegatronDecoder(model, vocab, batch_id=batch_id)
                decoder.start(ids.to(device), mask.to(device), capacity)
            elif op == _STEP:
                decoders[batch_id].step(ids.to(device))
            else:
                raise RuntimeError(f"the decode link sent an unknown call {op}")
        forwards += 1


@dataclass
class TensorParallelRanks:
    """A colocated engine's link across the trainer's tensor-parallel ranks
    (:class:`~screl.rollout.engines.protocol.RankLink`): rank 0's engine leads ``link``; every other rank
    :meth:`follow` s it with its own shard of the ``GPTModel``."""

    link: DecodeLink
    model: Any
    """This rank's ``GPTModel`` shard (unwrapped)."""
    autocast: torch.dtype | None = None
    """The compute dtype of the engine's forward passes (as the leader's)."""

    def follow(self) -> int:
        """A follower: run the leader's forward passes until it ends them; the number run. Like the leader, it
        decodes its shard's copy in the compute dtype (:func:`decode_module`), freed when the leader ends the turn."""
        if self._decode is None:
            self._decode = decode_module(self.model, self.autocast)
        model = self._decode
        try:
            return serve_decode(self.link, model, lambda: eval_no_grad(model, self.autocast))
        finally:
            twin = getattr(model, "screl_decode_copy", None)
            if twin is not None:
                twin.free()

    _decode: Any = None


def decode_module(model: Any, autocast: torch.dtype | None) -> Any:
    """The module a colocated Megatron engine decodes: a copy of the trainer's ``GPTModel`` in ``autocast`` (its
    compute dtype) where the masters are fp32, cast once per turn (:class:`~.decode_copy.DecodeCopy`, freed at a
    stand-down) instead of every weight re-cast by autocast at every decode step; else the module itself."""
    masters = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if autocast not in (torch.bfloat16, torch.float16) or masters != {torch.float32}:
        return model
    return DecodeCopy(model, autocast).module


@contextlib.contextmanager
def eval_no_grad(model: torch.nn.Module, autocast: torch.dtype | None = None) -> Iterator[None]:
    """One decode forward on a module the trainer also trains: eval mode (restored after; megatron reads its KV
    cache only in eval mode), no autograd (not ``inference_mode``: megatron caches its RoPE table across calls, and
    an inference tensor there would break the trainer's backward), and the engine's compute dtype."""
    amp = torch.autocast(_device_type(model), dtype=autocast) if autocast is not None else contextlib.nullcontext()
    training = model.training
    with torch.no_grad(), amp:
        if training:
            model.eval()
        try:
            yield
        finally:
            if training:
                model.train()


def _device_type(model: torch.nn.Module) -> str:
    return next(model.parameters()).device.type
