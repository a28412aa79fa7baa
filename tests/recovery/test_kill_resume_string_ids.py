"""String prompt ids through a real kill and resume: a DatasetTask whose ``id_column`` holds strings (mapped to
stable 63-bit prompt ids) is SIGKILLed mid-step and resumed; ``screl events check`` finds the log clean, and every
prompt id the log admits maps back to its dataset string (the admit events' ``prompt_keys``)."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import pytest
import yaml

from screl.data.events import parse_event, read_events
from screl.envs.dataset_columns import string_prompt_id

from .conftest import recovery_config
from .kill_chain import IN_ORDER, final_outcome, kill_chain

pytestmark = pytest.mark.slow


def test_kill9_a_run_with_string_ids_resumes_and_keeps_them(tmp_path: Path) -> None:
    data = tmp_path / "data"
    data.mkdir()
    uids = [f"arith/train/{i:03d}-{'ab'[i % 2]}" for i in range(24)]
    datasets.Dataset.from_list([{"uid": u, "question": f"{i}+{i}=", "answer": f"#### {2 * i}", "source": "arith"}
                                for i, u in enumerate(uids)]).to_parquet(str(data / "train.parquet"))
    steps, ck_root, run_dir = 4, tmp_path / "bundles", tmp_path / "run"
    config = recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER, source="grpo_dataset_tiny.yaml")
    cfg = yaml.safe_load(config.read_text())
    task = cfg["data"]["init_args"]["task"]["init_args"]
    task.update(path=str(data / "train.parquet"), id_column="uid", max_prompt_tokens=None)
    task.pop("val_split")
    cfg["grpo"].update(val_period=0, val_at_end=False)
    config.write_text(yaml.safe_dump(cfg))
    kills = kill_chain(config, ["mid_step"], run_dir, ck_root, random.Random(3))
    assert kills == ["mid_step"], f"the kill did not land before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)  # screl events check: OK, resumed, every step trained once
    by_id = {string_prompt_id(u): u for u in uids}
    seen: dict[int, str] = {}
    for _, line in read_events(run_dir):
        event = parse_event(line)
        if event.name in ("admit", "spare"):
            keys = (event.extra or {}).get("prompt_keys")
            assert keys is not None, f"{event.name} without prompt_keys: {line}"
            seen.update(zip(event.prompt_ids, keys, strict=True))  # type: ignore[attr-defined]
    assert seen and all(by_id[pid] == key for pid, key in seen.items())  # each id maps back to its own string
