"""``model.init_args.lora`` in ``screl check``: bad settings, MegatronStrategy, colocation and NCCL refits refused."""

from __future__ import annotations

from pathlib import Path

import pytest
from _check_helpers import load_config, run_check

KEY = "model.init_args.lora"


def test_lora_is_refused_where_the_engines_would_not_get_merged_weights(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("grpo_tiny.yaml")
    cfg["model"]["init_args"]["lora"] = {"r": 4, "alpha": 8, "target_modules": "all-linear"}
    assert run_check(cfg, tmp_path, capsys)[0] == 0
    colocated = load_config("grpo_colocated_tiny.yaml")
    colocated["model"]["init_args"]["lora"] = {"r": 4}
    rc, out = run_check(colocated, tmp_path, capsys)
    assert rc == 2 and "data.init_args.generation.colocated.enabled = True: model.init_args.lora with " \
        "data.init_args.generation.colocated.enabled: true is not supported" in out, out
    megatron = load_config("grpo_megatron_tiny.yaml")
    megatron["model"]["init_args"]["lora"] = {"r": 4}
    rc, out = run_check(megatron, tmp_path, capsys)
    assert rc == 2 and f"{KEY} = {{'r': 4}}: LoRA trains a Hugging Face policy under Lightning's own strategies" in out
    cfg["model"]["init_args"]["lora"] = {"r": 4, "load_in_4bit": True}
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 2 and "QLoRA" in out and "1 problem(s)" in out, out
