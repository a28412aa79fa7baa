"""DatasetTask over the field's layouts (issue 47, item 2), on parquet files written here: TRL's conversational
format (a chat in the prompt column, rendered through the chat template, never stringified), verl's parquet layout
(struct columns by dotted name, ``data_source``, ``extra_info``), string ids (stable across processes, collisions
refused, the string kept), the policy's ``chat_template_kwargs``, and a task that travels without its rows."""

from __future__ import annotations

import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest

from screl.envs import DatasetTask, PromptRecord
from screl.envs import dataset_columns as columns
from screl.envs.dataset_columns import string_prompt_id
from screl.models import HFCausalLM, TinyCausalLM

KEY = "data.init_args.task.init_args"


def extra_info_reward(prompt: PromptRecord, completion: str) -> float:
    """A verl-style reward: reads the row's ``extra_info`` and its ground truth."""
    info = prompt.metadata["extra_info"]
    return float(completion.strip() == prompt.metadata["answer"]) + 0.5 * (info["split"] == "train")


FN = f"{__name__}:extra_info_reward"


def write(tmp_path: Path, rows: list[dict[str, Any]], name: str = "data") -> str:
    path = tmp_path / f"{name}.parquet"
    datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def chat(i: int, *, system: bool = False, assistant: bool = False) -> list[dict[str, str]]:
    turns = [{"role": "system", "content": "be exact"}] if system else []
    turns.append({"role": "user", "content": f"{i}+1="})
    return turns + ([{"role": "assistant", "content": str(i + 1)}] if assistant else [])


def test_a_conversational_prompt_column_renders_through_the_chat_template(tmp_path: Path) -> None:
    rows = [{"prompt": chat(i, system=i == 0, assistant=i == 2), "answer": str(i + 1)} for i in range(3)]
    task = DatasetTask(write(tmp_path, rows), system_prompt="be brief", reward_fn=FN)  # no chat_template needed
    assert [p.text for p in task.prompts()] == ["0+1=", "1+1=", "2+1="]  # the user turn until the policy is known
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))
    texts = [p.text for p in task.prompts()]
    assert texts[0] == "<bos>system be exact<eos>user 0+1=<eos>assistant "  # its own system turn kept
    assert texts[1] == "<bos>system be brief<eos>user 1+1=<eos>assistant "
    assert texts[2] == "<bos>system be brief<eos>user 2+1=<eos>assistant "  # the last assistant turn left out
    assert "prompt" not in task.prompts()[0].metadata and task.prompt(2).metadata["answer"] == "3"


def test_trl_messages_column_drops_the_final_assistant_turn(tmp_path: Path) -> None:
    rows = [{"messages": chat(i, assistant=True), "answer": str(i + 1)} for i in range(2)]
    task = DatasetTask(write(tmp_path, rows), messages_column="messages", reward_fn=FN)
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))
    assert task.prompts()[1].text == "<bos>user 1+1=<eos>assistant "
    only_assistant = [{"messages": [{"role": "assistant", "content": "2"}], "answer": "2"}]
    lone = DatasetTask(write(tmp_path, only_assistant, "lone"), messages_column="messages", reward_fn=FN)
    with pytest.raises(ValueError, match=rf"row 0 of .*: {KEY}\.messages_column holds no message before the"):
        lone.prompts()[0]


def test_a_list_prompt_is_never_stringified(tmp_path: Path) -> None:
    """The old bug: a list of messages in the prompt column became its Python repr as the prompt text."""
    task = DatasetTask(write(tmp_path, [{"prompt": chat(i), "answer": "1"} for i in range(3)]), reward_fn=FN)
    before = [p.text for p in task.prompts()]
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))
    for text in before + [p.text for p in task.prompts()] + [task.prompt(1).text]:
        assert not text.startswith("[{") and "'role'" not in text and "'content'" not in text, text


