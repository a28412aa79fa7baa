"""``token_capture.enabled`` decides what a failed sibling costs its group (the controller's ledger policy):
on (the default), finished siblings are kept and only the failed one is generated again
(``rollout_recovery.default_granularity``); off, no finished generation outlives its group's failure: the whole
group is generated again, as after a restart."""

from __future__ import annotations

from typing import Any

import pytest

from screl.config import RunConfig
from screl.controller.settings import recovery_policy
from screl.data import RolloutLedger


def _run(**blocks: Any) -> RunConfig:
    return RunConfig.from_dict({"grpo": {"num_prompts_per_step": 2, "num_generations_per_prompt": 3}, **blocks})


def _fail_one(run: RunConfig) -> tuple[list[int], list[str], list[int]]:
    """Seal sibling 0, fail sibling 1 (sibling 2 in flight): (siblings to abort, states, siblings to dispatch)."""
    ledger = RolloutLedger(recovery_policy(run))
    ledger.reserve("g", 0, 3, start_weight=0, task_source="math")
    attempts = [ledger.dispatch("g", i) for i in range(3)]
    ledger.seal("g", 0, attempts[0])
    abort = ledger.fail("g", 1, attempts[1])
    return abort, [s.state.value for s in ledger.group("g").siblings], ledger.pending_siblings("g")


def test_token_capture_is_on_by_default_and_keeps_finished_siblings() -> None:
    run = _run()
    assert run.token_capture.enabled is True
    assert _fail_one(run) == ([], ["sealed", "failed", "dispatched"], [1])


def test_without_token_capture_a_failure_regenerates_the_whole_group() -> None:
    run = _run(token_capture={"enabled": False})
    assert _fail_one(run) == ([2], ["abandoned", "failed", "abandoned"], [0, 1, 2])


@pytest.mark.parametrize("enabled", [True, False])
def test_overrides_apply_only_with_token_capture(enabled: bool) -> None:
    run = _run(token_capture={"enabled": enabled},
               rollout_recovery={"task_source_granularity_overrides": {"math": "prompt_group"}})
    assert recovery_policy(run).resolve("math").value == "prompt_group"
    assert recovery_policy(run).resolve("code").value == ("sibling" if enabled else "prompt_group")
