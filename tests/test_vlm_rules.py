"""``screl check`` on vision-language configs (:mod:`screl.rules.vlm_rules`): each refused combination fails
check naming its key, the reason and the fix; the shipped VLM config passes."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
from _check_helpers import load_config, run_check

PPO_MODEL = {"class_path": "screl.PPO", "init_args": {"policy": {"class_path": "screl.models.TinyVisionLM"}}}

BAD: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("image_task_text_policy", "grpo_vlm_tiny.yaml",
     {"model.init_args.policy": {"class_path": "screl.models.TinyCausalLM", "init_args": {}}},
     "model.init_args.policy", "TinyCausalLM is a text-only policy"),
    ("ppo_vlm", "grpo_vlm_tiny.yaml", {"model": PPO_MODEL},
     "model.class_path", "its values would ignore what the policy sees"),
    ("distill_vlm", "grpo_vlm_tiny.yaml", {"model.class_path": "screl.Distill"},
     "model.class_path", "the teachers would score the completions without them"),
    ("megatron_vlm", "grpo_vlm_tiny.yaml",
     {"trainer.strategy": {"class_path": "screl.strategies.MegatronStrategy", "init_args": {}}},
     "trainer.strategy", "vision tower and multimodal positions are not built there"),
    ("vllm_vlm", "grpo_vlm_tiny.yaml", {"data.init_args.generation.backend": "vllm"},
     "data.init_args.generation.backend", "does not run the Qwen2-VL family"),
    ("plain_engine_vlm", "grpo_vlm_tiny.yaml", {"data.init_args.generation.backend": "tests.engine_plugins.PlainEngine"},
     "data.init_args.generation.backend", "the PlainEngine engine does not declare vision_inputs"),
    ("static_decode_vlm", "grpo_vlm_tiny.yaml", {"data.init_args.generation.backend_args": {"decode": "static"}},
     "data.init_args.generation.backend_args.decode", "decodes through Hugging Face's forward"),
    ("colocated_vlm", "grpo_vlm_tiny.yaml", {"data.init_args.generation.colocated": {"enabled": True}},
     "data.init_args.generation.colocated.enabled", "the images are drawn on a generation worker"),
    ("multi_turn_vlm", "grpo_vlm_tiny.yaml", {"data.init_args.generation.workflow": "screl.rollout.MultiTurnWorkflow"},
     "data.init_args.generation.workflow", "single-turn workflow only"),
]


def _set(cfg: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, last = dotted.split(".")
    for part in parents:
        cfg = cfg.setdefault(part, {})
    cfg[last] = value


@pytest.mark.parametrize(("rule", "base", "changes", "key", "words"), BAD, ids=[b[0] for b in BAD])
def test_a_refused_vlm_config_fails_check_naming_its_key(
    rule: str, base: str, changes: dict[str, Any], key: str, words: str, tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = copy.deepcopy(load_config(base))
    for dotted, value in changes.items():
        _set(cfg, dotted, value)
    rc, out = run_check(cfg, tmp_path, capsys)
    assert rc != 0, f"{rule}: check passed\n{out}"
    lines = [line for line in out.splitlines() if f"{key} = " in line or f"{key}: " in line]
    assert any(words in line and "Fix:" in line for line in lines), f"{rule}: {words!r} not said about {key}:\n{out}"


def test_the_vlm_config_passes_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, out = run_check(load_config("grpo_vlm_tiny.yaml"), tmp_path, capsys)
    assert rc == 0, out
    assert "rows per step        128" in out