@pytest.mark.parametrize(("rows", "match"), [
    ([{"prompt": 7, "answer": "1"}], rf"{KEY}\.prompt_column='prompt' holds int64 values \(row 0 of .*: 7\): expected"
                                     r" text \(TRL's standard format\) or a list of \{role, content\} messages"),
    ([{"prompt": ["1+1=", "2+2="], "answer": "1"}], rf"{KEY}\.prompt_column='prompt' holds list<item: string> values"),
    ([{"prompt": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "answer": "1"}],
     rf"{KEY}\.prompt_column='prompt': the messages' content holds .* \(row 0 of"),
])
def test_a_prompt_column_of_another_type_is_refused(tmp_path: Path, rows: list[dict[str, Any]], match: str) -> None:
    with pytest.raises(TypeError, match=match):
        DatasetTask(write(tmp_path, rows), reward_fn=FN)


def test_a_policy_that_templates_chats_again_is_refused(tmp_path: Path) -> None:
    task = DatasetTask(write(tmp_path, [{"prompt": chat(1), "answer": "2"}]), reward_fn=FN)
    policy = TinyCausalLM()
    policy.chat_template = True  # a policy that templates prompts itself (HFCausalLM(chat_template=True))
    with pytest.raises(ValueError, match=r"the chats of .* are both true: the prompt would be templated twice; set"):
        task.prepare(policy, str(tmp_path))


def verl_rows(n: int) -> list[dict[str, Any]]:
    return [{"data_source": "openai/gsm8k" if i % 2 else "lighteval/MATH", "prompt": chat(i), "ability": "math",
             "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
             "extra_info": {"split": "train" if i < 3 else "test", "index": 10 + i}} for i in range(n)]


def test_verl_parquet_layout(tmp_path: Path) -> None:
    task = DatasetTask(write(tmp_path, verl_rows(4)), answer_column="reward_model.ground_truth",
                       task_source_column="data_source", id_column="extra_info.index", reward_fn=FN)
    prompts = task.prompts()
    assert [p.prompt_id for p in prompts] == [10, 11, 12, 13]  # a struct field as the id
    first = task.prompt(11)
    assert first.metadata["answer"] == "2" and first.metadata["task_source"] == "openai/gsm8k"
    assert first.metadata["extra_info"] == {"split": "train", "index": 11} and first.metadata["ability"] == "math"
    assert task.rewards([task.prompt(11), task.prompt(13)], ["2", "4"]) == [1.5, 1.0]  # extra_info reaches rewards
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))
    assert task.prompt(12).text == "<bos>user 2+1=<eos>assistant "
    with pytest.raises(KeyError, match=rf"{KEY}\.answer_column='reward_model\.answer' is not a column of .*"
                                       r"'reward_model\.ground_truth'"):
        DatasetTask(write(tmp_path, verl_rows(2)), answer_column="reward_model.answer", reward_fn=FN)


def test_string_ids_are_stable_kept_and_unique(tmp_path: Path) -> None:
    rows = [{"question": f"{i}+1=", "answer": str(i + 1), "uid": f"gsm8k/train/{i:04d}"} for i in range(5)]
    path = write(tmp_path, rows)
    task = DatasetTask(path, prompt_column="question", id_column="uid", reward_fn=FN)
    ids = [p.prompt_id for p in task.prompts()]
    assert ids == [string_prompt_id(r["uid"]) for r in rows] and all(0 <= i < 2**63 for i in ids)
    assert task.prompt(ids[3]).metadata["dataset_id"] == "gsm8k/train/0003"  # the verbatim string
    code = ("from screl.envs import DatasetTask; import sys; t = DatasetTask(sys.argv[1], prompt_column='question',"
            " id_column='uid', reward_fn='operator:eq'); print([p.prompt_id for p in t.prompts()])")
    other = subprocess.run([sys.executable, "-c", code, path], capture_output=True, text=True, check=True)
    assert other.stdout.strip().splitlines()[-1] == str(ids)  # the same ids in another process (no hash seed)
    twice = write(tmp_path, [*rows, {**rows[1], "question": "again"}], "twice")
    with pytest.raises(ValueError, match=rf"{KEY}\.id_column='uid': id 'gsm8k/train/0001' appears twice .*: rows 1"
                                         " and 5; ids must be unique"):
        DatasetTask(twice, prompt_column="question", id_column="uid", reward_fn=FN)


