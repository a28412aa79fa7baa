"""CPU stand-ins for the CUDA-only calls that megatron-core makes on the training path.

megatron-core 0.16.1 asks ``torch.cuda`` for the current device, synchronizes the stream and keeps its
tensor-parallel RNG streams in CUDA generator state, even when every tensor lives on the CPU. On a
CPU-only build those calls raise. :func:`apply` replaces exactly these, process-wide, until
:func:`remove`:

- ``torch.cuda.current_device()`` returns ``torch.device("cpu")`` (megatron passes it as ``device=``);
- ``torch.cuda.synchronize()`` is a no-op;
- ``Tensor.cuda()`` returns the tensor as it is (megatron moves the last pipeline stage's copy of tied
  embeddings there before the all-reduce that initializes it from the first stage);
- the default causal and sliding-window attention masks are built on the CPU (megatron hard-codes
  ``device="cuda"`` there);
- the tensor-parallel RNG tracker keeps CPU generator states (:class:`CpuRNGStatesTracker`), and
  ``tensor_parallel.random``'s get/set-state helpers read and write the CPU generator.

Megatron's optimizers need more than these process-wide stand-ins, and only while their own code runs:
:func:`megatron_optimizer_calls` is a scope (a ``TorchFunctionMode``) for the strategy's calls into
``megatron.core.optimizer`` (see :class:`CudaNamesOnCpu`).

:class:`~screl.strategies.MegatronStrategy` applies it only when the accelerator is the CPU and CUDA is
unavailable. ``tests/strategies/test_cpu_shim.py`` pins :data:`MEGATRON_CORE_VERSION`: re-check these
calls before moving the pin.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from megatron.core import __version__ as _installed_version
from megatron.core.fusions import fused_softmax as _fused_softmax
from megatron.core.tensor_parallel import random as _mp_random
from megatron.core.transformer import utils as _transformer_utils
from torch.overrides import TorchFunctionMode

__all__ = [
    "MEGATRON_CORE_VERSION",
    "CpuRNGStatesTracker",
    "CudaNamesOnCpu",
    "apply",
    "is_applied",
    "megatron_optimizer_calls",
    "model_parallel_cpu_manual_seed",
    "remove",
]

MEGATRON_CORE_VERSION = "0.16.1"
"""The megatron-core release whose CUDA-only calls this shim was written against."""

_originals: dict[str, Any] = {}


class CpuRNGStatesTracker(_mp_random.CudaRNGStatesTracker):
    """Megatron's named RNG streams (data-parallel, model-parallel, expert) on the CPU generator.

    ``fork(name)`` swaps the process's CPU RNG state for the named stream and back, as Megatron's
    tracker does with the CUDA generator.
    """

    def add(self, name: str, seed: int) -> None:
        """Track a new stream seeded with ``seed``."""
        self._is_initialized = True
        if seed in self.seeds_:
            raise ValueError(f"RNG seed {seed} is already tracked.")
        if name in self.states_:
            raise ValueError(f"RNG state {name!r} is already tracked.")
        self.seeds_.add(seed)
        generator = torch.Generator()
        generator.manual_seed(seed)
        self.states_[name] = generator.get_state()

    @contextlib.contextmanager
    def fork(self, name: str = _mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
        """Run the block on the named stream, then restore the caller's CPU RNG state."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not tracked.")
        outer = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(outer)


def _cpu_get_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    return torch.get_rng_state()


def _cpu_set_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    torch.set_rng_state(new_state)


def _cpu_current_device() -> torch.device:
    return torch.device("cpu")


def _noop_synchronize(device: Any = None) -> None:
    return None


def _cpu_causal_mask(sq: int) -> torch.Tensor:
    return torch.triu(torch.ones(sq, sq), diagonal=1).bool()


def _cpu_sliding_window_causal_mask(sq: int, skv: int, window_size: tuple[int, int]) -> torch.Tensor:
    m = torch.ones(sq, skv, dtype=torch.bool)
    return ~torch.tril(torch.triu(m, diagonal=skv - sq - window_size[0]), diagonal=skv - sq + window_size[1])


