"""``screl export`` of ``MegatronStrategy`` bundles written at TP=2 (a PPO run's) and PP=2: merged in one process (a
one-process gloo group at TP=1/PP=1 reads the shards) back to Hugging Face names; the folder gives the policy's logits
and its ``critic/`` the critic's values (fp32, 1e-5)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from screl.checkpoint.store import CheckpointStore
from screl.export import main

from ._export_helpers import load_folder, logits_of, probe_ids
from ._megatron_export_jobs import LAYOUTS, perturbed_critic, perturbed_policy, write_checkpoint

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_megatron_bundle_exports_the_policys_logits_and_the_critics_values(tmp_path: Path, layout: str) -> None:
    ckpt_dir = tmp_path / "staged" / "lightning.ckpt"
    write_checkpoint(str(ckpt_dir), layout)
    assert {p.name.split("_")[2] for p in ckpt_dir.glob("*.distcp")} == {"0", "1"}  # files of both ranks
    store = CheckpointStore(str(tmp_path / "bundles"))
    with store.begin(3) as writer:
        writer.write_dir("lightning.ckpt", str(ckpt_dir))
        writer.commit({"trainer_version": 3})
    out = tmp_path / "out"
    assert main([str(tmp_path / "bundles"), "--out", str(out), "--dtype", "fp32"]) == 0
    assert '"layout": "megatron"' in (out / "screl_export.json").read_text()
    model, tokenizer = load_folder(str(out))
    ids = probe_ids(tokenizer)
    want = logits_of(perturbed_policy(), ids)
    assert float((logits_of(model, ids) - want).abs().max()) <= 1e-5
    assert float(want.abs().max()) > 0.1
    if layout == "pp2":  # no critic in this bundle: none exported
        assert not (out / "critic").exists()
        return
    # the critic: its trunk a Hugging Face folder under critic/, its head beside it, giving the critic's values
    critic = perturbed_critic()
    trunk = AutoModelForCausalLM.from_pretrained(str(out / "critic"), dtype=torch.float32)
    head = load_file(str(out / "critic" / "value_head.safetensors"))
    mask = torch.ones_like(ids)
    with torch.no_grad():
        hidden = trunk.base_model(input_ids=ids, attention_mask=mask).last_hidden_state
        values = (hidden @ head["weight"].T + head["bias"]).squeeze(-1)
        expected = critic(ids, mask)
    assert float((values - expected).abs().max()) <= 1e-5 and float(expected.abs().max()) > 1e-3
