"""The torch engine's continuous decode path (``decode: continuous``) against the static path and the trainer's
forward: the same tokens for the same seeds, logprobs within 1e-5 of a full forward in fp32, with rows joining and
leaving mid-batch, aborts, refits in flight and stand-downs; its KV cache sized once and handed back."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from screl.models import TinyCausalLM
from screl.rollout import GenerationRequest, GenerationResult, SamplingParams
from screl.rollout.engines import continuous
from screl.rollout.engines.kv_cache import CacheShape, SlotKVCache, slots_for_budget
from screl.rollout.engines.sdpa_attention import decode_attention, length_bias
from screl.rollout.engines.slot_forward import SlotForward
from screl.rollout.engines.torch_engine import TorchGenerationEngine

torch.set_num_threads(1)
TOL = 1e-5  # engine vs trainer logprobs in fp32
SPEC = TinyCausalLM(scale="tiny")


def _engine(decode: str = "continuous", rows: int = 3, prefill: int = 2048, **kwargs: Any) -> TorchGenerationEngine:
    return TorchGenerationEngine(SPEC, num_threads=1, seed=0, decode=decode, continuous={
        "max_rows": rows, "kv_cache_gb": 0.01, "sync_every": 3, "prefill_tokens": prefill}, **kwargs)


def _requests(n: int = 7, prefix: str = "r", **sampling: Any) -> list[GenerationRequest]:
    prompts = [[5, 6, 7], [8], [9, 10, 11, 12, 13], [14, 15]]
    base: dict[str, Any] = {"temperature": 0.9}
    return [GenerationRequest(f"{prefix}{i}", prompts[i % 4], SamplingParams(
        **{"max_new_tokens": 6 + 2 * i, "seed": 50 + i, **base, **sampling})) for i in range(n)]


def _reference(model: Any, res: GenerationResult, temperature: float) -> torch.Tensor:
    """The trainer's logprobs: log_softmax(logits / T) of the sampled tokens from one full forward pass."""
    prompt, toks = res.prompt_token_ids, res.token_ids
    with torch.no_grad():
        logits = model(torch.tensor([prompt + toks])).logits[0].float()
    logits = logits[len(prompt) - 1: len(prompt) - 1 + len(toks)]
    return torch.log_softmax(logits / temperature, dim=-1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)


def _max_gap(a: list[float], b: torch.Tensor) -> float:
    return float((torch.tensor(a) - b).abs().max())


@pytest.mark.parity
@pytest.mark.parametrize("sampling", [{}, {"top_k": 5, "top_p": 0.8}, {"min_new_tokens": 6}])
def test_same_tokens_as_the_static_path_and_trainer_logprobs_while_rows_join_and_leave(sampling: dict) -> None:
    cont, static = _engine(), _engine("static")
    taken: list[int] = []
    take = cont.continuous.cache.take  # type: ignore[union-attr]
    cont.continuous.cache.take = lambda: taken.append(take()) or taken[-1]  # type: ignore[union-attr,method-assign]
    ours, ref = cont.generate(_requests(**sampling)), static.generate(_requests(**sampling))
    assert len(taken) == 7 and set(taken) == {0, 1, 2}  # 7 rows through 3 slots: they joined as slots freed
    model = SPEC.build_model().eval()
    for x, y in zip(ours, ref, strict=True):
        assert (x.token_ids, x.finish_reason, x.stop_token_id) == (y.token_ids, y.finish_reason, y.stop_token_id)
        assert x.weight_versions == [0] * len(x.token_ids) and len(x.logprobs) == len(x.token_ids)
        assert _max_gap(x.logprobs, _reference(model, x, 0.9)) <= TOL
    assert cont.continuous.cache.free_slots == 3  # type: ignore[union-attr]


