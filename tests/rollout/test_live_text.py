""":class:`screl.rollout.server.live_text.LiveText`: what a stream sends before a reply is done, on a real byte-level
BPE tokenizer (characters split across tokens): deltas that are always a prefix of the final text, held back at a
split character, the last token (it may be a stop token) and the start of a stop string."""

from __future__ import annotations

import pytest

from screl.envs.base import decode_completion
from screl.rollout.server.live_text import LiveText, rest


@pytest.fixture(scope="module")
def tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=280, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["hello world, the stream goes on"] * 4, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def _stream(tokenizer, text: str, stops: list[str], live: bool = True) -> tuple[list[str], LiveText, list[int]]:  # type: ignore[no-untyped-def]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    lt = LiveText(tokenizer, 1, stops, live)
    deltas = [lt.update(0, ids[:n]) for n in range(1, len(ids) + 1)]
    return [d for d in deltas if d], lt, ids


def test_deltas_are_a_prefix_of_the_final_text_and_never_split_a_character(tokenizer) -> None:  # type: ignore[no-untyped-def]
    text = "héllo wörld 🙂 the stream goes on"
    deltas, lt, ids = _stream(tokenizer, text, [])
    final = decode_completion(tokenizer, ids)
    assert final == text
    assert len(tokenizer.convert_ids_to_tokens(tokenizer("🙂", add_special_tokens=False)["input_ids"])) > 1
    assert len(deltas) > 5 and all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == lt.sent[0] and final.startswith(lt.sent[0])
    assert lt.sent[0] + rest(lt.sent[0], final) == final
    held = LiveText(tokenizer, 1, [], True)
    held.update(0, ids[:-1])  # every text token, the stop token not yet drawn
    assert len(held.sent[0]) < len(final)  # the last token waits: it might have been a stop token


def test_the_text_stops_at_a_stop_string_and_the_start_of_one_waits(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, lt, ids = _stream(tokenizer, "hello STOP world goes on", ["STOP"])
    assert lt.sent[0] == "hello " and "".join(deltas) == "hello "  # apply_stops' text: before the stop string
    assert not lt.live[0]
    partial = LiveText(tokenizer, 1, ["STOP"], True)
    ids = tokenizer("hello STO", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    for n in range(1, len(ids) + 1):
        partial.update(0, ids[:n])
    assert partial.sent[0] == "hello " and partial.live[0]  # "STO" may begin the stop string: held back


def test_a_reply_that_may_call_tools_sends_nothing_early(tokenizer) -> None:  # type: ignore[no-untyped-def]
    deltas, lt, _ = _stream(tokenizer, "hello world", [], live=False)
    assert deltas == [] and lt.sent == [""]
    assert rest("", "hello world") == "hello world"
