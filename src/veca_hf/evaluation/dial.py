# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What turning the budget dial does to one image, as plain functions: the pictures of a demo, each testable alone.

- `DialImage.prepare`: the image at a resolution (aspect kept, sides multiples of the patch size), bounded in size.
- `patch_features_by_budget` and `patch_colours`: the patch features at every budget, coloured by one PCA basis
  fitted on all of them, so that a colour means the same at every budget.
- `patch_at` and `similarity_map`: the patch under a click, and the cosine of every patch feature with its feature.
- `core_pixels` and `core_attention`: where the cores sit over the image in a block, and one core's attention over
  the patches.
- `attention_cost`: attention FLOPs of VECA at a budget against a dense ViT of the same size, across resolutions.

Shape legend: Hp x Wp patch grid, D width, C budget, L blocks, h x w pixels.
"""

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F

from ..flops import attention_block_flops, num_patches_for
from .core_tracing import core_attention_maps, core_positions_per_layer
from .feature_maps import image_at_resolution, project_to_rgb
from .features import extract_features


__all__ = [
    "DialImage",
    "attention_cost",
    "core_attention",
    "core_pixels",
    "patch_at",
    "patch_colours",
    "patch_features_by_budget",
    "similarity_map",
    "timed_forward",
]


@dataclass
class DialImage:
    """One image ready for the model: `image` (RGB, `w x h`, what is drawn) and `pixel_values` `(1, 3, h, w)`."""

    image: PIL.Image.Image
    pixel_values: torch.Tensor
    patch_size: int
    resized_from: tuple[int, int] | None  # the upload's `(w, h)` when it was larger than `max_side`

    @classmethod
    def prepare(cls, image, resolution: int, patch_size: int, max_side: int = 1024) -> "DialImage":
        """`image` (PIL or an `(h, w, 3)` uint8 array) at short side `resolution`, its long side at most `max_side`.

        Raises:
            `ValueError`: for anything that is not an image, or a resolution that is not a positive multiple of the
            patch size.
        """
        if isinstance(image, np.ndarray):
            if image.ndim != 3 or image.shape[-1] not in (3, 4) or image.dtype != np.uint8:
                raise ValueError(f"Expected an RGB image (h, w, 3) of uint8, got {image.shape} {image.dtype}.")
            image = PIL.Image.fromarray(image)
        if not isinstance(image, PIL.Image.Image):
            raise ValueError(f"Expected an image, got {type(image).__name__}: upload a JPEG, PNG or WebP file.")
        if resolution <= 0 or resolution % patch_size:
            raise ValueError(f"The resolution {resolution} is not a positive multiple of the patch size {patch_size}.")
        image = image.convert("RGB")
        resized_from = image.size if max(image.size) > max_side else None
        resized, pixel_values = image_at_resolution(image, resolution, patch_size, max_side=max_side)
        return cls(resized, pixel_values, patch_size, resized_from)

    @property
    def grid(self) -> tuple[int, int]:
        """The patch grid `(Hp, Wp)`."""
        return self.pixel_values.shape[2] // self.patch_size, self.pixel_values.shape[3] // self.patch_size


@torch.no_grad()
def patch_features_by_budget(model, pixel_values: torch.Tensor, budgets: Sequence[int]) -> dict[int, torch.Tensor]:
    """`{C: (Hp, Wp, D)}`: the patch features of one image at every budget."""
    return {budget: extract_features(model, pixel_values, budget)[1][0] for budget in budgets}


def patch_colours(features_by_budget: dict[int, torch.Tensor]) -> dict[int, np.ndarray]:
    """`{C: (Hp, Wp, 3) uint8}`: the patch features as RGB, through one PCA basis fitted on every budget's."""
    budgets = list(features_by_budget)
    colours, _ = project_to_rgb([features_by_budget[budget] for budget in budgets], method="pca")
    return {
        budget: (colour.numpy() * 255).round().astype(np.uint8)
        for budget, colour in zip(budgets, colours, strict=True)
    }


def patch_at(x: float, y: float, image_size: tuple[int, int], grid: tuple[int, int]) -> tuple[int, int]:
    """The `(row, col)` of the patch under pixel `(x, y)` of a `(w, h)` picture of a `(Hp, Wp)` grid."""
    width, height = image_size
    if not (0 <= x < width and 0 <= y < height):
        raise ValueError(f"The point ({x}, {y}) is outside the {width} x {height} image.")
    return min(int(y * grid[0] / height), grid[0] - 1), min(int(x * grid[1] / width), grid[1] - 1)


def similarity_map(patch_features: torch.Tensor, row: int, col: int) -> torch.Tensor:
    """`(Hp, Wp)`: the cosine of every patch feature with the one at `(row, col)` (1 there)."""
    query = patch_features[row, col].float()
    return F.cosine_similarity(patch_features.float(), query.expand_as(patch_features), dim=-1)


def core_pixels(model, dial_image: DialImage, budget: int, block: int) -> np.ndarray:
    """`(C, 2)`: where the cores sit over the drawn image in `block` (0-based), as `(x, y)` pixels."""
    positions = core_positions_per_layer(model, dial_image.pixel_values, budget)  # (L, C, 2) in [-1, 1]
    if not 0 <= block < len(positions):
        raise ValueError(f"block must be in [0, {len(positions)}), got {block}.")
    width, height = dial_image.image.size
    xy = (positions[block].float().numpy() + 1) / 2  # [0, 1]
    return xy * np.array([width, height], dtype=np.float32)


def core_attention(model, dial_image: DialImage, budget: int, block: int, core: int) -> torch.Tensor:
    """`(Hp, Wp)`: core `core`'s attention over the patches in `block` (0-based), averaged over heads."""
    maps = core_attention_maps(model, dial_image.pixel_values, budget, cores=[core])
    if not 0 <= block < len(maps.patch_maps):
        raise ValueError(f"block must be in [0, {len(maps.patch_maps)}), got {block}.")
    return maps.patch_maps[block, 0]


def attention_cost(config, budget: int, resolutions: Sequence[int]) -> list[dict]:
    """Per square resolution: the FLOPs of all attention blocks (projections and attention, `attention_block_flops`)
    of VECA at `budget` and of a dense ViT of the same width and depth with one CLS token, and their ratio."""
    rows = []
    for resolution in resolutions:
        patches = num_patches_for(resolution, resolution, config.patch_size)
        veca = config.num_hidden_layers * attention_block_flops(config.hidden_size, patches, num_cores=budget)
        dense = config.num_hidden_layers * attention_block_flops(config.hidden_size, patches, num_prefix_tokens=1)
        rows.append({"resolution": resolution, "veca_flops": veca, "dense_flops": dense, "ratio": veca / dense})
    return rows


@torch.no_grad()
def timed_forward(model, pixel_values: torch.Tensor, budget: int) -> float:
    """Seconds of one forward pass at `budget` (after nothing else: what the user waits for)."""
    start = time.perf_counter()
    model(pixel_values, num_core_tokens=budget)
    return time.perf_counter() - start
