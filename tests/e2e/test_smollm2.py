"""Two GRPO steps of configs/grpo_smollm2.yaml on the real SmolLM2-135M-Instruct: the weights move and the
trainer's recomputed logprobs match the engine's (``train/logprob_mismatch``).

The KV cache is recomputed at each refit: without it a token sampled after a refit in mid-sample is labelled
with the new version but computed over the old weights' KV cache, so its engine logprob differs from the
trainer's by the weight change itself (CI saw 1.12 after one step), not by any numerics gap."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from lightning.pytorch import Callback

from screl.models import SmolLM2

from .conftest import ROOT, metrics, run_fit

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_cluster")]


class _Weights(Callback):
    def __init__(self) -> None:
        self.final: dict[str, Any] = {}

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        self.final = {k: v.detach().clone() for k, v in pl_module.export_weights().items()}


def test_two_grpo_steps_of_the_demo_config_change_the_weights(smollm2: SmolLM2, tmp_path: Path) -> None:
    cfg: dict[str, Any] = yaml.safe_load((ROOT / "configs" / "grpo_smollm2.yaml").read_text())
    cfg["trainer"].update(max_steps=2, default_root_dir=str(tmp_path / "run"), enable_progress_bar=False)
    cfg["checkpointing"]["checkpoint_dir"] = str(tmp_path / "checkpoints")  # the config keeps bundles
    cfg["grpo"].update(max_num_steps=2, val_period=0, val_at_start=False, val_at_end=False)
    cfg["async_rl"]["recompute_kv_cache_after_weight_updates"] = True
    cfg["model"]["init_args"]["policy"]["init_args"]["cache_dir"] = smollm2.cache_dir
    before = smollm2.build_model().state_dict()
    probe = _Weights()
    rows = metrics(run_fit(cfg, tmp_path, callbacks=[probe]))
    assert set(probe.final) == set(before)
    moved = max((probe.final[k] - before[k]).abs().max().item() for k in before)
    # AdamW's update is normalized: its first step moves every weight with a gradient by exactly lr, and no step
    # moves one by much more than lr (at most ~1.0 x lr for beta1 0.9, beta2 0.999), so two steps move the
    # farthest weight by between lr and ~2 lr
    lr = cfg["model"]["init_args"]["learning_rate"]
    assert 0.99 * lr <= moved <= 2.05 * lr, (moved, lr)
    mismatch = [r["train/logprob_mismatch"] for r in rows if "train/logprob_mismatch" in r]
    # step 0 trains version 0's own tokens; step 1 has on-policy rows only if a whole row came after the refit.
    # fp32 on both sides, the KV cache recomputed at each refit: only the attention's summation order differs
    assert 1 <= len(mismatch) <= 2 and max(mismatch) < 1e-4, mismatch
