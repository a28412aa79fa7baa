"""``screl.models.ShapeTwin``: the shipped recipe shapes shrink to tiny models that keep their architecture."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from screl.models import ShapeTwin, char_vocab, shrink_config

SHAPES = Path(__file__).resolve().parents[2] / "configs" / "recipes" / "shapes"
NAMES = sorted(p.name for p in SHAPES.iterdir() if p.is_dir())


def test_every_recipe_shape_is_shipped() -> None:
    assert NAMES == ["llama3.1-8b-instruct", "llama3.2-1b-instruct", "qwen2.5-math-1.5b-instruct", "qwen3-0.6b"]


@pytest.mark.parametrize("name", NAMES)
def test_the_twin_keeps_the_architecture_and_shrinks_the_sizes(name: str) -> None:
    src = json.loads((SHAPES / name / "config.json").read_text())
    twin = ShapeTwin(str(SHAPES / name))
    model = twin.build_model()
    cfg = model.config
    assert type(model).__name__ == src["architectures"][0]
    assert cfg.num_attention_heads // cfg.num_key_value_heads == src["num_attention_heads"] // src["num_key_value_heads"]
    src_head = src.get("head_dim") or src["hidden_size"] // src["num_attention_heads"]
    head = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    assert head * cfg.num_attention_heads / cfg.hidden_size == src_head * src["num_attention_heads"] / src["hidden_size"]
    assert cfg.tie_word_embeddings == src["tie_word_embeddings"]
    rope = dict(src.get("rope_scaling") or {}, rope_theta=src["rope_theta"])
    assert {k: v for k, v in cfg.rope_parameters.items() if k in rope} == rope
    names = {n for n, _ in model.named_parameters()}
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (src["model_type"] == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (src["model_type"] == "qwen3")
    assert ("lm_head.weight" in names) == (not src["tie_word_embeddings"])
    assert cfg.vocab_size == len(char_vocab()) and cfg.hidden_size <= 96 and cfg.num_hidden_layers == 2
    assert sum(p.numel() for p in model.parameters()) < 1_000_000


@pytest.mark.parametrize("name", NAMES)
def test_the_twin_maps_onto_megatron_as_the_real_model_does(name: str) -> None:
    from screl.strategies import GPTModelProvider
    from transformers import AutoConfig

    real = GPTModelProvider.from_hf_config(AutoConfig.from_pretrained(str(SHAPES / name), local_files_only=True))
    twin = GPTModelProvider.from_hf_config(ShapeTwin(str(SHAPES / name)).build_config())
    same = ("add_qkv_bias", "qk_layernorm", "rotary_base", "rope_scaling", "share_embeddings_and_output_weights",
            "layernorm_epsilon")
    assert {k: getattr(twin, k) for k in same} == {k: getattr(real, k) for k in same}
    assert getattr(twin, "rope_scaling_factor", None) == getattr(real, "rope_scaling_factor", None)


def test_same_seed_same_weights_and_the_chat_template() -> None:
    a = ShapeTwin(str(SHAPES / "qwen3-0.6b"), chat_template=True).build_model().state_dict()
    b = ShapeTwin(str(SHAPES / "qwen3-0.6b"), chat_template=True).build_model().state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)  # exact: the same seeded init run twice in one process
    spec = ShapeTwin(str(SHAPES / "qwen3-0.6b"), chat_template=True)
    tok = spec.build_tokenizer()
    templated = spec.prompt_token_ids(tok, "1+2")
    assert tok.decode(templated) == "<bos>user 1+2<eos>assistant "
    assert ShapeTwin(str(SHAPES / "qwen3-0.6b")).prompt_token_ids(tok, "1+2") == tok("1+2")["input_ids"]


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a config.json file"):
        ShapeTwin(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="not a whole hidden size"):
        shrink_config({"model_type": "qwen3", "hidden_size": 96, "intermediate_size": 192, "num_attention_heads": 4,
                       "num_key_value_heads": 4, "head_dim": 64}, head_dim=2, num_kv_heads=2)
    with pytest.raises(ValueError, match="must be even"):
        shrink_config({"model_type": "qwen2", "hidden_size": 64, "intermediate_size": 128,
                       "num_attention_heads": 4}, head_dim=3)
    with pytest.raises(ValueError, match="system_prompt needs chat_template"):
        ShapeTwin(str(SHAPES / "qwen3-0.6b"), system_prompt="be brief")
    with pytest.raises(ValueError, match="vocab_size=10 is below the character tokenizer's 43 ids"):
        ShapeTwin(str(SHAPES / "qwen3-0.6b"), vocab_size=10)


def test_the_real_shapes_of_qwen2_5_0_5b_with_its_vocabulary() -> None:
    """The GPU acceptance policy (examples/gpu/acceptance_configs.py): Qwen2.5-0.5B's sizes over the character
    tokenizer with the real vocabulary's rows; an id past the tokenizer's decodes as nothing."""
    src = json.loads((SHAPES.parents[2] / "examples/models/qwen2.5-0.5b-instruct/config.json").read_text())
    spec = ShapeTwin(str(SHAPES.parents[2] / "examples/models/qwen2.5-0.5b-instruct"), head_dim=64, num_kv_heads=2,
                     num_layers=24, vocab_size=151936)
    fields = spec.config_fields()
    for key in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                "num_hidden_layers", "vocab_size", "tie_word_embeddings", "rope_theta"):
        assert fields[key] == src[key], key
    assert spec.build_tokenizer().decode([3, 151000, 4]) == "ab"
