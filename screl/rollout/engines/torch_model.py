"""The torch engine's model: building it, choosing its decode path, and the tensors a refit copies into.

:func:`load_model` builds the policy's model frozen in eval mode on the engine's device, or takes a shared module
(colocated) as it is. :func:`choose_decode_path` turns ``backend_args.decode`` into ``static`` or ``hf`` and logs
the choice (never a silent one). :class:`ModelTensors` is one refit's view of the model's tensors: it checks and
copies each bucket in place (:func:`~screl.rollout.engines.weight_copy.copy_bucket`) and names the persistent
tensors no bucket gave.

Invariant: a refit copies into the model's own tensors (no new ones), so a decoder holding them sees it at once.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from screl.config_generation import TORCH_DECODE_PATHS
from screl.models.spec import PolicySpec, resolve_dtype
from screl.models.vision import vision_token_ids
from screl.rollout.engines.decode_copy import DecodeCopy
from screl.rollout.engines.static_decode import STATIC_ATTENTION_PATH, static_decode_support
from screl.rollout.engines.weight_copy import copy_bucket

log = logging.getLogger(__name__)

DECODE_PATHS = TORCH_DECODE_PATHS
DECODE_KEY = "data.init_args.generation.backend_args.decode"


def load_model(policy: PolicySpec, device: str, model: torch.nn.Module | None) -> tuple[Any, torch.device]:
    """The model to decode with and its device: ``model`` (colocated: the trainer's) as it is (not moved, not
    frozen), or its :class:`DecodeCopy` in the policy's dtype where that differs from its parameters' (fp32 masters,
    a bf16 spec); else the policy's model built on ``device``, in eval mode, without gradients."""
    dev = torch.device(device)
    if model is not None:
        dtype = engine_dtype(policy, model)
        return (model if dtype is None else DecodeCopy(model, dtype).module), next(model.parameters()).device
    built: Any = policy.build_model()
    built.to(dev)  # transformers' wrapped .to
    built.eval()
    built.requires_grad_(False)
    return built, dev


def engine_dtype(policy: PolicySpec, model: torch.nn.Module) -> torch.dtype | None:
    """The dtype a colocated engine decodes ``model`` in when it is not its parameters' (None: theirs): the spec's
    (the dtype a worker's engine would hold), below the masters' precision."""
    dtype = resolve_dtype(str(getattr(policy, "dtype", "float32")))
    masters = {p.dtype for p in model.parameters() if p.is_floating_point()}
    return dtype if masters == {torch.float32} and dtype != torch.float32 else None


def choose_decode_path(model: Any, decode: str) -> str:
    """``static`` or ``hf`` from the setting, logged once (never a silent choice)."""
    if decode not in DECODE_PATHS:
        raise ValueError(f"{DECODE_KEY}={decode!r}: expected one of {DECODE_PATHS}")
    if decode == "hf":
        log.info("screl: the torch engine decodes with Hugging Face's forward (%s=hf)", DECODE_KEY)
        return "hf"
    why = static_decode_support(model)
    if why is not None:
        if decode == "static":
            raise ValueError(f"{DECODE_KEY}=static: {why}; set it to auto or hf")
        log.info("screl: the torch engine decodes with Hugging Face's forward: the static-cache path cannot run "
                 "this model (%s)", why)
        return "hf"
    log.info("screl: the torch engine decodes %s on its static-cache path (%s=%s); attention: %s",
             type(model).__name__, DECODE_KEY, decode, STATIC_ATTENTION_PATH)
    return "static"


def banned_tokens(model: Any, vocab_size: int, device: torch.device) -> torch.Tensor:
    """A vision-language model's image placeholder tokens, never sampled (``[vocabulary]`` bool)."""
    banned = torch.zeros(vocab_size, dtype=torch.bool)
    banned[[t for t in vision_token_ids(model.config) if t < vocab_size]] = True
    return banned.to(device)


class ModelTensors:
    """One refit's view of a model's parameters and buffers (tied ones under each of their names)."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.names: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        self.names.update(dict(model.named_buffers(remove_duplicate=False)))
        self.loaded: set[int] = set()  # ids of the tensors given so far (a tied tensor counts under any name)
        self.given: set[str] = set()

    def load(self, bucket: Mapping[str, torch.Tensor]) -> int:
        """Check ``bucket`` and copy it in place; returns how many tensors it held."""
        return copy_bucket(bucket, self.names, self.given, self.loaded)

    def missing(self) -> list[str]:
        """The persistent tensors no bucket gave so far (under none of their names)."""
        persistent = set(self.model.state_dict())
        return sorted(k for k, t in self.names.items() if id(t) not in self.loaded and k in persistent)
