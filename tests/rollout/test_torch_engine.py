from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch

from screl.models import EOS_TOKEN_ID, TinyCausalLM
from screl.rollout import GenerationEngine, GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.engines.torch_sampling import Batch as _Batch
from screl.rollout.engines.torch_sampling import Row as _Row
from screl.rollout.engines.weight_copy import copy_serial

torch.set_num_threads(1)

SPEC = TinyCausalLM(seed=0)
PROMPTS = ["3+4=", "1+1=", "12+34=", "9=", "0+0=0+0="]  # different lengths: exercises left padding
VOCAB = 43


def encode(text: str) -> list[int]:
    return SPEC.build_tokenizer()(text, add_special_tokens=False)["input_ids"]


def requests(n: int = 5, prefix: str = "r", **sampling: Any) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            f"{prefix}{i}", encode(PROMPTS[i % len(PROMPTS)]), SamplingParams(seed=100 + i, **sampling)
        )
        for i in range(n)
    ]


def reference_logprobs(model: torch.nn.Module, res: GenerationResult, temperature: float) -> torch.Tensor:
    """log_softmax(logits / T) of the sampled tokens, from one full forward pass over prompt + completion."""
    prompt, toks = res.prompt_token_ids, res.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + toks])).logits[0].float()
    logits = logits[len(prompt) - 1 : len(prompt) - 1 + len(toks)]
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)


class HookedEngine(TorchGenerationEngine):
    """Calls ``hook(step)`` after each sampling step (step = tokens per row so far), in the generate thread."""

    hook: Callable[[int], None] | None = None

    def _sample_step(self, rows: list[_Row], batch: _Batch, logits: torch.Tensor, version: int) -> None:
        super()._sample_step(rows, batch, logits, version)
        if self.hook is not None:
            self.hook(max(len(r.tokens) for r in rows))


def wait_until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise TimeoutError("condition not reached")
        time.sleep(0.001)


def run_in_thread(fn: Callable[[], Any]) -> tuple[threading.Thread, list[Any]]:
    out: list[Any] = []
    th = threading.Thread(target=lambda: out.append(fn()), daemon=True)
    th.start()
    return th, out


def test_engine_satisfies_the_protocol() -> None:
    assert isinstance(TorchGenerationEngine(SPEC), GenerationEngine)


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 1.0},
        {"temperature": 0.7, "min_new_tokens": 12},
        {"temperature": 1.3, "top_k": 5, "top_p": 0.8},  # logprobs stay those of the full tempered softmax
    ],
)
@pytest.mark.parity
def test_logprobs_equal_a_full_forward_recompute(sampling: dict[str, Any]) -> None:
    eng = TorchGenerationEngine(SPEC)
    results = eng.generate(requests(8, max_new_tokens=12, **sampling))
    model = SPEC.build_model().eval()
    for res in results:
        assert len(res.token_ids) == len(res.logprobs) == len(res.weight_versions) >= 1
        ref = reference_logprobs(model, res, sampling["temperature"])
        torch.testing.assert_close(torch.tensor(res.logprobs), ref, rtol=1e-5, atol=1e-5)


def test_top_k_restricts_the_sampled_tokens() -> None:
    eng = TorchGenerationEngine(SPEC)
    model = SPEC.build_model().eval()
    for res in eng.generate(requests(5, max_new_tokens=8, top_k=1)):
        prompt, toks = res.prompt_token_ids, res.token_ids
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks])).logits[
                0, len(prompt) - 1 : len(prompt) - 1 + len(toks)
            ]
        assert toks == logits.argmax(-1).tolist()  # top_k=1 is greedy


def test_greedy_matches_argmax_and_reports_untempered_logprobs() -> None:
    eng = TorchGenerationEngine(SPEC)
    a, b = (
        eng.generate(requests(1, max_new_tokens=6, temperature=0.0)),
        eng.generate(
            [
                GenerationRequest(
                    "x", encode(PROMPTS[0]), SamplingParams(max_new_tokens=6, temperature=0.0, seed=7)
                )
            ]
        ),
    )
    assert a[0].token_ids == b[0].token_ids
    ref = reference_logprobs(SPEC.build_model().eval(), a[0], 1.0)
    torch.testing.assert_close(torch.tensor(a[0].logprobs), ref, rtol=1e-5, atol=1e-5)


