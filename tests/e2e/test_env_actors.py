"""Environments in Ray actors of their own (``MultiTurnWorkflow(env_actors=True)``) give the same conversations
as environments in the worker's process: same seeds, same engine, same rows."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch

from screl.envs.calculator import CalculatorTask
from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.workflows.multiturn import MultiTurnWorkflow
from screl.rollout.workflows.workflow import RolloutItem

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


def test_environment_actors_reproduce_in_process_environments() -> None:
    policy = TinyCausalLM(hidden_size=32, num_layers=1)
    engine = TorchGenerationEngine(policy, seed=0)
    tok = policy.build_tokenizer()
    task = CalculatorTask(max_operand=3)
    items = [RolloutItem(f"g{p.prompt_id}_g0_a1", p, (), SamplingParams(max_new_tokens=4, seed=i))
             for i, p in enumerate(task.prompts()[:4])]

    async def generate(requests: list[Any]) -> list[Any]:
        return engine.generate(requests)

    rows = {}
    for actors in (False, True):
        wf = MultiTurnWorkflow(task, tok, max_turns=3, max_total_tokens=64, env_actors=actors)
        rows[actors] = asyncio.run(wf.run(items, generate))
    for local, remote in zip(rows[False], rows[True], strict=True):
        assert local.status == remote.status == "sealed"
        # exact: the environment is pure Python wherever it runs, and the one engine in this process decodes every
        # turn as its own batch of one with the turn's seed: the same kernels on the same inputs in both runs
        assert local.reward == remote.reward
        assert all(torch.equal(local.row[k], remote.row[k]) for k in local.row)
    assert any(len(o.row["loss_mask"]) > int(o.row["loss_mask"].sum()) for o in rows[True]), \
        "no conversation went past its first turn: nothing was checked"
