"""The one stop rule (``screl.rollout.engines.stop_tokens``): tokenizers built in memory, and the torch engine applying it.

The same model directory runs on vLLM's CPU build in ``test_vllm_stop_tokens.py``.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen2Config

from screl.models import HFCausalLM
from screl.models.tokenizer import EOS_TOKEN_ID, build_char_tokenizer
from screl.rollout.engines.protocol import GenerationRequest, SamplingParams
from screl.rollout.engines.stop_tokens import StopTokens, end_of_turn_ids, load_generation_config, stop_tokens
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.rows import FINISH_CODES, ROW_SCHEMA
from tests.rollout.stop_model import MAX_NEW, PROMPTS, StopModel, build_stop_model, chatml_tokenizer

torch.set_num_threads(1)


def _tokenizer(names: list[str], template: str | None, special: list[str]) -> PreTrainedTokenizerFast:
    """Characters a-z at ids 0-25, then ``names``; ``special`` of them registered as special tokens."""
    vocab = {c: i for i, c in enumerate("abcdefghijklmnopqrstuvwxyz")}
    vocab.update({n: 26 + i for i, n in enumerate(names)})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="a"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="</s>", additional_special_tokens=special)
    if template is not None:
        tok.chat_template = template
    return tok


def test_the_character_tokenizer_ends_a_turn_with_its_eos() -> None:
    """Its template writes ``<eos>`` after each message: the end-of-turn token is the EOS itself."""
    rule = stop_tokens(build_char_tokenizer())
    assert rule == StopTokens(eos=(EOS_TOKEN_ID,), generation_config=(), end_of_turn=(EOS_TOKEN_ID,))
    assert rule.ids == {EOS_TOKEN_ID}


def test_a_chatml_template_ends_a_turn_with_im_end() -> None:
    tok = chatml_tokenizer(eos=7, end_of_turn=30)
    assert tok.convert_ids_to_tokens(30) == "<|im_end|>"
    assert end_of_turn_ids(tok) == (30,)
    assert stop_tokens(tok).ids == {7, 30}


def test_an_end_of_turn_token_of_any_name_is_found_by_rendering_the_template() -> None:
    """``<|turn_over|>`` is in no list of names: the token the template writes after the assistant's content is."""
    template = "{% for m in messages %}{{ m['content'] }}<|turn_over|>{% endfor %}"
    tok = _tokenizer(["</s>", "<|turn_over|>"], template, special=["<|turn_over|>"])
    assert end_of_turn_ids(tok) == (27,)


def test_a_plain_token_after_the_turn_is_no_end_of_turn() -> None:
    """A template that writes an ordinary character after the content has no end-of-turn token."""
    tok = _tokenizer(["</s>"], "{% for m in messages %}{{ m['content'] }}z{% endfor %}", special=[])
    assert end_of_turn_ids(tok) == ()


def test_a_known_name_counts_only_when_the_template_uses_it_and_the_vocabulary_has_it() -> None:
    used = "{% for m in messages %}{{ m['content'] }}{% if false %}<|eot_id|>{% endif %}</s>{% endfor %}"
    with_it = _tokenizer(["</s>", "<|eot_id|>"], used, special=["<|eot_id|>"])
    assert end_of_turn_ids(with_it) == (26, 27)  # </s> rendered after the content, <|eot_id|> named by the template
    unused = _tokenizer(["</s>", "<|eot_id|>"], "{% for m in messages %}{{ m['content'] }}{% endfor %}",
                        special=["<|eot_id|>"])
    assert end_of_turn_ids(unused) == ()
    not_in_vocab = _tokenizer(["</s>"], used, special=[])
    assert end_of_turn_ids(not_in_vocab) == (26,)


def test_no_chat_template_no_end_of_turn() -> None:
    assert end_of_turn_ids(_tokenizer(["</s>", "<|im_end|>"], None, special=["<|im_end|>"])) == ()


def test_a_template_that_cannot_render_falls_back_to_the_names() -> None:
    template = "{{ raise_exception('no assistant turns') }}<|im_end|>"
    tok = _tokenizer(["</s>", "<|im_end|>"], template, special=["<|im_end|>"])
    assert end_of_turn_ids(tok) == (27,)


