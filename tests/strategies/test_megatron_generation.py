"""The Megatron generation engine (``generation.backend: megatron``) on CPU, in spawned gloo ranks.

- In a worker (its own GPTModel at TP=1): after a bucketed refit in Megatron's own names, it samples the torch
  engine's tokens for the same seeds and weights, and its logprobs equal the torch engine's and the trainer's
  recompute (Megatron's full forward) to 1e-5 in fp32; a refit that misses a parameter is refused and the engine
  refuses to generate until a complete one.
- Colocated under tensor parallelism (TP=2): rank 0's engine decodes with its shard while rank 1 follows every
  forward through the decode link; the completions equal the TP=1 torch engine's.
  With bf16 autocast on fp32 masters, each rank decodes a bf16 copy cast once a turn, with the tokens of the
  masters under autocast.
"""

from __future__ import annotations

from typing import Any

import _megatron_engine_jobs as ejobs
import _megatron_jobs as jobs
import pytest
import torch

ATOL = 1e-5


@pytest.fixture(scope="module")
def engine_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = jobs.spawn(ejobs.engine_job, 1, str(tmp_path_factory.mktemp("megatron_engine")))
    return torch.load(f"{out}.0", weights_only=False)  # type: ignore[no-any-return]


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.parity
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_megatron_engine_samples_the_torch_engines_tokens_with_the_trainers_logprobs(
    engine_run: dict[str, Any], temperature: float
) -> None:
    got = engine_run[f"t{temperature}"]
    mg, pt = got["megatron"], got["torch"]
    assert [r["tokens"] for r in mg] == [r["tokens"] for r in pt]
    assert [r["finish"] for r in mg] == [r["finish"] for r in pt]
    assert sum(len(r["tokens"]) for r in mg) >= 3 * len(mg)  # real completions, not immediate stops
    assert _max_diff([r["logprobs"] for r in mg], [r["logprobs"] for r in pt]) <= ATOL
    assert _max_diff([r["logprobs"] for r in mg], got["recompute"]) <= ATOL
    assert all(v == 1 for r in mg for v in r["versions"])


def test_megatron_engine_loads_megatron_names_bucket_by_bucket(engine_run: dict[str, Any]) -> None:
    assert engine_run["buckets"] > 3  # 8 KiB buckets: the refit streamed in pieces
    # before the refit the engine held its own init: its greedy logprobs are not the policy's
    first = [r["logprobs"][0] for r in engine_run["before"]], [r["logprobs"][0] for r in engine_run["greedy"]]
    assert max(abs(a - b) for a, b in zip(*first, strict=True)) > 1e-3


def test_megatron_engine_refuses_an_incomplete_refit_until_a_complete_one(engine_run: dict[str, Any]) -> None:
    assert "missing keys" in engine_run["partial"] and "linear_fc2" in engine_run["partial"]
    assert "weights mix two versions" in engine_run["after_partial"]
    assert engine_run["version"] == 3
    assert [r["tokens"] for r in engine_run["after_full_refit"]] == [r["tokens"] for r in engine_run["greedy"]]


@pytest.mark.parametrize("bf16", [pytest.param(False, marks=pytest.mark.parity), True])  # bf16: a 0.02 bound
def test_colocated_tensor_parallel_decode_follows_the_leader(tmp_path: Any, bf16: bool) -> None:
    """Two turns with a trainer's step (every weight flipped in place) between them. bf16: autocast on fp32 masters,
    each rank decodes a bf16 copy of its shard, freed at the end of each turn and cast again under the new weights
    at the next (two casts); the completions are the torch engine's on the masters under autocast, the same tokens
    and logprobs within bf16 rounding (tests/rollout/test_decode_copy.py's bound)."""
    out = jobs.spawn(ejobs.tensor_parallel_bf16_job if bf16 else ejobs.tensor_parallel_job, 2, str(tmp_path))
    lead, follower = (torch.load(f"{out}.{r}", weights_only=False) for r in range(2))
    for mg, pt in zip(lead["megatron"], lead["torch"], strict=True):
        assert [r["tokens"] for r in mg] == [r["tokens"] for r in pt]
        assert _max_diff([r["logprobs"] for r in mg], [r["logprobs"] for r in pt]) <= (0.02 if bf16 else ATOL)
    assert lead["megatron"][0] != lead["megatron"][1]  # the second turn decoded the trainer's new weights
    # two batches of two (max_batch_size 2): a prefill and a decode per token, each run on the follower too
    assert all(f >= 2 * (1 + 1) for f in follower["forwards"]) and len(follower["forwards"]) == 2
    assert lead["still_training"] and follower["still_training"]
    assert lead["copied"] == follower["copied"] == bf16
    assert follower["freed"] == [bf16, bf16]  # the follower's copy goes when the leader ends the turn
    assert lead["casts"] == follower["casts"] == (2 if bf16 else None)  # once a turn
