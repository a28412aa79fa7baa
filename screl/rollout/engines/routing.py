"""The torch engine's record of a mixture-of-experts policy's routing (rollout routing replay, R3).

Every forward pass the engine runs on a request (its prefill, each decode step, a re-prefill after a refit or a
stand-down) records, for every position it fed, the top-k experts each MoE layer chose
(:func:`screl.models.moe.record_routing`). A request's record is ``[positions, layers, top_k]`` (int16) over its
prompt and completion: ``-1`` where the engine never fed the position (the last sampled token), which the trainer's
replay leaves to its own router. The trainer replays it (:func:`screl.models.moe.replay_routing`), so both sides
use the same experts for every token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

from screl.models.moe import moe_routers, record_routing


class RoutingRecorder:
    """Routing capture for one engine's model (see the module docstring)."""

    def __init__(self, model: torch.nn.Module) -> None:
        routers = moe_routers(model)
        if not routers:
            raise ValueError(f"routing replay needs a mixture-of-experts policy: {type(model).__name__} has no "
                             "top-k router (model.init_args.routing_replay)")
        self.model = model
        self.layers = len(routers)
        self.top_k = int(routers[0].top_k)  # type: ignore[arg-type]

    def empty(self, positions: int) -> Tensor:
        return torch.full((positions, self.layers, self.top_k), -1, dtype=torch.int16)

    @contextlib.contextmanager
    def forward(self, records: Sequence[Tensor], lengths: Sequence[int], width: int) -> Iterator[None]:
        """One forward pass over ``width`` positions per row (left-padded): afterwards row ``i``'s last ``width``
        fed positions end at ``lengths[i]`` (its sequence length so far) and are written into ``records[i]``."""
        with record_routing(self.model) as calls:
            yield
        per_layer = [c[-1].reshape(len(records), width, self.top_k) for c in calls]  # [rows, width, k] each
        chosen = torch.stack(per_layer, dim=2).to("cpu", torch.int16)  # [rows, width, layers, k]
        for i, (record, length) in enumerate(zip(records, lengths, strict=True)):
            fed = min(width, length)
            record[length - fed:length] = chosen[i, width - fed:]


def grown(record: Tensor, positions: int) -> Tensor:
    """``record`` with room for ``positions`` (new positions -1)."""
    if record.shape[0] >= positions:
        return record
    pad = torch.full((positions - record.shape[0], *record.shape[1:]), -1, dtype=record.dtype)
    return torch.cat([record, pad])
