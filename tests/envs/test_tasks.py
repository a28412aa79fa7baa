from __future__ import annotations

import json
import pickle
from pathlib import Path

import pytest

from screl.envs import (
    Addition,
    CountLetter,
    CustomReward,
    JsonlTask,
    PromptRecord,
    Task,
    arithmetic_prompts,
    decode_completion,
    load_reward_fn,
)
from screl.models import build_char_tokenizer


def echo_length(prompt: PromptRecord, completion: str) -> float:
    """A user reward for the plugin tests."""
    return float(len(completion)) + prompt.metadata.get("bonus", 0)


HERE = f"{__name__}:echo_length"


def test_arithmetic_prompts_are_the_peer_dataset() -> None:
    prompts = arithmetic_prompts()
    assert len(prompts) == 100
    assert [p.text for p in prompts[:3]] == ["0+0=", "0+1=", "0+2="]
    assert prompts[10] == PromptRecord(prompt_id=10, text="1+0=", metadata={"a": 1, "b": 0})
    assert prompts[-1].text == "9+9=" and prompts[-1].prompt_id == 99
    assert [p.prompt_id for p in prompts] == list(range(100))
    assert CountLetter().prompts() == Addition().prompts() == prompts


@pytest.mark.parametrize(
    ("completion", "expected"),
    [("", 0.0), ("a", 1.0), ("ab", 0.5), ("aab", 2 / 3), ("xyz", 0.0), ("banana", 0.5), ("A a", 1 / 3)],
)
def test_count_letter_reward(completion: str, expected: float) -> None:
    assert CountLetter("a").reward(arithmetic_prompts()[0], completion) == pytest.approx(expected, abs=0.0)


def test_count_letter_other_letter_and_validation() -> None:
    assert CountLetter("z").reward(arithmetic_prompts()[0], "zzaa") == 0.5
    with pytest.raises(ValueError, match="must be a single character"):
        CountLetter("ab")


@pytest.mark.parametrize(("completion", "expected"), [("abcd", 1.0), ("bcde", 0.0), ("abcde", 0.0), ("", 0.0)])
def test_count_letter_threshold_is_pass_fail(completion: str, expected: float) -> None:
    assert CountLetter("a", threshold=0.25).reward(arithmetic_prompts()[0], completion) == expected
    with pytest.raises(ValueError, match=r"threshold=0\.0\) must be in \(0, 1\]"):
        CountLetter("a", threshold=0.0)


@pytest.mark.parametrize(
    ("prompt_id", "completion", "expected"),
    [
        (34, "7", 1.0),  # 3+4
        (34, "7abc", 1.0),
        (34, "77", 1.0),  # startswith, as the peer
        (34, "8", 0.0),
        (34, " 7", 0.0),
        (34, "", 0.0),
        (99, "18", 1.0),  # 9+9
        (99, "1", 0.0),
        (0, "0", 1.0),
    ],
)
def test_addition_reward(prompt_id: int, completion: str, expected: float) -> None:
    task = Addition()
    assert task.reward(task.prompt(prompt_id), completion) == expected


