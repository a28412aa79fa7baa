"""MathVerify: answer formats, equivalences, format reward and masking, and the timeout/raise path (a data
failure on the rollout worker, never a zero reward or a crash). The verifier processes are real."""

from __future__ import annotations

import json
import pickle
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from screl.envs import DatasetTask, MathVerify, MathVerifyError, PromptRecord
from screl.envs._verify_worker import answer_text
from screl.rollout.workflows.workflow import SingleTurnWorkflow

HANG = "\\boxed{9^{9^{9^{9}}}}"  # sympy evaluates the power tower: a verification that never ends


def rec(answer: object, pid: int = 0) -> PromptRecord:
    return PromptRecord(pid, "q", {"answer": answer})


@pytest.fixture(scope="module")
def mv() -> Iterator[MathVerify]:
    verifier = MathVerify(timeout_s=20.0)
    yield verifier
    verifier.close()


GSM8K_GOLD = "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nAltogether she sold 48+24 = <<48+24=72>>72 clips.\n#### 72"


@pytest.mark.parametrize(("gold", "completion", "expected"), [
    # \boxed{...}
    ("\\frac{1}{2}", "Halving gives \\boxed{\\frac{1}{2}}.", 1.0),
    ("\\frac{1}{2}", "So the result is \\boxed{\\frac{1}{3}}.", 0.0),
    ("42", "\\boxed{42}, and then 7 more steps", 1.0),  # the boxed answer wins over a later number
    # GSM8K's '#### 42' (gold as the dataset's whole solution)
    (GSM8K_GOLD, "48 + 24 = 72 clips.\n#### 72", 1.0),
    (GSM8K_GOLD, "48 + 24 = 71 clips.\n#### 71", 0.0),
    (GSM8K_GOLD, "#### 72\nThe 48 clips in April.", 1.0),  # the '####' line, not the last number
    # a plain final number
    ("42", "First 6 * 7, so the answer is 42.", 1.0),
    ("42", "First 6 * 7, so the answer is 41.", 0.0),
    ("1,000", "The total is 1000", 1.0),
])
def test_answer_formats(mv: MathVerify, gold: str, completion: str, expected: float) -> None:
    assert mv.rewards([rec(gold)], [completion]) == [expected]


@pytest.mark.parametrize(("gold", "completion", "expected"), [
    ("\\frac{1}{2}", "\\boxed{0.5}", 1.0),
    ("\\frac{1}{2}", "$\\frac{2}{4}$", 1.0),
    ("\\sqrt{8}", "\\boxed{2\\sqrt{2}}", 1.0),
    ("[1,2)", "\\boxed{[1,2)}", 1.0),
    ("(1,2]", "\\boxed{[1,2)}", 0.0),  # open and closed ends differ
    ("\\sqrt{2}", "\\boxed{1.41}", 0.0),
    ("x^2+2x+1", "\\boxed{(x+1)^2}", 1.0),
    ("x^2+1", "\\boxed{(x+1)^2}", 0.0),
])
def test_equivalence(mv: MathVerify, gold: str, completion: str, expected: float) -> None:
    assert mv.rewards([rec(gold)], [completion]) == [expected]


def test_a_batch_is_scored_in_order(mv: MathVerify) -> None:
    prompts = [rec(str(i), pid=i) for i in range(40)]
    completions = [f"#### {i if i % 3 else i + 1}" for i in range(40)]
    assert mv.rewards(prompts, completions) == [0.0 if i % 3 == 0 else 1.0 for i in range(40)]


def test_answer_text_reads_the_gsm8k_line_and_wraps_a_bare_gold() -> None:
    assert answer_text("work\n#### 1,234\nmore", gold=False) == "1,234"
    assert answer_text("\\frac{1}{2}", gold=True) == "$\\frac{1}{2}$"
    assert answer_text("\\boxed{3}", gold=True) == "\\boxed{3}"


def test_format_reward_and_masking() -> None:
    verifier = MathVerify(format_reward=0.1, mask_unparsable=True)
    try:
        prompts = [rec("7")] * 3
        completions = ["\\boxed{7}", "\\boxed{8}", "I do not know."]
        assert verifier.rewards(prompts, completions) == pytest.approx([1.1, 0.1, 0.0])
        assert [verifier.masked(p, c) for p, c in zip(prompts, completions, strict=True)] == [False, False, True]
    finally:
        verifier.close()
    assert not MathVerify().masked(rec("7"), "I do not know.")  # masking is opt-in