def test_a_string_id_collision_is_refused_naming_both_strings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    rows = [{"question": "a", "answer": "1", "uid": "alpha"}, {"question": "b", "answer": "2", "uid": "beta"}]
    path = write(tmp_path, rows)
    monkeypatch.setattr(columns, "string_prompt_id", lambda value: 42)  # a 63-bit collision, forced
    with pytest.raises(ValueError, match=r"the string ids 'alpha' \(row 0\) and 'beta' \(row 1\) of .* map to the same"
                                         r" prompt id 42 \(a 63-bit hash collision\); rename one"):
        DatasetTask(path, prompt_column="question", id_column="uid", reward_fn=FN)


def test_the_task_travels_without_its_rows(tmp_path: Path) -> None:
    rows = [{"question": "question number " + "x" * (60 if i < 100 else 120), "answer": str(i), "uid": f"id-{i}"}
            for i in range(300)]
    task = DatasetTask(write(tmp_path, rows), prompt_column="question", id_column="uid", holdout=5,
                       max_prompt_tokens=100, reward_fn=FN)
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))  # rows 100.. are 136 characters (a token each): dropped
    blob = pickle.dumps(task)
    assert len(blob) < 4000 and b"question number" not in blob  # 300 rows of 76 to 136 characters: none travels
    copy = pickle.loads(blob)
    assert copy.prompts() == task.prompts() and copy.val_prompts() == task.val_prompts()
    assert len(copy.prompts()) + len(copy.val_prompts()) == 100
    assert copy.prompt(string_prompt_id("id-7")).metadata["dataset_id"] == "id-7"
    with pytest.raises(KeyError, match=r"DatasetTask has no prompt_id"):
        copy.prompt(string_prompt_id("id-150"))  # too long: dropped at prepare


TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}"
            "assistant{% if enable_thinking is defined and not enable_thinking %} nothink{% endif %} {% endif %}")


def test_chat_template_kwargs_reach_the_rendered_prompt(tmp_path: Path) -> None:
    tokenizer = TinyCausalLM().build_tokenizer()
    tokenizer.chat_template = TEMPLATE
    folder = tmp_path / "tok"
    tokenizer.save_pretrained(str(folder))
    off = {"enable_thinking": False}
    templated = HFCausalLM(str(folder), chat_template=True, chat_template_kwargs=off)
    ids = templated.prompt_token_ids(tokenizer, "1+1=")
    assert tokenizer.decode(ids) == "user 1+1= assistant nothink "
    plain = HFCausalLM(str(folder), chat_template=True)
    assert tokenizer.decode(plain.prompt_token_ids(tokenizer, "1+1=")) == "user 1+1= assistant "
    task = DatasetTask(write(tmp_path, [{"prompt": chat(1), "answer": "2"}]), reward_fn=FN)
    task.prepare(HFCausalLM(str(folder), chat_template_kwargs=off), str(tmp_path / "run"))
    assert task.prompts()[0].text == "user 1+1= assistant nothink "  # the task's chats get them too


def sum_is_right(prompts: list[Any], completions: list[Any], answer: list[str], **kwargs: Any) -> list[float]:
    """A TRL reward function over conversational data: messages in, messages out."""
    assert all(isinstance(p, list) and p[-1]["role"] == "user" for p in prompts)
    return [float(c[0]["content"].strip() == a) for c, a in zip(completions, answer, strict=True)]


def short(prompts: list[Any], completions: list[Any], completion_ids: list[list[int]], **kwargs: Any) -> list[Any]:
    """Applies to completions of at most 3 tokens only (None elsewhere: skipped, as TRL skips it)."""
    return [1.0 if len(ids) <= 2 else None if len(ids) > 3 else 0.0 for ids in completion_ids]


