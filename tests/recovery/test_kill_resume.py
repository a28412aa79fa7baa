"""Fault injection: SIGKILL `screl fit` at seeded points in a row (every kind of point), resume each time, and
check nothing was lost or trained twice (the kill chain itself is in kill_chain.py). The run's prompts are a
DatasetTask with string ids scored by TRL-style reward functions: the ids survive every kill, each admitted prompt id
maps back to its dataset string. The policy trains LoRA adapters: its bundles hold the adapters, every resume loads
them onto the base, and the last bundle exports as the merged model."""

from __future__ import annotations

import random
from pathlib import Path

import datasets
import pytest
import yaml

from screl.checkpoint.store import CheckpointStore
from screl.data.events import parse_event, read_events
from screl.envs.dataset_columns import string_prompt_id
from screl.export.source import read_bundle

from .conftest import recovery_config, with_snapshots
from .kill_chain import IN_ORDER, final_outcome, kill_chain

pytestmark = pytest.mark.slow


KINDS = ["generation", "mid_step", "checkpoint_write", "snapshot_write"]


@pytest.mark.parametrize("seed", [0])
def test_kill9_at_seeded_points_of_every_kind_loses_no_group(seed: int, tmp_path: Path) -> None:
    """Four kills in a row, each kind of point once, in a seeded order. With the other kill chains
    (tests/recovery/test_kill_resume_algos.py: 3 + 1 + 1; distillation, VLM: 1 each) the slow tier kills 11 runs at seeded points."""
    rng = random.Random(seed)
    ck_root = tmp_path / "bundles"
    steps = 30  # long enough that every incarnation reaches its kill point
    config = with_snapshots(recovery_config(tmp_path, str(ck_root), steps=steps, sampler=IN_ORDER))
    uids = _string_id_task(config, tmp_path / "data.parquet")
    cfg = yaml.safe_load(config.read_text())
    cfg["model"]["init_args"]["lora"] = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    config.write_text(yaml.safe_dump(cfg))
    run_dir = tmp_path / "run"
    points = list(KINDS)
    rng.shuffle(points)
    kills = kill_chain(config, points, run_dir, ck_root, rng)
    assert sorted(set(kills)) == sorted(KINDS), f"not every kind of kill landed before the run finished: {kills}"
    final_outcome(run_dir, steps, IN_ORDER)
    store = CheckpointStore(str(ck_root))
    latest = store.latest()
    assert latest is not None and latest.step == steps
    # interrupted saves left temporary directories behind; none was ever selected, and retention swept them
    assert [p.name for p in ck_root.iterdir() if p.name.startswith("tmp_step_")] == []
    by_id = {string_prompt_id(u): u for u in uids}
    seen: dict[int, str] = {}
    for _, line in read_events(run_dir):
        event = parse_event(line)
        if event.name in ("admit", "spare"):
            keys = (event.extra or {}).get("prompt_keys")
            assert keys is not None, f"{event.name} without prompt_keys: {line}"
            seen.update(zip(event.prompt_ids, keys, strict=True))  # type: ignore[attr-defined]
    assert len(seen) > 8 and all(by_id[pid] == key for pid, key in seen.items())  # each id maps back to its string
    weights = read_bundle(str(ck_root), config=str(config))  # LoRA: adapters in the bundle, the base merged in
    assert weights.step == steps and weights.lora is not None and weights.lora[0].r == 4
    assert weights.lora[1] and all("lora_" in name for name in weights.lora[1]), sorted(weights.lora[1])[:4]


def _string_id_task(config: Path, parquet: Path) -> list[str]:
    """The run's task becomes a DatasetTask over string ids, scored by TRL-style reward functions."""
    uids = [f"letters/train/{i:03d}-{'ab'[i % 2]}" for i in range(24)]
    datasets.Dataset.from_list([{"uid": u, "prompt": f"say a {i}", "letter": "a"} for i, u in enumerate(uids)]
                               ).to_parquet(str(parquet))
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.DatasetTask", "init_args": {
        "path": str(parquet), "id_column": "uid", "prompt_column": "prompt", "answer_column": None,
        "reward_funcs": ["screl.rewards.examples:letter_share", "screl.rewards.examples:starts_with_letter"],
        "reward_weights": [1.0, 0.5]}}
    config.write_text(yaml.safe_dump(cfg))
    return uids
