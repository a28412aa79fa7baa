"""DatasetTask's ``image_column`` (issue 36): images as relative paths in JSONL and as a Hugging Face ``Image`` feature
in parquet, checked at load (naming the row), decoded where they are used, never carried in a prompt record; and
``screl check`` on an image dataset with a text-only policy."""

from __future__ import annotations

import copy
import io
import pickle
from pathlib import Path
from typing import Any

import datasets
import pytest
from _check_helpers import load_config, run_check
from PIL import Image

from screl.envs import DatasetTask, PromptRecord

KEY = "data.init_args.task.init_args"
COLOURS = [(255, 0, 0), (0, 128, 255), (20, 200, 40)]


def count_answer(prompt: PromptRecord, completion: str) -> float:
    return 1.0 if completion.strip() == str(prompt.metadata["answer"]) else 0.0


FN = f"{__name__}:count_answer"


def _image(i: int) -> Image.Image:
    image = Image.new("RGB", (8 + i, 6), COLOURS[i % 3])
    image.putpixel((i, 2), (i, 2 * i, 3 * i))  # each one distinct
    return image


def _jsonl_with_paths(tmp_path: Path, n: int = 3) -> Path:
    (tmp_path / "img").mkdir(parents=True)
    rows = []
    for i in range(n):
        _image(i).save(tmp_path / "img" / f"{i}.png")
        rows.append({"prompt": f"what colour? {i}", "answer": str(i), "image": f"img/{i}.png"})
    datasets.Dataset.from_list(rows).to_json(tmp_path / "data.jsonl")
    return tmp_path / "data.jsonl"


def _same(a: Image.Image, b: Image.Image) -> bool:
    return a.size == b.size and list(a.convert("RGB").getdata()) == list(b.convert("RGB").getdata())


def test_relative_image_paths_are_read_on_use_and_never_held_by_the_prompt(tmp_path: Path) -> None:
    task = DatasetTask(str(_jsonl_with_paths(tmp_path)), image_column="image", reward_fn=FN)
    prompts = task.prompts()
    assert [p.metadata["dataset_row"] for p in prompts] == [{"split": "train", "index": i} for i in range(3)]
    assert all("image" not in p.metadata for p in prompts)  # the record holds the row, not the image
    for i, p in enumerate(prompts):
        [got] = task.images(p)
        assert got.mode == "RGB" and _same(got, _image(i))
    shipped = pickle.loads(pickle.dumps(task))  # as a rollout worker gets it: it reads the images itself
    assert _same(shipped.images(prompts[2])[0], _image(2))


def test_an_image_feature_in_parquet_is_read_undecoded_and_decoded_on_use(tmp_path: Path) -> None:
    rows = {"prompt": ["a", "b"], "answer": ["0", "1"], "image": [_image(0), _image(1)]}
    ds = datasets.Dataset.from_dict(rows).cast_column("image", datasets.Image())
    ds.to_parquet(str(tmp_path / "data.parquet"))
    task = DatasetTask(str(tmp_path / "data.parquet"), image_column="image", reward_fn=FN)
    prompts = task.prompts()
    assert all(set(p.metadata) == {"answer", "dataset_row"} for p in prompts)
    assert _same(task.images(prompts[1])[0], _image(1))
    assert len(pickle.dumps(task)) < 4096  # no image bytes travel with the task or its records


def test_encoded_bytes_and_a_list_of_images_per_row(tmp_path: Path) -> None:
    def png(i: int) -> bytes:
        buf = io.BytesIO()
        _image(i).save(buf, format="PNG")
        return buf.getvalue()

    ds = datasets.Dataset.from_dict({"prompt": ["two"], "answer": ["2"], "images": [[png(0), png(2)]]})
    ds.to_parquet(str(tmp_path / "data.parquet"))
    task = DatasetTask(str(tmp_path / "data.parquet"), image_column="images", reward_fn=FN)
    got = task.images(task.prompts()[0])
    assert len(got) == 2 and _same(got[0], _image(0)) and _same(got[1], _image(2))


def test_a_missing_image_file_or_value_is_refused_at_load_naming_the_row(tmp_path: Path) -> None:
    path = _jsonl_with_paths(tmp_path)
    (tmp_path / "img" / "1.png").unlink()
    with pytest.raises(FileNotFoundError, match=r"row 1 of .*data.jsonl.*the image .*1.png.* in 'image' "
                                                r"\(image_column\) does not exist"):
        DatasetTask(str(path), image_column="image", reward_fn=FN)
    datasets.Dataset.from_list([{"prompt": "x", "answer": "0", "image": None}]).to_json(tmp_path / "none.jsonl")
    with pytest.raises(ValueError, match=r"row 0 of .*none.jsonl.* has no image in 'image' \(image_column\)"):
        DatasetTask(str(tmp_path / "none.jsonl"), image_column="image", reward_fn=FN)
    with pytest.raises(KeyError, match=rf"{KEY}.image_column='picture' is not a column of"):
        DatasetTask(str(path), image_column="picture", reward_fn=FN)


def test_a_number_in_the_image_column_is_refused(tmp_path: Path) -> None:
    datasets.Dataset.from_list([{"prompt": "x", "answer": "0", "image": 7}]).to_json(tmp_path / "d.jsonl")
    with pytest.raises(ValueError, match=r"row 0 .*'image' \(image_column\) holds int, not an image"):
        DatasetTask(str(tmp_path / "d.jsonl"), image_column="image", reward_fn=FN)


def _dataset_config(tmp_path: Path, image_column: str | None, policy: str) -> dict[str, Any]:
    cfg = copy.deepcopy(load_config("grpo_vlm_tiny.yaml"))
    args: dict[str, Any] = {"path": str(_jsonl_with_paths(tmp_path)), "reward_fn": FN}
    if image_column is not None:
        args["image_column"] = image_column
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.DatasetTask", "init_args": args}
    cfg["model"]["init_args"]["policy"] = {"class_path": policy, "init_args": {}}
    return cfg


def test_check_refuses_an_image_dataset_with_a_text_policy_and_passes_either_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    rc, out = run_check(_dataset_config(tmp_path / "a", "image", "screl.models.TinyCausalLM"), tmp_path, capsys)
    assert rc != 0 and "TinyCausalLM is a text-only policy" in out and "model.init_args.policy" in out, out
    rc, out = run_check(_dataset_config(tmp_path / "b", None, "screl.models.TinyCausalLM"), tmp_path, capsys)
    assert "text-only policy" not in out, out  # a DatasetTask without image_column is a text task
    rc, out = run_check(_dataset_config(tmp_path / "c", "image", "screl.models.TinyVisionLM"), tmp_path, capsys)
    assert rc == 0, out
