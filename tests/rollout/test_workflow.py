"""The single-turn workflow and the docs' custom workflow, on the real torch engine (no Ray)."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import pytest

from screl.envs import CountLetter, PromptRecord, Task
from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROW_SCHEMA
from screl.rollout.workflows.workflow import RolloutItem, SingleTurnWorkflow

DOC = Path(__file__).resolve().parents[2] / "docs" / "extending.md"


class _Flaky(CountLetter):
    """Its verifier raises whenever the batch holds the second prompt (together or alone)."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[int] = []
        self.bad = self.prompts()[1].prompt_id

    def rewards(self, prompts: Any, completions: Any) -> list[float]:
        self.batches.append(len(prompts))
        if any(p.prompt_id == self.bad for p in prompts):
            raise ValueError("odd")
        return super().rewards(prompts, completions)


def _setup(task: Task) -> tuple[TorchGenerationEngine, list[RolloutItem], Any]:
    policy = TinyCausalLM(hidden_size=32, num_layers=1)
    engine = TorchGenerationEngine(policy, seed=0)
    tok = policy.build_tokenizer()
    prompts: list[PromptRecord] = task.prompts()[:3]
    items = [RolloutItem(f"g{p.prompt_id}_g0_a1", p, tuple(tok(p.text, add_special_tokens=False)["input_ids"]),
                         SamplingParams(max_new_tokens=6, min_new_tokens=6, seed=i)) for i, p in enumerate(prompts)]
    return engine, items, tok


async def _generate_with(engine: TorchGenerationEngine, requests: list[Any]) -> list[Any]:
    return engine.generate(requests)


def test_single_turn_rows_follow_the_schema_and_rewards_are_batched() -> None:
    task = _Flaky()
    engine, items, tok = _setup(task)
    wf = SingleTurnWorkflow(task=task, tokenizer=tok)
    out = asyncio.run(wf.run(items, lambda reqs: _generate_with(engine, reqs)))
    assert [o.attempt for o in out] == [i.attempt for i in items]
    sealed = [o for o in out if o.status == "sealed"]
    failed = [o for o in out if o.status == "data_error"]
    assert task.batches == [3, 1, 1, 1], "one Task.rewards call, then one by one to find the culprit"
    assert [o.status for o in out] == ["sealed", "data_error", "sealed"]
    assert len(sealed) + len(failed) == 3 and all("odd" in o.detail for o in failed)
    for o in sealed:
        assert o.row is not None and set(o.row) == set(ROW_SCHEMA.names)
        assert o.row["reward"].item() == pytest.approx(o.reward)
        assert o.row["generation_logprobs"].numel() == o.response_len == 6


def test_the_docs_workflow_runs_and_penalizes_length() -> None:
    code = re.search(r"```python\n(.*?)```", DOC.read_text(), re.S)
    assert code is not None, "docs/extending.md lost its workflow example"
    assert len(code.group(1).splitlines()) < 60
    namespace: dict[str, Any] = {}
    exec(compile(code.group(1), str(DOC), "exec"), namespace)  # noqa: S102 - the docs' own example
    task = CountLetter()
    engine, items, tok = _setup(task)
    plain = asyncio.run(SingleTurnWorkflow(task=task, tokenizer=tok).run(items, lambda r: _generate_with(engine, r)))
    engine2, _, _ = _setup(task)
    penalized = asyncio.run(namespace["LengthPenalty"](task=task, tokenizer=tok).run(
        items, lambda r: _generate_with(engine2, r)))
    for a, b in zip(plain, penalized, strict=True):
        assert b.reward == pytest.approx(a.reward - 0.01 * a.response_len)
        assert b.row is not None and b.row["reward"].item() == pytest.approx(b.reward)