def test_same_seed_same_output_and_seeds_differ() -> None:
    eng = TorchGenerationEngine(SPEC)
    first = eng.generate(requests(5, max_new_tokens=10))
    again = TorchGenerationEngine(SPEC).generate(requests(5, max_new_tokens=10, prefix="s"))
    assert [r.token_ids for r in first] == [r.token_ids for r in again]
    # exact: one process, the same 5 requests in one batch of the same shape, the same per-request seeds: the same
    # kernels in the same order (only the request ids differ)
    assert [r.logprobs for r in first] == [r.logprobs for r in again]
    same_prompt = [
        GenerationRequest(f"q{i}", encode("3+4="), SamplingParams(max_new_tokens=10, seed=i))
        for i in range(4)
    ]
    outs = [r.token_ids for r in eng.generate(same_prompt)]
    assert len({tuple(o) for o in outs}) == 4


def test_engine_seed_makes_unseeded_requests_reproducible() -> None:
    def run() -> list[list[int]]:
        reqs = [
            GenerationRequest(f"u{i}", encode("3+4="), SamplingParams(max_new_tokens=8)) for i in range(3)
        ]
        return [r.token_ids for r in TorchGenerationEngine(SPEC, seed=1).generate(reqs)]

    assert run() == run()


@pytest.mark.parity
def test_batch_invariance() -> None:
    eng = TorchGenerationEngine(SPEC, max_batch_size=None)
    reqs = requests(5, max_new_tokens=12)
    together = eng.generate(reqs)
    alone = [eng.generate([r])[0] for r in reqs]
    reordered = eng.generate(list(reversed(reqs)))[::-1]
    chunked = TorchGenerationEngine(SPEC, max_batch_size=2).generate(reqs)
    for other in (alone, reordered, chunked):
        for x, y in zip(together, other, strict=True):
            assert x.request_id == y.request_id and x.token_ids == y.token_ids
            torch.testing.assert_close(
                torch.tensor(x.logprobs), torch.tensor(y.logprobs), rtol=1e-5, atol=1e-5
            )


def test_eos_stops_and_min_new_tokens_masks_it() -> None:
    eng = TorchGenerationEngine(SPEC)
    not_ab = tuple(t for t in range(VOCAB) if t not in (3, 4))  # stop on everything but 'a' and 'b'
    results = eng.generate(requests(24, max_new_tokens=10, min_new_tokens=4, stop_token_ids=not_ab))
    assert "stop" in {r.finish_reason for r in results}
    for r in results:
        assert set(r.token_ids[:4]) <= {3, 4}  # no stop token before min_new_tokens
        assert all(t in (3, 4) for t in r.token_ids[:-1])
        if r.finish_reason == "stop":
            assert r.token_ids[-1] in not_ab and len(r.token_ids) >= 5
        else:
            assert len(r.token_ids) == 10

    plain = eng.generate(requests(40, max_new_tokens=30))
    stopped = [r for r in plain if r.finish_reason == "stop"]
    assert stopped, "some sample should hit <eos> within 30 tokens"
    for r in plain:
        assert EOS_TOKEN_ID not in r.token_ids[:-1]
        assert (r.token_ids[-1] == EOS_TOKEN_ID) == (r.finish_reason == "stop")


def test_fixed_length_and_ignore_eos() -> None:
    eng = TorchGenerationEngine(SPEC)
    for kw in ({"min_new_tokens": 30}, {"ignore_eos": True}):
        for r in eng.generate(requests(40, max_new_tokens=30, **kw)):
            assert r.finish_reason == "length" and len(r.token_ids) == 30
            if "min_new_tokens" in kw:
                assert EOS_TOKEN_ID not in r.token_ids


def test_update_weights_changes_outputs_and_versions() -> None:
    eng = TorchGenerationEngine(SPEC)
    before = eng.generate(requests(5, max_new_tokens=10))
    assert eng.version == 0 and all(r.weight_versions == [0] * len(r.token_ids) for r in before)
    other = TinyCausalLM(seed=1).build_model()
    sd = {k: v for k, v in other.state_dict().items() if k != "lm_head.weight"}  # tied: one name suffices
    eng.update_weights(sd, version=3)
    after = eng.generate(requests(5, max_new_tokens=10, prefix="b"))
    assert eng.version == 3
    assert [r.token_ids for r in after] != [r.token_ids for r in before]
    assert all(
        r.weight_versions == [3] * len(r.token_ids) and (r.start_version, r.end_version) == (3, 3)
        for r in after
    )
    for r in after:
        ref = reference_logprobs(other.eval(), r, 1.0)
        torch.testing.assert_close(torch.tensor(r.logprobs), ref, rtol=1e-5, atol=1e-5)
    eng.set_version(4)
    relabeled = eng.generate(requests(5, max_new_tokens=10, prefix="c"))
    assert [r.token_ids for r in relabeled] == [r.token_ids for r in after]
    assert all(set(r.weight_versions) == {4} for r in relabeled)


