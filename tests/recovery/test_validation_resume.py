"""Resuming `screl fit` from a bundle captured while a validation ran, written with
``checkpointing.save_optimizer: false``: the resumed run redoes that validation, once; the bundle keeps the optimizer's
hyperparameters but not its moments, the manifest says so, and a resume from it is refused (nothing modified) unless
``resume_without_optimizer``. (One lineage for both rules: each launch is a whole ``screl fit`` start-up.)"""

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
    """val/version per incarnation's metrics.csv that logged any, oldest first."""
    out = []
    for path in sorted(root.rglob("metrics.csv"), key=lambda p: p.stat().st_mtime):
        with path.open() as fh:
            versions = [float(r["val/version"]) for r in csv.DictReader(fh) if r.get("val/version")]
        if versions:
            out.append(versions)
    return out


def test_a_bundle_taken_mid_validation_without_optimizer_state_resumes_only_when_told_to_and_redoes_it(
    tmp_path: Path,
) -> None:
    ck = tmp_path / "bundles"
    config = recovery_config(tmp_path, str(ck), steps=3)
    cfg = yaml.safe_load(config.read_text())
    cfg["data"]["init_args"]["task"] = {"class_path": "screl.envs.CountLetter",
                                        "init_args": {"letter": "a", "holdout": 6}}
    cfg["grpo"]["val_period"] = 1
    cfg["checkpointing"]["save_optimizer"] = False
    config.write_text(yaml.safe_dump(cfg))
    log = tmp_path / "fit.log"
    assert start_fit(config, log).wait(timeout=600) == 0, log.read_text()[-3000:]
    # screl fit began Ray at launch (screl.prestart) and the run took that cluster over
    assert "screl: Ray started at launch, beside the driver's start-up" in log.read_text()
    store = CheckpointStore(str(ck))
    bundle = store.latest()
    assert bundle is not None and bundle.step == 3 and bundle.metadata["optimizer"] is False
    ckpt = torch.load(ck / "step_3" / "lightning.ckpt", weights_only=True)
    [opt] = ckpt["optimizer_states"]
    assert opt["state"] == {} and opt["param_groups"][0]["lr"] == cfg["model"]["init_args"]["learning_rate"]
    state = torch.load(io.BytesIO(store.read_bytes(bundle, "controller_state.pt")), weights_only=False)
    assert state["validation"] == {"pending": [3]}, "the bundle was captured while version 3 was validating"

    # a longer run from that bundle is refused while the config does not accept the missing optimizer state
    cfg["trainer"]["max_steps"] = cfg["grpo"]["max_num_steps"] = 4
    config.write_text(yaml.safe_dump(cfg))
    before = sorted(p.name for p in ck.iterdir())
    refused = tmp_path / "refused.log"
    assert start_fit(config, refused).wait(timeout=600) != 0
    out = refused.read_text()
    assert "was written with checkpointing.save_optimizer: false" in out
    assert "checkpointing.resume_without_optimizer: true" in out and "Nothing was modified" in out
    assert sorted(p.name for p in ck.iterdir()) == before

    cfg["checkpointing"]["resume_without_optimizer"] = True
    config.write_text(yaml.safe_dump(cfg))
    resumed = tmp_path / "resumed.log"
    assert start_fit(config, resumed).wait(timeout=600) == 0, resumed.read_text()[-3000:]
    assert f"resuming from {ck}/step_3" in resumed.read_text()
    latest = store.latest()
    assert latest is not None and latest.step == 4
    events = [parse_event(line) for _, line in read_events(tmp_path / "run")]
    [restore] = [i for i, e in enumerate(events) if e.name == "restore"]  # the refused launch restored nothing
    assert [e.trainer_version for e in events[:restore] if e.name == "validate"] == [1, 2, 3]
    assert [e.trainer_version for e in events[restore:] if e.name == "validate"] == [3, 4]
    assert _val_versions(tmp_path / "root") == [[1.0, 2.0, 3.0], [3.0, 4.0]], (
        "each incarnation logs whole validations; the resumed one redoes version 3")
