"""The vLLM backend's engine arguments per device, and its request cache salts: pure, no vLLM needed."""

from __future__ import annotations

import pytest

from screl.config_generation import VLLM_GPU_MEMORY_UTILIZATION, vllm_engine_args
from screl.models import TinyCausalLM
from screl.rollout.engines.protocol import EngineOptions
from screl.rollout.engines.vllm_args import FIXED_ENGINE_ARGS
from screl.rollout.engines.vllm_engine import VLLMGenerationEngine, cache_salt

COMMON = {"max_model_len": None, "enable_prefix_caching": True, "scheduling_policy": "priority", "max_logprobs": 0}


def test_cpu_defaults_are_fp32_eager_with_prefix_caching() -> None:
    assert vllm_engine_args("cpu") == {"dtype": "float32", "enforce_eager": True, **COMMON}


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_defaults_are_the_models_dtype_cuda_graphs_and_a_memory_share(device: str) -> None:
    assert vllm_engine_args(device) == {"dtype": "auto", "enforce_eager": False,
                                        "gpu_memory_utilization": VLLM_GPU_MEMORY_UTILIZATION, **COMMON}
    assert VLLM_GPU_MEMORY_UTILIZATION == 0.5  # leaves a trainer sharing the GPU half of it (docs/generation.md)


def test_backend_args_override_the_defaults_key_by_key() -> None:
    args = vllm_engine_args("cuda", {"gpu_memory_utilization": 0.85, "enable_prefix_caching": False,
                                     "tensor_parallel_size": 2})
    assert args == {"dtype": "auto", "enforce_eager": False, "gpu_memory_utilization": 0.85, "max_model_len": None,
                    "enable_prefix_caching": False, "scheduling_policy": "priority", "max_logprobs": 0,
                    "tensor_parallel_size": 2}
    assert vllm_engine_args("cpu", {"dtype": "bfloat16"})["dtype"] == "bfloat16"


def test_the_defaults_are_copies() -> None:
    vllm_engine_args("cpu")["dtype"] = "float16"
    assert vllm_engine_args("cpu")["dtype"] == "float32"


@pytest.mark.parametrize("device", ["tpu", "cudagraph", "mps"])
def test_a_device_vllm_cannot_run_on_is_refused(device: str) -> None:
    with pytest.raises(ValueError, match=rf"generation.device='{device}': vLLM runs on cpu or cuda"):
        vllm_engine_args(device)
    with pytest.raises(ValueError, match=r"vLLM runs on cpu or cuda"):
        VLLMGenerationEngine.from_options(TinyCausalLM(), EngineOptions(device=device))


def test_generation_config_is_screls_to_set() -> None:
    """vLLM's ``generation_config`` would bring the model directory's EOS ids back: screl sets it."""
    assert "generation_config" in FIXED_ENGINE_ARGS
    with pytest.raises(ValueError, match=r"\['generation_config'\] are set by screl's vLLM backend"):
        VLLMGenerationEngine.from_options(TinyCausalLM(), EngineOptions(args={"generation_config": "auto"}))


@pytest.mark.parametrize("version", [0, 7, -1, 10**30])
def test_cache_salts_are_valid_and_differ_per_version(version: int) -> None:
    salt = cache_salt(version)
    assert 1 <= len(salt) <= 128 and not set(salt) & {"@", "/", "\\", "\0"}
    assert salt != cache_salt(version + 1)
