"""Reward functions in a real ``screl fit`` (Ray, TransferQueue, the torch engine): each function's mean and std reach
metrics.csv as ``train/rewards/<name>/mean`` and ``/std`` beside the weighted total."""

from __future__ import annotations

from pathlib import Path

import _e2e_rewards
import pytest
import ray.cloudpickle
from e2e.conftest import base_config, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_per_function_figures_are_logged_beside_the_total(tmp_path: Path) -> None:
    ray.cloudpickle.register_pickle_by_value(_e2e_rewards)
    cfg = base_config(tmp_path / "run")
    cfg["trainer"].update(max_steps=2)
    cfg["grpo"].update(max_num_steps=2)
    cfg["data"]["init_args"]["task"] = {
        "class_path": "screl.rewards.WithRewardFuncs",
        "init_args": {"task": cfg["data"]["init_args"]["task"],
                      "reward_funcs": ["_e2e_rewards:count_a", "_e2e_rewards:quarter_if_even"],
                      "reward_weights": [1.0, 2.0]}}
    rows = metrics(run_fit(cfg, tmp_path))
    means, stds = column(rows, "train/rewards/count_a/mean"), column(rows, "train/rewards/count_a/std")
    # a step logs the samples reported since the previous one: the first step's refit takes the whole first burst
    assert 1 <= len(means) == len(stds) <= 2 and all(0.0 <= m <= 1.0 for m in means) and all(s >= 0 for s in stds)
    assert column(rows, "train/rewards/quarter_if_even/mean") == [0.25] * len(means), "None left out of the mean"
    assert column(rows, "train/rewards/quarter_if_even/std") == [0.0] * len(means)
    assert len(column(rows, "train/raw_reward")) == 2
