"""``partial_tokens`` (``EngineCapabilities.streams_tokens``): the tokens of requests still generating, read from
another thread while the engine decodes, on the torch engine's batched and continuous paths. What the policy
server streams before a reply is done."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from screl.models import TinyCausalLM
from screl.rollout import GenerationRequest, SamplingParams
from screl.rollout.engines.protocol import declared_capabilities
from screl.rollout.engines.torch_engine import TorchGenerationEngine
from screl.rollout.engines.vllm_engine import VLLMGenerationEngine

torch.set_num_threads(1)
SPEC = TinyCausalLM(scale="tiny")


@pytest.mark.parametrize("decode", ["static", "continuous"])
def test_partial_tokens_grow_as_prefixes_of_the_final_tokens(decode: str) -> None:
    engine = TorchGenerationEngine(SPEC, num_threads=1, seed=0, decode=decode,
                                   continuous={"max_rows": 2, "kv_cache_gb": 0.01, "sync_every": 3})
    requests = [GenerationRequest(f"p{i}", [5 + i, 6, 7], SamplingParams(max_new_tokens=120, min_new_tokens=120,
                                                                         seed=i)) for i in range(2)]
    ids = [r.request_id for r in requests]
    seen: list[dict[str, list[int]]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.append(engine.partial_tokens([*ids, "not-in-flight"]))
            time.sleep(0.002)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        results = engine.generate(requests)
    finally:
        done.set()
        watcher.join()
    final = {r.request_id: r.token_ids for r in results}
    assert all(len(v) == 120 for v in final.values())
    reads = [s for s in seen if s]
    assert all("not-in-flight" not in s for s in reads)
    for rid in ids:
        lengths = [len(s[rid]) for s in reads if rid in s]
        assert all(s[rid] == final[rid][: len(s[rid])] for s in reads if rid in s)  # prefixes of the final tokens
        assert lengths == sorted(lengths)  # they only grow
        assert any(0 < n < 120 for n in lengths)  # read while the request was generating
    assert engine.partial_tokens(ids) == {}  # nothing is in flight after the call


def test_which_engines_declare_streaming_tokens() -> None:
    assert declared_capabilities(TorchGenerationEngine).streams_tokens
    vllm = declared_capabilities(VLLMGenerationEngine)
    assert not vllm.streams_tokens
    assert "FINAL_ONLY" in vllm.reason("streams_tokens", "vllm")