def test_update_weights_rejects_wrong_keys() -> None:
    eng = TorchGenerationEngine(SPEC)
    sd = dict(SPEC.build_model().state_dict())
    with pytest.raises(KeyError, match="keys not in the model"):
        eng.update_weights({**sd, "extra.weight": torch.zeros(1)}, 1)
    with pytest.raises(
        ValueError, match=r"shape mismatch \(given != model\): \['model.norm.weight: \(3,\) != \(64,\)'\]"
    ):
        eng.update_weights({**sd, "model.norm.weight": torch.zeros(3)}, 1)
    sd.pop("model.norm.weight")
    with pytest.raises(KeyError, match=r"missing keys: \['model.norm.weight'\]"):
        eng.update_weights(sd, 1)
    assert eng.version == 0


def test_abort_from_another_thread_returns_partial_tokens() -> None:
    eng = HookedEngine(SPEC)
    reached, aborted = threading.Event(), threading.Event()

    def hook(step: int) -> None:
        if step == 3:
            reached.set()
            assert aborted.wait(10)

    eng.hook = hook
    th, out = run_in_thread(lambda: eng.generate(requests(3, max_new_tokens=20, min_new_tokens=20)))
    assert reached.wait(10)
    eng.abort(["r1", "not-in-flight"])
    aborted.set()
    th.join(10)
    r0, r1, r2 = out[0]
    assert (r1.finish_reason, len(r1.token_ids), len(r1.logprobs), len(r1.weight_versions)) == (
        "abort",
        3,
        3,
        3,
    )
    assert r0.finish_reason == r2.finish_reason == "length" and len(r0.token_ids) == 20
    # the partial tokens are the prefix of the unaborted completion
    full = TorchGenerationEngine(SPEC).generate(requests(3, max_new_tokens=20, min_new_tokens=20, prefix="z"))
    assert full[1].token_ids[:3] == r1.token_ids
    assert eng.loop._aborted == set() and eng.loop.in_flight == set()


def test_duplicate_request_ids_are_rejected() -> None:
    eng = TorchGenerationEngine(SPEC)
    with pytest.raises(ValueError, match=r"repeated: \['r0'\]"):
        eng.generate(requests(1) + requests(1))
    with pytest.raises(ValueError, match="empty prompt"):
        eng.generate([GenerationRequest("e", [])])


def _pause_at_step(eng: HookedEngine, step_at: int) -> threading.Event:
    reached = threading.Event()

    def hook(step: int) -> None:
        if step == step_at:
            reached.set()
            wait_until(lambda: eng.paused)

    eng.hook = hook
    return reached


@pytest.mark.parametrize("recompute", [False, True])
def test_refit_while_paused_in_keep_mode_records_per_token_versions(recompute: bool) -> None:
    eng = HookedEngine(SPEC, recompute_kv_cache_after_weight_updates=recompute)
    reached = _pause_at_step(eng, 4)
    th, out = run_in_thread(lambda: eng.generate(requests(3, max_new_tokens=10, min_new_tokens=10)))
    assert reached.wait(10)
    eng.pause("keep", timeout=10)
    new = TinyCausalLM(seed=1).build_model().eval()
    eng.update_weights(new.state_dict(), version=1)
    eng.resume()
    th.join(10)
    for r in out[0]:
        assert r.weight_versions == [0] * 4 + [1] * 6
        assert r.weight_version_spans() == [(0, 0, 4), (1, 4, 10)]
        assert (r.start_version, r.end_version) == (0, 1)
        ref_new = reference_logprobs(new, r, 1.0)[4:]
        close = torch.allclose(torch.tensor(r.logprobs[4:]), ref_new, rtol=1e-5, atol=1e-5)
        assert close == recompute  # recomputed KV == fresh forward under the new weights; kept KV is stale