@pytest.mark.parity
def test_a_prompt_longer_than_the_prefill_budget_goes_in_chunks_with_the_same_tokens(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A budget of 2 positions a step: the 5-token prompt goes in as 2 + 2 + 1 over three steps, no step prefills
    more than 2 positions, the running rows decode meanwhile, and every row gets the static path's tokens and the
    trainer's logprobs."""
    eng, static = _engine(prefill=2), _engine("static")
    forward, steps, chunks = eng.continuous.forward, [0], []  # type: ignore[union-attr]
    prefill, step = forward.prefill, continuous._Call.step

    def counted_prefill(cache: Any, slot: int, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
        chunks.append((steps[0], cache.lengths[slot] if start else 0, start, int(ids.shape[0])))
        return prefill(cache, slot, ids, start)

    def counted_step(call: Any, version: int) -> torch.Tensor:
        steps[0] += 1
        return step(call, version)

    monkeypatch.setattr(forward, "prefill", counted_prefill)
    monkeypatch.setattr(continuous._Call, "step", counted_step)
    ours, ref = eng.generate(_requests()), static.generate(_requests())
    model = SPEC.build_model().eval()
    for x, y in zip(ours, ref, strict=True):
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert _max_gap(x.logprobs, _reference(model, x, 0.9)) <= TOL
    per_step: dict[int, int] = {}
    for at, _, _, n in chunks:
        per_step[at] = per_step.get(at, 0) + n
    assert max(per_step.values()) == 2 and len(per_step) > 7  # 34 prompt positions, at most 2 a step
    # the 5-token prompts ([9 .. 13]) went in at positions 0, 2 and 4, each chunk after the cached ones
    assert sum(1 for _, cached, start, n in chunks if start == 4 and n == 1 and cached == 4) == 2
    assert eng.continuous.cache.free_slots == 3  # type: ignore[union-attr]


def _on_checkpoint(engine: TorchGenerationEngine, at: int, action: Any) -> None:
    """Run ``action()`` in the generate thread before the ``at``-th gate between steps (no lock held)."""
    gate, calls = engine.loop._checkpoint, [0]

    def hooked(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == at:
            action()
        gate(*args, **kwargs)

    engine.loop._checkpoint = hooked  # type: ignore[method-assign]


@pytest.mark.parity
def test_an_abort_mid_batch_leaves_at_once_and_the_others_continue() -> None:
    eng, full = _engine(), _engine("static").generate(_requests())
    _on_checkpoint(eng, 5, lambda: eng.abort(["r1"]))
    out = eng.generate(_requests())
    assert out[1].finish_reason == "abort" and 1 <= len(out[1].token_ids) < len(full[1].token_ids)
    assert out[1].token_ids == full[1].token_ids[: len(out[1].token_ids)]
    assert len(out[1].logprobs) == len(out[1].weight_versions) == len(out[1].token_ids)
    for i in (0, 2, 3, 4, 5, 6):
        assert out[i].token_ids == full[i].token_ids and out[i].finish_reason == full[i].finish_reason
    assert eng.loop.in_flight == set() and eng.continuous.cache.free_slots == 3  # type: ignore[union-attr]


@pytest.mark.parity
@pytest.mark.parametrize("prefill", [2048, 2])
@pytest.mark.parametrize("recompute", [False, True])
def test_a_refit_in_flight_lands_between_steps(recompute: bool, prefill: int) -> None:
    """(``prefill`` 2: prompts go in over several steps, and a refit can land between a row's chunks.)"""
    eng = _engine(recompute_kv_cache_after_weight_updates=recompute, prefill=prefill)
    new = TinyCausalLM(scale="tiny", seed=1).build_model().eval()
    _on_checkpoint(eng, 4, lambda: eng.update_weights(new.state_dict(), 1))
    out = eng.generate(_requests(min_new_tokens=8, max_new_tokens=8))
    old = SPEC.build_model().eval()
    for r in out:
        first_new = r.weight_versions.index(1)
        assert r.weight_versions == [0] * first_new + [1] * (len(r.token_ids) - first_new)
        # a row that drew under version 0 started under it; one whose prompt went in over the refit did too
        assert r.end_version == 1 and (r.start_version == 0 if first_new else r.start_version in (0, 1))
        if first_new:
            assert _max_gap(r.logprobs[:first_new], _reference(old, r, 0.9)[:first_new]) <= TOL
        gap = _max_gap(r.logprobs[first_new:], _reference(new, r, 0.9)[first_new:])
        # recomputed KV == the trainer's forward under the new weights; a kept KV cache is stale for the rows that
        # started before the refit (those that joined after it prefilled under the new weights)
        assert (gap <= TOL) == (recompute or r.start_version == 1)
    if prefill == 2 and not recompute:  # a prompt that went in over the refit: stale first tokens, said so
        assert any(r.weight_versions[0] == 1 and r.start_version == 0 for r in out)


@pytest.mark.parity
@pytest.mark.parametrize("prefill", [2048, 2])
def test_a_stand_down_mid_batch_hands_the_cache_back_and_the_rows_re_prefill_on_wake(prefill: int) -> None:
    eng, full = _engine(prefill=prefill), _engine().generate(_requests())
    cache = eng.continuous.cache  # type: ignore[union-attr]
    reached, seen = threading.Event(), []
    _on_checkpoint(eng, 4, lambda: (reached.set(), _wait(lambda: eng.stood_down)))

    def trainer() -> None:
        assert reached.wait(10)
        eng.stand_down(timeout=10)
        seen.append(cache.allocated)
        eng.wake()

    th = threading.Thread(target=trainer, daemon=True)
    th.start()
    out = eng.generate(_requests())
    th.join(10)
    assert seen == [False] and cache.allocated
    model = SPEC.build_model().eval()
    for x, y in zip(out, full, strict=True):
        assert x.token_ids == y.token_ids and x.finish_reason == y.finish_reason
        assert _max_gap(x.logprobs, _reference(model, x, 0.9)) <= TOL
    eng.stand_down(timeout=10)  # idle: the cache goes back too, and comes back on the wake
    assert not cache.allocated
    eng.wake()
    assert cache.allocated and [len(k) for k in cache.k] == [3] * 2


def _wait(pred: Any) -> None:
    for _ in range(10000):
        if pred():
            return
        threading.Event().wait(0.001)
    raise TimeoutError("condition not reached")


def test_the_cache_is_sized_by_the_budget_in_the_compute_dtype_and_named_at_start_up(caplog: Any) -> None:
    shape = CacheShape(layers=2, kv_heads=2, head_dim=16, max_len=128, dtype=torch.bfloat16)
    assert shape.slot_bytes() == 2 * 2 * 2 * 128 * 16 * 2
    assert slots_for_budget(shape, 1.0, 256) == 256
    assert slots_for_budget(shape, 10 * shape.slot_bytes() / 2**30, 256) == 10
    with pytest.raises(ValueError, match="holds no slot of 128 positions"):
        slots_for_budget(shape, 1e-9, 4)
    with caplog.at_level("INFO"):
        eng = TorchGenerationEngine(SPEC, num_threads=1, seed=0, decode="continuous", model=SPEC.build_model(),
                                    autocast=torch.bfloat16)
    cache = eng.continuous.cache  # type: ignore[union-attr]
    assert cache.k[0].dtype == torch.bfloat16 and cache.slots == 256  # not the fp32 masters
    assert "KV cache 8.0 MiB bfloat16 on cpu (256 slots x 128 positions" in caplog.text
    assert "attention sdpa (prefill: is_causal, no mask" in caplog.text
    res = eng.generate(_requests(3))
    assert all(0 <= t < eng.vocab_size for r in res for t in r.token_ids)
    with pytest.raises(ValueError, match="needs 130 positions and a KV-cache slot holds 128"):
        eng.generate([GenerationRequest("long", [5, 6], SamplingParams(max_new_tokens=128))])
    assert "of backend_args.max_rows" not in caplog.text  # 256 slots: all the rows it was asked for
    with caplog.at_level("WARNING"):
        short = _engine(rows=1000)
    assert short.continuous.cache.slots < 1000  # type: ignore[union-attr]
    assert (f"KV cache holds {short.continuous.cache.slots} of backend_args.max_rows=1000 rows: "  # type: ignore[union-attr]
            "backend_args.kv_cache_gb=0.01 GB") in caplog.text


@pytest.mark.parity
def test_decode_attention_folds_grouped_heads_without_a_copy_and_equals_repeated_heads() -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 6, 1, 8, generator=g)
    k, v = torch.randn(3, 2, 5, 8, generator=g), torch.randn(3, 2, 5, 8, generator=g)
    lengths = torch.tensor([5, 2, 1])
    ours = decode_attention(q, k, v, length_bias(lengths, 5, torch.float32), 8 ** -0.5)
    for i, n in enumerate(lengths.tolist()):
        kr, vr = k[i, :, :n].repeat_interleave(3, 0), v[i, :, :n].repeat_interleave(3, 0)
        want = torch.softmax(q[i] @ kr.transpose(1, 2) * 8 ** -0.5, dim=-1) @ vr
        torch.testing.assert_close(ours[i], want, atol=1e-6, rtol=0)


@pytest.mark.parity
def test_the_slot_forward_equals_hugging_face_on_qwen3s_per_head_norms() -> None:
    """Qwen3 (a per-head RMSNorm on queries and keys): a slot's prefill and decode steps give Hugging Face's logits of
    the whole sequence, two rows at different lengths in one decode step."""
    from tests.rollout.test_static_decode import _qwen3

    model = _qwen3()
    fwd = SlotForward(model)
    cache = SlotKVCache(fwd.cache_shape(32, torch.float32), 2, torch.device("cpu"))
    seqs = [[5, 9, 17, 3, 8], [7, 8]]
    with torch.no_grad():
        firsts = [fwd.prefill(cache, slot, torch.tensor(s)) for slot, s in enumerate(seqs)]
        for slot, s in enumerate(seqs):
            want = model(torch.tensor([s])).logits[0, -1]
            torch.testing.assert_close(firsts[slot], want, rtol=0, atol=2e-5)
        nxt = torch.tensor([11, 12])
        step = fwd.decode(cache, nxt, torch.tensor([len(s) for s in seqs]), max(len(s) for s in seqs) + 1)
        for slot, s in enumerate(seqs):
            want = model(torch.tensor([[*s, int(nxt[slot])]])).logits[0, -1]
            torch.testing.assert_close(step[slot], want, rtol=0, atol=2e-5)


@pytest.mark.parity
def test_concurrent_calls_join_one_run_and_each_returns_when_its_own_rows_finish() -> None:
    """A second call submitted while the first decodes joins its run (no wait for the cache): both get the static
    path's tokens and the trainer's logprobs, and the first returns while the second's longer rows still decode."""
    eng, static = _engine(), _engine("static")
    first, second = _requests(4, "a"), _requests(3, "b", max_new_tokens=30, min_new_tokens=30)
    dec, held, release, joined = eng.continuous, threading.Event(), threading.Event(), []
    assert dec is not None and eng.capabilities.continuous_batching and not static.capabilities.continuous_batching

    def hook() -> None:
        if not joined:  # the first call's third gate: hand the second call to the run in progress
            joined.append(eng.submit(second))
            _wait(lambda: dec.merged_calls == 1)
        elif all(r.request_id not in eng.loop.in_flight for r in first) and not held.is_set():
            held.set()  # the first call has returned; hold the run until the test has looked
            assert release.wait(10)

    gate, calls = eng.loop._checkpoint, [0]

    def hooked(*args: Any, **kwargs: Any) -> None:
        calls[0] += 1
        if calls[0] == 3 or (joined and calls[0] > 3):
            hook()
        gate(*args, **kwargs)

    eng.loop._checkpoint = hooked  # type: ignore[method-assign]
    out_a = eng.generate(first)
    assert held.wait(10) and not joined[0].done()  # returned while the joined rows still decode
    release.set()
    out_b = joined[0].result(timeout=30)
    model = SPEC.build_model().eval()
    for ours, ref in ((out_a, static.generate(first)), (out_b, static.generate(second))):
        for x, y in zip(ours, ref, strict=True):
            assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
            assert _max_gap(x.logprobs, _reference(model, x, 0.9)) <= TOL
    assert [len(r.token_ids) for r in out_b] == [30] * 3 and dec.merged_calls == 1
    assert eng.loop.in_flight == set() and dec.cache.free_slots == 3


@pytest.mark.parity
def test_a_stand_down_parks_joined_calls_and_a_failed_run_fails_every_call_waiting_on_it() -> None:
    eng = _engine()
    dec = eng.continuous
    assert dec is not None
    full = _engine().generate(_requests(3, "a") + _requests(3, "b", max_new_tokens=12))
    later: list[Any] = []
    stood: list[bool] = []

    def action() -> None:
        later.append(eng.submit(_requests(3, "b", max_new_tokens=12)))
        _wait(lambda: dec.merged_calls == 1)
        threading.Thread(target=trainer, daemon=True).start()
        _wait(lambda: eng.stood_down)

    def trainer() -> None:
        eng.stand_down(timeout=10)  # the joined call waits as parked: the pause does not wait for it
        stood.append(dec.cache.allocated)
        eng.wake()

    _on_checkpoint(eng, 3, action)
    out = eng.generate(_requests(3, "a")) + later[0].result(timeout=30)
    assert stood == [False]
    assert [r.token_ids for r in out] == [r.token_ids for r in full]  # re-prefilled after the wake, same tokens

    eng2 = _engine()
    dec2 = eng2.continuous
    assert dec2 is not None
    decode, steps = dec2.forward.decode, [0]

    def failing(*args: Any) -> torch.Tensor:
        steps[0] += 1
        if steps[0] == 4:
            raise RuntimeError("device lost")
        return decode(*args)

    dec2.forward.decode = failing  # type: ignore[method-assign]
    _on_checkpoint(eng2, 2, lambda: (later.append(eng2.submit(_requests(2, "c"))),
                                     _wait(lambda: dec2.merged_calls == 1)))
    with pytest.raises(RuntimeError, match=r"the continuous decode run failed \(RuntimeError: device lost\)"):
        eng2.generate(_requests(3, "a"))
    with pytest.raises(RuntimeError, match=r"the continuous decode run failed \(RuntimeError: device lost\)"):
        later[1].result(timeout=30)
    assert eng2.loop.in_flight == set() and dec2.cache.free_slots == 3
    assert [len(r.token_ids) for r in eng2.generate(_requests(2, "d"))] == [6, 8]  # the next call runs anew


def test_decode_shapes_bucket_to_powers_of_two_and_graphs_are_cuda_only() -> None:
    from screl.rollout.engines.decode_graphs import bucket, graphs_enabled

    assert [bucket(n, 256) for n in (1, 2, 3, 5, 64, 65, 300)] == [1, 2, 4, 8, 64, 128, 256]
    assert [bucket(n, 100, floor=64) for n in (1, 64, 65, 99)] == [64, 64, 100, 100]
    cpu = torch.device("cpu")
    assert not graphs_enabled("auto", cpu) and not graphs_enabled(False, cpu)
    assert graphs_enabled("auto", torch.device("cuda")) and not graphs_enabled(False, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"cuda_graphs=true needs a CUDA device \(the engine runs on cpu\)"):
        graphs_enabled(True, cpu)
    with pytest.raises(ValueError, match=r"cuda_graphs='on': expected auto, true or false"):
        graphs_enabled("on", cpu)


@pytest.mark.parity
def test_the_bucketed_decode_shapes_a_graph_replays_give_the_exact_shapes_tokens() -> None:
    """What a CUDA graph captures, run eagerly on the CPU: each step at the next power of two of slots (the extra
    free slots decode junk at their own positions) and of keys (at least 128, the extra ones under the length
    bias); the rows get the unpadded step's tokens and the trainer's logprobs. A refit copies in place (the addresses
    a graph holds stay valid); a stand-down drops the graphs with the cache."""
    eng, exact = _engine(rows=5), _engine(rows=5)
    dec = eng.continuous
    assert dec is not None and not dec.graphs.capture and "decode steps eager (no CUDA graphs)" in dec.describe()
    dec.graphs.bucketed = True
    shapes: list[tuple[int, int, int]] = []
    decode = dec.forward.decode

    def recorded(cache: Any, ids: torch.Tensor, pos: torch.Tensor, keys: int) -> torch.Tensor:
        shapes.append((int(ids.shape[0]), int(pos.shape[0]), keys))
        return decode(cache, ids, pos, keys)

    dec.forward.decode = recorded  # type: ignore[method-assign]
    reqs = _requests(9) + _requests(3, "x", max_new_tokens=40)
    ours, ref = eng.generate(reqs), exact.generate(reqs)
    assert {rows for rows, _, _ in shapes} == {4, 5} and {keys for *_, keys in shapes} == {128}, shapes
    model = SPEC.build_model().eval()
    for x, y in zip(ours, ref, strict=True):
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert _max_gap(x.logprobs, _reference(model, x, 0.9)) <= TOL
    before = dec.forward.storage(dec.cache)
    eng.update_weights(TinyCausalLM(scale="tiny", seed=1).build_model().state_dict(), 1)
    assert dec.forward.storage(dec.cache) == before  # in place: graphs captured before a refit stay valid
    dec.graphs.graphs[(1, 128)] = "captured"  # type: ignore[assignment]
    eng.stand_down(timeout=10)  # the cache they point at is freed: the graphs go with it
    assert dec.graphs.graphs == {} and not dec.cache.allocated
    eng.wake()


def test_auto_picks_the_continuous_path_on_a_gpu_and_the_static_path_on_a_cpu() -> None:
    from types import SimpleNamespace

    model = SPEC.build_model()
    on = SimpleNamespace(model=model, device=torch.device("cuda"))
    assert TorchGenerationEngine._decode_path(on, "auto") == "continuous"  # type: ignore[arg-type]
    assert TorchGenerationEngine._decode_path(on, "static") == "static"  # type: ignore[arg-type]
    assert _engine("auto").decode_path == "static" and _engine("auto").continuous is None
    assert continuous.held_kv_cache_gib({"decode": "auto", "kv_cache_gb": 3}) == 3.0  # the GPU's path: counted
    assert continuous.held_kv_cache_gib({"decode": "static", "kv_cache_gb": 3}) is None


class _Replayed:
    """A fake at the true edge (capturing a CUDA graph needs a GPU): what ``DecodeGraphs._record`` returns, with
    its semantics: the warm-up runs the step once, each ``replay()`` runs it again on the buffers it was given."""

    def __init__(self, step: Any) -> None:
        self.step, self.replays = step, 0
        step()

    def replay(self) -> None:
        self.replays += 1
        self.step()


@pytest.mark.parity
def test_captured_steps_replay_on_static_buffers_once_a_shape_and_again_after_a_stand_down() -> None:
    """The capture bookkeeping around ``torch.cuda.graph`` (everything but the capture itself): each (rows, keys)
    shape is recorded once and replayed with the step's tokens and positions copied into the static buffers, the
    logits read from the static output; the rows get the eager engine's tokens and the trainer's logprobs. A
    stand-down drops the graphs with the cache, and the next call records them again."""
    eng, exact = _engine(rows=5), _engine(rows=5)
    g = eng.continuous.graphs  # type: ignore[union-attr]
    g.capture = g.bucketed = True
    recorded: list[_Replayed] = []
    g._record = lambda step: recorded.append(_Replayed(step)) or recorded[-1]  # type: ignore[method-assign]
    reqs = _requests(9) + _requests(3, "x", max_new_tokens=40)
    ours, ref = eng.generate(reqs), exact.generate(reqs)
    model = SPEC.build_model().eval()
    for x, y in zip(ours, ref, strict=True):
        assert (x.token_ids, x.finish_reason) == (y.token_ids, y.finish_reason)
        assert _max_gap(x.logprobs, _reference(model, x, 0.9)) <= TOL
    assert g.captures == len(recorded) == len(g.graphs) == 2 and set(g.graphs) == {(4, 128), (5, 128)}
    steps = sum(r.replays for r in recorded)
    assert steps >= 40  # every decode step replayed a recorded graph (no eager step)
    eng.stand_down(timeout=10)
    assert g.graphs == {} and g.out is None  # the graphs' logits buffer goes back with them
    eng.wake()
    eng.generate(_requests(2, "y"))
    assert g.captures == 3 and set(g.graphs) == {(2, 128)}  # recorded again on the new cache


@pytest.mark.parametrize("decode", ["static", "continuous"])
def test_the_busy_clock_counts_decoding_only(decode: str) -> None:
    """``busy_s``: the seconds a call decoded (a colocated run's ``rollout/engine_busy_s``): idle time and a
    parked call's time under a keep-pause are left out."""
    eng = _engine(decode)
    assert eng.busy_s == 0.0
    held: list[float] = []

    def park() -> None:  # the trainer's turn: the call parks 0.3 s at this gate
        before = eng.busy_s
        threading.Thread(target=lambda: (eng.pause("keep", timeout=10), time.sleep(0.3), eng.resume()),
                         daemon=True).start()
        _wait(lambda: eng.paused)
        held.append(before)

    _on_checkpoint(eng, 3, park)
    t0 = time.perf_counter()
    eng.generate(_requests())
    wall = time.perf_counter() - t0
    time.sleep(0.05)  # the continuous path's decode thread winds down after the call has its rows
    busy = eng.busy_s
    assert held and 0 < busy < wall - 0.25  # the 0.3 s parked are not busy
    time.sleep(0.05)
    assert eng.busy_s == busy  # idle
