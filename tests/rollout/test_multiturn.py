"""Token capture: the token-exact splice, the multi-turn row and its loss mask (hand-derived), and the direct
multi-turn workflow on the real torch engine (no Ray)."""

from __future__ import annotations

import asyncio
import math
from typing import Any

import pytest
import torch

from screl.algos import ClippedPGLoss
from screl.envs import CountLetter, PromptRecord
from screl.envs.calculator import CalculatorEnv, CalculatorTask, evaluate_sum
from screl.envs.environment import Action, Environment, EnvTask, StepResult, ToolCall
from screl.models import TinyCausalLM
from screl.models.tokenizer import build_char_tokenizer
from screl.rollout.engines.protocol import SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import ROW_SCHEMA
from screl.rollout.workflows.chat import SpliceError, chat_prompt_ids, encode_text
from screl.rollout.workflows.multiturn import MultiTurnWorkflow
from screl.rollout.workflows.trajectory import TrajectoryError, Turn, build_row
from screl.rollout.workflows.workflow import RolloutItem

TOK = build_char_tokenizer()


def test_the_splice_keeps_past_tokens_verbatim_and_tokenizes_only_the_new_text() -> None:
    first = chat_prompt_ids(TOK, [{"role": "user", "content": "3+4"}])
    assert TOK.decode(first, skip_special_tokens=False) == "<bos>user 3+4<eos>assistant "
    # a past that re-tokenizing would change: the model sampled <pad> (id 0) where the text has nothing
    reply = [*encode_text(TOK, "="), 0, 1]
    messages = [{"role": "user", "content": "3+4"}, {"role": "assistant", "content": "="},
                {"role": "tool", "content": "7"}]
    spliced = chat_prompt_ids(TOK, messages, first + reply)
    assert spliced[:len(first) + len(reply)] == first + reply
    assert TOK.decode(spliced[len(first) + len(reply):], skip_special_tokens=False) == "tool 7<eos>assistant "
    # a reply the model did not end (no <eos>): the template's end of turn is added after it
    cut = chat_prompt_ids(TOK, messages, first + reply[:-1])
    assert cut == first + reply + spliced[len(first) + len(reply):]
    forgetful = build_char_tokenizer()
    forgetful.chat_template = "{{ messages[-1]['content'] }}"  # renders the last message only
    with pytest.raises(SpliceError, match="renders the earlier turns differently"):
        chat_prompt_ids(forgetful, messages, first + reply)


def _turn(prompt: list[int], tokens: list[int], base: float, version: int, finish: str = "stop") -> Turn:
    return Turn(tuple(prompt), tuple(tokens), tuple(base + 0.1 * i for i in range(len(tokens))),
                tuple([version] * len(tokens)), finish)


def test_a_conversation_becomes_one_row_that_trains_on_model_tokens_only() -> None:
    t0 = _turn([2, 5, 6], [7, 8], -1.0, 0)
    t1 = _turn([2, 5, 6, 7, 8, 9, 10, 11], [12, 13, 1], -2.0, 1)
    row = build_row([t0, t1], 0.75)
    assert row["input_ids"].tolist() == [2, 5, 6, 7, 8, 9, 10, 11, 12, 13, 1]
    assert row["prompt_len"].tolist() == [3]
    assert row["loss_mask"].tolist() == [1, 1, 0, 0, 0, 1, 1, 1]
    assert row["generation_logprobs"].tolist() == pytest.approx([-1.0, -0.9, 0, 0, 0, -2.0, -1.9, -1.8])
    assert row["token_versions"].tolist() == [0, 0, 0, 0, 0, 1, 1, 1]
    assert row["reward"].tolist() == [0.75]
    chunk = ROW_SCHEMA.collate({"keys": ["k"], "trainer_version": 1, "start_weight": [0]},
                               {k: [v] for k, v in row.items()}, pad_id=0)
    # position j predicts token j + 1: the completion starts at 3, so tokens 3..10 sit at positions 2..9
    assert chunk["token_mask"].tolist() == [[0, 0, 1, 1, 0, 0, 0, 1, 1, 1]]
    assert set(chunk) == set(ROW_SCHEMA.collated_keys)


