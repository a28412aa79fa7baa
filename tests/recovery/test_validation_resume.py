"""A checkpoint captured while a validation runs: the resumed `screl fit` redoes that validation, once."""

from __future__ import annotations

import csv
import io
from pathlib import Path

import pytest
import torch
import yaml

from screl.checkpoint.store import CheckpointStore
from screl.data.events import parse_event, read_events

from .conftest import recovery_config, start_fit

pytestmark = pytest.mark.slow


def _val_versions(root: Path) -> list[list[float]]:
    """val/version per incarnation's metrics.csv, oldest first."""
    out = []
    for path in sorted(root.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime):
        with path.open() as fh:
            out.append([float(r["val/version"]) for r in csv.DictReader(fh) if r.get("val/version")])
    return out


def test_a_checkpoint_taken_while_validation_runs_is_redone_on_resume(tmp_path: Path) -> None:
    ck = tmp_path / "bundles"
    config = recovery_config(tmp_path, str(ck), steps=3)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.CountLetter",
                                        "init_args": {"letter": "a", "holdout": 6}}
    cfg["grpo"]["val_period"] = 1
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "fit.log"
    assert start_fit(config, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    store = CheckpointStore(str(ck))
    bundle = store.latest()
    assert bundle is not None and bundle.step == 3
    state = torch.load(io.BytesIO(store.read_bytes(bundle, "controller_state.pt")), weights_only=False)
    assert state["validation"] == {"pending": [3]}, "the bundle was captured while version 3 was validating"

    cfg["trainer"]["max_steps"] = cfg["grpo"]["max_num_steps"] = 4
    config.write_text(yaml.safe_dump(cfg))
    assert start_fit(config, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    events = [parse_event(line) for _, line in read_events(tmp_path / "run")]
    restore = max(i for i, e in enumerate(events) if e.name == "restore")
    assert [e.trainer_version for e in events[:restore] if e.name == "validate"] == [1, 2, 3]
    assert [e.trainer_version for e in events[restore:] if e.name == "validate"] == [3, 4]
    assert _val_versions(tmp_path / "root") == [[1.0, 2.0, 3.0], [3.0, 4.0]], (
        "each incarnation logs whole validations; the resumed one redoes version 3")
