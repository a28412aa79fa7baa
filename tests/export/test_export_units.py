"""The exported folder without a fit: a vision-language policy (``AutoModelForImageTextToText``, its processor), a
PPO critic beside the policy, a missing tokenizer named, a hub push that cannot reach the hub (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from screl.export import ExportError, write_hf_folder
from screl.export.record import spec_to_dict
from screl.models import TinyCausalLM, TinyVisionLM, ValueModel

from ._export_helpers import logits_of, probe_ids


def _perturbed(module: torch.nn.Module, seed: int = 1) -> dict[str, torch.Tensor]:
    """Weights unlike the spec's seeded ones (as training leaves them)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=gen))
    return module.state_dict()


def test_a_vision_language_policy_reloads_with_its_logits_and_processor(tmp_path: Path) -> None:
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    spec = TinyVisionLM()
    model = spec.build_model()
    weights = _perturbed(model)
    write_hf_folder({"policy": spec_to_dict(spec)}, weights, str(tmp_path / "vlm"), dtype="fp32")
    loaded = AutoModelForImageTextToText.from_pretrained(str(tmp_path / "vlm"), dtype=torch.float32)
    ids = probe_ids(spec.build_tokenizer())
    assert float((logits_of(loaded, ids) - logits_of(model, ids)).abs().max()) <= 1e-5
    processor = AutoImageProcessor.from_pretrained(str(tmp_path / "vlm"))
    pixels = processor.size.get("max_pixels", processor.size.get("longest_edge"))
    assert pixels == spec.image_size**2


def test_a_ppo_critic_goes_beside_the_policy(tmp_path: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    spec = TinyCausalLM()
    critic = ValueModel(spec)
    critic_weights = _perturbed(critic, seed=2)
    record = {"policy": spec_to_dict(spec), "value": spec_to_dict(spec)}
    out = tmp_path / "ppo"
    write_hf_folder(record, spec.build_model().state_dict(), str(out), dtype="fp32", critic=critic_weights)
    trunk = AutoModelForCausalLM.from_pretrained(str(out / "critic"), dtype=torch.float32)
    head = load_file(str(out / "critic" / "value_head.safetensors"))
    ids = probe_ids(spec.build_tokenizer())
    mask = torch.ones_like(ids)
    hidden = trunk.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
    values = torch.nn.functional.linear(hidden, head["weight"], head["bias"]).squeeze(-1)
    with torch.no_grad():
        assert float((values - critic(ids, mask)).abs().max()) <= 1e-5
    assert float(critic(ids, mask).abs().max()) > 1e-3  # the head is not the zero it starts as


def test_a_missing_tokenizer_is_named(tmp_path: Path) -> None:
    spec = TinyCausalLM()
    model_dir = tmp_path / "base"
    spec.build_model().save_pretrained(str(model_dir))  # weights and config, no tokenizer
    record = {"policy": {"class_path": "screl.models.HFCausalLM", "init_args": {"path": str(model_dir)}}}
    with pytest.raises(ExportError, match=rf"tokenizer of HFCausalLM could not be loaded from '{model_dir}'"):
        write_hf_folder(record, spec.build_model().state_dict(), str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_weights_of_another_model_are_refused(tmp_path: Path) -> None:
    small = TinyCausalLM(scale="small").build_model().state_dict()
    with pytest.raises(ExportError, match=r"do not fit the spec's model"):
        write_hf_folder({"policy": spec_to_dict(TinyCausalLM())}, small, str(tmp_path / "out"))


def test_an_offline_hub_push_names_the_repo_and_keeps_the_export(tmp_path: Path) -> None:
    from screl.callbacks.hf_export import HubPushError, push_folder

    spec = TinyCausalLM()
    folder = write_hf_folder({"policy": spec_to_dict(spec)}, spec.build_model().state_dict(), str(tmp_path / "f"))
    with pytest.raises(HubPushError, match=r"'screl-tests/no-such-repo'.*local export is complete at"):
        push_folder(folder, "screl-tests/no-such-repo")
    assert json.loads((Path(folder) / "screl_export.json").read_text())["dtype"] == "bf16"


def test_the_cli_refuses_a_folder_of_other_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from screl.export import main

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    (tmp_path / "ckpt").mkdir()
    assert main([str(tmp_path / "ckpt"), "--out", str(tmp_path / "out")]) == 1
    assert "no complete checkpoint bundle" in capsys.readouterr().err