def test_pause_abort_aborts_in_flight_and_new_calls_wait_for_resume() -> None:
    eng = HookedEngine(SPEC)
    reached = _pause_at_step(eng, 2)
    th, out = run_in_thread(lambda: eng.generate(requests(2, max_new_tokens=10, min_new_tokens=10)))
    assert reached.wait(10)
    eng.pause("abort", timeout=10)
    th.join(10)
    assert [(r.finish_reason, len(r.token_ids)) for r in out[0]] == [("abort", 2), ("abort", 2)]

    eng.hook = None
    th2, out2 = run_in_thread(lambda: eng.generate(requests(2, max_new_tokens=5, prefix="n")))
    th2.join(0.05)
    assert th2.is_alive() and not out2  # waits while paused
    eng.resume()
    th2.join(10)
    assert [r.finish_reason != "abort" for r in out2[0]] == [True, True]


def test_pause_wait_lets_in_flight_finish() -> None:
    eng = HookedEngine(SPEC)
    reached = _pause_at_step(eng, 2)
    th, out = run_in_thread(lambda: eng.generate(requests(2, max_new_tokens=6, min_new_tokens=6)))
    assert reached.wait(10)
    eng.pause("wait", timeout=10)
    th.join(10)
    assert [(r.finish_reason, len(r.token_ids)) for r in out[0]] == [("length", 6), ("length", 6)]
    eng.resume()


def test_pause_times_out_with_a_clear_error() -> None:
    eng = HookedEngine(SPEC)
    release = threading.Event()
    reached = threading.Event()

    def hook(step: int) -> None:
        if step == 1:
            reached.set()
            assert release.wait(10)

    eng.hook = hook
    th, _ = run_in_thread(lambda: eng.generate(requests(1, max_new_tokens=3)))
    assert reached.wait(10)
    with pytest.raises(TimeoutError, match="1 generate call"):
        eng.pause("keep", timeout=0.05)
    release.set()
    wait_until(lambda: eng.loop._active == 0)
    eng.resume()
    th.join(10)
    assert not th.is_alive()


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool, torch.complex64, torch.complex128]
)
def test_serial_copy_equals_copy_(dtype: torch.dtype) -> None:
    src = (torch.randn(33, 17) * 50).to(dtype)
    dst = torch.zeros(33, 17, dtype=dtype)
    copy_serial(dst, src)
    assert torch.equal(dst, src)
    strided = torch.zeros(17, 33, dtype=dtype).t()  # not contiguous: falls back to copy_
    copy_serial(strided, src)
    assert torch.equal(strided, src)
    copy_serial(dst, src.t().contiguous().t())  # a non-contiguous source
    assert torch.equal(dst, src)


def test_update_weights_from_another_thread_adds_no_openmp_team() -> None:
    """A weight copy on the refit thread must not give that thread its own OpenMP team: once a process has
    more OpenMP threads than cores, libgomp stops spinning and every decode step pays for waking its
    helpers (a 2-thread generation of 64 x 64 tokens went from 0.49 s to 0.81 s). Checked in a subprocess
    with 2 torch threads and the small model, whose weights are big enough for torch to parallelise a copy."""
    script = """
import sys, torch, psutil
from concurrent.futures import ThreadPoolExecutor
torch.set_num_threads(2)
from screl.models import TinyCausalLM
from screl.rollout.engines import torch_engine as te, weight_copy
spec = TinyCausalLM(scale="small")
eng = te.TorchGenerationEngine(spec, num_threads=2)
weights = spec.build_model().state_dict()
x = torch.randn(512, 512); x @ x
pool = ThreadPoolExecutor(1); pool.submit(lambda: None).result()
if sys.argv[1] == "copy_":
    weight_copy.copy_serial = lambda dst, src: dst.copy_(src)
before = psutil.Process().num_threads()
pool.submit(eng.update_weights, weights, 1).result()
print(psutil.Process().num_threads() - before)
"""
    if "OpenMP" not in torch.__config__.parallel_info():
        pytest.skip("torch is not built with OpenMP here")
    added = {
        how: int(subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, check=True,
                                timeout=120).stdout.split()[-1])
        for how in ("serial", "copy_")
    }
    assert added == {"serial": 0, "copy_": 1}  # copy_ on that thread spawns a helper: the check can fail