@pytest.mark.parametrize(("gen_eos", "cfg_eos", "expected"), [
    ([9, 4], 2, (4, 9)),  # the generation config's list
    (5, 2, (5,)),  # one int
    (None, [2, 3], (2, 3)),  # none there: the model config's
    (None, None, ()),
])
def test_generation_config_ids(gen_eos: object, cfg_eos: object, expected: tuple[int, ...]) -> None:
    tok = build_char_tokenizer()
    gen = None if gen_eos is None else GenerationConfig(eos_token_id=gen_eos)
    rule = stop_tokens(tok, gen, Qwen2Config(eos_token_id=cfg_eos))
    assert rule.generation_config == expected
    assert rule.ids == {EOS_TOKEN_ID, *expected}


def test_a_request_stops_on_its_own_ids_and_ignore_eos_keeps_only_those() -> None:
    rule = StopTokens(eos=(1,), generation_config=(1, 4), end_of_turn=(6,))
    assert rule.for_request((8,)) == {1, 4, 6, 8}
    assert rule.for_request((8,), ignore_eos=True) == {8}
    assert rule.for_request((), ignore_eos=True) == frozenset()
    assert [rule.kind(t) for t in (1, 4, 6, 8)] == ["eos", "generation_config", "end_of_turn", "request"]
    assert rule.kind(1, ignore_eos=True) == "request"  # the request's own id, though it is the EOS too


def test_load_generation_config_reads_the_file_else_the_model_config(tmp_path: Path) -> None:
    Qwen2Config(eos_token_id=3).save_pretrained(tmp_path)
    assert load_generation_config(str(tmp_path)).eos_token_id == 3  # derived from config.json
    GenerationConfig(eos_token_id=[3, 8]).save_pretrained(tmp_path)
    assert load_generation_config(str(tmp_path)).eos_token_id == [3, 8]
    assert load_generation_config(str(tmp_path / "nothing")) is None


@pytest.fixture(scope="module")
def stop_model(tmp_path_factory: pytest.TempPathFactory) -> StopModel:
    return build_stop_model(tmp_path_factory.mktemp("stop-model"))


def test_the_torch_engine_stops_by_each_rule_and_says_which(stop_model: StopModel) -> None:
    """The model's greedy completions stop at the tokenizer's EOS, at either id of the generation config's list and
    at the template's ``<|im_end|>`` (the helper picked the ids from the model's own completions)."""
    engine = TorchGenerationEngine(HFCausalLM(stop_model.path))
    assert engine.stop_tokens == StopTokens((stop_model.eos,), tuple(sorted(stop_model.generation_config)),
                                            (stop_model.end_of_turn,))
    results = engine.generate([GenerationRequest(f"r{i}", list(p), SamplingParams(max_new_tokens=MAX_NEW,
                                                                                   temperature=0))
                               for i, p in enumerate(PROMPTS)])
    by_kind = {"eos": {stop_model.eos}, "generation_config": set(stop_model.generation_config),
               "end_of_turn": {stop_model.end_of_turn}}
    for r, (pos, kind), greedy in zip(results, stop_model.expected, stop_model.greedy, strict=True):
        assert r.finish_reason == "stop" and r.stop_kind == kind, (r.request_id, r.stop_kind, kind)
        assert r.token_ids == list(greedy[:pos + 1])  # the greedy completion, cut at its first stop
        assert len(r.token_ids) == pos + 1 and r.stop_token_id == r.token_ids[-1] in by_kind[kind]
        assert ROW_SCHEMA.build(r, 0.0)["finish_reason"].tolist() == [FINISH_CODES["stop"]]
    assert {r.stop_token_id for r in results} >= {stop_model.eos, *stop_model.generation_config,
                                                  stop_model.end_of_turn}
    ignored = engine.generate([GenerationRequest("ig", list(PROMPTS[0]), SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True))])[0]
    assert ignored.finish_reason == "length" and len(ignored.token_ids) == MAX_NEW
    assert ignored.stop_token_id is None and ignored.stop_kind is None
    longest = max(results, key=lambda r: len(r.token_ids))  # a prompt whose first stop comes late
    own = next(t for t in longest.token_ids[1:-1] if t not in engine.stop_tokens.ids)
    asked = engine.generate([GenerationRequest("own", longest.prompt_token_ids, SamplingParams(
        max_new_tokens=MAX_NEW, temperature=0, stop_token_ids=(own,)))])[0]
    assert asked.stop_kind == "request" and asked.stop_token_id == own
    assert asked.token_ids == longest.token_ids[:longest.token_ids.index(own) + 1]