def test_a_turn_that_re_tokenized_the_past_is_refused() -> None:
    with pytest.raises(TrajectoryError, match="differ at token 1 of 5"):
        build_row([_turn([2, 5, 6], [7, 8], -1.0, 0), _turn([2, 9, 6, 7, 8, 3], [4], -1.0, 0)], 1.0)


def test_the_loss_averages_over_the_model_tokens_of_a_masked_row() -> None:
    row = build_row([_turn([2, 5], [7, 8], -1.0, 0), _turn([2, 5, 7, 8, 9, 10], [12], -1.0, 0)], 1.0)
    chunk = ROW_SCHEMA.collate({"keys": ["k"], "trainer_version": 0, "start_weight": [0]},
                               {k: [v] for k, v in row.items()}, pad_id=0)
    mask = chunk["token_mask"]
    assert mask.tolist() == [[0, 1, 1, 0, 0, 1]]
    prev = torch.full_like(mask, -1.0)
    # model tokens move by +0.1, -0.1, +0.05 (inside the clip range); the tool's tokens by +3 (far outside it)
    delta = torch.tensor([[0.0, 0.1, -0.1, 3.0, 3.0, 0.05]])
    loss, metrics = ClippedPGLoss(ratio_clip_min=0.2, ratio_clip_max=0.28)(
        prev + delta, prev, prev, torch.ones(1), mask)
    expected = -(math.exp(0.1) + math.exp(-0.1) + math.exp(0.05)) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    assert metrics["num_valid_tokens"].item() == 3
    assert metrics["clip_fraction"].item() == 0.0


def test_the_calculator_parses_calls_and_scores_the_episode() -> None:
    task = CalculatorTask(max_operand=9)
    prompt = task.prompt(3 * 10 + 4)
    env = task.make_env(prompt)
    assert env.reset(prompt) == "3+4"
    assert env.parse_tool_calls("=") == [ToolCall("calculator", {"expression": "3+4"})]
    assert env.parse_tool_calls(" =2+2z") == [ToolCall("calculator", {"expression": "2+2"})]
    assert env.parse_tool_calls("7") == []
    assert env.step(Action("=", tuple(env.parse_tool_calls("=")))) == StepResult("7", 0.25, False)
    assert env.step(Action("=", tuple(env.parse_tool_calls("=")))) == StepResult("7", 0.0, False)
    assert env.step(Action("7", ())) == StepResult("", 1.0, True)
    unaided = task.make_env(prompt)
    unaided.reset(prompt)
    assert unaided.step(Action("7x", ())).reward == 0.5
    assert unaided.step(Action("8", ())).reward == 0.0
    json_env = CalculatorEnv(syntax="json")
    assert json_env.parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "1+2"}}'
                                     '</tool_call>') == [ToolCall("calculator", {"expression": "1+2"})]
    assert evaluate_sum("12+3+4") == 19 and evaluate_sum("1-2") is None


class _Talker:
    """Answers every reply with "ok" for ``turns`` replies, then ends with reward = replies seen."""

    observation_role = "user"

    def __init__(self, turns: int) -> None:
        self.turns, self.seen = turns, 0

    def reset(self, prompt: PromptRecord) -> str:
        return prompt.text

    def parse_tool_calls(self, text: str) -> list[ToolCall]:
        return []

    def step(self, action: Action) -> StepResult:
        self.seen += 1
        return StepResult("ok", 1.0, self.seen >= self.turns)


class _TalkTask(EnvTask):
    def __init__(self, turns: int) -> None:
        self.turns = turns

    def prompts(self) -> list[PromptRecord]:
        return [PromptRecord(0, "hi"), PromptRecord(1, "yo")]

    def make_env(self, prompt: PromptRecord) -> Environment:
        return _Talker(self.turns)

    def reward(self, prompt: PromptRecord, completion: str) -> float:
        return 0.0


def _run(wf: MultiTurnWorkflow, engine: TorchGenerationEngine, items: list[RolloutItem]) -> list[Any]:
    async def generate(requests: list[Any]) -> list[Any]:
        return engine.generate(requests)

    return asyncio.run(wf.run(items, generate))


