"""Advice ``screl check`` prints on a valid config: a pretrained policy at a learning rate that wrecks it."""

from __future__ import annotations

from pathlib import Path

import pytest
from _check_helpers import load_config, run_check

from screl.rules.advice import config_advice


def test_a_pretrained_policy_at_a_high_learning_rate_gets_advice(tmp_path: Path,
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("recipes/grpo_1b_megatron_colocated.yaml")  # an HF policy by hub id (cached for the suite)
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 0 and "advice:" not in out, out
    cfg["model"]["init_args"]["learning_rate"] = 1e-3
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 0, out
    assert ("advice: model.init_args.learning_rate = 0.001 trains a pretrained policy (HFCausalLM) at >= 0.0001"
            in out), out
    tiny = load_config("grpo_tiny.yaml")  # a tiny model from scratch trains at 3e-3 by design: no advice
    tiny["model"]["init_args"]["learning_rate"] = 3e-3
    assert config_advice(tiny) == []


def test_a_system_prompt_without_a_chat_template_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = load_config("recipes/grpo_qwen3_0.6b_agent.yaml")  # HFCausalLM without chat_template (its default: off)
    cfg["model"]["init_args"]["policy"]["init_args"]["system_prompt"] = "be brief"
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc == 2 and "1 problem(s)" in out, out
    assert ("model.init_args.policy.init_args.system_prompt = 'be brief': is ignored: without chat_template the "
            "prompts are given to the model as raw text") in out
    cfg["model"]["init_args"]["policy"]["init_args"]["chat_template"] = True
    assert run_check(cfg, tmp_path, capsys)[0] == 0
