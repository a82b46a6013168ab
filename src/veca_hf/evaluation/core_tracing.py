# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Where VECA's cores sit and look, block by block: core positions, core-to-patch attention maps, and a drawing.

`trace_cores` runs a VECA model once and returns, from the model's own outputs, where the cores sit in every block
(`all_core_positions`, asked for with `output_core_positions=True`) and the attention maps (`attentions`);
`core_positions_per_layer`, `core_attention_maps` and `draw_core_attention` build on it. `core_attention_in_block`
is one core's row of one block's map, computed alone in `O(T)` memory (for large images). The paper's core-attention
view goes the other way: `patch_core_attention` is each patch's attention over the cores (the patches' call),
`patch_core_attention_pictures` colours it with one projection per budget across blocks, and
`draw_patch_core_attention` draws it.

Shape legend: B batch, C active cores, L blocks, H heads, T = C + Hp * Wp tokens, Hp x Wp patch grid, k shown cores.
"""

import math
import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from torch import nn

from ..model.positions_veca import apply_rotary_pos_emb
from .feature_maps import project_to_rgb, resolve_projection
from .features import backbone_of


__all__ = [
    "CoreAttentionMaps",
    "CoreTrace",
    "PatchCoreAttention",
    "core_attention_in_block",
    "core_attention_maps",
    "core_positions_per_layer",
    "draw_core_attention",
    "draw_patch_core_attention",
    "patch_core_attention",
    "patch_core_attention_pictures",
    "patch_core_attention_summary",
    "trace_cores",
]


@dataclass
class CoreTrace:
    r"""
    What `trace_cores` records in one forward pass.

    Args:
        outputs (`VecaModelOutput`): the model's output.
        core_positions (`torch.Tensor` of shape `(B, L, C, 2)`):
            Where the cores sit in each block, `(x, y)` in `[-1, 1]`: the model's `all_core_positions` (the
            `tanh`ed coordinates each block's RoPE used) stacked. Block 1's are the bank's (image-independent); the
            last equal `outputs.core_positions`.
        attentions (`tuple[torch.Tensor]`, *optional*): `outputs.attentions`, L x `(B, H, T, T)`.
        grid (`tuple[int, int]`): the patch grid `(Hp, Wp)`.
    """

    outputs: Any
    core_positions: torch.Tensor
    attentions: tuple[torch.Tensor, ...] | None
    grid: tuple[int, int]


def _veca(model: nn.Module) -> nn.Module:
    veca = backbone_of(model)
    if veca.config.model_type != "veca":
        raise ValueError(
            f"Core tracing needs a VECA model, got model_type={veca.config.model_type!r}; pass a VecaModel or a VECA "
            "head model."
        )
    return veca


def trace_cores(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None, output_attentions: bool = True
) -> CoreTrace:
    r"""
    Runs a VECA model once and returns where the cores sit in every block, and (optionally) the attention maps,
    both read from the model's outputs (`output_core_positions=True`, `output_attentions=True`).

    Args:
        model (`nn.Module`): a `VecaModel` (or a VECA head model holding one).
        pixel_values (`torch.FloatTensor` of shape `(B, 3, H, W)`): normalised images.
        num_core_tokens (`int`, *optional*): the budget.
        output_attentions (`bool`, *optional*, defaults to `True`): also return the block-sparse attention maps.
    """
    veca = _veca(model)
    outputs = veca(
        pixel_values,
        num_core_tokens=num_core_tokens,
        output_attentions=output_attentions,
        output_core_positions=True,
        return_dict=True,
    )
    positions = torch.stack(outputs.all_core_positions, dim=1)  # L x (B, C, 2) -> (B, L, C, 2)
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
    model's `core_positions`.

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


class _BlockReached(Exception):
    """Ends a forward pass once the watched block's attention has its inputs: the blocks after it are not needed."""