def test_the_direct_workflow_captures_every_turn_of_every_conversation() -> None:
    policy = TinyCausalLM(hidden_size=32, num_layers=1)
    engine = TorchGenerationEngine(policy, seed=0)
    task = _TalkTask(turns=3)
    items = [RolloutItem(f"g{p.prompt_id}_g0_a1", p, (), SamplingParams(max_new_tokens=3, min_new_tokens=3, seed=i))
             for i, p in enumerate(task.prompts())]
    out = _run(MultiTurnWorkflow(task, TOK, max_turns=5, max_total_tokens=200), engine, items)
    for o, item in zip(out, items, strict=True):
        assert o.status == "sealed" and o.reward == 3.0 and o.response_len == 9
        ids = o.row["input_ids"].tolist()
        p = int(o.row["prompt_len"][0])
        assert TOK.decode(ids[:p], skip_special_tokens=False) == f"<bos>user {item.prompt.text}<eos>assistant "
        mask = o.row["loss_mask"].tolist()
        assert sum(mask) == 9 and len(mask) == len(ids) - p
        between = [t for t, m in zip(ids[p:], mask, strict=True) if m == 0]
        assert TOK.decode(between, skip_special_tokens=False) == "<eos>user ok<eos>assistant " * 2
    # the turn cap, and the token cap shrinking the last turn
    capped = _run(MultiTurnWorkflow(task, TOK, max_turns=2, max_total_tokens=200), engine, items[:1])[0]
    assert capped.reward == 2.0 and capped.response_len == 6
    tight = _run(MultiTurnWorkflow(task, TOK, max_turns=5, max_total_tokens=30), engine, items[:1])[0]
    assert len(tight.row["input_ids"]) <= 30


def test_the_multi_turn_workflow_needs_an_environment_task() -> None:
    with pytest.raises(TypeError, match="MultiTurnWorkflow needs an EnvTask"):
        MultiTurnWorkflow(task=CountLetter(), tokenizer=TOK)


class _Scripted:
    """The engine edge, scripted: each conversation (by attempt id) replies its lines in order, each ended by <eos>,
    on the prompt it is given (so the workflow's splice and the row are real)."""

    def __init__(self, replies: dict[str, list[str]]) -> None:
        self.replies = {k: list(v) for k, v in replies.items()}

    async def __call__(self, requests: list[Any]) -> list[Any]:
        from screl.rollout.engines.protocol import GenerationResult

        out = []
        for r in requests:
            ids = [*encode_text(TOK, self.replies[r.request_id].pop(0)), TOK.eos_token_id]
            out.append(GenerationResult(r.request_id, list(r.prompt_token_ids), ids, [-0.5] * len(ids), "stop",
                                        [0] * len(ids), 0, 0, TOK.eos_token_id, "eos"))
        return out


@pytest.mark.parametrize("mask_malformed", [True, False])
def test_a_conversation_the_environment_flags_trains_nothing(mask_malformed: bool) -> None:
    """The tool task with ``mask_malformed_calls``: a conversation with a malformed call ('=+' is no sum) keeps
    its row and reward but its sample_mask is 0; a well-formed one ('=3+4') is unmasked. Without the knob, both
    train."""
    task = CalculatorTask(syntax="compact", mask_malformed_calls=mask_malformed)
    by_text = {p.text: p for p in task.prompts()}
    items = [RolloutItem("bad", by_text["3+4"], (), SamplingParams(max_new_tokens=8, seed=0)),
             RolloutItem("good", by_text["3+4"], (), SamplingParams(max_new_tokens=8, seed=1))]
    generate = _Scripted({"bad": ["=+", "7"], "good": ["=3+4", "7"]})
    out = asyncio.run(MultiTurnWorkflow(task, TOK, max_turns=4, max_total_tokens=200).run(items, generate))
    bad, good = out
    assert bad.status == good.status == "sealed"
    assert float(bad.row["sample_mask"][0]) == (0.0 if mask_malformed else 1.0)
    assert float(good.row["sample_mask"][0]) == 1.0
    assert bad.reward == 0.5 and good.reward == 1.25  # the rewards stand either way: unaided; call + answer
    assert int(bad.row["loss_mask"].sum()) == len("=+") + 1 + len("7") + 1  # the model's tokens of both turns
