"""The megatron-core CPU shim: pinned to the release it was written for, and fully reversible."""

from __future__ import annotations

import megatron.core
import pytest
import torch
from megatron.core.fusions import fused_softmax
from megatron.core.tensor_parallel import random as mp_random
from screl.strategies import cpu_shim


def test_shim_is_pinned_to_the_installed_megatron_core() -> None:
    assert megatron.core.__version__ == cpu_shim.MEGATRON_CORE_VERSION, (
        f"megatron-core is {megatron.core.__version__} but screl.strategies.cpu_shim was written for "
        f"{cpu_shim.MEGATRON_CORE_VERSION}: re-check its CUDA-only calls, then move the pin."
    )


@pytest.fixture
def shim() -> object:
    cpu_shim.apply()
    try:
        yield cpu_shim
    finally:
        cpu_shim.remove()


def test_apply_replaces_the_cuda_only_calls(shim: object) -> None:
    assert cpu_shim.is_applied()
    assert torch.cuda.current_device() == torch.device("cpu")
    torch.cuda.synchronize()
    t = torch.ones(2)
    assert t.cuda() is t
    mask = fused_softmax.get_default_causal_mask(3)
    assert mask.device.type == "cpu"
    assert mask.tolist() == [[False, True, True], [False, False, True], [False, False, False]]
    assert isinstance(mp_random.get_cuda_rng_tracker(), cpu_shim.CpuRNGStatesTracker)


def test_tracker_forks_named_cpu_streams_and_restores_the_caller(shim: object) -> None:
    cpu_shim.model_parallel_cpu_manual_seed(7, tp_rank=1)
    tracker = mp_random.get_cuda_rng_tracker()
    outer = torch.get_rng_state()
    with tracker.fork():
        first = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), outer)
    with tracker.fork():
        second = torch.rand(3)
    expected = torch.Generator().manual_seed(7 + 2718 + 1)
    assert torch.equal(torch.cat([first, second]), torch.rand(6, generator=expected))
    with pytest.raises(KeyError, match="'nope' is not tracked"):
        with tracker.fork("nope"):
            pass


def test_remove_restores_megatron_and_torch_cuda() -> None:
    before = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.Tensor.cuda,
        fused_softmax.get_default_causal_mask,
        mp_random._get_cuda_rng_state,
        mp_random._CUDA_RNG_STATE_TRACKER,
    )
    cpu_shim.apply()
    cpu_shim.apply()  # idempotent
    cpu_shim.remove()
    after = (
        torch.cuda.current_device,
        torch.cuda.synchronize,
        torch.Tensor.cuda,
        fused_softmax.get_default_causal_mask,
        mp_random._get_cuda_rng_state,
        mp_random._CUDA_RNG_STATE_TRACKER,
    )
    assert after == before
    assert not cpu_shim.is_applied()
    with pytest.raises(RuntimeError, match=r"needs the CPU shim"):
        cpu_shim.model_parallel_cpu_manual_seed(0, tp_rank=0)