@torch.no_grad()
def core_attention_in_block(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None, block: int = -1, core: int = 0
) -> torch.Tensor:
    r"""
    One core's attention over all `C + N` tokens in one block, per head, for one image: row `core` of that block's
    `output_attentions` map, computed alone. The model runs up to that block only and the core's query meets the
    block's keys (with the block's RoPE), so memory grows with `T`, not `T^2`: the full maps of VECA-B at 1024 px
    are about 0.8 GB per block.

    Args:
        model (`nn.Module`): a `VecaModel` (or a VECA head model holding one).
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        num_core_tokens (`int`, *optional*): the budget `C`.
        block (`int`, *optional*, defaults to -1): the block, 0-based; negative counts from the end.
        core (`int`, *optional*, defaults to 0): the core, 0-based, `< C`.

    Returns:
        `torch.Tensor` of shape `(H, C + N)`, float32: cores first, then the patches row by row; each row sums to 1.
    """
    veca = _veca(model)
    pixel_values = _single_image(pixel_values)
    num_blocks = len(veca.encoder.layer)
    if not -num_blocks <= block < num_blocks:
        raise ValueError(f"block must be in [{-num_blocks}, {num_blocks}), got {block}.")
    num_cores = veca.resolve_num_core_tokens(num_core_tokens)
    if not 0 <= core < num_cores:
        raise ValueError(f"core must be one of the {num_cores} active cores (0 to {num_cores - 1}), got {core}.")
    attention = veca.encoder.layer[block].attention
    inputs = []

    def capture(module, args):
        inputs.extend(args)
        raise _BlockReached

    handle = attention.register_forward_pre_hook(capture)
    try:
        veca(pixel_values, num_core_tokens=num_cores)
    except _BlockReached:
        pass
    finally:
        handle.remove()
    hidden_states, (core_cos, core_sin), (patch_cos, patch_sin) = inputs[:3]  # (1, T, D) normed, then RoPE
    width, num_heads, head_dim = veca.config.hidden_size, attention.num_heads, attention.head_dim
    weight, bias = attention.qkv_proj.weight, attention.qkv_proj.bias  # output rows: q, k, v, each (H, Hd)
    query = nn.functional.linear(hidden_states[:, core], weight[:width], bias[:width])  # (1, D)
    key = nn.functional.linear(hidden_states, weight[width : 2 * width], bias[width : 2 * width])  # (1, T, D)
    query = query.view(1, num_heads, 1, head_dim)
    key = key.view(1, -1, num_heads, head_dim).transpose(1, 2)  # (1, H, T, Hd)
    # as the block does: the core rotates by its own position; keys by the cores' then the patches' positions
    core_cos, core_sin = core_cos.unsqueeze(-3), core_sin.unsqueeze(-3)  # (1, 1, C, Hd)
    query = apply_rotary_pos_emb(query, core_cos[..., core : core + 1, :], core_sin[..., core : core + 1, :])
    key = apply_rotary_pos_emb(key, (core_cos, patch_cos.unsqueeze(-3)), (core_sin, patch_sin.unsqueeze(-3)))
    scores = torch.matmul(query, key.transpose(2, 3)) * attention.scaling  # (1, H, 1, T)
    return scores.softmax(dim=-1, dtype=torch.float32)[0, :, 0]  # (H, T)


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
    from matplotlib import colormaps, patheffects
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure state

    num_layers, num_shown = maps.patch_maps.shape[:2]
    num_cores = maps.core_positions.shape[1]
    width, height = image.size
    pixels = _to_pixels(maps.core_positions, width, height)  # (L, C, 2)
    colours = colormaps["tab10"](np.arange(num_shown) % 10)
    cell, panel = 1.4, min(max(4.0, 1.4 * num_layers), 8.0)
    figure_size = (cell * num_shown + panel + 0.6, max(cell * num_layers, panel) + 0.6)
    figure = Figure(figsize=figure_size, layout="constrained")
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
    return Path(path)


# ----------------------------------------------------------------------------------------------------------------
# The paper's core-attention view: each patch's attention over the cores
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def patch_core_attention(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None
) -> torch.Tensor:
    r"""
    Each patch's attention profile over the active cores, per block, for one image: the patches' call (patches
    attend to the cores only), read from the model's own `attentions` and averaged over heads. Every profile sums
    to 1 over the `C` cores.

    Args:
        model (`nn.Module`): a `VecaModel` (or a VECA head model).
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        num_core_tokens (`int`, *optional*): the budget `C`.

    Returns:
        `torch.Tensor` of shape `(L, Hp, Wp, C)`, float32.
    """
    trace = trace_cores(model, _single_image(pixel_values), num_core_tokens, output_attentions=True)
    num_cores = trace.core_positions.shape[2]
    # (1, H, T, T): rows C.. are the patches' queries; their keys are the C cores (patch -> patch entries are 0)
    profiles = [attention[0, :, num_cores:, :num_cores].float().mean(0) for attention in trace.attentions]  # (N, C)
    return torch.stack(profiles).reshape(len(profiles), *trace.grid, num_cores)


@dataclass
class PatchCoreAttention:
    r"""
    The paper's core-attention view of one image: per budget, every block's patch-to-core attention profiles and
    their colours (one projection per budget, fitted across the blocks).

    Args:
        profiles (`dict[int, torch.Tensor]`): budget `C` -> `(L, Hp, Wp, C)`, see `patch_core_attention`.
        colours (`dict[int, torch.Tensor]`): budget -> `(L, Hp, Wp, 3)` in `[0, 1]`.
        projection (`str`): `"umap"` or `"pca"`.
    """

    profiles: dict[int, torch.Tensor]
    colours: dict[int, torch.Tensor]
    projection: str

    @property
    def grid(self) -> tuple[int, int]:
        """`(Hp, Wp)`."""
        return tuple(next(iter(self.profiles.values())).shape[1:3])


