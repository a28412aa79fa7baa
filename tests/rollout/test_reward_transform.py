"""Reward shaping and scaling: DAPO's overlong penalty, a custom function, clip-and-map, by hand."""

from __future__ import annotations

import pickle

import pytest

from screl.config import GRPOConfig, from_dict
from screl.rollout.workflows.reward_transform import RewardTransform, load_shaping_fn, reward_transform


def halve(reward: float, response_length: int, finish_reason: str) -> float:
    return reward / 2 if finish_reason == "length" else reward


@pytest.mark.parametrize(("length", "penalty"), [(0, 0.0), (12, 0.0), (13, -0.125), (14, -0.25), (16, -0.5),
                                                 (20, -0.5)])
def test_overlong_penalty_ramps_over_the_buffer(length: int, penalty: float) -> None:
    # L_max 16, buffer 4, factor 0.5: 0 up to 12 tokens, then -(len - 12) / 4 * 0.5, capped at L_max
    rt = RewardTransform(overlong_buffer_length=4, overlong_penalty_factor=0.5, max_response_length=16)
    assert rt.overlong_penalty(length) == penalty
    assert rt(1.0, length, "stop") == 1.0 + penalty


def test_shaping_then_scaling_in_order() -> None:
    rt = RewardTransform(overlong_buffer_length=4, max_response_length=8, shaping_fn=f"{__name__}.halve",
                         scaling=(-1.0, 1.0, 0.0, 10.0))
    # 0.8 - 1.0 (8 tokens: full penalty) = -0.2; halved (length) = -0.1; [-1, 1] -> [0, 10]: 4.5
    assert rt(0.8, 8, "length") == pytest.approx(4.5, abs=1e-12)
    assert rt(5.0, 0, "stop") == 10.0  # clipped to source_max first
    again = pickle.loads(pickle.dumps(rt))  # workers get it by pickle; the function is re-imported by path
    assert again(0.8, 8, "length") == rt(0.8, 8, "length")


def test_the_config_builds_the_transform() -> None:
    off = from_dict(GRPOConfig, {})
    assert reward_transform(off, max_new_tokens=16) is None
    on = from_dict(GRPOConfig, {"reward_shaping": {"enabled": True, "overlong_buffer_length": 4},
                                "reward_scaling": {"enabled": True, "source_min": -1.0, "source_max": 1.0}})
    rt = reward_transform(on, max_new_tokens=16)
    assert rt == RewardTransform(overlong_buffer_length=4, max_response_length=16, scaling=(-1.0, 1.0, 0.0, 1.0))


def test_a_shaping_function_that_cannot_be_used_names_the_key() -> None:
    with pytest.raises(ValueError, match=r"reward_shaping.class_path='nope.fn': cannot import it"):
        load_shaping_fn("nope.fn")
    with pytest.raises(ValueError, match=r"is not callable as fn\(reward, response_length, finish_reason\)"):
        load_shaping_fn("screl.rollout.workflows.reward_transform.__doc__")
