"""The trainer's side of a vision-language policy: the same images and rotary positions the engine used.

A chunk of multimodal rows carries each row's processed images (``pixel_values``, ``image_grid_thw``:
:data:`screl.rollout.rows.VISION_SCHEMA`). The forward that recomputes the rows' logprobs takes them back in row order
with the multimodal rotary positions of the right-padded rows (:func:`screl.models.vision.mrope_positions`), so every
token sees the image features and positions it had in the engine's left-padded batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from screl.models.vision import is_vision_model, mrope_positions
from screl.rollout.rows import vision_of_rows


def vision_forward_inputs(model: torch.nn.Module, batch: dict[str, Any], sl: slice) -> dict[str, Tensor]:
    """The extra forward inputs of rows ``sl`` (empty for a text policy): position ids, pixel values, grids."""
    if not is_vision_model(model):
        return {}
    if "pixel_values" not in batch:
        raise ValueError(f"{type(model).__name__} is a vision-language policy and the chunk's rows carry no images "
                         "(rows written for a text policy): train it on a task whose prompts have images")
    ids, attention = batch["input_ids"][sl], batch["attention_mask"][sl]
    device = ids.device
    vision = vision_of_rows(batch["pixel_values"][sl], batch["image_grid_thw"][sl])
    grid = vision.image_grid_thw.to(device)
    positions, _ = mrope_positions(model, ids, attention, grid if grid.numel() else None)  # type: ignore[arg-type]
    if not grid.numel():
        return {"position_ids": positions}
    return {"position_ids": positions, "pixel_values": vision.pixel_values.to(device), "image_grid_thw": grid}
