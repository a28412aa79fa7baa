"""GRPO on the calculator tool task: the direct multi-turn workflow learns (sync, so its curve does not depend on
the machine's load), an agent written against the OpenAI API (the official client, over the policy server) trains
through token capture, and so does an OpenAI Agents SDK agent with function calling (configs/grpo_agent_sdk_tiny.yaml)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from screl.data.event_check import check_events

from .conftest import ROOT, column, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def _config(name: str, tmp_path: Path, steps: int) -> dict[str, Any]:
    cfg: dict[str, Any] = copy.deepcopy(yaml.safe_load((ROOT / "configs" / name).read_text()))
    cfg["trainer"].update(max_steps=steps, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False,
                          enable_model_summary=False)
    cfg["grpo"]["max_num_steps"] = steps
    cfg["data"]["init_args"]["step_timeout_s"] = 120
    return cfg


def test_the_tool_task_reward_rises_and_every_row_is_a_conversation(tmp_path: Path) -> None:
    cfg = _config("grpo_tool_tiny.yaml", tmp_path, steps=30)
    # sync (no lookahead): which weights generate each group does not depend on the machine's load, so the learning
    # curve is the same on a loaded CI machine (async, the reward once rose 0.014 -> 0.056 there against 0.1)
    cfg["async_rl"]["sampler"] = {"name": "in_order", "max_lookahead_versions": 0}
    run_dir = run_fit(cfg, tmp_path)
    rows = metrics(run_dir)
    rewards = column(rows, "reward")
    assert len(rewards) == 30
    first, last = sum(rewards[:8]) / 8, sum(rewards[-8:]) / 8
    assert last > first + 0.1, (first, last, rewards)
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()


def test_an_openai_client_agent_trains_through_the_server(tmp_path: Path) -> None:
    cfg = _config("grpo_agent_tiny.yaml", tmp_path, steps=4)
    run_dir = run_fit(cfg, tmp_path)
    rows = metrics(run_dir)
    assert len(column(rows, "reward")) == 4
    # a conversation's row trains on the model's tokens only: at most max_turns x max_new_tokens per row
    tokens = column(rows, "train/num_valid_tokens")
    per_step = cfg["grpo"]["num_prompts_per_step"] * cfg["grpo"]["num_generations_per_prompt"]
    assert tokens and all(0 < t <= per_step * 3 * 4 for t in tokens), tokens
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()


def test_an_agents_sdk_agent_learns_to_call_the_tool(tmp_path: Path) -> None:
    pytest.importorskip("agents", reason="the OpenAI Agents SDK is in the agents and dev extras")
    # measured (the curve is the same in every run: sessions sample by their siblings' seeds): the reward is ~0.01
    # for 6 steps, then rises to 0.2 by step 12 and to 0.25 (every rollout calls the tool) by step 14
    steps = 16
    cfg = _config("grpo_agent_sdk_tiny.yaml", tmp_path, steps=steps)
    run_dir = run_fit(cfg, tmp_path)
    rewards = column(metrics(run_dir), "reward")
    assert len(rewards) == steps
    # the reward needs the tool call: 0.25 for a well-formed call (an unaided right sum is rare for the tiny model)
    first, last = sum(rewards[:4]) / 4, sum(rewards[-4:]) / 4
    assert last > first + 0.1, (first, last, rewards)
    report = check_events(run_dir, cfg["async_rl"]["sampler"], final=True)
    assert report.ok, report.format()
