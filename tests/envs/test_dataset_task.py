"""DatasetTask over local files the tests write (parquet, JSONL, CSV): prompt sources, columns, the chat
template, max_prompt_tokens, holdout and val_split, and its part in the bootstrap fingerprint."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import datasets
import pytest

from screl.checkpoint import (
    FingerprintMismatchError,
    bootstrap_fingerprint,
    validate_bootstrap_anchor,
    write_bootstrap_anchor,
)
from screl.envs import DatasetTask, HeldOut, MathVerify, PromptRecord
from screl.models import TinyCausalLM

KEY = "data.init_args.task.init_args"
ROWS = [
    {"question": f"{a}+{b}=", "answer": str(a + b), "source": "add" if a % 2 else "sum", "uid": 100 + a}
    for a, b in zip(range(10), range(3, 13), strict=True)
]


def echo_answer(prompt: PromptRecord, completion: str) -> float:
    """A user reward: 1.0 when the completion is the reference answer."""
    return 1.0 if completion.strip() == str(prompt.metadata["answer"]) else 0.0


FN = f"{__name__}:echo_answer"


def write(tmp_path: Path, rows: list[dict[str, Any]], fmt: str, name: str = "data") -> str:
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"{name}.{fmt}"
    if fmt == "parquet":
        ds.to_parquet(str(path))
    elif fmt == "jsonl":
        ds.to_json(str(path), lines=True)
    else:
        ds.to_csv(str(path), index=False)
    return str(path)


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "csv"])
def test_reads_each_local_format(tmp_path: Path, fmt: str) -> None:
    task = DatasetTask(write(tmp_path, ROWS, fmt), prompt_column="question", task_source_column="source",
                       reward_fn=FN)
    prompts = task.prompts()
    assert [p.prompt_id for p in prompts] == list(range(10))  # the row index
    assert [p.text for p in prompts] == [r["question"] for r in ROWS]
    assert str(prompts[4].metadata["answer"]) == "11"  # CSV reads the answers back as ints
    assert prompts[3].metadata["task_source"] == "add" and prompts[4].metadata["task_source"] == "sum"
    assert "question" not in prompts[0].metadata and prompts[0].metadata["uid"] == 100
    assert task.rewards(prompts[:2], ["3", "4"]) == [1.0, 0.0]


def test_a_folder_and_data_files(tmp_path: Path) -> None:
    folder = tmp_path / "folder"
    folder.mkdir()
    write(folder, ROWS[:6], "parquet", name="train-00000")
    write(folder, ROWS[6:], "parquet", name="train-00001")
    assert len(DatasetTask(str(folder), prompt_column="question", reward_fn=FN).prompts()) == 10
    one = write(tmp_path, ROWS[:4], "jsonl")
    task = DatasetTask("json", data_files={"train": one}, prompt_column="question", reward_fn=FN)
    assert [p.text for p in task.prompts()] == [r["question"] for r in ROWS[:4]]


def test_template_and_id_column(tmp_path: Path) -> None:
    task = DatasetTask(write(tmp_path, ROWS, "parquet"), prompt_template="what is {question} ({source})",
                       id_column="uid", verifier=MathVerify())
    prompts = task.prompts()
    assert [p.prompt_id for p in prompts] == [r["uid"] for r in ROWS]
    assert prompts[1].text == "what is 1+4= (add)"
    assert task.prompt(105).metadata["answer"] == "13"
    assert task.rewards(prompts[:3], ["#### 3", "\\boxed{5}", "6"]) == [1.0, 1.0, 0.0]


def test_messages_column_through_the_chat_template(tmp_path: Path) -> None:
    rows = [{"messages": [{"role": "user", "content": f"{i}+1="}], "answer": str(i + 1)} for i in range(4)]
    rows[0]["messages"] = [{"role": "system", "content": "add"}, {"role": "user", "content": "0+1="}]
    task = DatasetTask(write(tmp_path, rows, "parquet"), messages_column="messages", chat_template=True,
                       system_prompt="be brief", reward_fn=FN)
    assert task.prompts()[1].text == "1+1="  # the user turn until the run's policy is known
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))
    texts = [p.text for p in task.prompts()]
    assert texts[0] == "<bos>system add<eos>user 0+1=<eos>assistant "  # its own system turn kept
    assert texts[1] == "<bos>system be brief<eos>user 1+1=<eos>assistant "
    assert not (tmp_path / "run" / "dataset_filter.json").exists()  # no max_prompt_tokens: nothing filtered


def test_max_prompt_tokens_drops_long_prompts_and_writes_the_count(tmp_path: Path) -> None:
    rows = [{"prompt": "1+" * n + "1=", "answer": str(n + 1)} for n in range(1, 9)]  # 2n + 2 characters
    train, test = write(tmp_path, rows, "jsonl"), write(tmp_path, rows[2:5], "jsonl", name="test")
    task = DatasetTask("json", data_files={"train": train, "test": test}, val_split="test", max_prompt_tokens=10,
                       reward_fn=FN)
    held = HeldOut(task)
    assert len(task.prompts()) == 8 and len(held.prompts()) == 3  # nothing dropped until the policy is known
    run_dir = tmp_path / "run"
    held.prepare(TinyCausalLM(), str(run_dir))  # prepares the task, then takes its held-out prompts again
    task.prepare(TinyCausalLM(), str(run_dir))  # idempotent
    assert [p.prompt_id for p in task.prompts()] == [0, 1, 2, 3]  # one character per token: 4, 6, 8, 10 tokens
    assert [p.text for p in held.prompts()] == ["1+1+1+1=", "1+1+1+1+1="]  # rows 0 and 1 of the test split
    report = json.loads((run_dir / "dataset_filter.json").read_text())
    assert report["max_prompt_tokens"] == 10
    assert report["train"] == {"split": "train", "kept": 4, "dropped": 4, "dropped_ids": [4, 5, 6, 7]}
    assert report["val"] == {"split": "test", "kept": 2, "dropped": 1, "dropped_ids": [2]}
    with pytest.raises(KeyError, match="has no prompt_id 7"):
        task.prompt(7)


def test_max_prompt_tokens_counts_the_chat_template(tmp_path: Path) -> None:
    rows = [{"prompt": "1+1=", "answer": "2"}]
    task = DatasetTask(write(tmp_path, rows, "jsonl"), chat_template=True, max_prompt_tokens=10, reward_fn=FN)
    with pytest.raises(ValueError, match=rf"{KEY}\.max_prompt_tokens=10 drops every prompt .* raise it"):
        task.prepare(TinyCausalLM(), str(tmp_path))  # 4 characters, 20 tokens once templated


def test_every_prompt_dropped_names_the_key(tmp_path: Path) -> None:
    task = DatasetTask(write(tmp_path, ROWS, "parquet"), prompt_column="question", max_prompt_tokens=3,
                       reward_fn=FN)
    with pytest.raises(ValueError, match=rf"{KEY}\.max_prompt_tokens=3 drops every prompt"):
        task.prepare(TinyCausalLM(), str(tmp_path / "run"))


def test_holdout_and_val_split(tmp_path: Path) -> None:
    path = write(tmp_path, ROWS, "parquet")
    task = DatasetTask(path, prompt_column="question", holdout=3, reward_fn=FN)
    train, val = task.prompts(), task.val_prompts()
    assert len(train) == 7 and len(val) == 3
    assert {p.prompt_id for p in train}.isdisjoint({p.prompt_id for p in val})
    assert [p.prompt_id for p in DatasetTask(path, prompt_column="question", holdout=3,
                                             reward_fn=FN).val_prompts()] == [p.prompt_id for p in val]
    test = write(tmp_path, [{"question": "9+9=", "answer": "18"}], "parquet", name="test")
    split = DatasetTask("parquet", data_files={"train": path, "test": test}, val_split="test",
                        prompt_column="question", reward_fn=FN)
    assert len(split.prompts()) == 10
    assert [(p.prompt_id, p.text) for p in split.val_prompts()] == [(0, "9+9=")]


def test_pickles_with_its_prompts(tmp_path: Path) -> None:
    task = DatasetTask(write(tmp_path, ROWS, "parquet"), prompt_column="question", verifier=MathVerify())
    copy = pickle.loads(pickle.dumps(task))
    assert copy.prompts() == task.prompts()
    assert copy.rewards(copy.prompts()[:1], ["\\boxed{3}"]) == [1.0]


@pytest.mark.parametrize(("kwargs", "error", "match"), [
    ({"prompt_column": "question", "prompt_template": "{question}"}, ValueError,
     r"prompt_column and prompt_template are both set"),
    ({"prompt_column": "nope"}, KeyError, rf"{KEY}\.prompt_column='nope' is not a column"),
    ({"prompt_column": "question", "answer_column": "solution"}, KeyError,
     rf"{KEY}\.answer_column='solution' is not a column"),
    ({"prompt_template": "{question} {nope}"}, KeyError, r"prompt_template names the column 'nope'"),
    ({"messages_column": "question"}, TypeError, rf"{KEY}\.messages_column='question' holds text, not a list of"),
    ({"prompt_column": "question", "system_prompt": "hi"}, ValueError, rf"{KEY}\.system_prompt needs"),
    ({"prompt_column": "question", "id_column": "source"}, ValueError,
     rf"{KEY}\.id_column='source': id 'sum' appears twice in .*: rows 0 and 2; ids must be unique"),
    ({"prompt_column": "source", "answer_column": "uid.value"}, KeyError,
     rf"{KEY}\.answer_column='uid\.value' is not a column of .*; its columns: \['answer', 'question'"),
    ({"prompt_column": "question", "holdout": 2, "val_split": "test"}, ValueError, r"set one of them"),
    ({"prompt_column": "question", "max_prompt_tokens": 0}, ValueError, rf"{KEY}\.max_prompt_tokens=0 must be"),
    ({"prompt_column": "question", "split": "test"}, ValueError, rf"{KEY}\.split='test': a single file"),
])
def test_config_errors_name_the_key(tmp_path: Path, kwargs: dict[str, Any], error: type[Exception],
                                    match: str) -> None:
    with pytest.raises(error, match=match):
        DatasetTask(write(tmp_path, ROWS, "parquet"), reward_fn=FN, **kwargs)


def test_reward_source_and_paths_are_checked(tmp_path: Path) -> None:
    path = write(tmp_path, ROWS, "parquet")
    with pytest.raises(ValueError, match=r"exactly one of verifier .*, reward_fn .* and reward_funcs .*got none"):
        DatasetTask(path, prompt_column="question")
    with pytest.raises(FileNotFoundError, match=rf"{KEY}\.path='./missing.parquet' does not exist"):
        DatasetTask("./missing.parquet", reward_fn=FN)
    task = DatasetTask(path, prompt_column="question", chat_template=True, reward_fn=FN)
    policy = TinyCausalLM()
    policy.chat_template = True  # a policy that templates prompts itself (HFCausalLM(chat_template=True))
    with pytest.raises(ValueError, match=r"templated twice"):
        task.prepare(policy, str(tmp_path))


def _config(**task_args: Any) -> dict[str, Any]:
    args = {"path": "data/gsm8k.parquet", "split": "train", "revision": None, "max_prompt_tokens": 256,
            "prompt_column": "question", **task_args}
    return {"model": {"class_path": "screl.GRPO"},
            "data": {"class_path": "screl.RolloutDataModule",
                     "init_args": {"task": {"class_path": "screl.envs.DatasetTask", "init_args": args}}}}


def test_the_dataset_identity_is_in_the_bootstrap_fingerprint(tmp_path: Path) -> None:
    base = bootstrap_fingerprint(_config())
    assert bootstrap_fingerprint(_config()) == base
    for change in ({"path": "data/gsm8k_v2.parquet"}, {"split": "test"}, {"revision": "abc123"},
                   {"max_prompt_tokens": 128}, {"data_files": {"train": "x.parquet"}}):
        assert bootstrap_fingerprint(_config(**change)) != base, change
    store = str(tmp_path / "ckpt")
    write_bootstrap_anchor(store, _config())
    assert validate_bootstrap_anchor(store, _config()) is not None
    with pytest.raises(FingerprintMismatchError,
                       match=r'data\.init_args\.task\.init_args\.path: "data/gsm8k\.parquet" -> "data/other\.parquet"'):
        validate_bootstrap_anchor(store, _config(path="data/other.parquet"))


# -- bad input files (issue 40, item 3): a clear error at load, naming the file and the row, before any work ---------
BAD_FILES: list[tuple[str, str, bytes, str]] = [
    ("empty_jsonl", "jsonl", b"", r"path='.*bad\.jsonl' has no rows \(it is empty\)"),
    ("blank_lines", "jsonl", b"\n  \n", r"has no rows \(it is empty\)"),
    ("empty_csv", "csv", b"", r"has no rows \(it is empty\)"),
    ("header_only_csv", "csv", b"question,answer\n", r"has no rows \(only a header\)"),
    ("empty_parquet", "parquet", b"", r"path='.*bad\.parquet' is empty \(0 bytes\)"),
    ("non_utf8_jsonl", "jsonl", b'{"question": "1+1=", "answer": "2"}\n{"question": "\xff\xfe", "answer": "3"}\n',
     r"line 2 is not UTF-8 \(byte 0xff at column 15\); re-encode"),
    ("non_utf8_csv", "csv", b"question,answer\n1+1=,2\n\xe9t\xe9,3\n", r"line 3 is not UTF-8 \(byte 0xe9"),
    ("broken_json_line", "jsonl", b'{"question": "1+1=", "answer": "2"}\n{"question": "2+2=",\n',
     r"line 2 \(row 1\) is not JSON"),
    ("json_array_line", "jsonl", b'{"question": "1+1=", "answer": "2"}\n[1, 2]\n', r"line 2 \(row 1\) is a JSON list"),
    ("row_without_the_prompt", "jsonl", b'{"question": "1+1=", "answer": "2"}\n{"answer": "3"}\n',
     rf"row 1 of .*bad\.jsonl' \(split 'train'\) has no 'question' \(the prompt, {KEY}\.prompt_column\)"),
    ("null_prompt", "jsonl", b'{"question": "1+1=", "answer": "2"}\n{"question": null, "answer": "3"}\n',
     r"row 1 of .* has no 'question'"),
    ("empty_prompt", "csv", b'question,answer\n1+1=,2\n"",3\n', r"row 1 of .* has (no|an empty) 'question'"),
    ("duplicate_ids", "jsonl", b'{"question": "a", "answer": "1", "uid": 4}\n{"question": "b", "answer": "2", "uid": 4}\n',
     rf"{KEY}\.id_column='uid': id 4 appears twice .*: rows 0 and 1; ids must be unique"),
]


@pytest.mark.parametrize(("fmt", "content", "match"), [case[1:] for case in BAD_FILES],
                         ids=[case[0] for case in BAD_FILES])
def test_a_bad_dataset_file_is_a_clear_error_at_load_naming_the_row(tmp_path: Path, fmt: str, content: bytes,
                                                                      match: str) -> None:
    path = tmp_path / f"bad.{fmt}"
    path.write_bytes(content)
    id_column = "uid" if b"uid" in content else None
    with pytest.raises(ValueError, match=match):
        DatasetTask(str(path), prompt_column="question", id_column=id_column, reward_fn=FN)


def test_a_template_over_a_null_column_names_the_row(tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text('{"q": "1+1=", "answer": "2"}\n{"q": null, "answer": "3"}\n')
    with pytest.raises(ValueError, match=rf"row 1 of .* has no 'q' \(the prompt, {KEY}\.prompt_template\)"):
        DatasetTask(str(path), prompt_template="what is {q}", reward_fn=FN)


def test_a_prompt_longer_than_the_context_is_refused_before_the_run_starts(tmp_path: Path) -> None:
    policy = TinyCausalLM()
    context = policy.build_config().max_position_embeddings
    rows = [{"prompt": "1+1=", "answer": "2"}, {"prompt": "1" * (context + 5), "answer": "1"}]
    path = write(tmp_path, rows, "jsonl")
    task = DatasetTask(path, reward_fn=FN)
    with pytest.raises(ValueError, match=rf"{KEY}: prompt id 1 of .* is {context + 5} tokens .* context is {context}"
                                         rf" positions .* Set {KEY}\.max_prompt_tokens"):
        task.prepare(policy, str(tmp_path / "run"))
    capped = DatasetTask(path, max_prompt_tokens=context // 2, reward_fn=FN)  # the knob the error names
    capped.prepare(policy, str(tmp_path / "run"))
    assert [p.prompt_id for p in capped.prompts()] == [0]


def test_jsonl_task_names_the_bad_line(tmp_path: Path) -> None:
    from screl.envs import JsonlTask

    path = tmp_path / "p.jsonl"
    cases = [(b"", r"has no rows"), (b'{"prompt": "a"}\n\xff\n', r"line 2 of .* is not UTF-8"),
             (b'{"prompt": "a"}\n{"prompt": \n', r"line 2 of .* is not JSON"),
             (b'{"prompt": "a", "id": 0}\n{"prompt": "b", "id": 1}\n{"prompt": "c", "id": 1}\n', None)]
    for content, match in cases:
        path.write_bytes(content)
        if match is None:
            path.write_bytes(content.replace(b', "id": 0', b""))
            with pytest.raises(ValueError, match=r"line 1 of .* has id=None: every row needs an integer id"):
                JsonlTask(str(path), reward_fn=FN, id_key="id").prompts()
            path.write_bytes(content)
            with pytest.raises(ValueError, match=r"duplicate prompt id 1 .*: lines 2 and 3"):
                JsonlTask(str(path), reward_fn=FN, id_key="id").prompts()
            continue
        with pytest.raises(ValueError, match=match):
            JsonlTask(str(path), reward_fn=FN).prompts()
