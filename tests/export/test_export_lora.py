"""``screl export`` of a LoRA run's bundle: the checkpoint a real (one-step, one-process) GRPO fit with
``lora: {r: 4, alpha: 8, target_modules: all-linear}`` on ``TinyCausalLM`` saves through Lightning, with ``HFExport``
recording the policy spec, published as a bundle (``lightning.ckpt`` under its manifest) the way the checkpoint
writer publishes one. Merged by default: a plain Hugging Face folder with the trained policy's logits (fp32, 1e-5);
``--adapter``: a PEFT adapter folder ``PeftModel.from_pretrained(base, DIR)`` loads to the same logits. ``--adapter``
on a full fine-tune's bundle and a base whose weights changed are refused."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from screl.callbacks import HFExport

from screl.checkpoint.resume import LIGHTNING_CKPT
from screl.checkpoint.store import CheckpointStore
from screl.export import main
from screl.export.cli import export_bundle
from screl.models import TinyCausalLM
from screl.models.lora import RECORD, is_adapter_key
from screl.modules.grpo import GRPO

from ._export_helpers import load_folder, logits_of, probe_ids

SPEC = TinyCausalLM(seed=0)
LORA = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
ALGO = {"num_prompts_per_step": 2, "num_generations_per_prompt": 2}
STEP = 1


def _chunk() -> dict[str, Any]:
    """One step of real generations (2 groups x 2 rows), laid out as the data module collates them."""
    from screl.datamodule import collate_chunk
    from screl.rollout import GenerationRequest, SamplingParams
    from screl.rollout.engines.torch_engine import TorchGenerationEngine
    from screl.rollout.rows import ROW_SCHEMA

    tok = SPEC.build_tokenizer()
    reqs = [GenerationRequest(f"p{i}_g{s}", tok(f"{i}+{i + 1}=", add_special_tokens=False)["input_ids"],
                              SamplingParams(max_new_tokens=6, min_new_tokens=6, temperature=1.0, seed=7 * i + s))
            for i in range(2) for s in range(2)]
    rows = [ROW_SCHEMA.build(res, float(i % 3)) for i, res in enumerate(TorchGenerationEngine(SPEC, seed=0)
                                                                           .generate(reqs))]
    meta = {"keys": [r.request_id for r in reqs], "trainer_version": 0, "step_groups": 2, "last_chunk": True,
            "start_weight": [0] * len(reqs)}
    return collate_chunk(meta, ROW_SCHEMA.merge(rows), pad_id=0)


class _Batches:
    """Batches as Lightning takes an iterable (a list would be read as several dataloaders)."""

    def __init__(self, *batches: dict[str, Any]) -> None:
        self.batches = batches

    def __iter__(self) -> Any:
        return iter(self.batches)


def _bundle(root: Path, trainer: L.Trainer) -> None:
    """The trainer's checkpoint as ``root/step_<STEP>/lightning.ckpt``, published with its manifest."""
    local = root.parent / "lightning.ckpt"
    trainer.save_checkpoint(local)
    with CheckpointStore(str(root)).begin(STEP) as writer:
        writer.write_bytes(LIGHTNING_CKPT, local.read_bytes())
        writer.commit({"trainer_version": STEP})


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    torch.set_num_threads(1)
    tmp = tmp_path_factory.mktemp("lora_run")
    module = GRPO(policy=SPEC, lora=dict(LORA), learning_rate=1e-2, algo=ALGO)
    trainer = L.Trainer(accelerator="cpu", max_steps=STEP, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp),
                        callbacks=[HFExport(at_end=False)])
    chunk = _chunk()
    trainer.fit(module, train_dataloaders=_Batches(chunk, chunk))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():  # stronger adapters than one step's (B starts at zero), saved by the module's own hook
        for name, param in module.model.named_parameters():
            if is_adapter_key(name):
                param.copy_(torch.randn(param.shape, generator=g) * 0.2)
    _bundle(tmp / "ckpt", trainer)
    ids = probe_ids(SPEC.build_tokenizer())
    return {"tmp": tmp, "ckpt": tmp / "ckpt", "ids": ids, "logits": logits_of(module.model, ids)}