def test_reward_funcs_score_conversational_rows_as_trl_does(tmp_path: Path) -> None:
    rows = [{"prompt": chat(i), "answer": str(i + 1)} for i in range(3)]
    funcs = [f"{__name__}:sum_is_right", f"{__name__}:short"]
    task = DatasetTask(write(tmp_path, rows), reward_funcs=funcs, reward_weights=[1.0, 0.5])
    task.prepare(TinyCausalLM(), str(tmp_path / "run"))
    prompts = list(task.prompts())
    assert prompts[1].metadata["prompt_messages"] == chat(1)
    completions = ["1", "5 ", "3"]  # right; wrong; right (1, 2 and 1 tokens under the policy's tokenizer)
    assert task.rewards(prompts, completions) == [1.5, 0.5, 1.5]
    ids = [[4], [8, 3], [6] * 5]  # the last as a 5-token completion: "short" does not apply (None)
    scored = task.scored(prompts, completions, ids)
    assert [s.reward for s in scored] == [1.5, 0.5, 1.0]
    assert [s.parts for s in scored] == [{"sum_is_right": 1.0, "short": 1.0}, {"sum_is_right": 0.0, "short": 1.0},
                                         {"sum_is_right": 1.0}]  # a None is left out of the parts
    with pytest.raises(ValueError, match=r"give exactly one of verifier .* got reward_fn, reward_funcs"):
        DatasetTask(write(tmp_path, rows), reward_funcs=funcs, reward_fn=FN)
    with pytest.raises(ValueError, match=r"reward_weights=\[1.0\] weigh reward_funcs, which is not set"):
        DatasetTask(write(tmp_path, rows), reward_fn=FN, reward_weights=[1.0])


def _index_of_records(task: DatasetTask) -> list[tuple[Any, ...]]:
    return [(p.prompt_id, p.metadata.get("task_source"), p.metadata.get("agent"), p.metadata.get("dataset_id"))
            for p in task.prompts()]


@pytest.mark.parametrize("layout", ["string ids and a source", "verl struct ids", "row index, own columns", "chat"])
def test_the_prompt_index_is_what_the_records_say_read_from_the_key_columns_alone(tmp_path: Path,
                                                                                   layout: str) -> None:
    n = 40
    if layout == "string ids and a source":
        rows = [{"id": f"train/{i:03d}", "question": f"{i}+1=", "answer": str(i + 1), "src": ["a", "b"][i % 2],
                 "agent": None if i % 3 else "calc"} for i in range(n)]
        args: dict[str, Any] = {"prompt_column": "question", "id_column": "id", "task_source_column": "src"}
    elif layout == "verl struct ids":
        rows = [{"prompt": f"{i}+1=", "data_source": "gsm8k", "answer": str(i + 1),
                 "extra_info": {"index": 1000 + i, "split": "train"}} for i in range(n)]
        args = {"id_column": "extra_info.index", "task_source_column": "data_source"}
    elif layout == "row index, own columns":  # columns named as the keys: the metadata carries them as they are
        rows = [{"prompt": f"{i}+1=", "answer": str(i + 1), "task_source": f"s{i % 4}", "dataset_id": f"d{i}",
                 "agent": "calc"} for i in range(n)]
        args = {}
    else:
        rows = [{"prompt": chat(i), "answer": str(i + 1), "id": f"c/{i}"} for i in range(n)]
        args = {"id_column": "id"}
    task = DatasetTask(write(tmp_path, rows), reward_fn=FN, holdout=5, **args)
    index = list(task.prompt_index())
    assert len(index) == n - 5 and index == _index_of_records(task)
    columns = dict(zip(("id", "source", "agent", "key"), zip(*index, strict=True), strict=True))
    carried = {name for name in ("source", "agent", "key") if any(v is not None for v in columns[name])}
    assert carried == {"string ids and a source": {"source", "agent", "key"}, "verl struct ids": {"source"},
                       "row index, own columns": {"source", "agent", "key"}, "chat": {"key"}}[layout]
