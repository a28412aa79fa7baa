"""The pure parts of validation during training: pass@k, the val/* aggregate, and when a version is due."""

from __future__ import annotations

import pytest

from screl.config import GRPOConfig, ValidationConfig
from screl.controller.validation import ValidationRunner, aggregate, pass_at_k


@pytest.mark.parametrize(("n", "c", "k", "expected"), [
    (4, 1, 1, 1 - 3 / 4),      # 1 - C(3,1)/C(4,1)
    (4, 1, 4, 1.0),            # C(3,4) = 0: one pass among all four samples
    (4, 0, 2, 0.0),
    (5, 2, 3, 1 - 1 / 10),     # 1 - C(3,3)/C(5,3)
    (1, 1, 1, 1.0),
])
def test_pass_at_k_is_the_unbiased_estimator(n: int, c: int, k: int, expected: float) -> None:
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts() -> None:
    with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n, got n=2 c=3 k=1"):
        pass_at_k(2, 3, 1)


def test_aggregate_by_hand() -> None:
    samples = [
        {"prompt_id": 1, "reward": 1.0, "response_len": 4, "finish_reason": "length"},
        {"prompt_id": 1, "reward": 0.0, "response_len": 8, "finish_reason": "stop"},
        {"prompt_id": 2, "reward": 0.5, "response_len": 2, "finish_reason": "stop"},
        {"prompt_id": 2, "reward": 0.5, "response_len": 2, "finish_reason": "length"},
    ]
    # prompt 1: one pass of two -> pass@1 1/2, pass@2 1; prompt 2: none passes (0.5 < 1.0)
    assert aggregate(samples, num_samples=2, pass_threshold=1.0) == {
        "val/reward_mean": 0.5, "val/response_length": 4.0, "val/truncated_fraction": 0.5, "val/prompts": 2.0,
        "val/pass@1": 0.25, "val/pass@2": 0.5,
    }
    assert aggregate(samples, num_samples=2, pass_threshold=0.5)["val/pass@1"] == pytest.approx((0.5 + 1.0) / 2)


def _runner(**algo: object) -> ValidationRunner:
    cfg = GRPOConfig(**algo, validation=ValidationConfig(max_prompts=3))  # type: ignore[arg-type]
    return ValidationRunner(cfg, [9, 8, 7, 6], 16, 0, [object(), object()], lambda w: None, lambda e: None)


def test_which_versions_are_due() -> None:
    r = _runner(val_period=5, val_at_start=True)
    assert [v for v in range(12) if r.due(v)] == [0, 5, 10]
    assert not r.due(11, final=True), "val_at_end is off"
    assert _runner(val_period=5, val_at_end=True).due(11, final=True)
    assert not _runner(val_period=5).due(0), "version 0 only with val_at_start"
    r.started.add(5)
    assert not r.due(5), "a version is validated once"


def test_samples_split_whole_prompts_over_workers_with_version_independent_seeds() -> None:
    r = _runner(val_period=1)
    parts = r._samples(3)
    assert [[pid for pid, _, _ in p] for p in parts] == [[9, 7], [8]], "max_prompts=3 keeps the first three"
    assert parts == r._samples(4), "every validation scores the same requests"


def test_the_checker_flags_a_validation_ahead_of_training_or_off_its_pin() -> None:
    from screl.data import TrainStepEvent, ValidateEvent, check_events

    log = [ValidateEvent(trainer_version=0, extra={"token_versions": [0]}),
           TrainStepEvent(step=0, group_ids=()),
           ValidateEvent(trainer_version=1, extra={"token_versions": [0, 1]}),
           ValidateEvent(trainer_version=2, extra={"token_versions": [2]})]
    rules = [(v.rule, v.message) for v in check_events(log).violations]
    assert rules == [("validate-pinned", "validation of version 1 generated with versions [0, 1]"),
                     ("validate-version", "validation of version 2 after 1 steps")]