def test_rewards_batch_and_length_check() -> None:
    task = Addition()
    p = task.prompt(12)
    assert task.rewards([p, p], ["3", "4"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="1 prompts but 2 completions"):
        task.rewards([p], ["3", "4"])
    with pytest.raises(KeyError, match="no prompt_id 100"):
        task.prompt(100)


def test_decode_completion_skips_special_tokens() -> None:
    tok = build_char_tokenizer()
    ids = tok("aab", add_special_tokens=False)["input_ids"] + [tok.eos_token_id, tok.pad_token_id]
    text = decode_completion(tok, ids)
    assert text == "aab"
    assert CountLetter().reward(arithmetic_prompts()[0], text) == pytest.approx(2 / 3)


def test_custom_reward_from_module_function() -> None:
    task = CustomReward(Addition(), reward_fn=HERE)
    assert task.prompts() == arithmetic_prompts()
    assert task.reward(task.prompt(5), "abc") == 3.0
    assert pickle.loads(pickle.dumps(task)).reward(task.prompt(5), "ab") == 2.0


@pytest.mark.parametrize(
    ("target", "error", "match"),
    [
        ("no_colon", ValueError, "must have the form"),
        ("json:", ValueError, "must have the form"),
        ("json:__version__", TypeError, "is not callable"),
        ("json:nope", AttributeError, "nope"),
    ],
)
def test_load_reward_fn_errors(target: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_reward_fn(target)


def test_jsonl_task(tmp_path: Path) -> None:
    path = tmp_path / "prompts.jsonl"
    rows = [{"id": 7, "prompt": "hi", "bonus": 10}, {"id": 3, "prompt": "yo"}]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    task = JsonlTask(str(path), reward_fn=HERE, id_key="id")
    assert task.prompts() == [
        PromptRecord(prompt_id=7, text="hi", metadata={"bonus": 10}),
        PromptRecord(prompt_id=3, text="yo", metadata={}),
    ]
    assert task.reward(task.prompt(7), "abc") == 13.0
    assert [p.prompt_id for p in JsonlTask(str(path), reward_fn=HERE).prompts()] == [0, 1]

    path.write_text("\n".join(json.dumps(r) for r in [rows[0], rows[0]]))
    with pytest.raises(ValueError, match="duplicate prompt id 7"):
        JsonlTask(str(path), reward_fn=HERE, id_key="id").prompts()


def test_subclassing_is_the_other_plugin_point() -> None:
    class Echo(Task):
        def prompts(self) -> list[PromptRecord]:
            return [PromptRecord(1, "x"), PromptRecord(1, "y")]

        def reward(self, prompt: PromptRecord, completion: str) -> float:
            return 1.0 if completion == prompt.text else 0.0

    task = Echo()
    assert task.rewards(task.prompts(), ["x", "x"]) == [1.0, 0.0]
    with pytest.raises(ValueError, match="duplicate prompt_id 1"):
        task.prompt(1)


@pytest.mark.parametrize(("form", "completion", "expected"), [
    ("number", " 7 ", 1.0),
    ("number", "7.", 0.2 + 0.8 * (1 - 1 / 24)),                # one extra character
    ("number", "The answer is 7.", 0.2 + 0.8 * (1 - 15 / 24)),  # fifteen
    ("number", "3 + 4 = 7, as everyone who counts will agree", 0.2),
    ("number", "17", 0.0),                                       # the sum inside another number is not the sum
    ("tag", "<answer>7</answer>", 1.0),
    ("tag", "7", 0.2 + 0.8 * (1 - 1 / 24)),                     # shorter than the tag: one extra at least
])
def test_strict_answer_pays_the_bare_sum_and_less_per_extra_character(form: str, completion: str,
                                                                      expected: float) -> None:
    from screl.envs import StrictAnswer

    task = StrictAnswer(form=form, brevity_chars=24)  # type: ignore[arg-type]
    assert task.prompt(34).text.startswith("What is 3 + 4? Reply with")
    assert task.reward(task.prompt(34), completion) == pytest.approx(expected, abs=1e-12)


def test_strict_answer_without_brevity_is_exact_or_partial_and_holds_prompts_out() -> None:
    from screl.envs import StrictAnswer

    task = StrictAnswer(partial=0.25, holdout=20)
    assert task.reward(task.prompt(task.prompts()[0].prompt_id), "I think it is 99") == 0.0
    first = task.prompts()[0]
    total = str(first.metadata["a"] + first.metadata["b"])
    assert task.reward(first, f"It is {total}") == 0.25 and task.reward(first, total) == 1.0
    assert len(task.prompts()) == 80 and {p.prompt_id for p in task.val_prompts()} == {
        p.prompt_id for p in CountLetter(holdout=20).val_prompts()}
    with pytest.raises(ValueError, match=r"form='json'\) must be one of \['number', 'tag'\]"):
        StrictAnswer(form="json")  # type: ignore[arg-type]
