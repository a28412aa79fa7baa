"""Policy losses, registered by name (verl's ``register_policy_loss``): what a LightningModule's ``loss_fn`` is.

A policy loss is a small ``nn.Module`` implementing :class:`PolicyLoss`; ``@register_policy_loss("name")`` on its
class lets a config choose it by that name (``model.init_args.loss_fn: clipped``, built with its defaults) besides
its ``class_path`` (with ``init_args``). :class:`~screl.algos.ClippedPGLoss` is registered as ``clipped``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from torch import Tensor

__all__ = ["PolicyLoss", "get_policy_loss", "policy_loss", "policy_loss_names", "register_policy_loss"]

DEFAULT_POLICY_LOSS = "clipped"
"""The loss a module builds when its ``loss_fn`` is None."""


class PolicyLoss(Protocol):
    """What GRPO, PPO and Distill read and call of their ``loss_fn``; :class:`~screl.algos.ClippedPGLoss` is the
    built-in one. Tensors are next-token aligned, ``[B, T]`` (see :mod:`screl.algos.losses`)."""

    token_level_loss: bool
    """True: the loss is a token mean over the step's valid tokens, and the module passes their count over every
    micro-batch and replica as ``global_normalizer``; False: a mean over rows, which the module rescales from the
    micro-batch's rows to the chunk's."""

    @property
    def requires_reference_logprobs(self) -> bool:
        """Whether ``forward`` needs ``reference_logprobs`` (the module then keeps a frozen copy of the initial
        policy and scores every micro-batch with it)."""
        ...

    def forward(
        self, curr_logprobs: Tensor, prev_logprobs: Tensor, generation_logprobs: Tensor, advantages: Tensor,
        token_mask: Tensor, sample_mask: Tensor | None = None, reference_logprobs: Tensor | None = None,
        global_normalizer: float | Tensor | None = None,
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """``(loss, metrics)``: a scalar loss with grad through ``curr_logprobs`` (current policy), from ``prev``
        (the step's start), ``generation`` (the behaviour policy) and per-token ``advantages``; metrics are
        detached scalars with plain names (the module adds ``train/``)."""
        ...

    # `nn.Module.__call__` runs `forward` (with hooks); declared untyped so that jsonargparse, which compares a
    # protocol's methods with the class's own, accepts an `nn.Module` as implementing it
    def __call__(self, *args: Any, **kwargs: Any) -> Any: ...


_LossT = TypeVar("_LossT", bound=type)
_LOSSES: dict[str, type] = {}


def register_policy_loss(name: str) -> Callable[[_LossT], _LossT]:
    """Register a policy-loss class under ``name`` (a class decorator); a second registration of one name is
    refused."""

    def add(cls: _LossT) -> _LossT:
        if name in _LOSSES:
            raise ValueError(f"policy loss {name!r} is already registered ({_LOSSES[name].__qualname__})")
        _LOSSES[name] = cls
        return cls

    return add


def get_policy_loss(name: str) -> type:
    """The class registered as ``name``."""
    try:
        return _LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; registered: {policy_loss_names()}, or give its "
                         "class_path (with init_args)") from None


def policy_loss_names() -> list[str]:
    return sorted(_LOSSES)


def policy_loss(loss_fn: PolicyLoss | str | None) -> PolicyLoss:
    """A module's ``loss_fn`` argument as a loss: itself, the registered loss of that name built with its
    defaults, or (None) the default ``clipped``."""
    if loss_fn is None or isinstance(loss_fn, str):
        built: PolicyLoss = get_policy_loss(loss_fn or DEFAULT_POLICY_LOSS)()
        return built
    return loss_fn
