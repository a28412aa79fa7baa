"""TRL-style reward functions with weights (issue 47 item 3): the batch layout, None, async functions, the verl
adapter, TRL's own functions unchanged, the per-function figures, and each kind of bad input named."""

from __future__ import annotations

import asyncio
import math
import pickle
import statistics
from typing import Any

import pytest

from screl.envs import Addition, PromptRecord
from screl.models import TinyCausalLM
from screl.rewards import (
    PROMPT_MESSAGES,
    NonFiniteRewardError,
    RewardFuncError,
    RewardFuncs,
    RewardStats,
    WithRewardFuncs,
    verl_score,
)

RECORDS = [
    PromptRecord(0, "2+3=", {"answer": "5", "kind": "math"}),
    PromptRecord(1, "hello", {"answer": "x", "kind": "chat"}),
    PromptRecord(2, "chat", {"answer": "7", "kind": "math",
                             PROMPT_MESSAGES: [{"role": "user", "content": "3+4?"}]}),
]
COMPLETIONS = ["5", "hi there", "the answer is 7"]
IDS = [[1], [2, 3], [4, 5, 6]]
SEEN: dict[str, Any] = {}


def exact(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], answer: list[str],
          **kwargs: Any) -> list[float | None]:
    SEEN.update(prompts=prompts, completions=completions, completion_ids=completion_ids, answer=answer, **kwargs)
    texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
    return [None if k != "math" else float(t.endswith(a)) for t, a, k in zip(texts, answer, kwargs["kind"],
                                                                              strict=True)]


def length(completion_ids: list[list[int]], **kwargs: Any) -> list[float]:
    return [float(len(ids)) for ids in completion_ids]


async def slow_half(completions: list[Any], **kwargs: Any) -> list[float]:
    await asyncio.sleep(0.01)
    return [0.5] * len(completions)


def test_batch_is_laid_out_as_trl_and_totals_are_weighted_sums_skipping_none() -> None:
    funcs = RewardFuncs([exact, length, slow_half], reward_weights=[2.0, 0.1, 1.0])
    totals, values = funcs.score(RECORDS, COMPLETIONS, IDS)
    assert values == {"exact": [1.0, None, 1.0], "length": [1.0, 2.0, 3.0], "slow_half": [0.5, 0.5, 0.5]}
    assert totals == pytest.approx([2.0 + 0.1 + 0.5, 0.2 + 0.5, 2.0 + 0.3 + 0.5])
    assert SEEN["prompts"] == ["2+3=", "hello", [{"role": "user", "content": "3+4?"}]]
    assert SEEN["completions"][:2] == ["5", "hi there"]
    assert SEEN["completions"][2] == [{"role": "assistant", "content": "the answer is 7"}]
    assert SEEN["completion_ids"] == IDS and SEEN["answer"] == ["5", "x", "7"]
    assert PROMPT_MESSAGES not in SEEN, "the conversational prompt is the prompt, not a column"


def test_a_sample_every_function_skips_is_unscorable_and_the_rest_keep_their_parts() -> None:
    scored = RewardFuncs([exact]).scored(RECORDS, COMPLETIONS, IDS)
    assert [s.reward for s in scored] == [1.0, 0.0, 1.0]
    assert [s.unscorable for s in scored] == [False, True, False]
    assert [s.parts for s in scored] == [{"exact": 1.0}, {}, {"exact": 1.0}]


def test_async_functions_are_awaited_inside_a_running_event_loop_too() -> None:
    funcs = RewardFuncs([slow_half, length], reward_names=["half", "len"])

    async def inside_a_loop() -> list[float]:
        return funcs.score(RECORDS, COMPLETIONS, IDS).totals

    assert asyncio.run(inside_a_loop()) == pytest.approx([1.5, 2.5, 3.5])


def test_trl_reward_functions_run_unchanged() -> None:
    rewards = pytest.importorskip("trl.rewards", reason="trl is not installed (pip install -e '.[bench]')")
    recs = [PromptRecord(i, "q", {"solution": s, PROMPT_MESSAGES: [{"role": "user", "content": "q"}]})
            for i, s in enumerate(["$7$", "$7$"])]
    completions = ["<think>\nadd\n</think>\nThe answer is $7$", "no thinking, $8$"]
    funcs = RewardFuncs([rewards.think_format_reward, rewards.accuracy_reward], reward_weights=[0.5, 1.0])
    totals, values = funcs.score(recs, completions, [[1], [2]])
    assert values == {"think_format_reward": [1.0, 0.0], "accuracy_reward": [1.0, 0.0]}
    assert totals == [1.5, 0.0]
    by_path = RewardFuncs(["trl.rewards:think_format_reward"])
    assert by_path.names == ["think_format_reward"] and by_path.score(recs, completions, [[1], [2]]).totals == [1.0, 0.0]


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: Any = None) -> Any:
    hit = float(solution_str.strip().endswith(ground_truth))
    return {"score": hit, "acc": hit} if data_source == "dict" else hit


