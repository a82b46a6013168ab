# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Where VECA's cores sit and look, block by block: core positions, core-to-patch attention maps, and a drawing.

`trace_cores` runs a VECA model once and returns, from the model's own outputs, where the cores sit in every block
(`all_core_coordinates`, asked for with `output_core_coordinates=True`) and the attention maps (`attentions`);
`core_positions_per_layer`, `core_attention_maps` and `draw_core_attention` build on it.

Shape legend: B batch, C active cores, L blocks, H heads, T = C + Hp * Wp tokens, Hp x Wp patch grid, k shown cores.
"""

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from torch import nn

from .features import _bare_model
from .reports import _pyplot


__all__ = [
    "CoreAttentionMaps",
    "CoreTrace",
    "core_attention_maps",
    "core_positions_per_layer",
    "draw_core_attention",
    "trace_cores",
]


@dataclass
class CoreTrace:
    r"""
    What `trace_cores` records in one forward pass.

    Args:
        outputs (`VecaModelOutput`): the model's output.
        core_positions (`torch.Tensor` of shape `(B, L, C, 2)`):
            Where the cores sit in each block, `(x, y)` in `[-1, 1]`: the model's `all_core_coordinates` (the
            `tanh`ed coordinates each block's RoPE used) stacked. Block 1's are the bank's (image-independent); the
            last equal `outputs.core_coordinates`.
        attentions (`tuple[torch.Tensor]`, *optional*): `outputs.attentions`, L x `(B, H, T, T)`.
        grid (`tuple[int, int]`): the patch grid `(Hp, Wp)`.
    """

    outputs: Any
    core_positions: torch.Tensor
    attentions: tuple[torch.Tensor, ...] | None
    grid: tuple[int, int]


def trace_cores(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None, output_attentions: bool = True
) -> CoreTrace:
    r"""
    Runs a VECA model once and returns where the cores sit in every block, and (optionally) the attention maps,
    both read from the model's outputs (`output_core_coordinates=True`, `output_attentions=True`).

    Args:
        model (`nn.Module`): a `VecaModel` (or a VECA head model holding one).
        pixel_values (`torch.FloatTensor` of shape `(B, 3, H, W)`): normalised images.
        num_core_tokens (`int`, *optional*): the budget.
        output_attentions (`bool`, *optional*, defaults to `True`): also return the block-sparse attention maps.
    """
    veca = _bare_model(model)
    if veca.config.model_type != "veca":
        raise ValueError(
            f"Core tracing needs a VECA model, got model_type={veca.config.model_type!r}; pass a VecaModel or a VECA "
            "head model."
        )
    outputs = veca(
        pixel_values,
        num_core_tokens=num_core_tokens,
        output_attentions=output_attentions,
        output_core_coordinates=True,
        return_dict=True,
    )
    positions = torch.stack(outputs.all_core_coordinates, dim=1)  # L x (B, C, 2) -> (B, L, C, 2)
    patch_size = veca.config.patch_size
    grid = (pixel_values.shape[2] // patch_size, pixel_values.shape[3] // patch_size)
    return CoreTrace(outputs, positions, outputs.attentions if output_attentions else None, grid)


def _single_image(pixel_values: torch.Tensor) -> torch.Tensor:
    if pixel_values.ndim == 3:
        pixel_values = pixel_values[None]
    if pixel_values.ndim != 4 or pixel_values.shape[0] != 1:
        raise ValueError(f"Expected one image (3, H, W) or (1, 3, H, W), got {tuple(pixel_values.shape)}.")
    return pixel_values


@torch.no_grad()
def core_positions_per_layer(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None
) -> torch.Tensor:
    r"""
    Where the cores sit in each block for one image: `(L, C, 2)` as `(x, y)` in `[-1, 1]`; the last row equals the
    model's `core_coordinates`.

    Args:
        model (`nn.Module`): a `VecaModel`.
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        num_core_tokens (`int`, *optional*): the budget.
    """
    return trace_cores(model, _single_image(pixel_values), num_core_tokens, output_attentions=False).core_positions[0]


@dataclass
class CoreAttentionMaps:
    r"""
    Core-to-token attention of one image, averaged over heads (from the model's own `attentions`).

    Args:
        patch_maps (`torch.Tensor` of shape `(L, k, Hp, Wp)`): attention of each shown core over the patches.
        core_weights (`torch.Tensor` of shape `(L, k, C)`): attention of each shown core over the cores.
            Per row, `patch_maps.sum((-2, -1)) + core_weights.sum(-1) == 1` (one softmax over all `C + N` tokens).
        core_positions (`torch.Tensor` of shape `(L, C, 2)`): see `core_positions_per_layer`.
        cores (`list[int]`): the shown cores (0-based).
        attentions (`tuple[torch.Tensor]`): the model's maps, L x `(1, H, T, T)`.
    """

    patch_maps: torch.Tensor
    core_weights: torch.Tensor
    core_positions: torch.Tensor
    cores: list[int]
    attentions: tuple[torch.Tensor, ...] = field(repr=False)


@torch.no_grad()
def core_attention_maps(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None, cores: Iterable[int] = range(4)
) -> CoreAttentionMaps:
    r"""
    Per block, the core-to-patch attention maps of the chosen cores for one image, averaged over heads.

    Args:
        model (`nn.Module`): a `VecaModel`.
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        num_core_tokens (`int`, *optional*): the budget `C`.
        cores (`Iterable[int]`, *optional*, defaults to `range(4)`): which cores (0-based, `< C`).

    Returns:
        `CoreAttentionMaps`, whose `patch_maps` is `(L, k, Hp, Wp)`.
    """
    trace = trace_cores(model, _single_image(pixel_values), num_core_tokens, output_attentions=True)
    num_cores = trace.core_positions.shape[2]
    cores = list(cores)
    if not cores or min(cores) < 0 or max(cores) >= num_cores:
        raise ValueError(f"cores must be indices in [0, {num_cores}), got {cores}.")
    rows = torch.stack([attention[0, :, cores].float().mean(0) for attention in trace.attentions])  # (L, k, T)
    return CoreAttentionMaps(
        patch_maps=rows[..., num_cores:].reshape(len(rows), len(cores), *trace.grid),
        core_weights=rows[..., :num_cores],
        core_positions=trace.core_positions[0],
        cores=cores,
        attentions=trace.attentions,
    )


def _to_pixels(positions: torch.Tensor, width: int, height: int) -> np.ndarray:
    """`(x, y)` in `[-1, 1]` (patch centres at `(i + 0.5) / n * 2 - 1`) -> pixel coordinates. `(..., 2)`."""
    positions = positions.detach().float().cpu().numpy()
    return np.stack([(positions[..., 0] + 1) / 2 * width, (positions[..., 1] + 1) / 2 * height], axis=-1)


def draw_core_attention(
    image: PIL.Image.Image, maps: CoreAttentionMaps, path: str | os.PathLike, title: str | None = None
) -> Path:
    r"""
    Draws `maps` over `image` and saves a PNG: a grid (rows = blocks, columns = the shown cores) of core-to-patch
    attention overlays (colours span each map's own range), each with the core's position (white cross) and the
    share of its attention that goes to patches; and a panel with every core's trajectory across the blocks
    (circle = block 1, triangle = last block).

    Args:
        image (`PIL.Image.Image`): the image the model saw (the crop, e.g. from `center_crop_resized`).
        maps (`CoreAttentionMaps`): from `core_attention_maps`.
        path (`str` or `os.PathLike`): the PNG to write.
        title (`str`, *optional*): a figure title.
    """
    plt = _pyplot()
    from matplotlib import patheffects

    num_layers, num_shown = maps.patch_maps.shape[:2]
    num_cores = maps.core_positions.shape[1]
    width, height = image.size
    pixels = _to_pixels(maps.core_positions, width, height)  # (L, C, 2)
    colours = plt.get_cmap("tab10")(np.arange(num_shown) % 10)
    cell, panel = 1.4, min(max(4.0, 1.4 * num_layers), 8.0)
    figure_size = (cell * num_shown + panel + 0.6, max(cell * num_layers, panel) + 0.6)
    figure = plt.figure(figsize=figure_size, layout="constrained")
    left, right = figure.subfigures(1, 2, width_ratios=[cell * num_shown + 0.3, panel + 0.3])
    axes = left.subplots(num_layers, num_shown, squeeze=False)
    extent = (0, width, height, 0)
    outline = [patheffects.withStroke(linewidth=3, foreground="black")]
    for layer in range(num_layers):
        for column, core in enumerate(maps.cores):
            axis = axes[layer, column]
            attention = maps.patch_maps[layer, column].float().cpu().numpy()
            axis.imshow(image, extent=extent)
            low, high = float(attention.min()), float(attention.max())  # per-map range: the number gives the mass
            axis.imshow(attention, extent=extent, cmap="inferno", alpha=0.7, vmin=low, vmax=max(high, low + 1e-12))
            axis.plot(*pixels[layer, core], "x", color="white", markersize=6, markeredgewidth=2, path_effects=outline)
            axis.text(0.03, 0.04, f"{attention.sum():.2f}", color="white", fontsize=6, transform=axis.transAxes,
                      bbox=dict(facecolor="black", alpha=0.5, pad=1, edgecolor="none"))  # fmt: skip
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_xlim(0, width)
            axis.set_ylim(height, 0)
            if layer == 0:
                axis.set_title(f"core {core + 1}", color=colours[column], fontsize=8)
            if column == 0:
                axis.set_ylabel(f"block {layer + 1}", fontsize=8)
    left.suptitle("core-to-patch attention (mean over heads)", fontsize=9)
    left.supxlabel("number: share of the core's attention on patches; x: the core", fontsize=7)
    axis = right.subplots()
    axis.imshow(image, extent=extent)
    shown = {core: colours[column] for column, core in enumerate(maps.cores)}
    for core in range(num_cores):
        track = pixels[:, core]  # (L, 2)
        colour = shown.get(core, (1.0, 1.0, 1.0, 0.8))
        size = 6 if core in shown else 4
        line_width = 2 if core in shown else 1
        axis.plot(track[:, 0], track[:, 1], "-", color=colour, linewidth=line_width, path_effects=outline)
        axis.plot(
            *track[0], "o", markerfacecolor="none", markeredgecolor=colour, markersize=size, path_effects=outline
        )
        axis.plot(*track[-1], "^", color=colour, markersize=size, path_effects=outline)
    axis.set_xlim(0, width)
    axis.set_ylim(height, 0)
    axis.set_xticks([])
    axis.set_yticks([])
    axis.set_title(f"all {num_cores} cores: block 1 (o) -> block {num_layers} (^)", fontsize=9)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)
