"""How a worker's generation settings become vLLM's engine arguments (``generation.backend: vllm``).

:func:`check_options` refuses what the backend cannot take (an argument screl sets, a device vLLM cannot run on,
routing records) before anything is built; :func:`set_cpu_environment` sets the EngineCore's CPU environment;
:func:`apply_weight_transfer` maps ``backend_args.weight_transfer``; :func:`async_engine_args` builds the
``AsyncEngineArgs`` with the fields in :data:`FIXED_ENGINE_ARGS` set by screl. The defaults of the others, per
device: ``screl.config_generation.VLLM_DEFAULTS``.

Invariant: the fields in :data:`FIXED_ENGINE_ARGS` are screl's alone (they define what the rollout rows mean).
"""

from __future__ import annotations

import os
from typing import Any

from screl.config_generation import vllm_engine_args
from screl.rollout.engines.protocol import EngineOptions
from screl.rollout.engines.vllm_worker import ScrelWorkerExtension

KEY = "data.init_args.generation.backend_args"

#: Set by screl and not to be overridden: they define what the rollout rows mean. (The defaults of the others,
#: per device: ``screl.config_generation.VLLM_DEFAULTS``.)
FIXED_ENGINE_ARGS = ("model", "logprobs_mode", "skip_tokenizer_init", "worker_extension_cls", "seed",
                     "generation_config")


def check_options(options: EngineOptions) -> None:
    """Refuse a worker's options the vLLM backend cannot take: a fixed argument, a device, routing records."""
    fixed = sorted(set(options.args) & set(FIXED_ENGINE_ARGS))
    if fixed:
        raise ValueError(f"{KEY}: {fixed} are set by screl's vLLM backend and cannot be overridden")
    vllm_engine_args(options.device)  # a device vLLM cannot run on fails here
    if options.record_routing:
        raise ValueError("model.init_args.routing_replay: vLLM does not return the experts it routed each token "
                         "to (a build that did would need each request's per-token router top-k ids in its "
                         "output); use backend: torch")


def set_cpu_environment(num_threads: int | None) -> None:
    """The KV-cache space and OpenMP threads of vLLM's CPU EngineCore (a child process: it inherits them)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache on CPU (vLLM's default is 4)
    if num_threads is not None:  # the EngineCore child inherits these
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        os.environ["OMP_NUM_THREADS"] = str(num_threads)


def apply_weight_transfer(args: dict[str, Any]) -> None:
    """Replace ``weight_transfer`` in ``args`` by vLLM's ``weight_transfer_config`` (nccl), or drop it (null)."""
    transfer = args.pop("weight_transfer", None)
    if transfer not in (None, "nccl"):
        raise ValueError(f"{KEY}.weight_transfer={transfer!r}: expected nccl (GPU) or null (the object store)")
    if transfer == "nccl":
        from vllm.config import WeightTransferConfig

        args["weight_transfer_config"] = WeightTransferConfig(backend="nccl")


def async_engine_args(model_dir: str, args: dict[str, Any], seed: int, generation_config: str) -> Any:
    """vLLM's ``AsyncEngineArgs``: screl's fixed fields, then ``args`` (those not None)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    return AsyncEngineArgs(
        model=model_dir, skip_tokenizer_init=True, logprobs_mode="processed_logprobs",
        worker_extension_cls=f"{ScrelWorkerExtension.__module__}.{ScrelWorkerExtension.__qualname__}", seed=seed,
        generation_config=generation_config, **{k: v for k, v in args.items() if v is not None},
    )