def test_a_hanging_verification_times_out_into_a_data_failure(tmp_path: Path) -> None:
    verifier = MathVerify(timeout_s=1.0)
    try:
        task = dataset_task(tmp_path, ["5", "2", "3"], verifier)
        verifier.rewards([rec("1")], ["1"])  # the process is up: the timing below is the verification's
        prompts, completions = task.prompts(), [HANG, "\\boxed{2}", "\\boxed{4}"]
        workflow = SingleTurnWorkflow(task=task, tokenizer=None)
        start = time.monotonic()
        with ThreadPoolExecutor(1) as pool:  # as on a rollout worker: off the main thread
            scores = pool.submit(workflow.score, list(prompts), completions, [[1]] * 3).result()
        elapsed = time.monotonic() - start
        assert isinstance(scores[0], MathVerifyError)
        assert "timeout_s=1 on prompt 0" in str(scores[0]) and "data failure" in str(scores[0])
        # the rest of the batch, in the process started after the kill
        assert [getattr(s, "reward", s) for s in scores[1:]] == [1.0, 0.0]
        assert elapsed < 30.0
        start = time.monotonic()  # the same sample again: the cached failure, no second wait
        with pytest.raises(MathVerifyError, match="ran past timeout_s=1 on prompt 0"):
            task.rewards(prompts[:1], completions[:1])
        assert time.monotonic() - start < 0.5
        assert task.rewards(prompts[1:2], ["#### 2"]) == [1.0]  # the verifier still works
    finally:
        verifier.close()


def test_a_raising_verification_is_a_data_failure(mv: MathVerify, tmp_path: Path) -> None:
    task = dataset_task(tmp_path, ["", "4", None], mv)
    workflow = SingleTurnWorkflow(task=task, tokenizer=None)
    scores = workflow.score(list(task.prompts()), ["\\boxed{1}", "4", "4"], [[1], [2], [2]])
    assert isinstance(scores[0], MathVerifyError) and "reference answer '' does not parse" in str(scores[0])
    assert not isinstance(scores[1], BaseException) and scores[1].reward == 1.0
    assert isinstance(scores[2], MathVerifyError) and "answer_key" in str(scores[2])
    with pytest.raises(MathVerifyError, match="1 of 2 verifications failed; math-verify failed on prompt 0"):
        task.rewards(task.prompts()[:2], ["\\boxed{1}", "4"])


def test_a_killed_process_is_replaced(mv: MathVerify) -> None:
    mv.rewards([rec("1")], ["1"])
    for child in list(mv._idle):
        child.proc.kill()
        child.proc.wait()
    assert mv.rewards([rec("12")], ["\\boxed{12}"]) == [1.0]


def test_pickles_without_its_processes(mv: MathVerify) -> None:
    mv.rewards([rec("1")], ["1"])
    copy = pickle.loads(pickle.dumps(mv))
    assert copy._idle == [] and copy.timeout_s == mv.timeout_s
    try:
        assert copy.rewards([rec("\\pi")], ["\\boxed{\\pi}"]) == [1.0]
    finally:
        copy.close()


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"timeout_s": 0}, r"verifier\.init_args\.timeout_s=0 must be > 0"),
    ({"format_reward": -1}, r"verifier\.init_args\.format_reward=-1 must be >= 0"),
    ({"processes": 0}, r"verifier\.init_args\.processes=0 must be >= 1"),
])
def test_bad_settings_name_their_key(kwargs: dict[str, float], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        MathVerify(**kwargs)  # type: ignore[arg-type]


def dataset_task(tmp_path: Path, answers: list[object], verifier: MathVerify) -> DatasetTask:
    """A DatasetTask over a JSONL file of ``answers`` (prompt ids: the row index)."""
    path = tmp_path / "answers.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": a}) + "\n" for i, a in enumerate(answers)))
    return DatasetTask(str(path), prompt_column="question", verifier=verifier)
