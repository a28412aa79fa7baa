"""``screl export`` and ``HFExport`` on a real run: one short GRPO fit (grpo_tiny, 2 steps, one process) with
checkpoint bundles and ``HFExport`` in ``trainer.callbacks``; the folders it and ``screl export`` write reload with
``transformers`` and give the trainer's logits (fp32, 1e-5). A corrupt bundle is refused naming the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback

from screl.export import main
from screl.export.source import read_bundle

from ._export_helpers import load_folder, logits_of, probe_ids

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]

STEPS = 2


class TrainerLogits(Callback):
    """The trainer's own logits on the probe at the end of training (the weights the last bundle holds)."""

    def __init__(self) -> None:
        self.logits: torch.Tensor | None = None

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        tokenizer = pl_module.policy_spec.build_tokenizer()
        self.logits = logits_of(pl_module.model, probe_ids(tokenizer))


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from e2e.conftest import base_config, run_fit

    tmp = tmp_path_factory.mktemp("export_run")
    cfg = base_config(tmp)
    cfg["trainer"]["max_steps"] = STEPS
    cfg["grpo"]["max_num_steps"] = STEPS
    cfg["checkpointing"] = {"enabled": True, "checkpoint_dir": str(tmp / "ckpt"), "save_period": 1, "keep_top_k": 2}
    cfg["trainer"]["callbacks"] = [{"class_path": "screl.callbacks.HFExport",
                                    "init_args": {"dtype": "fp32", "out_dir": str(tmp / "export")}}]
    probe = TrainerLogits()
    run_dir = run_fit(cfg, tmp, callbacks=[probe])
    assert probe.logits is not None
    return {"tmp": tmp, "ckpt": tmp / "ckpt", "export": tmp / "export", "logits": probe.logits, "run_dir": run_dir}


def test_hfexport_folder_gives_the_trainers_logits(run: dict[str, Any]) -> None:
    folder = run["export"] / "final"
    for name in ("model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "screl_export.json"):
        assert (folder / name).is_file(), name
    model, tokenizer = load_folder(str(folder))
    got = logits_of(model, probe_ids(tokenizer))
    assert float((got - run["logits"]).abs().max()) <= 1e-5
    assert float(run["logits"].abs().max()) > 0.1  # not a trivially zero model
    gen = json.loads((folder / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.eos_token_id == 1  # the character tokenizer's <eos>
    assert gen["temperature"] == 1.0 and gen["do_sample"] is True
    assert tokenizer.chat_template, "the chat template travels with the tokenizer"


def test_screl_export_of_the_checkpoint_root_gives_the_trainers_logits(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert main([str(run["ckpt"]), "--out", str(out), "--dtype", "fp32"]) == 0
    info = json.loads((out / "screl_export.json").read_text())
    assert info["step"] == STEPS and info["layout"] == "single"
    assert info["policy"]["class_path"] == "screl.models.tiny.TinyCausalLM"
    model, tokenizer = load_folder(str(out))
    assert float((logits_of(model, probe_ids(tokenizer)) - run["logits"]).abs().max()) <= 1e-5


def test_default_dtype_is_bf16_and_shards_above_the_limit(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "bf16"
    assert main([str(run["ckpt"] / f"step_{STEPS}"), "--out", str(out), "--max-shard-size", "100KB"]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    model, tokenizer = load_folder(str(out))
    # bf16 rounding only: close to the trainer's, not equal
    assert float((logits_of(model, probe_ids(tokenizer)) - run["logits"]).abs().max()) < 0.1


def test_a_corrupt_bundle_is_refused_naming_the_file(run: dict[str, Any], tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "ckpt"
    shutil.copytree(run["ckpt"], root)
    part = root / f"step_{STEPS}" / "controller_state.pt"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    before = sorted(p.name for p in (root / f"step_{STEPS}").iterdir())
    assert main([str(root), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert "controller_state.pt" in err and "sha256" in err and f"step_{STEPS}" in err
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in (root / f"step_{STEPS}").iterdir()) == before  # read-only


def test_the_runs_config_stands_in_for_a_bundle_without_the_record(run: dict[str, Any]) -> None:
    from screl.export.record import record_from_config, spec_from_dict
    from screl.export.source import _record

    with pytest.raises(ValueError, match=r"HFExport.*--config"):
        _record({"callbacks": {}}, None, "s3://bucket/step_2")
    stored = read_bundle(str(run["ckpt"])).record
    from_config = record_from_config(str(run["run_dir"] / "config.yaml"))
    assert spec_from_dict(from_config["policy"], "config") == spec_from_dict(stored["policy"], "bundle")
    assert from_config["generation"]["max_new_tokens"] == stored["generation"]["max_new_tokens"] == 8
