"""The continuous decode path's per-slot sampling state, on the device: each slot's sampling parameters, uniforms,
tokens, logprobs, token count, finish code and position, so a decode step samples, records and stops rows with no
host sync (:meth:`SlotState.sample`); the host reads it every few steps (:meth:`SlotState.read`).

Invariant: a live slot's token ``j`` is drawn at its uniform ``j`` by :func:`~.torch_sampling.draw`, the static
path's math, so a row's tokens depend on its seed, prompt and weights only (not on its slot or batch mates).
"""

from __future__ import annotations

import torch
from torch import Tensor

from screl.rollout.engines.torch_sampling import Row, draw

RUNNING, STOPPED, LENGTH, PREFILLING = 0, 1, 2, 3
"""A slot's code: decoding, finished by a stop token or by ``max_new_tokens``, or still prefilling (a prompt that
goes into the KV cache over several steps: it neither draws nor advances)."""


class SlotState:
    """Device tensors of ``slots`` rows with up to ``steps`` new tokens each over ``vocab`` logits."""

    def __init__(self, slots: int, steps: int, vocab: int, device: torch.device) -> None:
        self.steps, self.vocab = steps, vocab
        self.temps = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_p = torch.ones(slots, dtype=torch.float32, device=device)
        self.top_k = torch.full((slots,), vocab, dtype=torch.long, device=device)
        self.min_new = torch.zeros(slots, dtype=torch.long, device=device)
        self.max_new = torch.ones(slots, dtype=torch.long, device=device)
        self.stop_mask = torch.zeros(slots, vocab, dtype=torch.bool, device=device)
        self.uniforms = torch.zeros(slots, steps, dtype=torch.float64, device=device)
        self.tokens = torch.zeros(slots, steps, dtype=torch.long, device=device)
        self.logprobs = torch.zeros(slots, steps, dtype=torch.float32, device=device)
        self.count = torch.zeros(slots, dtype=torch.long, device=device)  # tokens drawn
        self.code = torch.full((slots,), LENGTH, dtype=torch.long, device=device)  # a free slot is not running
        self.feed = torch.zeros(slots, dtype=torch.long, device=device)  # the token the next decode step feeds
        self.pos = torch.zeros(slots, dtype=torch.long, device=device)  # positions in the slot's KV cache

    def join(self, slot: int, row: Row) -> None:
        """Load ``row``'s parameters and uniforms into ``slot`` (its tokens so far count; host to device only)."""
        sp, dev = row.sampling, self.temps.device
        self.temps[slot], self.top_p[slot] = sp.temperature, sp.top_p
        self.top_k[slot] = sp.top_k or self.vocab
        self.min_new[slot], self.max_new[slot] = sp.min_new_tokens, sp.max_new_tokens
        mask = torch.zeros(self.vocab, dtype=torch.bool)
        mask[[t for t in row.stop_ids if 0 <= t < self.vocab]] = True
        self.stop_mask[slot] = mask.to(dev)
        u = row.uniforms[: self.steps]
        self.uniforms[slot, : len(u)] = u.to(dev)
        self.uniforms[slot, len(u):] = float(u[-1])
        n = len(row.tokens)
        self.count[slot], self.code[slot] = n, RUNNING
        if n:
            self.tokens[slot, :n] = torch.tensor(row.tokens, device=dev)
            self.logprobs[slot, :n] = torch.tensor(row.logprobs, device=dev)

    def grow(self, steps: int) -> None:
        """Room for ``steps`` tokens a slot (rows that join a run may want more than those before them): the
        per-step tensors get more columns, the slots' values so far kept (between steps only)."""
        if steps <= self.steps:
            return
        more = steps - self.steps
        self.uniforms = torch.cat([self.uniforms, self.uniforms[:, -1:].expand(-1, more)], dim=1)
        self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(self.tokens.shape[0], more)], dim=1)
        self.logprobs = torch.cat([self.logprobs, self.logprobs.new_zeros(self.logprobs.shape[0], more)], dim=1)
        self.steps = steps

    def leave(self, slot: int) -> None:
        self.code[slot] = LENGTH

    def sample(self, logits: Tensor, filtered: bool, banned: Tensor | None) -> None:
        """Draw a token for every running slot ``0 .. len(logits) - 1`` and record it, all on the device."""
        hi = logits.shape[0]
        live = self.code[:hi] == RUNNING
        step = self.count[:hi]
        at = step.clamp(max=self.steps - 1)
        params = _Params(self, hi)
        u = self.uniforms[:hi].gather(1, at[:, None]).squeeze(1)
        tokens, logp = draw(logits, params, u, step, banned, filtered)
        rows = torch.arange(hi, device=logits.device)
        self.tokens[rows, at] = torch.where(live, tokens, self.tokens[rows, at])
        self.logprobs[rows, at] = torch.where(live, logp, self.logprobs[rows, at])
        count = step + live.long()
        stop = self.stop_mask[:hi].gather(1, tokens[:, None]).squeeze(1) & (count > self.min_new[:hi])
        code = torch.where(stop, STOPPED, torch.where(count >= self.max_new[:hi], LENGTH, RUNNING))
        self.code[:hi] = torch.where(live, code, self.code[:hi])
        self.count[:hi] = count
        self.feed[:hi] = torch.where(live, tokens, self.feed[:hi])

    def advance(self, hi: int) -> None:
        """After a decode step: each running slot's fed token now holds a position."""
        self.pos[:hi] += (self.code[:hi] == RUNNING).long()

    def read(self, hi: int, lo: int, up: int) -> tuple[list[int], list[int], list[list[int]], list[list[float]]]:
        """One device-to-host copy: each slot's count and code, and its tokens and logprobs ``lo .. up - 1`` (slots
        ``0 .. hi - 1``; the host has every slot's tokens below ``lo``, none drew past ``up``)."""
        up = min(max(up, lo), self.steps)
        packed = torch.cat([self.count[:hi, None].double(), self.code[:hi, None].double(),
                            self.tokens[:hi, lo:up].double(), self.logprobs[:hi, lo:up].double()], dim=1).cpu()
        n = up - lo
        counts = packed[:, 0].long().tolist()
        codes = packed[:, 1].long().tolist()
        return counts, codes, packed[:, 2: 2 + n].long().tolist(), packed[:, 2 + n:].tolist()


class _Params:
    """The sampling parameters of slots ``0 .. hi - 1`` as :func:`draw` reads them (views, no copy)."""

    def __init__(self, s: SlotState, hi: int) -> None:
        self.temps, self.top_p, self.top_k = s.temps[:hi], s.top_p[:hi], s.top_k[:hi]
        self.min_new, self.stop_mask = s.min_new[:hi], s.stop_mask[:hi]
