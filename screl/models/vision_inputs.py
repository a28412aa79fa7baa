"""A vision-language prompt's processed images (torch only: the rollout protocol imports it without transformers)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class VisionInputs:
    """One prompt's processed images: what the model's vision tower reads."""

    pixel_values: Tensor
    """``[patches, channels x temporal_patch x patch x patch]`` (float32), the images' patches in order."""
    image_grid_thw: Tensor
    """``[images, 3]`` (int64): each image's patch grid (temporal, height, width)."""

    def __post_init__(self) -> None:
        grid = self.image_grid_thw
        if grid.ndim != 2 or grid.shape[1] != 3:
            raise ValueError(f"VisionInputs: image_grid_thw has shape {tuple(grid.shape)}, expected [images, 3]")
        if int(grid.prod(-1).sum()) != self.pixel_values.shape[0]:
            raise ValueError(f"VisionInputs: the grids hold {int(grid.prod(-1).sum())} patches, pixel_values "
                             f"{self.pixel_values.shape[0]}")

    @staticmethod
    def concat(inputs: Sequence[VisionInputs]) -> VisionInputs:
        """The inputs of several prompts as one forward pass takes them (images in row order)."""
        return VisionInputs(torch.cat([v.pixel_values for v in inputs]), torch.cat([v.image_grid_thw for v in inputs]))

    def nbytes(self) -> int:
        return int(self.pixel_values.numel() * self.pixel_values.element_size()
                   + self.image_grid_thw.numel() * self.image_grid_thw.element_size())
