"""Reward functions inside a rollout (the real torch engine, the default single-turn workflow): each sealed row carries
its functions' values to the report, an unscorable sample is masked out of the loss, a non-finite value is a data
failure of that sample alone."""

from __future__ import annotations

import asyncio
import math
from typing import Any

from screl.envs import Addition
from screl.models import TinyCausalLM
from screl.rewards import WithRewardFuncs
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.workflows.workflow import RolloutItem, SingleTurnWorkflow


def by_b(completion_ids: list[list[int]], b: list[int], **kwargs: Any) -> list[float | None]:
    """b == 0: 1.0; b == 1: does not apply; b == 2: NaN."""
    return [{0: 1.0, 1: None, 2: math.nan}.get(v, 0.0) for v in b]


def tokens(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


def test_the_workflow_reports_parts_masks_unscorable_samples_and_fails_non_finite_ones() -> None:
    task = WithRewardFuncs(Addition(), reward_funcs=[by_b], reward_weights=[3.0])
    policy = TinyCausalLM(hidden_size=32, num_layers=1)
    engine, tok = TorchGenerationEngine(policy, seed=0), policy.build_tokenizer()
    items = [RolloutItem(f"g{p.prompt_id}_g0_a1", p, tuple(tok(p.text, add_special_tokens=False)["input_ids"]),
                         SamplingParams(max_new_tokens=5, min_new_tokens=5, seed=i))
             for i, p in enumerate(task.prompts()[:4])]

    async def generate(requests: list[Any]) -> list[Any]:
        return engine.generate(requests)

    out = asyncio.run(SingleTurnWorkflow(task=task, tokenizer=tok).run(items, generate))
    assert [o.status for o in out] == ["sealed", "sealed", "data_error", "sealed"]
    assert "'by_b' returned nan for sample 2 (prompt_id 2)" in out[2].detail, "one batch, the culprit alone fails"
    assert [o.reward for o in out] == [3.0, 0.0, 0.0, 0.0]
    assert [o.reward_parts for o in out] == [{"by_b": 1.0}, {}, None, {"by_b": 0.0}]
    masks = [float(o.row["sample_mask"][0]) for o in out if o.row is not None]
    assert masks == [1.0, 0.0, 1.0], "every function returned None: no gradient from it (TRL zeroes its advantage)"

    both = WithRewardFuncs(Addition(), reward_funcs=[tokens, by_b])
    sealed = asyncio.run(SingleTurnWorkflow(task=both, tokenizer=tok).run(items[:2], generate))
    assert [o.reward_parts for o in sealed] == [{"tokens": 5.0, "by_b": 1.0}, {"tokens": 5.0}]
    assert [float(o.row["sample_mask"][0]) for o in sealed if o.row is not None] == [1.0, 1.0]
