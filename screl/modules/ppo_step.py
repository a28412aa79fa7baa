"""PPO's step: its checked block, the data every epoch of it shares, its whitening, and its minibatches.

Every epoch, policy and critic alike, shuffles the step's ``N`` rows with a permutation seeded by the run's seed
(``seed_everything``), the step (``trainer_version``), the model and the epoch (:func:`minibatch_permutation`), cuts
it into ``k = ppo.num_minibatches`` minibatches of ``N / k`` rows and takes one optimizer update per minibatch. A
minibatch's token-level loss is normalized by its own valid tokens (a sequence-level loss by its rows), as in every
PPO implementation, so each update is the mean over its minibatch. ``k = 1`` is one unshuffled full-batch update per
epoch; a minibatch larger than ``micro_batch_size`` still accumulates gradients over micro-batches.

Invariant: the permutation is a function of its arguments only, the same on every data-parallel replica and in a
resumed run; each replica takes the rows of every global minibatch that its shard holds, possibly none
(:func:`shard_minibatches`), so a step at DP = n equals the one-process step up to float summation order.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from screl.config import PPOConfig, from_dict

if TYPE_CHECKING:
    from screl.modules.compute import PolicyCompute


def checked_ppo_config(algo: dict[str, Any] | PPOConfig | None) -> PPOConfig:
    """``PPO``'s ``ppo`` block (``algo``), checked: ``ppo.num_minibatches`` cuts the step's rows into equal
    minibatches."""
    ppo: PPOConfig = algo if isinstance(algo, PPOConfig) else from_dict(PPOConfig, algo)
    rows, k = ppo.num_prompts_per_step * ppo.num_generations_per_prompt, ppo.num_minibatches
    if k < 1 or rows % k:
        raise ValueError(f"ppo.num_minibatches={k}: must be >= 1 and divide the step's num_prompts_per_step x "
                         f"num_generations_per_prompt = {rows} rows")
    return ppo


def minibatch_permutation(seed: int, step: int, model: str, epoch: int, rows: int) -> Tensor:
    """The order of a step's ``rows`` in one epoch of ``model`` (``policy`` or ``critic``) with minibatches.

    A function of its arguments only (a BLAKE2 digest of them seeds a CPU generator), so every data-parallel
    replica draws the same permutation and a resumed run repeats it."""
    digest = hashlib.blake2b(f"screl-ppo:{seed}:{step}:{model}:{epoch}".encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randperm(rows, generator=generator)


def shard_minibatches(order: Tensor, num_minibatches: int, offset: int, local_rows: int) -> list[Tensor]:
    """Each global minibatch's rows that one shard holds, as indices into the shard, in ``order``'s order.

    ``order``: the step's global row order (a permutation of ``0 .. N - 1``, ``N`` divisible by
    ``num_minibatches``); the shard holds global rows ``offset .. offset + local_rows - 1``. Minibatch ``j`` is
    ``order[j * N / k : (j + 1) * N / k]``; a shard may hold none of its rows (an empty index tensor)."""
    rows = order.numel()
    if rows % num_minibatches:
        raise ValueError(f"ppo.num_minibatches={num_minibatches}: a step of {rows} rows does not split into "
                         f"{num_minibatches} equal minibatches; set it to a divisor of {rows}")
    size = rows // num_minibatches
    out = []
    for j in range(num_minibatches):
        part = order[j * size:(j + 1) * size]
        out.append(part[(part >= offset) & (part < offset + local_rows)] - offset)
    return out


@dataclass(frozen=True)
class StepData:
    """What every epoch of one RL step shares (all detached): this replica's rows of the step."""

    input_ids: Tensor
    attention_mask: Tensor
    token_mask: Tensor
    sample_mask: Tensor
    valid_tokens: Tensor
    """The step's (a minibatch's) valid tokens over every replica, at least 1: the token-level loss normalizer."""
    old_values: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    returns: Tensor
    global_rows: int
    """Rows of the whole step (of a minibatch: of the whole minibatch), over every replica."""
    row_offset: int
    """The step's row index of this replica's first row."""

    @property
    def rows(self) -> int:
        """This replica's rows."""
        return int(self.input_ids.shape[0])

    def take(self, rows: Tensor) -> StepData:
        """The same data restricted to ``rows`` (indices into this replica's rows), in that order."""
        per_row = ("input_ids", "attention_mask", "token_mask", "sample_mask", "old_values", "old_logprobs",
                   "behaviour_logprobs", "advantages", "returns")
        return dataclasses.replace(self, **{k: getattr(self, k)[rows] for k in per_row})

    def stats(self) -> dict[str, Tensor]:
        """The advantages' and the returns' statistics over this replica's valid tokens."""
        mask = (self.token_mask * self.sample_mask[:, None]).bool()
        adv, ret = self.advantages[mask], self.returns[mask]
        return {
            "ppo/advantages_mean": adv.mean(), "ppo/advantages_std": adv.std() if adv.numel() > 1 else adv.sum() * 0,
            "ppo/advantages_min": adv.min(), "ppo/advantages_max": adv.max(),
            "ppo/returns_mean": ret.mean(), "ppo/returns_std": ret.std() if ret.numel() > 1 else ret.sum() * 0,
        }


def whiten_over_shards(adv: Tensor, valid: Tensor, batch: dict[str, Any], compute: PolicyCompute,
                       eps: float = 1e-8) -> Tensor:
    """``screl.algos.masked_whiten`` (the same operations) with the mean and the population variance taken
    over every replica's valid tokens."""
    m = valid.to(adv.dtype)
    x = torch.where(valid, adv, torch.zeros_like(adv))
    count = compute.sum_over_shards(m.sum(), batch).clamp(min=1.0)
    mean = compute.sum_over_shards((x * m).sum(), batch) / count
    var = compute.sum_over_shards((((x - mean) * m) ** 2).sum(), batch) / count
    return ((x - mean) * torch.rsqrt(var + eps)) * m


def epoch_minibatches(batch: dict[str, Any], data: StepData, model: str, epoch: int, num_minibatches: int,
                      compute: PolicyCompute) -> list[StepData]:
    """One epoch's minibatches of this replica's rows, each with its global valid-token and row counts.

    ``num_minibatches: 1``: the step itself, unshuffled. Otherwise the seeded permutation cut into equal parts, each
    replica keeping its shard's rows of every part."""
    k = num_minibatches
    if k == 1:
        return [data]
    seed = int(os.environ.get("PL_GLOBAL_SEED", "0"))
    order = minibatch_permutation(seed, int(batch["trainer_version"]), model, epoch, data.global_rows)
    parts = shard_minibatches(order, k, data.row_offset, data.rows)
    mask = data.token_mask * data.sample_mask[:, None]
    valid = compute.sum_over_shards(torch.stack([mask[rows].sum() for rows in parts]), batch).clamp_min(1.0)
    return [dataclasses.replace(data.take(rows), valid_tokens=valid[j], global_rows=data.global_rows // k)
            for j, rows in enumerate(parts)]
