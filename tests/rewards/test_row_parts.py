"""Each row's per-function reward values travel with its chunk: kept by key in the controller, collated as
``rewards/<name>`` (NaN where a row has none), sliced with the rows by a data-parallel shard."""

from __future__ import annotations

import math

import torch

from screl.datamodule import collate_chunk, shard_groups
from screl.rewards.stats import RowRewardParts


def test_parts_are_taken_once_per_key_and_the_oldest_go_past_capacity() -> None:
    parts = RowRewardParts(capacity=2)
    parts.add("a", {"f": 1.0, "g": 0.5})
    parts.add("b", {"f": 2.0})
    parts.add("none", None)  # a task without reward functions: nothing kept
    parts.add("c", {"g": 3.0})  # past capacity: "a" goes
    assert len(parts) == 2
    assert parts.take(["a", "b", "c"]) == {"f": [None, 2.0, None], "g": [None, None, 3.0]}
    assert parts.take(["b", "c"]) == {} and len(parts) == 0  # taken once


def _rows(n: int) -> dict[str, list[torch.Tensor]]:
    return {"input_ids": [torch.tensor([5, 6, 7, 8]) for _ in range(n)], "prompt_len": [torch.tensor([2])] * n,
            "generation_logprobs": [torch.tensor([-0.5, -0.25])] * n, "token_versions": [torch.tensor([0, 0])] * n,
            "reward": [torch.tensor(float(i)) for i in range(n)], "raw_reward": [torch.tensor(float(i)) for i in range(n)],
            "finish_reason": [torch.tensor(0)] * n, "loss_mask": [torch.tensor([1, 1])] * n,
            "sample_mask": [torch.tensor(1.0)] * n}


def test_a_chunk_carries_each_functions_value_per_row_and_a_shard_keeps_its_rows() -> None:
    meta = {"trainer_version": 0, "keys": [f"k{i}" for i in range(4)], "start_weight": [0] * 4,
            "reward_parts": {"f": [0.0, 1.0, None, 3.0]}}
    batch = collate_chunk(meta, _rows(4), pad_id=0)
    f = batch["rewards/f"]
    assert f.shape == (4,) and f[0] == 0.0 and f[3] == 3.0 and math.isnan(float(f[2]))
    second = shard_groups(batch, group_size=2, num_shards=2, shard=1)
    assert math.isnan(float(second["rewards/f"][0])) and second["rewards/f"][1] == 3.0  # rows 2 and 3
    assert second["rewards"].tolist() == [2.0, 3.0]
    assert "rewards/f" not in collate_chunk({**meta, "reward_parts": {}}, _rows(4), pad_id=0)
