from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

from screl.models import (
    CHARS,
    MODEL_SCALES,
    SPECIAL_TOKENS,
    HFCausalLM,
    PolicySpec,
    TinyCausalLM,
    build_char_tokenizer,
)

torch.set_num_threads(1)

TINY: dict[str, Any] = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
    tie_word_embeddings=True,
    pad_token_id=0,
    eos_token_id=1,
    bos_token_id=2,
)
SMALL: dict[str, Any] = dict(
    TINY,
    hidden_size=256,
    intermediate_size=1024,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=256,
)


def _same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_char_tokenizer_matches_the_peer_definition() -> None:
    tok = build_char_tokenizer()
    assert isinstance(tok, PreTrainedTokenizerFast)
    vocab = tok.get_vocab()
    assert [vocab[s] for s in SPECIAL_TOKENS] == [0, 1, 2]
    assert [vocab[c] for c in CHARS] == list(range(3, 3 + len(CHARS)))
    assert len(tok) == 43
    assert (tok.pad_token_id, tok.eos_token_id, tok.bos_token_id) == (0, 1, 2)
    assert tok("3+4=", add_special_tokens=False)["input_ids"] == [32, 40, 33, 41]
    assert tok("3+4=")["input_ids"] == [32, 40, 33, 41]  # no BOS/EOS added
    assert tok.decode([3, 1, 4, 0, 2, 5], skip_special_tokens=True) == "abc"
    assert tok("A")["input_ids"] == [0]  # unknown -> <pad>


def test_scales_match_the_peer_kwargs() -> None:
    assert MODEL_SCALES["tiny"] == TINY and MODEL_SCALES["small"] == SMALL


def test_tiny_builds_the_peer_model_bit_for_bit() -> None:
    model = TinyCausalLM(seed=0).build_model()
    assert isinstance(model, Qwen2ForCausalLM)
    assert sum(p.numel() for p in model.parameters()) == 77056
    assert next(model.parameters()).dtype == torch.float32
    # The peer: transformers.set_seed(0) then Qwen2ForCausalLM(Qwen2Config(vocab_size=43, **MODEL_KWARGS)).
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        ref = Qwen2ForCausalLM(Qwen2Config(vocab_size=43, **TINY))
    assert _same_weights(model, ref)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size, cfg.tie_word_embeddings) == (
        64,
        2,
        43,
        True,
    )


def test_seeded_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    state = torch.get_rng_state()
    a, b = TinyCausalLM(seed=3).build_model(), TinyCausalLM(seed=3).build_model()
    assert torch.equal(torch.get_rng_state(), state)
    assert _same_weights(a, b)
    assert not _same_weights(a, TinyCausalLM(seed=4).build_model())


def test_explicit_sizes_override_the_scale() -> None:
    spec = TinyCausalLM(scale="small", hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    cfg = spec.build_config()
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        32,
        1,
        2,
        1,
    )
    assert cfg.intermediate_size == 1024 and cfg.max_position_embeddings == 256
    assert TinyCausalLM(scale="small").build_config().hidden_size == 256


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"scale": "huge"}, "not a known scale"),
        ({"hidden_size": 30}, "must be divisible by num_heads"),
        ({"num_heads": 4, "num_kv_heads": 3}, "must be divisible by num_kv_heads"),
        ({"num_layers": 0}, "num_hidden_layers=0 must be >= 1"),
        ({"dtype": "float64"}, "dtype='float64' is not supported"),
    ],
)
def test_bad_tiny_args_are_rejected(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TinyCausalLM(**kwargs)


def test_spec_pickles_and_rebuilds_the_same_model() -> None:
    spec = TinyCausalLM(hidden_size=32, seed=5)
    clone = pickle.loads(pickle.dumps(spec))
    assert clone == spec and hash(clone) == hash(spec) and clone != TinyCausalLM(hidden_size=32, seed=6)
    assert "hidden_size=32" in repr(spec)
    assert _same_weights(spec.build_model(), clone.build_model())


def test_spec_is_configurable_with_jsonargparse() -> None:
    jsonargparse = pytest.importorskip("jsonargparse")
    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_argument("--policy", type=PolicySpec)
    cfg = parser.parse_args(
        ["--policy", '{"class_path": "screl.models.TinyCausalLM", "init_args": {"hidden_size": 32}}']
    )
    spec = parser.instantiate(cfg).policy
    assert spec == TinyCausalLM(hidden_size=32)


def test_hf_checkpoint_roundtrip(tmp_path: Path) -> None:
    spec = TinyCausalLM(hidden_size=32, num_heads=2, num_kv_heads=1, seed=1)
    model, tok = spec.build_model().eval(), spec.build_tokenizer()
    model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)

    hf = HFCausalLM(str(tmp_path))
    loaded, loaded_tok = hf.build_model().eval(), hf.build_tokenizer()
    assert _same_weights(model, loaded)
    ids = torch.tensor([tok("3+4=ab", add_special_tokens=False)["input_ids"]])
    with torch.no_grad():  # exact: the same class and bit-identical weights on the same input, in one process
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    assert loaded_tok("3+4=ab", add_special_tokens=False)["input_ids"] == ids[0].tolist()
    assert loaded_tok.eos_token_id == 1 and loaded_tok.pad_token_id == 0
    assert pickle.loads(pickle.dumps(hf)) == hf


def test_hf_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is neither a local directory nor a hub id"):
        HFCausalLM(str(tmp_path / "nope")).build_model()
