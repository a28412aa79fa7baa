"""The torch engine's forward passes through Hugging Face's own forward (``decode: hf``) and its dynamic cache.

:class:`HFForward` prefills a left-padded batch (position ids from the attention mask; a vision-language model's
multimodal rotary positions and images) and decodes one cached step on each row's last token, keeping the cache,
the mask and the next positions in the :class:`~screl.rollout.engines.torch_sampling.Batch`. Under routing replay
each forward pass records the experts it routed every fed position to into the rows
(:mod:`screl.rollout.engines.routing`).

Invariant: it returns the fp32 logits of each row's last position, as the static-cache path does
(:mod:`screl.rollout.engines.static_decode`); a finished row decodes a dummy token whose logits are ignored. The
caller holds the engine's forward-pass context (lock, no autograd, autocast).
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from screl.models.vision import mrope_positions
from screl.models.vision_inputs import VisionInputs
from screl.rollout.engines.routing import RoutingRecorder
from screl.rollout.engines.torch_sampling import Batch, Row


class HFForward:
    """Prefill and cached decode steps of a batch on ``model``'s Hugging Face forward (see the module docstring)."""

    def __init__(self, model: Any, device: torch.device, routing: RoutingRecorder | None, vision: bool) -> None:
        self.model = model
        self.device = device
        self.routing = routing
        self.vision = vision
        params = inspect.signature(model.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def prefill(self, rows: list[Row], batch: Batch, ids: torch.Tensor, attn: torch.Tensor,
                lengths: list[int]) -> torch.Tensor:
        """Forward the left-padded sequences ``ids`` (``lengths`` each) whole; logits of the last position."""
        pos = (attn.cumsum(-1) - 1).clamp(min=0)
        images: dict[str, torch.Tensor] = {}
        if self.vision:
            pos, images = self._vision_prefill(rows, ids, attn, batch)
        with self._recording(rows, lengths, ids.shape[1]):
            out = self.model(
                input_ids=ids, attention_mask=attn, position_ids=pos, use_cache=True, logits_to_keep=1, **images
            )
        batch.cache = self._out_cache(out)
        batch.attn = attn
        batch.next_pos = attn.sum(-1)
        return out.logits[:, -1, :].float()

    def step(self, rows: list[Row], batch: Batch, last: list[int]) -> torch.Tensor:
        """One cached step on the tokens ``last`` (one a row); logits of that position."""
        assert batch.attn is not None and batch.next_pos is not None
        ids = torch.tensor(last, dtype=torch.long, device=self.device)[:, None]
        batch.attn = torch.cat([batch.attn, batch.attn.new_ones((len(rows), 1))], dim=1)
        pos = batch.next_pos[:, None]
        if batch.rope_delta is not None:  # the multimodal rotary position: the same for its three sections
            pos = (pos + batch.rope_delta)[None].expand(3, -1, -1)
        batch.next_pos = batch.next_pos + 1
        kwargs = {self.cache_kw: batch.cache}
        fed = [len(r.req.prompt_token_ids) + len(r.tokens) if r.finish is None else 0 for r in rows]
        with self._recording(rows, fed, 1):
            out = self.model(input_ids=ids, attention_mask=batch.attn, position_ids=pos, use_cache=True, **kwargs)
        batch.cache = self._out_cache(out)
        return out.logits[:, -1, :].float()

    def _vision_prefill(self, rows: list[Row], ids: torch.Tensor, attn: torch.Tensor,
                        batch: Batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """A vision-language model's prefill: the multimodal rotary positions of the left-padded batch (its decode
        offsets kept in ``batch``) and the rows' images, in row order, for the model's own forward."""
        inputs = [r.req.vision for r in rows if r.req.vision is not None]
        vision = VisionInputs.concat(inputs) if inputs else None
        grid = vision.image_grid_thw.to(self.device) if vision is not None else None
        pos, batch.rope_delta = mrope_positions(self.model, ids, attn, grid)  # type: ignore[arg-type]
        if vision is None:
            return pos, {}
        return pos, {"pixel_values": vision.pixel_values.to(self.device), "image_grid_thw": grid}  # type: ignore[dict-item]

    def _recording(self, rows: list[Row], lengths: list[int], width: int) -> Any:
        """Record the routing of this forward pass into the rows (a MoE policy under routing replay)."""
        if self.routing is None:
            return contextlib.nullcontext()
        return self.routing.forward([r.routing for r in rows], lengths, width)  # type: ignore[misc]

    @staticmethod
    def _out_cache(out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else out.past_key_values
