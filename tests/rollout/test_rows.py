"""The row schema: build, merge and collate of rollout rows, pinned on hand-computed chunks."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from screl.datamodule import ROW_KEYS, collate_chunk, shard_groups
from screl.rollout.engines.protocol import GenerationResult
from screl.rollout.rows import DERIVED_KEYS, FINISH_CODES, ROW_FIELDS, ROW_SCHEMA, RowField, RowSchema

# two rows: prompt [5, 6] + completion [7, 8, 9]; prompt [11, 12, 13] + completion [14]
RESULTS = [
    GenerationResult("a", [5, 6], [7, 8, 9], [-0.5, -0.25, -1.0], "length", [3, 4, 4], 3, 4),
    GenerationResult("b", [11, 12, 13], [14], [-2.0], "stop", [4], 4, 4),
]
REWARDS = [1.0, -0.5]
META: dict[str, Any] = {"keys": ["a", "b"], "trainer_version": 5, "step_groups": 1, "last_chunk": True,
                        "buffer_fill": 0.5, "start_weight": [2, 3], "not_passed_on": 7}
PAD = 99
VALUES = RowField("values", torch.float32, "value estimate, one per completion token", "per_completion_token",
                  collate_as="old_values", fill=-1.0)


def _exact(actual: Any, expected: torch.Tensor) -> None:
    assert isinstance(actual, torch.Tensor)
    assert actual.dtype == expected.dtype and actual.shape == expected.shape, (actual, expected)
    assert torch.equal(actual, expected), (actual, expected)


def _data(schema: RowSchema = ROW_SCHEMA, extra: list[dict[str, list[float]]] | None = None) -> dict[str, Any]:
    """The two rows as the worker writes them (``build``, then ``merge`` for the data-plane put)."""
    pairs = enumerate(zip(RESULTS, REWARDS, strict=True))
    return schema.merge([schema.build(r, w, extra[i] if extra else None) for i, (r, w) in pairs])


def test_the_row_fields_and_collated_keys() -> None:
    assert ROW_FIELDS == ("input_ids", "prompt_len", "loss_mask", "generation_logprobs", "token_versions", "reward",
                          "raw_reward", "finish_reason", "sample_mask")
    assert ROW_KEYS == ("input_ids", "attention_mask", "token_mask", "generation_logprobs", "token_versions",
                        "rewards", "raw_rewards", "finish_reason", "sample_mask", "start_weight")
    assert ROW_KEYS == ROW_SCHEMA.collated_keys
    assert set(DERIVED_KEYS) <= set(ROW_KEYS)


def test_build_writes_the_rows_fields() -> None:
    row = ROW_SCHEMA.build(RESULTS[1], -0.5)
    assert list(row) == list(ROW_FIELDS)
    _exact(row["input_ids"], torch.tensor([11, 12, 13, 14]))
    _exact(row["prompt_len"], torch.tensor([3]))
    _exact(row["loss_mask"], torch.tensor([1.0]))  # a single-turn completion is all the model's
    _exact(row["generation_logprobs"], torch.tensor([-2.0]))
    _exact(row["token_versions"], torch.tensor([4]))
    _exact(row["reward"], torch.tensor([-0.5]))
    _exact(row["raw_reward"], torch.tensor([-0.5]))
    _exact(row["finish_reason"], torch.tensor([FINISH_CODES["stop"]]))
    _exact(row["sample_mask"], torch.tensor([1.0]))
    masked = ROW_SCHEMA.build(RESULTS[0], 1.0, extra={"sample_mask": [0.0]})
    _exact(masked["sample_mask"], torch.tensor([0.0]))
    _exact(masked["finish_reason"], torch.tensor([FINISH_CODES["length"]]))


def test_collate_two_rows_exactly() -> None:
    batch = collate_chunk(META, _data(), PAD)
    assert list(batch) == ["trainer_version", "step_groups", "last_chunk", "buffer_fill", *ROW_KEYS]
    meta = (batch["trainer_version"], batch["step_groups"], batch["last_chunk"], batch["buffer_fill"])
    assert meta == (5, 1, True, 0.5)
    _exact(batch["input_ids"], torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 14, PAD]]))
    _exact(batch["attention_mask"], torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]))
    # position j predicts token j + 1: row 0's completion is predicted at 1..3, row 1's at 2
    _exact(batch["token_mask"], torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 0.0]]))
    _exact(batch["generation_logprobs"], torch.tensor([[0.0, -0.5, -0.25, -1.0], [0.0, 0.0, -2.0, 0.0]]))
    # the trainer's version (5) where no completion token is predicted
    _exact(batch["token_versions"], torch.tensor([[5, 3, 4, 4], [5, 5, 4, 5]]))
    _exact(batch["rewards"], torch.tensor([1.0, -0.5]))
    _exact(batch["raw_rewards"], torch.tensor([1.0, -0.5]))
    _exact(batch["finish_reason"], torch.tensor([1, 0]))  # length, stop
    _exact(batch["sample_mask"], torch.tensor([1.0, 1.0]))
    _exact(batch["start_weight"], torch.tensor([2, 3]))


@pytest.mark.parametrize("data", [{}, {name: [] for name in ROW_FIELDS}])
def test_collate_an_empty_chunk(data: dict[str, Any]) -> None:
    batch = collate_chunk({"keys": [], "trainer_version": 2, "last_chunk": True}, data, PAD)
    assert list(batch) == ["trainer_version", "last_chunk", *ROW_KEYS]
    empty_long, empty_float = torch.zeros((0, 1), dtype=torch.long), torch.zeros((0, 1))
    for key in ("input_ids", "attention_mask", "token_versions"):
        _exact(batch[key], empty_long)
    for key in ("token_mask", "generation_logprobs"):
        _exact(batch[key], empty_float)
    _exact(batch["rewards"], torch.zeros(0))
    _exact(batch["raw_rewards"], torch.zeros(0))
    _exact(batch["finish_reason"], torch.zeros(0, dtype=torch.long))
    _exact(batch["sample_mask"], torch.zeros(0))
    _exact(batch["start_weight"], torch.zeros(0, dtype=torch.long))


def test_a_new_per_completion_token_field_collates_aligned_and_shards() -> None:
    schema = RowSchema((*ROW_SCHEMA.fields, VALUES))
    assert schema.names == (*ROW_FIELDS, "values")
    assert schema.collated_keys == (*ROW_KEYS[:-1], "old_values", "start_weight")
    data = _data(schema, extra=[{"values": [0.5, 0.25, 0.125]}, {"values": [2.0]}])
    batch = collate_chunk(META, data, PAD, schema=schema)
    assert "values" not in batch
    _exact(batch["old_values"], torch.tensor([[-1.0, 0.5, 0.25, 0.125], [-1.0, -1.0, 2.0, -1.0]]))
    plain = collate_chunk(META, _data(), PAD)
    assert list(batch) == [*list(plain)[:-1], "old_values", "start_weight"]
    for key in ROW_KEYS:
        _exact(batch[key], plain[key])  # the other tensors are unchanged
    second = shard_groups(batch, group_size=1, num_shards=2, shard=1, schema=schema)
    _exact(second["old_values"], torch.tensor([[-1.0, -1.0, 2.0, -1.0]]))
    _exact(second["input_ids"], torch.tensor([[11, 12, 13, 14, PAD]]))
    assert (second["chunk_rows"], second["chunk_valid_tokens"], second["dp_shards"]) == (2, 4.0, 2)


def test_a_scalar_field_collates_stacked_under_its_own_name() -> None:
    schema = RowSchema((*ROW_SCHEMA.fields, RowField("turns", torch.int64, "[turns]", "scalar")))
    batch = collate_chunk(META, _data(schema, extra=[{"turns": [1]}, {"turns": [3]}]), PAD, schema=schema)
    _exact(batch["turns"], torch.tensor([1, 3]))
    assert schema.collated_keys[-2:] == ("turns", "start_weight")


def test_build_needs_every_fields_values() -> None:
    schema = RowSchema((*ROW_SCHEMA.fields, VALUES))
    with pytest.raises(ValueError, match=r"no values for the row fields \['values'\]"):
        schema.build(RESULTS[0], 1.0)


def test_merge_rejects_a_row_with_other_fields() -> None:
    row = ROW_SCHEMA.build(RESULTS[0], 1.0)
    del row["reward"]
    with pytest.raises(ValueError, match="a row has fields"):
        ROW_SCHEMA.merge([row])


@pytest.mark.parametrize(("fields", "message"), [
    ((*ROW_SCHEMA.fields, RowField("more_ids", torch.int64, "", "sequence")),
     "exactly one 'sequence' field, got 2"),
    (ROW_SCHEMA.fields[:1] + ROW_SCHEMA.fields[2:], "exactly one 'prompt_len' field, got 0"),
    ((*ROW_SCHEMA.fields, RowField("reward", torch.float32, "", "scalar", collate_as="r2")),
     r"field names \['reward'\] appear more than once"),
    ((*ROW_SCHEMA.fields, RowField("r2", torch.float32, "", "scalar", collate_as="rewards")),
     r"collated names \['rewards'\] appear more than once"),
    ((*ROW_SCHEMA.fields, RowField("token_mask", torch.float32, "", "per_completion_token")),
     r"collated names \['token_mask'\] appear more than once"),
])
def test_schema_rejects_an_ambiguous_declaration(fields: tuple[RowField, ...], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RowSchema(fields)


def test_field_rejects_an_unknown_kind() -> None:
    with pytest.raises(ValueError, match="kind 'ragged' is not one of"):
        RowField("x", torch.float32, "", "ragged")  # type: ignore[arg-type]
