"""Refits stream buckets into the torch engine in place (issue 33 item 3): no merged state dict, one bucket held
at a time, the same weights as a one-dict refit, and an incomplete refit refused without relabelling."""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator

import pytest
import torch

from screl.models import TinyCausalLM
from screl.rollout.engines.buckets import bucket_from_wire, bucket_to_wire, iter_buckets
from screl.rollout.engines.protocol import GenerationRequest, SamplingParams
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.worker import GenerationWorker

SPEC = TinyCausalLM()
NEW = TinyCausalLM(seed=1)


def _new_state() -> dict[str, torch.Tensor]:
    return dict(NEW.build_model().state_dict())


def _requests(n: int = 3) -> list[GenerationRequest]:
    return [GenerationRequest(f"r{i}", [3 + i, 4, 5], SamplingParams(max_new_tokens=6, seed=i)) for i in range(n)]


def _weights(engine: TorchGenerationEngine) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in engine.model.state_dict().items()}


def test_a_bucketed_refit_equals_the_one_dict_refit_bit_for_bit() -> None:
    merged, bucketed = TorchGenerationEngine(SPEC), TorchGenerationEngine(SPEC)
    state = _new_state()
    merged.update_weights(state, 3)
    buckets = iter_buckets(state.items(), bucket_bytes=2048)  # a generator: drawn once, lazily
    bucketed.update_weights(buckets, 3)
    a, b = _weights(merged), _weights(bucketed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    old = SPEC.build_model().state_dict()
    assert sum(not torch.equal(a[k], old[k]) for k in a) > len(a) // 2  # the refit changed the weights
    assert merged.version == bucketed.version == 3
    assert [r.token_ids for r in merged.generate(_requests())] == [r.token_ids for r in bucketed.generate(_requests())]


def test_the_engine_draws_buckets_lazily_and_holds_one_at_a_time() -> None:
    """Each bucket is copied into the model before the next is drawn, and released by then: when bucket i+1 is
    drawn, every tensor of bucket i is already freed (weakrefs dead) and its values are already in the model."""
    engine = TorchGenerationEngine(SPEC)
    state = _new_state()
    names = list(state)
    chunks = [names[i:i + 3] for i in range(0, len(names), 3)]
    assert len(chunks) > 3
    alive: list[weakref.ref[torch.Tensor]] = []
    drawn: list[int] = []

    def buckets() -> Iterator[dict[str, torch.Tensor]]:
        for i, chunk in enumerate(chunks):
            if i:
                assert all(r() is None for r in alive), f"bucket {i - 1} is still held when bucket {i} is drawn"
                live = dict(engine.model.named_parameters(remove_duplicate=False))
                live.update(dict(engine.model.named_buffers()))
                assert all(torch.equal(live[k], state[k]) for k in chunks[i - 1]), "not copied before the next draw"
            drawn.append(i)
            alive.clear()
            yield _fresh(chunk)  # no local: once yielded, only the engine holds the bucket

    def _fresh(chunk: list[str]) -> dict[str, torch.Tensor]:
        bucket = {k: state[k].clone() for k in chunk}
        alive.extend(weakref.ref(t) for t in bucket.values())
        return bucket

    engine.update_weights(buckets(), 7)
    assert drawn == list(range(len(chunks))) and engine.version == 7
    assert all(r() is None for r in alive)


def test_an_incomplete_refit_fails_and_keeps_the_old_version_label() -> None:
    engine = TorchGenerationEngine(SPEC)
    before = engine.generate(_requests())
    state = _new_state()
    del state["model.norm.weight"]
    with pytest.raises(KeyError, match=r"missing keys: \['model.norm.weight'\] \(1 in all\)"):
        engine.update_weights(iter_buckets(state.items(), bucket_bytes=2048), 5)
    assert engine.version == 0
    # the buckets before the end were copied: the weights mix two versions, so the engine refuses to decode
    with pytest.raises(RuntimeError, match=r"a refit to version 5 failed after \d+ tensor\(s\) were copied"):
        engine.generate(_requests())
    engine.update_weights(iter_buckets(_new_state().items(), bucket_bytes=2048), 6)  # a complete refit heals it
    after = engine.generate(_requests())
    assert engine.version == 6 and all(set(r.weight_versions) == {6} for r in after)
    assert [r.token_ids for r in after] != [r.token_ids for r in before]


def test_a_bad_bucket_is_refused_before_it_is_copied() -> None:
    engine = TorchGenerationEngine(SPEC)
    old = _weights(engine)
    state = _new_state()
    with pytest.raises(ValueError, match=r"shape mismatch \(given != model\): \['model.norm.weight: \(3,\) != \(64,\)'\]"):
        engine.update_weights([{"model.norm.weight": torch.zeros(3)}, state], 2)
    with pytest.raises(KeyError, match="keys not in the model: \\['extra.weight'\\]"):
        engine.update_weights([{"extra.weight": torch.zeros(1)}], 2)
    assert engine.version == 0 and all(torch.equal(v, old[k]) for k, v in _weights(engine).items())
    assert engine.generate(_requests(1))[0].weight_versions[0] == 0  # nothing was copied: it still decodes
    first = {k: state[k] for k in list(state)[:2]}
    with pytest.raises(ValueError, match=r"update_weights: weight buckets overlap on \['"):
        engine.update_weights([first, first], 2)
    assert engine.version == 0


def test_the_worker_streams_buckets_to_the_engine() -> None:
    """The worker hands the engine an iterator (no merged dict), and the refit equals the engine's own."""
    worker = GenerationWorker(SPEC)
    reference = TorchGenerationEngine(SPEC)
    state = _new_state()
    reference.update_weights(state, 4)
    seen: list[str] = []
    update = worker.engine.update_weights

    def spy(weights: object, version: int) -> None:
        seen.append(type(weights).__name__)
        update(weights, version)  # type: ignore[arg-type]

    worker.engine.update_weights = spy  # type: ignore[method-assign]
    assert asyncio.run(worker.update_weights(list(iter_buckets(state.items(), bucket_bytes=4096)), 4)) == 4
    assert seen == ["map"]  # drawn lazily, never merged
    a, b = _weights(reference), _weights(worker.engine)  # type: ignore[arg-type]
    assert all(torch.equal(a[k], b[k]) for k in a) and worker.engine.version == 4


def test_wire_buckets_round_trip_and_refit_like_tensor_buckets() -> None:
    """What WeightSync puts into the object store (numpy, so Ray hands workers views of the store, not copies)."""
    bucket = {"a": torch.randn(3, 5), "b": torch.arange(7), "c": torch.randn(4).bfloat16(), "s": torch.tensor(2.0)}
    back = bucket_from_wire(bucket_to_wire(bucket))
    assert list(back) == list(bucket)
    assert all(back[k].dtype == t.dtype and back[k].shape == t.shape and torch.equal(back[k], t)
               for k, t in bucket.items())
    state = _new_state()
    worker, reference = GenerationWorker(SPEC), TorchGenerationEngine(SPEC)
    reference.update_weights(state, 2)
    wire = [bucket_to_wire(b) for b in iter_buckets(state.items(), bucket_bytes=4096)]
    assert asyncio.run(worker.update_weights(wire, 2)) == 2
    a, b = _weights(reference), _weights(worker.engine)  # type: ignore[arg-type]
    assert all(torch.equal(a[k], b[k]) for k in a)
