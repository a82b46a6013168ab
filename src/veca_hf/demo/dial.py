# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What turning the budget dial does to one image, as plain functions: the pictures of a demo, each testable alone.

- `DialImage.prepare`: the image at a resolution (aspect kept, sides multiples of the patch size), bounded in size;
  a file larger than `MAX_PIXELS` is refused from its header, before it is decoded.
- `patch_features_by_budget` and `patch_colours`: the patch features at every budget, coloured by one PCA basis
  fitted on all of them, so that a colour means the same at every budget.
- `patch_at` and `similarity_map`: the patch under a click, and the cosine of every patch feature with its feature.
- `core_pixels` and `core_attention`: where the cores sit over the image in a block, and one core's attention over
  the patches (that one row alone: no block's `(T, T)` map is built).
- `attention_cost`: attention FLOPs of VECA at a budget against a dense ViT of the same size, across resolutions.
- `patch_picture`, `heatmap`, `draw_cores`, `cost_plot`: those values drawn over (or beside) the image.
- `dial`: everything above for one image at one budget, as the demo app (`examples/app.py`) shows it.

Shape legend: Hp x Wp patch grid, D width, C budget, L blocks, h x w pixels.
"""

import io
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import PIL.Image
import PIL.ImageDraw
import torch
import torch.nn.functional as F

from ..evaluation.core_tracing import core_attention_in_block, core_positions_per_layer
from ..evaluation.feature_maps import image_at_resolution, project_to_rgb
from ..evaluation.features import extract_features
from ..flops import attention_block_flops, num_patches_for


__all__ = [
    "MAX_PIXELS",
    "DialImage",
    "DialOutputs",
    "cost_plot",
    "dial",
    "draw_cores",
    "heatmap",
    "patch_picture",
    "attention_cost",
    "core_attention",
    "core_pixels",
    "patch_at",
    "patch_colours",
    "patch_features_by_budget",
    "similarity_map",
    "timed_forward",
]


MAX_PIXELS = 50_000_000  # a 48-megapixel phone photo passes; its RGB decode is 150 MB


@dataclass
class DialImage:
    """One image ready for the model: `image` (RGB, `w x h`, what is drawn) and `pixel_values` `(1, 3, h, w)`."""

    image: PIL.Image.Image
    pixel_values: torch.Tensor
    patch_size: int
    resized_from: tuple[int, int] | None  # the upload's `(w, h)` when it was larger than `max_side`

    @classmethod
    def prepare(
        cls, image, resolution: int, patch_size: int, max_side: int = 1024, max_pixels: int = MAX_PIXELS
    ) -> "DialImage":
        """`image` (a file path, PIL or an `(h, w, 3)` uint8 array) at short side `resolution`, its long side at most
        `max_side`. A file, or a PIL image not yet loaded, is checked against `max_pixels` from its header, before its
        pixels are decoded: a small compressed file can hold a huge image.

        Raises:
            `ValueError`: for anything that is not an image, an image of more than `max_pixels` pixels, or a
            resolution that is not a positive multiple of the patch size.
        """
        if isinstance(image, (str, os.PathLike)):
            try:
                opened = PIL.Image.open(image)  # reads the header only
            except PIL.Image.DecompressionBombError as error:  # PIL's own limit, checked on open
                raise ValueError(f"{error} Upload an image of at most {max_pixels / 1e6:g} megapixels.") from None
            except OSError:
                raise ValueError(
                    f"{os.fspath(image)!r} is not an image file PIL can read: upload a JPEG, PNG or WebP file."
                ) from None
            with opened:
                return cls.prepare(opened, resolution, patch_size, max_side, max_pixels)
        if isinstance(image, np.ndarray):
            if image.ndim != 3 or image.shape[-1] not in (3, 4) or image.dtype != np.uint8:
                raise ValueError(f"Expected an RGB image (h, w, 3) of uint8, got {image.shape} {image.dtype}.")
            image = PIL.Image.fromarray(image)
        if not isinstance(image, PIL.Image.Image):
            raise ValueError(f"Expected an image, got {type(image).__name__}: upload a JPEG, PNG or WebP file.")
        width, height = image.size
        if width * height > max_pixels:
            raise ValueError(
                f"The image is {width} x {height} pixels ({width * height / 1e6:g} megapixels), more than the limit "
                f"of {max_pixels / 1e6:g} megapixels: resize it (it is shown at {max_side} px at most) and upload it "
                "again."
            )
        if resolution <= 0 or resolution % patch_size:
            raise ValueError(f"The resolution {resolution} is not a positive multiple of the patch size {patch_size}.")
        image = image.convert("RGB")
        max_side = max(patch_size, max_side // patch_size * patch_size)  # a side the model can take
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
    """`(Hp, Wp)`: core `core`'s attention over the patches in `block` (0-based), averaged over heads. Only that row
    is computed (`core_attention_in_block`), so memory grows with the number of patches, not its square."""
    row = core_attention_in_block(model, dial_image.pixel_values, budget, block, core).mean(0)  # (C + N,)
    return row[budget:].reshape(dial_image.grid)


def attention_cost(config, budget: int, resolutions: Sequence[int]) -> list[dict]:
    """Per square resolution: the FLOPs of all attention blocks (projections and attention, `attention_block_flops`)
    of VECA at `budget` and of a dense ViT of the same width and depth with one CLS token, and their ratio."""
    rows = []
    for resolution in resolutions:
        patches = num_patches_for(resolution, resolution, config.patch_size)
        veca = config.num_hidden_layers * attention_block_flops(config.hidden_size, patches, num_core_tokens=budget)
        dense = config.num_hidden_layers * attention_block_flops(config.hidden_size, patches, num_prefix_tokens=1)
        rows.append({"resolution": resolution, "veca_flops": veca, "dense_flops": dense, "ratio": veca / dense})
    return rows


@torch.no_grad()
def timed_forward(model, pixel_values: torch.Tensor, budget: int) -> float:
    """Seconds of one forward pass at `budget` (after nothing else: what the user waits for)."""
    start = time.perf_counter()
    model(pixel_values, num_core_tokens=budget)
    return time.perf_counter() - start


def patch_picture(colours: np.ndarray, size: tuple[int, int]) -> PIL.Image.Image:
    """`(Hp, Wp, 3)` uint8 patch colours as a `size` `(w, h)` picture, one flat square per patch."""
    return PIL.Image.fromarray(colours).resize(size, PIL.Image.Resampling.NEAREST)


def heatmap(
    values: torch.Tensor, image: PIL.Image.Image, value_range: tuple[float, float] | None = None, alpha: float = 0.65
) -> PIL.Image.Image:
    """`(Hp, Wp)` values coloured (matplotlib's `magma`, low dark) and laid over `image`, one square per patch.
    `value_range` fixes what the colours span (e.g. `(-1, 1)` for cosines); by default the values' own min-max."""
    from matplotlib import colormaps

    values = values.detach().float().cpu().numpy()
    low, high = value_range if value_range is not None else (float(values.min()), float(values.max()))
    scaled = np.clip((values - low) / max(high - low, 1e-12), 0.0, 1.0)
    colours = (colormaps["magma"](scaled)[..., :3] * 255).round().astype(np.uint8)  # (Hp, Wp, 3)
    return PIL.Image.blend(image.convert("RGB"), patch_picture(colours, image.size), alpha)


def draw_cores(image: PIL.Image.Image, xy: np.ndarray, chosen: int | None = None) -> PIL.Image.Image:
    """`image` with a dot on each core (`(C, 2)` pixels, `core_pixels`); the `chosen` one larger and ringed."""
    drawn = image.convert("RGB").copy()
    draw = PIL.ImageDraw.Draw(drawn)
    radius = max(2.0, min(drawn.size) / 80)
    for index, (x, y) in enumerate(xy):
        r = radius * 2 if index == chosen else radius
        draw.ellipse((x - r, y - r, x + r, y + r), fill=(0, 255, 255), outline=(0, 0, 0))
        if index == chosen:
            draw.ellipse((x - 2 * r, y - 2 * r, x + 2 * r, y + 2 * r), outline=(255, 255, 0), width=2)
    return drawn


def cost_plot(rows: list[dict], resolution: int) -> PIL.Image.Image:
    """A small plot of attention GFLOPs against resolution (`attention_cost` rows), VECA and dense, this
    `resolution` marked."""
    from matplotlib.figure import Figure  # drawn to memory, no pyplot: the process's backend stays untouched

    figure = Figure(figsize=(4.2, 2.8), dpi=100)
    axes = figure.add_subplot()
    sides = [row["resolution"] for row in rows]
    axes.plot(sides, [row["dense_flops"] / 1e9 for row in rows], "o-", label="dense ViT", color="tab:gray")
    axes.plot(sides, [row["veca_flops"] / 1e9 for row in rows], "o-", label="VECA", color="tab:blue")
    here = next((row for row in rows if row["resolution"] == resolution), None)
    if here is not None:
        axes.plot([resolution], [here["veca_flops"] / 1e9], "*", markersize=14, color="tab:orange", label="this image")
    axes.set_xlabel("resolution (px, square)")
    axes.set_ylabel("attention GFLOPs")
    axes.set_yscale("log")
    axes.legend(fontsize=8)
    figure.tight_layout()
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png")
    return PIL.Image.open(io.BytesIO(buffer.getvalue())).convert("RGB")


@dataclass
class DialOutputs:
    """What one image looks like at one budget: the pictures (RGB, the size of the drawn image, except `cost`) and
    the numbers the demo prints. The `teacher_*` pictures are `None` without a teacher; `policy_budget` is the
    budget the model's fitted policy (`config.adaptive_budget`) picks for the image, `None` without one."""

    patches: PIL.Image.Image
    similarity: PIL.Image.Image
    cores: PIL.Image.Image
    core_attention: PIL.Image.Image
    cost: PIL.Image.Image
    seconds: float
    attention_flops: int
    dense_attention_flops: int
    clicked_patch: tuple[int, int]
    teacher_patches: PIL.Image.Image | None = None
    teacher_similarity: PIL.Image.Image | None = None
    policy_budget: int | None = None
    notes: list[str] = field(default_factory=list)


def dial(
    model,
    image,
    budget: int,
    resolution: int,
    block: int = -1,
    core: int = 0,
    click: tuple[float, float] | None = None,
    teacher=None,
    max_side: int = 1024,
    cost_resolutions: Sequence[int] = (224, 448, 672, 896, 1024),
    max_pixels: int = MAX_PIXELS,
) -> DialOutputs:
    """Every picture of the demo for `image` at `budget`: patch colours (one PCA basis over all of the model's
    budgets), the similarity map to the patch under `click` (`(x, y)` pixels of the drawn image; its centre by
    default), the cores over the image in `block` (negative counts from the end), core `core`'s attention there,
    this forward's wall time and the attention cost against a dense ViT. With a `teacher` (DINOv2 / DINOv3), its
    colours and similarity map beside VECA's, at the same image size rounded to its own patch size. `image` may be a
    file path: one of more than `max_pixels` pixels is refused before it is decoded.

    Raises:
        `ValueError`: for a bad image, resolution, budget, block, core or click, each naming the fix.
    """
    config = model.config
    budget = config.check_budget(budget, name="budget")
    dial_image = DialImage.prepare(image, resolution, config.patch_size, max_side=max_side, max_pixels=max_pixels)
    notes = []
    width, height = dial_image.image.size
    if min(width, height) < resolution - config.patch_size:  # the long side was bounded, the short one shrank
        notes.append(f"At {resolution} px this image's long side would pass {max_side} px: shown at {width} x "
                     f"{height} instead.")  # fmt: skip
    blocks = config.num_hidden_layers
    if not -blocks <= block < blocks:
        raise ValueError(f"block must be in [{-blocks}, {blocks}), got {block}.")
    block %= blocks
    if not 0 <= core < budget:
        raise ValueError(f"core must be one of the {budget} active cores (0 to {budget - 1}), got {core}.")
    x, y = click if click is not None else (width / 2, height / 2)
    row, col = patch_at(x, y, dial_image.image.size, dial_image.grid)

    seconds = timed_forward(model, dial_image.pixel_values, budget)
    features = patch_features_by_budget(model, dial_image.pixel_values, config.budgets)
    colours = patch_colours(features)[budget]
    similarity = similarity_map(features[budget], row, col)
    sides = {config.patch_size * max(1, side // config.patch_size) for side in cost_resolutions}  # the model's sides
    cost = attention_cost(config, budget, sorted({*sides, resolution}))
    here = next(entry for entry in cost if entry["resolution"] == resolution)
    outputs = DialOutputs(
        patches=patch_picture(colours, dial_image.image.size),
        similarity=heatmap(similarity, dial_image.image, value_range=(-1.0, 1.0)),
        cores=draw_cores(dial_image.image, core_pixels(model, dial_image, budget, block), chosen=core),
        core_attention=heatmap(core_attention(model, dial_image, budget, block, core), dial_image.image),
        cost=cost_plot(cost, resolution),
        seconds=seconds,
        attention_flops=here["veca_flops"],
        dense_attention_flops=here["dense_flops"],
        clicked_patch=(row, col),
        notes=notes,
    )
    if config.adaptive_budget is not None:  # the budget `num_core_tokens="auto"` gives this image
        with torch.inference_mode():
            picked = model(dial_image.pixel_values, num_core_tokens="auto").core_mask
        outputs.policy_budget = int(picked.sum())
    if teacher is not None:
        teacher_patch = teacher.config.patch_size
        side = max(teacher_patch, round(resolution / teacher_patch) * teacher_patch)
        teacher_image = DialImage.prepare(dial_image.image, side, teacher_patch, max_side=max_side)
        _, teacher_features = extract_features(teacher, teacher_image.pixel_values)
        teacher_colours, _ = project_to_rgb([teacher_features[0]], method="pca")
        teacher_colours = (teacher_colours[0].numpy() * 255).round().astype(np.uint8)
        t_row, t_col = patch_at(x * teacher_image.image.size[0] / width, y * teacher_image.image.size[1] / height,
                                teacher_image.image.size, teacher_image.grid)  # fmt: skip
        outputs.teacher_patches = patch_picture(teacher_colours, dial_image.image.size)
        teacher_similarity = similarity_map(teacher_features[0], t_row, t_col)
        outputs.teacher_similarity = heatmap(teacher_similarity, teacher_image.image, value_range=(-1.0, 1.0)).resize(
            dial_image.image.size, PIL.Image.Resampling.NEAREST
        )
    return outputs
