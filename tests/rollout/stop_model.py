"""A model directory whose greedy completions stop by each rule of ``screl.rollout.engines.stop_tokens``.

A random Qwen2 (head_dim 64, as vLLM's CPU attention requires; untied, wide init, so greedy decoding does not just
repeat a token) and a ChatML tokenizer, saved with ``save_pretrained``. The stop ids are picked from the model's own
greedy completions, so that of the prompts :data:`PROMPTS`, one stops at the tokenizer's EOS, two at the two ids of
``generation_config.eos_token_id`` (neither of them the tokenizer's EOS) and one at the chat template's end-of-turn
token ``<|im_end|>`` (the tokenizer puts the names at those ids). Shared by the torch engine's test and the test that
runs the torch engine and vLLM's CPU build side by side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

VOCAB = 45
SPECIALS = ("<pad>", "<eos>", "<bos>", "<|im_start|>", "<|im_end|>")
CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant {% endif %}")
PROMPTS: tuple[tuple[int, ...], ...] = tuple((5 + i, 9, 12 + i, 7, 20 + i, 30) for i in range(8))
MAX_NEW = 24
ROLES = ("eos", "generation_config", "generation_config", "end_of_turn")


@dataclass(frozen=True)
class StopModel:
    path: str
    eos: int
    generation_config: tuple[int, int]
    end_of_turn: int
    expected: tuple[tuple[int, str | None], ...]
    """Per prompt: the position (index in the completion) and kind of its first stop, or (-1, None) for length."""
    greedy: tuple[tuple[int, ...], ...]
    """Per prompt: its greedy completion of :data:`MAX_NEW` tokens, stops ignored."""


def _model() -> Qwen2ForCausalLM:
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                      tie_word_embeddings=False, initializer_range=0.3)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return Qwen2ForCausalLM(cfg).eval()


def _greedy(model: Qwen2ForCausalLM) -> list[list[int]]:
    """Each prompt's greedy completion (the prompts have one length: one batch, no padding)."""
    ids = torch.tensor(PROMPTS)
    with torch.no_grad():
        for _ in range(MAX_NEW):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[:, len(PROMPTS[0]):].tolist()


def _first_stop(seq: list[int], stops: dict[int, str]) -> tuple[int, str | None]:
    return next(((i, stops[t]) for i, t in enumerate(seq) if t in stops), (-1, None))


def _pick(seqs: list[list[int]]) -> tuple[tuple[int, ...], list[tuple[int, str | None]]]:
    """Four distinct ids, one per role, each the first stop (at position >= 2) of a prompt of its own."""

    def search(chosen: list[tuple[int, int, int]]) -> list[tuple[int, int, int]] | None:
        if len(chosen) == len(ROLES):
            return chosen
        ids = {t for _, _, t in chosen}
        for p, seq in enumerate(seqs):
            if p in {q for q, _, _ in chosen}:
                continue
            for i, t in enumerate(seq):
                if i < 2 or t in seq[:i] or t in ids or ids & set(seq[:i]):
                    continue
                if any(t in seqs[q][:j] for q, j, _ in chosen):
                    continue
                found = search([*chosen, (p, i, t)])
                if found is not None:
                    return found
        return None

    picked = search([])
    if picked is None:
        raise AssertionError("no four greedy tokens stop four prompts one rule each")
    stops = {t: role for (_, _, t), role in zip(picked, ROLES, strict=True)}
    return tuple(t for _, _, t in picked), [_first_stop(s, stops) for s in seqs]


def chatml_tokenizer(eos: int, end_of_turn: int) -> PreTrainedTokenizerFast:
    """A character tokenizer over :data:`VOCAB` ids with ``<eos>`` and ``<|im_end|>`` at the given ids and the
    ChatML-like template :data:`CHATML`."""
    names = [n for n in SPECIALS + tuple(CHARS) if n not in ("<eos>", "<|im_end|>")]
    vocab: dict[str, int] = {"<eos>": eos, "<|im_end|>": end_of_turn}
    free = (i for i in range(VOCAB) if i not in (eos, end_of_turn))
    vocab.update({n: next(free) for n in names})
    tk = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>", bos_token="<bos>",
                                  additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tok.chat_template = CHATML
    return tok


def build_stop_model(directory: Path) -> StopModel:
    """Save the model, its tokenizer and a generation config with two EOS ids under ``directory``."""
    model = _model()
    greedy = _greedy(model)
    (eos, g1, g2, eot), expected = _pick(greedy)
    model.config.eos_token_id = eos
    model.generation_config.eos_token_id = [g1, g2]
    model.save_pretrained(directory, safe_serialization=True)
    chatml_tokenizer(eos, eot).save_pretrained(directory)
    return StopModel(str(directory), eos, (g1, g2), eot, tuple(expected), tuple(tuple(g) for g in greedy))
