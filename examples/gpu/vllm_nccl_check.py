"""GPU check for the vLLM backend's NCCL weight transfer (two CUDA GPUs, vLLM 0.33 and Ray; a few minutes).

``backend_args: {weight_transfer: nccl}`` makes the trainer broadcast its policy's parameters straight to every
vLLM engine (``screl.rollout.engines.vllm_transfer``). That path is written against vLLM's API and was never run on a GPU
where it was written; this script is the check. It starts a loopback Ray cluster, one generation worker holding
an ``AsyncLLM`` on GPU 1 (``num_gpus=1``), and the "trainer" (this process) on GPU 0. It then:

1. refits through the object store (the default path) and through NCCL, timing both;
2. generates after the NCCL refit and compares the engine's logprobs with the trainer's own recomputation
   (fp32, so they agree to about 1e-5; a refit that loaded nothing would be off by far more);
3. refits again while a long request is in flight and checks that its tokens carry two weight versions.

Exit status 0 when all three hold. Run it in a venv with ``pip install -e '.[vllm]'`` on a 2-GPU machine:

    python examples/gpu/vllm_nccl_check.py

:func:`run_checks` does the same for any policy spec and returns the figures (``examples/gpu/acceptance.py`` calls
it with SmolLM2-135M-Instruct).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch


def run_checks(spec: Any = None, gpu_memory_utilization: float = 0.3, max_new_tokens: int = 900) -> dict[str, Any]:
    """The three checks on ``spec`` (default: the ``small`` tiny model); figures and ``ok``. Needs two GPUs."""
    import ray

    from screl.dataplane import start_local_ray
    from screl.models import TinyCausalLM
    from screl.rollout.engines.protocol import EngineOptions, GenerationRequest, SamplingParams
    from screl.rollout.engines.vllm_transfer import NcclWeightSender
    from screl.rollout.worker import WorkerResources, spawn_workers

    start_local_ray(num_cpus=4)
    if spec is None:
        spec = TinyCausalLM(scale="small", max_position_embeddings=1024, seed=0)  # head_dim 32
    [worker] = spawn_workers(1, spec, resources=WorkerResources(num_cpus=1, num_gpus=1), backend="vllm",
                             options=EngineOptions(device="cuda", seed=1,
                                                   args={"weight_transfer": "nccl",
                                                         "gpu_memory_utilization": gpu_memory_utilization}))
    module = spec.build_model().to("cuda:0")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g).to(p.device))

    t0 = time.perf_counter()
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    ray.get(worker.update_weights.remote([ray.put(state)], 1))
    store_s = time.perf_counter() - t0
    sender = NcclWeightSender([worker], module)
    t0 = time.perf_counter()
    sender.refit(2)
    nccl_s = time.perf_counter() - t0
    print(f"refit: object store {store_s:.3f} s, NCCL {nccl_s:.3f} s")

    req = GenerationRequest("check-1", [3, 4, 5], SamplingParams(max_new_tokens=40, seed=3))
    [res] = ray.get(worker.generate.remote([req]))
    ids = torch.tensor([list(res.prompt_token_ids) + res.token_ids], device="cuda:0")
    with torch.no_grad():
        logits = module(ids).logits[0, len(res.prompt_token_ids) - 1 : -1].double()
    ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(res.token_ids, device="cuda:0")[:, None])[:, 0]
    diff = (torch.tensor(res.logprobs, dtype=torch.float64, device="cuda:0") - ref).abs().max().item()
    res_versions = list(res.weight_versions)
    agree = diff < 1e-3 and set(res_versions) == {2}
    print(f"logprobs after the NCCL refit: max |engine - trainer| = {diff:.2e}, versions {set(res.weight_versions)}")

    long = GenerationRequest("check-2", [3, 4], SamplingParams(max_new_tokens=max_new_tokens,
                                                               min_new_tokens=max_new_tokens, seed=4))
    pending = worker.generate.remote([long])
    time.sleep(0.5)
    sender.refit(3)
    [res] = ray.get(pending)
    spans = res.weight_version_spans()
    split = [v for v, _, _ in spans] == [2, 3]
    print(f"a refit in flight: version spans {spans}")
    return {"refit_object_store_s": store_s, "refit_nccl_s": nccl_s, "probe_logprob_max_abs_diff": diff,
            "probe_weight_versions": sorted(set(res_versions)), "inflight_version_spans": [list(x) for x in spans],
            "ok": bool(agree and split)}


def main() -> int:
    if torch.cuda.device_count() < 2:
        print("needs 2 CUDA GPUs (trainer on cuda:0, the vLLM engine on another)")
        return 2
    ok = run_checks()["ok"]
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