def _tensor_stays_on_cpu(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return self


def _patches() -> dict[str, tuple[Any, str, Callable[..., Any]]]:
    return {
        "current_device": (torch.cuda, "current_device", _cpu_current_device),
        "synchronize": (torch.cuda, "synchronize", _noop_synchronize),
        "tensor_cuda": (torch.Tensor, "cuda", _tensor_stays_on_cpu),
        "get_rng_state": (_mp_random, "_get_cuda_rng_state", _cpu_get_rng_state),
        "set_rng_state": (_mp_random, "_set_cuda_rng_state", _cpu_set_rng_state),
        "causal_mask": (_fused_softmax, "get_default_causal_mask", _cpu_causal_mask),
        "causal_mask_utils": (_transformer_utils, "get_default_causal_mask", _cpu_causal_mask),
        "window_mask": (_fused_softmax, "get_sliding_window_causal_mask", _cpu_sliding_window_causal_mask),
        "window_mask_utils": (
            _transformer_utils,
            "get_sliding_window_causal_mask",
            _cpu_sliding_window_causal_mask,
        ),
    }


def is_applied() -> bool:
    """Whether the shim is in place in this process."""
    return bool(_originals)


def apply() -> None:
    """Install the CPU stand-ins (idempotent). Warns when megatron-core is not the pinned version."""
    if is_applied():
        return
    if _installed_version != MEGATRON_CORE_VERSION:
        warnings.warn(
            f"screl's megatron-core CPU shim was written for {MEGATRON_CORE_VERSION}, found "
            f"{_installed_version}: CUDA-only calls it does not cover may fail on CPU.",
            stacklevel=2,
        )
    for key, (owner, attr, replacement) in _patches().items():
        _originals[key] = getattr(owner, attr)
        setattr(owner, attr, replacement)
    _originals["tracker"] = (
        _mp_random._CUDA_RNG_STATE_TRACKER,
        _mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED,
    )
    _mp_random._CUDA_RNG_STATE_TRACKER = CpuRNGStatesTracker()
    _mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def remove() -> None:
    """Restore megatron-core and ``torch.cuda`` as they were before :func:`apply`."""
    if not is_applied():
        return
    for key, (owner, attr, _) in _patches().items():
        setattr(owner, attr, _originals[key])
    _mp_random._CUDA_RNG_STATE_TRACKER, _mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = _originals["tracker"]
    _originals.clear()


def model_parallel_cpu_manual_seed(seed: int, tp_rank: int, ep_rank: int = 0, etp_rank: int = 0) -> None:
    """CPU twin of ``tensor_parallel.model_parallel_cuda_manual_seed``: the same streams and offsets.

    Seeds the CPU generator with ``seed`` (shared by a data-parallel replica's ranks) and the tracker's
    model-parallel stream with ``seed + 2718 + tp_rank``. Requires :func:`apply`.
    """
    if not is_applied():
        raise RuntimeError(
            "model_parallel_cpu_manual_seed() needs the CPU shim: call cpu_shim.apply() first."
        )
    tracker = _mp_random._CUDA_RNG_STATE_TRACKER
    tracker.reset()
    torch.manual_seed(seed)
    tracker.add(_mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(_mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + tp_rank)
    tracker.add(_mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, seed + 1024 + 100 * ep_rank + etp_rank)


class CudaNamesOnCpu(TorchFunctionMode):
    """Megatron's optimizer code on CPU tensors: CUDA devices become the CPU, CPU tensors report CUDA type names.

    megatron-core 0.16.1's ``MixedPrecisionOptimizer``, ``DistributedOptimizer`` and ``clip_grads`` create
    their scratch tensors with ``device="cuda"`` (the overflow flag, the unit loss scale, the norm
    accumulators) and sort parameters into fp32/fp16/bf16 by ``param.type()`` compared with
    ``"torch.cuda.FloatTensor"`` and friends, raising ``TypeError`` on any other name. Inside this mode a
    ``device=`` that names CUDA (or a CUDA index) is the CPU, ``Tensor.cuda()`` returns the tensor, and
    ``Tensor.type()`` without arguments names a CPU tensor's CUDA twin (``torch.FloatTensor`` ->
    ``torch.cuda.FloatTensor``), so the dtype checks sort as on GPU. Nothing else changes; outside the mode
    ``type()`` tells the truth.
    """

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
    ) -> Any:
        kwargs = kwargs or {}
        device = kwargs.get("device")
        if isinstance(device, int) or (device is not None and torch.device(device).type == "cuda"):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            name: str = func(*args)
            return name if name.startswith("torch.cuda.") else "torch.cuda." + name.removeprefix("torch.")
        return func(*args, **kwargs)


def megatron_optimizer_calls() -> contextlib.AbstractContextManager[Any]:
    """The scope for a call into ``megatron.core.optimizer``: :class:`CudaNamesOnCpu` while the shim is applied,
    else nothing (on GPU megatron's own calls run as they are)."""
    return CudaNamesOnCpu() if is_applied() else contextlib.nullcontext()