def test_the_bundle_holds_adapters_only(run: dict[str, Any]) -> None:
    ckpt = torch.load(run["ckpt"] / f"step_{STEP}" / LIGHTNING_CKPT, weights_only=True)
    assert RECORD in ckpt and ckpt["callbacks"]["HFExport"]["policy"]
    assert all(is_adapter_key(k) for k in ckpt["state_dict"] if k.startswith("model."))


def test_a_lora_bundle_exports_the_merged_policy(run: dict[str, Any], tmp_path: Path) -> None:
    out = tmp_path / "merged"
    assert main([str(run["ckpt"]), "--out", str(out), "--dtype", "fp32"]) == 0
    info = json.loads((out / "screl_export.json").read_text())
    assert info["form"] == "merged" and info["lora"]["r"] == 4 and info["step"] == STEP
    model, tokenizer = load_folder(str(out))
    assert not any("lora" in k for k in model.state_dict())  # a plain model
    got = logits_of(model, probe_ids(tokenizer))
    assert float((got - run["logits"]).abs().max()) <= 1e-5
    base = logits_of(SPEC.build_model(), run["ids"])
    assert float((got - base).abs().max()) > 1e-2  # the adapters count


def test_adapter_writes_a_peft_folder_that_loads_onto_the_base(run: dict[str, Any], tmp_path: Path) -> None:
    from peft import PeftModel

    out = tmp_path / "adapter"
    assert main([str(run["ckpt"] / f"step_{STEP}"), "--out", str(out), "--adapter", "--dtype", "fp32"]) == 0
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert not (out / "model.safetensors").exists()
    assert json.loads((out / "screl_export.json").read_text())["form"] == "adapter"
    peft_model = PeftModel.from_pretrained(SPEC.build_model(), str(out))
    assert float((logits_of(peft_model, run["ids"]) - run["logits"]).abs().max()) <= 1e-5


def test_adapter_on_a_full_fine_tunes_bundle_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    module = GRPO(policy=SPEC, algo=ALGO)
    trainer = L.Trainer(accelerator="cpu", max_steps=0, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                        callbacks=[HFExport(at_end=False)])
    trainer.fit(module, train_dataloaders=_Batches(_chunk()))
    _bundle(tmp_path / "ckpt", trainer)
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "out"), "--adapter"]) == 1
    assert "--adapter" in capsys.readouterr().err and not (tmp_path / "out").exists()
    with pytest.raises(ValueError, match=r"--adapter: .*step_1 is not a LoRA run's bundle .*without --adapter"):
        export_bundle(str(tmp_path / "ckpt"), str(tmp_path / "out"), adapter=True)


def test_a_base_whose_weights_changed_is_refused_naming_both(run: dict[str, Any], tmp_path: Path) -> None:
    ckpt = torch.load(run["ckpt"] / f"step_{STEP}" / LIGHTNING_CKPT, weights_only=True)
    policy = ckpt["callbacks"]["HFExport"]["policy"]
    policy["init_args"] = {**policy.get("init_args", {}), "seed": 1}  # the spec now builds other base weights
    root = tmp_path / "ckpt"
    with CheckpointStore(str(root)).begin(STEP) as writer:
        writer.write_torch(LIGHTNING_CKPT, ckpt)
        writer.commit({})
    for adapter in ([], ["--adapter"]):
        with pytest.raises(ValueError, match=r"refusing to export .*trained on another base model: "
                                             r"TinyCausalLM\(.*seed=0.*\) \(weights sha256 [0-9a-f]{16}\), .*"
                                             r"TinyCausalLM\(.*seed=1.*\) \(weights sha256"):
            export_bundle(str(root), str(tmp_path / "out"), adapter=bool(adapter))
    assert not (tmp_path / "out").exists()