@torch.no_grad()
def patch_core_attention_pictures(
    model: nn.Module,
    pixel_values: torch.Tensor,
    budgets: Iterable[int],
    projection: str = "auto",
    seed: int = 0,
) -> PatchCoreAttention:
    r"""
    `patch_core_attention` at each budget, coloured with one joint projection to RGB per budget across the blocks
    (`project_to_rgb`: UMAP when `umap-learn` is installed, else PCA), so that colours compare across depth: where
    early blocks' colours follow position (cores attend around where they sit) and later ones follow objects, the
    cores went from isotropic to semantic.

    Args:
        model (`nn.Module`): a `VecaModel`.
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        budgets (`Iterable[int]`): the budgets (rows of the drawing).
        projection (`str`, *optional*, defaults to `"auto"`): `"umap"`, `"pca"` or `"auto"`.
        seed (`int`, *optional*, defaults to 0): UMAP's seed.
    """
    budgets = list(budgets)
    if not budgets:
        raise ValueError("patch_core_attention_pictures needs at least one budget.")
    projection = resolve_projection(projection)  # fail (or log the fallback) before the model runs
    profiles, colours = {}, {}
    for budget in budgets:
        profiles[budget] = patch_core_attention(model, pixel_values, budget)  # (L, Hp, Wp, C)
        (colours[budget],), projection = project_to_rgb([profiles[budget]], projection, seed=seed)
    return PatchCoreAttention(profiles, colours, projection)


def _normalised_entropy(profiles: torch.Tensor) -> torch.Tensor:
    """Entropy of each profile over the cores divided by `log C` (1 = uniform): `(..., C)` -> `(...)`."""
    entropy = -(profiles * profiles.clamp_min(1e-12).log()).sum(-1)
    return entropy / math.log(profiles.shape[-1]) if profiles.shape[-1] > 1 else torch.zeros_like(entropy)


def patch_core_attention_summary(pictures: PatchCoreAttention) -> dict[str, Any]:
    """The JSON of the core-attention view: shapes, the projection, and per budget and block the mean normalised
    entropy of the profiles (1 = every patch spreads its attention evenly over the cores) and the mean largest
    weight."""
    return {
        "projection": pictures.projection,
        "grid": list(pictures.grid),
        "budgets": {
            str(budget): {
                "profiles_shape": list(profiles.shape),
                "mean_normalised_entropy": [float(value) for value in _normalised_entropy(profiles).mean((1, 2))],
                "mean_max_weight": [float(value) for value in profiles.amax(-1).mean((1, 2))],
            }
            for budget, profiles in pictures.profiles.items()
        },
    }


def draw_patch_core_attention(
    image: PIL.Image.Image,
    pictures: PatchCoreAttention,
    path: str | os.PathLike,
    title: str | None = None,
    dpi: int = 110,
) -> Path:
    r"""
    Draws the core-attention view and saves a PNG: rows = budgets, columns = the image, then blocks 1..L; each panel
    is the patch grid coloured by the budget's joint projection of the patches' attention over the cores (the
    number: the block's mean normalised entropy, 1 = uniform over the cores).

    Args:
        image (`PIL.Image.Image`): the image the model saw (the crop, e.g. from `center_crop_resized`).
        pictures (`PatchCoreAttention`): from `patch_core_attention_pictures`.
        path (`str` or `os.PathLike`): the PNG to write.
        title (`str`, *optional*): a figure title.
        dpi (`int`, *optional*, defaults to 110): the PNG's resolution.
    """
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure state

    budgets = list(pictures.profiles)
    num_layers = next(iter(pictures.profiles.values())).shape[0]
    width, height = image.size
    extent = (0, width, height, 0)
    cell = 1.4
    figure = Figure(figsize=(cell * (num_layers + 1) * width / height + 0.4, cell * len(budgets) + 0.8),
                        layout="constrained")  # fmt: skip
    axes = figure.subplots(len(budgets), num_layers + 1, squeeze=False)
    for row, budget in enumerate(budgets):
        entropy = _normalised_entropy(pictures.profiles[budget]).mean((1, 2))  # (L,)
        axes[row, 0].imshow(image, extent=extent)
        axes[row, 0].set_ylabel(f"C = {budget}", fontsize=8)
        for layer in range(num_layers):
            axis = axes[row, layer + 1]
            axis.imshow(pictures.colours[budget][layer].numpy(), extent=extent, interpolation="nearest")
            axis.text(0.03, 0.04, f"{entropy[layer]:.2f}", color="white", fontsize=6, transform=axis.transAxes,
                      bbox=dict(facecolor="black", alpha=0.5, pad=1, edgecolor="none"))  # fmt: skip
            if row == 0:
                axis.set_title(f"block {layer + 1}", fontsize=8)
        for axis in axes[row]:
            axis.set_xticks([])
            axis.set_yticks([])
    projection = "UMAP" if pictures.projection == "umap" else "PCA"
    caption = (
        f"colours: one {projection} per budget (row), across blocks, of each patch's attention over the cores (mean "
        "over heads)\nnumber: the block's mean normalised entropy of those profiles (1 = uniform over the cores)"
    )
    figure.supxlabel(caption, fontsize=7)
    if title:
        figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=dpi)
    return Path(path)
