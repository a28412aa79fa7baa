"""Chunked logprobs (``screl.models.logprobs``): the same values and gradients as full logits, and never a
``[tokens, vocabulary]`` tensor on the way."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import Qwen2Config, Qwen2ForCausalLM

from screl.models.logprobs import (
    auto_chunk_tokens,
    chunked_logprobs_of_hidden,
    chunked_token_logprobs,
    full_token_logprobs,
    token_logprobs,
)

torch.set_num_threads(1)
VOCAB = 1000


def _model(tied: bool = True, seed: int = 0) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      tie_word_embeddings=tied)
    return Qwen2ForCausalLM(cfg).train()


def _batch(rows: int = 3, length: int = 11) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (rows, length), generator=g)
    attention = torch.ones(rows, length, dtype=torch.long)
    attention[1, 8:] = 0  # right padding, as collate_chunk lays rows out
    attention[2, 5:] = 0
    token_mask = attention[:, 1:].float() * (torch.rand(rows, length - 1, generator=g) > 0.3)
    return ids, attention, token_mask


def _loss_and_grads(model: torch.nn.Module, lp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    weights = torch.linspace(-1.0, 2.0, lp.numel()).reshape(lp.shape)  # a loss with per-token weights
    loss = (lp * weights * mask).sum() / mask.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


@pytest.mark.parity
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [None, 1, 7, 64])
def test_chunked_logprobs_and_gradients_equal_the_full_logits(tied: bool, temperature: float, chunk: Any) -> None:
    model = _model(tied)
    ids, attention, mask = _batch()
    full, full_grads = _loss_and_grads(model, full_token_logprobs(model, ids, attention, temperature), mask)
    lp = token_logprobs(model, ids, attention, temperature, chunk_tokens=chunk)
    chunked, grads = _loss_and_grads(model, lp, mask)
    assert lp.shape == (3, 10) and lp.dtype == torch.float32
    torch.testing.assert_close(chunked, full, rtol=0, atol=2e-6)
    assert grads.keys() == full_grads.keys()
    assert ("lm_head.weight" in grads) == (not tied)
    for name, g in full_grads.items():
        # fp32 round-off: summation order differs (chunks), so the bound scales with the gradient's magnitude
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=2e-6 * float(g.abs().max()), msg=name)


def test_chunking_zero_is_the_full_path() -> None:
    model = _model()
    ids, attention, _ = _batch()
    with torch.no_grad():  # exact: chunk_tokens=0 dispatches to full_token_logprobs itself, the same kernels twice
        assert torch.equal(token_logprobs(model, ids, attention, 0.9, chunk_tokens=0),
                           full_token_logprobs(model, ids, attention, 0.9))


@pytest.mark.parity
def test_entropy_equals_the_full_distributions() -> None:
    model = _model()
    ids, attention, _ = _batch()
    with torch.no_grad():
        _, entropy = chunked_token_logprobs(model, ids, attention, 0.8, chunk_tokens=5, with_entropy=True)
        logp = torch.log_softmax(model(input_ids=ids, attention_mask=attention).logits[:, :-1].float() / 0.8, -1)
    assert entropy is not None
    torch.testing.assert_close(entropy, -(logp.exp() * logp).sum(-1), rtol=0, atol=2e-5)


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_op_holds_logits_beyond_one_chunk() -> None:
    """The peak that sets memory at real scale: no tensor of forward or backward exceeds one chunk's logits
    (the full path makes ``tokens x vocabulary`` ones; the test would see them)."""
    model = _model()
    ids, attention, mask = _batch(rows=4, length=33)
    tokens, chunk = 4 * 32, 48
    for chunked in (True, False):
        with _LargestTensor() as seen:
            lp = (token_logprobs(model, ids, attention, 1.0, chunk_tokens=chunk) if chunked
                  else full_token_logprobs(model, ids, attention, 1.0))
            (lp * mask).sum().backward()
        model.zero_grad(set_to_none=True)
        if chunked:
            assert seen.largest == chunk * VOCAB  # one chunk's logits (the embedding's gradient is smaller)
        else:
            assert seen.largest >= tokens * VOCAB


@pytest.mark.parity
def test_matmul_runs_in_the_autocast_dtype() -> None:
    """Under bf16 autocast the head's matmul is bf16 (as the full path's), the softmax fp32; without autocast
    a bf16 head over fp32 hidden states is computed in fp32."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 16, generator=g)
    weight = torch.randn(50, 16, generator=g)
    labels = torch.randint(0, 50, (6,), generator=g)
    exact = torch.log_softmax(hidden @ weight.T, -1).gather(-1, labels[:, None]).squeeze(-1)
    lp, _ = chunked_logprobs_of_hidden(hidden, weight, labels, chunk_tokens=4)
    torch.testing.assert_close(lp, exact, rtol=0, atol=1e-6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp_bf16, _ = chunked_logprobs_of_hidden(hidden, weight, labels, chunk_tokens=4)
    bf16 = torch.log_softmax((hidden.bfloat16() @ weight.bfloat16().T).float(), -1).gather(-1, labels[:, None])
    assert lp_bf16.dtype == torch.float32
    torch.testing.assert_close(lp_bf16, bf16.squeeze(-1), rtol=0, atol=1e-6)
    assert not torch.allclose(lp_bf16, exact, atol=1e-4)  # it did run in bf16


def test_auto_chunk_fits_the_element_budget() -> None:
    assert auto_chunk_tokens(151_936) == 220
    assert auto_chunk_tokens(43) == 2**25 // 43
    assert auto_chunk_tokens(10**9) == 16


def test_a_head_that_is_not_a_plain_linear_is_refused_with_the_fix() -> None:
    model = _model()
    model.config.final_logit_softcapping = 30.0
    ids, attention, _ = _batch()
    with pytest.raises(ValueError, match=r"final_logit_softcapping.*logprob_chunk_tokens: 0"):
        token_logprobs(model, ids, attention, 1.0)
    assert token_logprobs(model, ids, attention, 1.0, chunk_tokens=0).shape == (3, 10)  # the way out
