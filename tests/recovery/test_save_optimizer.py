"""``checkpointing.save_optimizer: false``: bundles keep the optimizer's hyperparameters but not its moments, the
manifest says so, and a resume from one is refused (nothing modified) unless ``resume_without_optimizer``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from screl.checkpoint.store import CheckpointStore

from .conftest import recovery_config, start_fit

pytestmark = pytest.mark.slow


def test_a_bundle_without_optimizer_state_resumes_only_when_told_to(tmp_path: Path) -> None:
    config = recovery_config(tmp_path, str(tmp_path / "bundles"), steps=2)
    cfg = yaml.safe_load(config.read_text())
    cfg["checkpointing"]["save_optimizer"] = False
    config.write_text(yaml.safe_dump(cfg))
    proc = start_fit(config, tmp_path / "fit.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "fit.log").read_text()[-3000:]
    # screl fit began Ray at launch (screl.prestart) and the run took that cluster over
    assert "screl: Ray started at launch, beside the driver's start-up" in (tmp_path / "fit.log").read_text()
    store = CheckpointStore(str(tmp_path / "bundles"))
    bundle = store.latest()
    assert bundle is not None and bundle.step == 2 and bundle.metadata["optimizer"] is False
    ckpt = torch.load(tmp_path / "bundles" / "step_2" / "lightning.ckpt", weights_only=True)
    [opt] = ckpt["optimizer_states"]
    assert opt["state"] == {} and opt["param_groups"][0]["lr"] == cfg["model"]["init_args"]["learning_rate"]

    cfg["trainer"]["max_steps"] = cfg["grpo"]["max_num_steps"] = 3
    config.write_text(yaml.safe_dump(cfg))
    before = sorted(p.name for p in (tmp_path / "bundles").iterdir())
    proc = start_fit(config, tmp_path / "refused.log")
    assert proc.wait(timeout=600) != 0
    out = (tmp_path / "refused.log").read_text()
    assert "was written with checkpointing.save_optimizer: false" in out
    assert "checkpointing.resume_without_optimizer: true" in out and "Nothing was modified" in out
    assert sorted(p.name for p in (tmp_path / "bundles").iterdir()) == before

    cfg["checkpointing"]["resume_without_optimizer"] = True
    config.write_text(yaml.safe_dump(cfg))
    proc = start_fit(config, tmp_path / "resumed.log")
    assert proc.wait(timeout=600) == 0, (tmp_path / "resumed.log").read_text()[-3000:]
    assert f"resuming from {tmp_path / 'bundles'}/step_2" in (tmp_path / "resumed.log").read_text()
    latest = store.latest()
    assert latest is not None and latest.step == 3
