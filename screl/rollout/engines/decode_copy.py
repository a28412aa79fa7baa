"""A colocated engine's copy of the trainer's module in the engine's dtype (:class:`DecodeCopy`), cast once per wake
rather than per decode step under autocast. Both the torch and the Megatron engines decode with it.

The copy is the module's structure again (:func:`_twin`): each submodule shallow-copied with its parameters replaced
by cast ones (tied parameters stay tied), its buffers and every other attribute shared with the masters (RoPE tables,
configs, a Megatron module's process groups, which cannot be deep-copied), its hook tables its own.
"""

from __future__ import annotations

import copy
from typing import Any

import torch


class DecodeCopy:
    """A colocated engine's copy of the trainer's fp32 master module in the engine's dtype: the engine decodes
    with :attr:`module` (the same structure; its parameters in ``dtype``, its buffers the masters'), so a decode
    step casts nothing, where the masters under autocast would re-cast every weight every step.

    The copy follows the masters: before a forward (a hook on the module, and on its rotary embedding, which the
    static-cache path's prefill calls) it is cast again if it was freed or if a master changed since (their
    in-place version counters: an optimizer step moves them). The colocated host frees it at each stand-down
    (``EngineTurns.stand_down`` calls :meth:`free`), so it costs memory only while the engine decodes, and is cast once per wake.
    :attr:`casts` counts the casts; :attr:`checks` the hook's calls.
    """

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype) -> None:
        self.dtype, self.casts, self.checks = dtype, 0, 0
        self._masters = list(master.parameters())  # tied ones once
        with torch.inference_mode(False), torch.no_grad():
            cast = {id(p): torch.nn.Parameter(p.detach().to(dtype), requires_grad=False) for p in self._masters}
            self.module: Any = _twin(master, cast, {}).eval()
        self._copies = [cast[id(p)] for p in self._masters]
        self._versions = self._stamp()
        self.casts = 1
        object.__setattr__(self.module, "screl_decode_copy", self)  # a plain attribute, not a submodule
        self.module.register_forward_pre_hook(self._hook)
        rotary = getattr(getattr(self.module, "model", None), "rotary_emb", None)
        if isinstance(rotary, torch.nn.Module):
            rotary.register_forward_pre_hook(self._hook)

    def _stamp(self) -> list[int]:
        return [p._version for p in self._masters]

    def _hook(self, *_: Any) -> None:
        self.ensure()

    def ensure(self) -> None:
        """Cast again if the copy was freed or a master changed since the last cast (a decode path that calls no
        hooked module before its forward, the continuous one, calls this itself)."""
        self.checks += 1
        if self._copies[0].numel() == 0 or self._stamp() != self._versions:
            self.refresh()

    def refresh(self) -> None:
        """Cast the masters into the copy (its tensors allocated again where freed)."""
        with torch.inference_mode(False), torch.no_grad():
            for master, twin in zip(self._masters, self._copies, strict=True):
                if twin.numel() == 0:
                    twin.data = master.detach().to(self.dtype)
                else:
                    twin.copy_(master)
        self._versions = self._stamp()
        self.casts += 1

    def free(self) -> None:
        """Drop the copy's tensors (a stand-down: the trainer trains the masters); the next forward casts again."""
        for twin in self._copies:
            twin.data = torch.empty(0, dtype=self.dtype, device=twin.device)


def _twin(module: torch.nn.Module, cast: dict[int, torch.nn.Parameter], done: dict[int, Any]) -> Any:
    """``module`` again with the parameters ``cast`` maps (by the master's id) and everything else shared: a shallow
    copy of each submodule (once each, as the module tree shares them) with its own parameter, buffer, submodule and
    hook tables, so a hook or a mode set on the copy never reaches the masters."""
    if id(module) in done:
        return done[id(module)]
    twin = copy.copy(module)
    done[id(module)] = twin
    state = twin.__dict__
    for name, value in list(state.items()):
        if "hook" in name and isinstance(value, dict):
            state[name] = type(value)(value)  # dict or OrderedDict, its own
    state["_parameters"] = {k: None if p is None else cast[id(p)] for k, p in module._parameters.items()}
    state["_buffers"] = dict(module._buffers)
    state["_modules"] = {k: None if m is None else _twin(m, cast, done) for k, m in module._modules.items()}
    return twin