def test_verl_compute_score_through_the_adapter() -> None:
    recs = [PromptRecord(0, "a", {"data_source": "gsm8k", "reward_model": {"ground_truth": "4"}, "extra_info": {}}),
            PromptRecord(1, "b", {"data_source": "dict", "ground_truth": "9"})]
    fn = verl_score(f"{__name__}:compute_score")
    funcs = RewardFuncs([fn])
    assert funcs.names == ["compute_score"]
    assert funcs.score(recs, ["so 4", "so 8"], [[1], [2]]).values == {"compute_score": [1.0, 0.0]}
    assert funcs.score(recs, ["so 5", "9"], [[1], [2]]).totals == [0.0, 1.0]
    again = pickle.loads(pickle.dumps(fn))
    assert again([0, 1], ["4", "9"], None, data_source=["x", "dict"], ground_truth=["4", "9"]) == [1.0, 1.0]
    with pytest.raises(RewardFuncError, match="no ground truth"):
        funcs.score([PromptRecord(0, "a", {"data_source": "x"})], ["4"], [[1]])


def old_style(prompt: PromptRecord, completion: str) -> float:
    return 1.0


def wrong_length(completions: list[Any], **kwargs: Any) -> list[float]:
    return [1.0] * (len(completions) + 1)


def needs_column(completions: list[Any], solution: list[str]) -> list[float]:
    return [0.0] * len(completions)


def not_finite(completions: list[Any], **kwargs: Any) -> list[float]:
    return [math.nan if c == "hi there" else 1.0 for c in completions]


def test_the_wrong_signature_is_named_with_the_expected_one() -> None:
    with pytest.raises(RewardFuncError, match=r"old_style.*\(prompt: .*expected TRL's fn\(prompts, completions, "
                                              r"completion_ids, \*\*kwargs\)"):
        RewardFuncs([old_style])
    with pytest.raises(RewardFuncError, match=r"'needs_column' cannot be called with the batch's columns "
                                              r"\['answer', 'kind'\].*solution"):
        RewardFuncs([needs_column]).score(RECORDS[:2], COMPLETIONS[:2], IDS[:2])
    with pytest.raises(ValueError, match="2 weights for 1 reward_funcs"):
        RewardFuncs([length], reward_weights=[1.0, 2.0])
    with pytest.raises(ValueError, match=r"named \['length'\] appear more than once"):
        RewardFuncs([length, length])
    with pytest.raises(ValueError, match="must be a callable or a path 'package.module:function'"):
        RewardFuncs(["no_colon"])


def test_a_wrong_length_and_a_non_finite_value_are_named() -> None:
    with pytest.raises(RewardFuncError, match=r"'wrong_length' returned 4 rewards for 3 completions"):
        RewardFuncs([wrong_length]).score(RECORDS, COMPLETIONS, IDS)
    with pytest.raises(NonFiniteRewardError, match=r"'not_finite' returned nan for sample 1 \(prompt_id 1\)"):
        RewardFuncs([not_finite]).score(RECORDS, COMPLETIONS, IDS)
    scored = RewardFuncs([not_finite, length]).scored(RECORDS, COMPLETIONS, IDS)
    assert [s.error is None for s in scored] == [True, False, True], "only the culprit fails"
    assert [s.reward for s in scored if s.error is None] == [2.0, 4.0]


def test_with_reward_funcs_scores_any_task_and_encodes_text_completions_with_the_policy_tokenizer() -> None:
    task = WithRewardFuncs(Addition(), reward_funcs=[length, f"{__name__}:slow_half"], reward_weights=[1.0, 2.0])
    rec = task.prompts()[0]
    with pytest.raises(RuntimeError, match=r"call task.prepare\(policy, run_dir\) first"):
        task.rewards([rec], ["12"])
    policy = TinyCausalLM()
    task.prepare(policy, "/tmp")
    n = len(policy.build_tokenizer()("12 ab", add_special_tokens=False)["input_ids"])
    assert task.rewards([rec], ["12 ab"]) == [n + 1.0]
    assert task.scored([rec], ["x"], [[5, 6, 7]])[0].parts == {"length": 3.0, "slow_half": 0.5}
    back = pickle.loads(pickle.dumps(task))
    assert back.rewards([rec], ["12 ab"]) == [n + 1.0]


def test_reward_stats_match_trl_nanmean_and_nanstd() -> None:
    stats = RewardStats()
    rows = [{"a": 1.0, "b": 2.0}, {"a": 3.0}, {"a": 8.0, "b": 4.0}, {}]
    for parts in rows:
        stats.add(parts)
    stats.add(None)
    out = stats.take()
    assert out == pytest.approx({"rewards/a/mean": 4.0, "rewards/a/std": statistics.stdev([1.0, 3.0, 8.0]),
                                 "rewards/b/mean": 3.0, "rewards/b/std": statistics.stdev([2.0, 4.0])})
    assert stats.take() == {}, "taken once a step"


def test_the_docs_config_builds(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/rewards.md's first YAML snippet, with its user modules standing in as this file's functions."""
    import re
    import sys
    from pathlib import Path

    import jsonargparse
    import yaml

    text = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    snippet = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert snippet is not None
    this = sys.modules[__name__]
    monkeypatch.setitem(sys.modules, "my_pkg.rewards", this)
    monkeypatch.setitem(sys.modules, "my_pkg.verl_rewards", this)
    monkeypatch.setitem(sys.modules, "my_pkg", this)
    monkeypatch.setattr(this, "exact_answer", exact, raising=False)
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--task", type=WithRewardFuncs)
    task_cfg = yaml.safe_load(snippet.group(1))["data"]["init_args"]["task"]
    task = parser.instantiate(parser.parse_object({"task": task_cfg})).task
    assert task.reward_funcs.names == ["think_format_reward", "exact", "compute_score"]
    assert task.reward_funcs.weights == [0.2, 1.0, 1.0]
