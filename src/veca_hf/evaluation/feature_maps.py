# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Pictures of dense features, as the VECA paper's figures draw them: one image at several resolutions through VECA
(at chosen budgets) and its teacher or baselines, the patch features coloured by one joint 3-D projection to RGB,
the same colours over the image, and the cosine of each patch feature with the global feature.

`project_to_rgb` fits one projection (UMAP, as the paper, when `umap-learn` is installed, else PCA) on several
feature sets together and colours them all with it; `feature_pictures` runs the models; `draw_feature_pictures`
draws the figure and `feature_pictures_summary` is its JSON. `examples/visualize_features.py` is the command line.

Shape legend: M points, D feature width, Hp x Wp patch grid, h x w pixels, R resolution (the short side).
"""

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from transformers.utils import logging

from ..model.image_processing_pil_veca import VecaImageProcessorPil
from .features import ProbeModel, check_resolutions, extract_features


logger = logging.get_logger(__name__)

__all__ = [
    "FeaturePicture",
    "FeaturePictureRow",
    "FeaturePictures",
    "draw_feature_pictures",
    "feature_pictures",
    "feature_pictures_summary",
    "global_patch_cosine",
    "image_at_resolution",
    "load_image",
    "project_to_rgb",
    "resolve_projection",
    "write_feature_pictures",
]

PROJECTIONS = ("auto", "umap", "pca")
UMAP_HINT = 'pip install umap-learn (or pip install -e ".[viz]")'


# ----------------------------------------------------------------------------------------------------------------
# Joint projection to RGB
# ----------------------------------------------------------------------------------------------------------------


def _umap_module():
    """`umap` (from `umap-learn`), imported on first use: it takes seconds (numba)."""
    import umap

    return umap


def resolve_projection(method: str = "auto") -> str:
    r"""
    The projection `project_to_rgb` will use: `"umap"` or `"pca"`.

    Args:
        method (`str`, *optional*, defaults to `"auto"`):
            `"umap"` (an `ImportError` naming the `viz` extra when `umap-learn` is missing), `"pca"`, or `"auto"`:
            UMAP when `umap-learn` is installed, else PCA (with a logged warning).
    """
    if method not in PROJECTIONS:
        raise ValueError(f"Unknown projection {method!r}: choose among {list(PROJECTIONS)}.")
    if method == "pca":
        return "pca"
    try:
        _umap_module()
    except ImportError as error:
        if method == "umap":
            raise ImportError(
                f"The UMAP projection needs umap-learn, the `viz` extra: {UMAP_HINT}; or use --projection pca."
            ) from error
        logger.warning(f"umap-learn is not installed ({UMAP_HINT}): projecting to RGB with PCA instead of UMAP.")
        return "pca"
    return "umap"


def _pca_3d(points: torch.Tensor) -> torch.Tensor:
    """Exact PCA to 3 components (eigenvectors of the covariance, each signed so its largest loading is positive,
    so that the colours do not flip between runs): `(M, D)` float64 -> `(M, 3)`."""
    centred = points - points.mean(0)
    covariance = centred.T @ centred / max(1, len(points) - 1)  # (D, D)
    _, vectors = torch.linalg.eigh(covariance)  # ascending eigenvalues
    components = vectors[:, -3:].flip(-1)  # (D, 3), the largest first
    largest = components.abs().argmax(0)  # (3,)
    components = components * torch.sign(components[largest, torch.arange(components.shape[1])])
    return centred @ components


def _umap_3d(points: torch.Tensor, seed: int) -> torch.Tensor:
    """UMAP to 3 components (seeded, hence single-threaded): `(M, D)` -> `(M, 3)`."""
    umap = _umap_module()
    reducer = umap.UMAP(n_components=3, n_neighbors=max(2, min(15, len(points) - 1)), random_state=seed, n_jobs=1)
    return torch.from_numpy(np.asarray(reducer.fit_transform(points.float().numpy()), dtype=np.float64))


@torch.no_grad()
def project_to_rgb(
    features: Sequence[torch.Tensor],
    method: str = "auto",
    normalize: bool = False,
    seed: int = 0,
    quantile: float = 0.01,
) -> tuple[list[torch.Tensor], str]:
    r"""
    Colours several feature sets with one projection to RGB fitted on all of them together, so that a colour means
    the same in every set (e.g. one model's patches at every resolution, or one budget's attention at every block).

    The points are projected to 3-D (UMAP or PCA), then each of the 3 axes is scaled to `[0, 1]` by its `quantile`
    and `1 - quantile` over all the points (clipped outside), one scaling for all the sets.

    Args:
        features (`Sequence[torch.Tensor]`, each of shape `(..., D)`): the feature sets; same `D`, any leading shape.
        method (`str`, *optional*, defaults to `"auto"`): `"umap"`, `"pca"` or `"auto"`, see `resolve_projection`.
        normalize (`bool`, *optional*, defaults to `False`): L2-normalise each vector first (project directions).
        seed (`int`, *optional*, defaults to 0): UMAP's seed (PCA is exact).
        quantile (`float`, *optional*, defaults to 0.01): the robust range of each colour axis.

    Returns:
        `(colours, method)`: one `(..., 3)` float tensor in `[0, 1]` per set, and the projection used. With PCA the
        colours are a fixed function of the vector (the same vector in two sets gets the same colour); UMAP embeds
        the points of all the sets in one fit.
    """
    if not features:
        raise ValueError("project_to_rgb needs at least one feature set.")
    widths = {tensor.shape[-1] for tensor in features}
    if len(widths) != 1:
        raise ValueError(f"All feature sets must have the same width, got {sorted(widths)}.")
    method = resolve_projection(method)
    sizes = [math.prod(tensor.shape[:-1]) for tensor in features]
    points = torch.cat([tensor.reshape(-1, tensor.shape[-1]).detach().cpu().double() for tensor in features])  # (M, D)
    if normalize:
        points = F.normalize(points, dim=-1)
    if points.shape[-1] < 3:
        points = F.pad(points, (0, 3 - points.shape[-1]))
    if method == "umap" and len(points) > 4:
        projected = _umap_3d(points, seed)
    else:
        if method == "umap":
            logger.warning(f"UMAP needs more than 4 points, got {len(points)}: using PCA.")
            method = "pca"
        projected = _pca_3d(points)  # (M, 3)
    low = torch.quantile(projected, quantile, dim=0)
    high = torch.quantile(projected, 1 - quantile, dim=0)
    span = torch.where(high - low > 1e-12, high - low, torch.ones_like(high))
    colours = ((projected - low) / span).clamp(0, 1).float().split(sizes)  # (M, 3) -> one part per set
    return [part.reshape(*tensor.shape[:-1], 3) for part, tensor in zip(colours, features, strict=True)], method


# ----------------------------------------------------------------------------------------------------------------
# Images and features
# ----------------------------------------------------------------------------------------------------------------


def load_image(path: str | os.PathLike) -> PIL.Image.Image:
    """Reads an image file as RGB; a `ValueError` naming the file if it is missing or not an image."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"Image file {str(path)!r} does not exist.")
    try:
        with PIL.Image.open(path) as image:
            return image.convert("RGB")
    except (OSError, PIL.UnidentifiedImageError) as error:
        raise ValueError(f"Cannot read the image file {str(path)!r}: {error}") from error


def image_at_resolution(
    image: PIL.Image.Image, resolution: int, multiple: int, max_side: int | None = None
) -> tuple[PIL.Image.Image, torch.Tensor]:
    r"""
    The whole image, aspect kept, at short side `resolution`: both sides rounded to multiples of `multiple` (VECA's
    aspect-preserving processor, `VecaImageProcessorPil.for_any_size`), the long side at most `max_side` (the short
    side then shrinks with it).

    Args:
        image (`PIL.Image.Image`): an RGB image.
        resolution (`int`): the short side, a multiple of `multiple`.
        multiple (`int`): every model's patch size (their least common multiple).
        max_side (`int`, *optional*): bound on the long side, to bound memory.

    Returns:
        `(resized, pixel_values)`: the resized RGB image (for drawing) and the normalised `(1, 3, h, w)` input.
    """
    size = (
        {"shortest_edge": resolution} if max_side is None else {"shortest_edge": resolution, "longest_edge": max_side}
    )
    processor = VecaImageProcessorPil.for_any_size(resolution, patch_size=multiple, do_pad=False, size=size)
    pixel_values = processor(image, return_tensors="pt")["pixel_values"]  # (1, 3, h, w)
    height, width = pixel_values.shape[-2:]
    return image.resize((width, height), PIL.Image.Resampling.BICUBIC), pixel_values


def global_patch_cosine(global_feature: torch.Tensor, patch_features: torch.Tensor) -> torch.Tensor:
    """Cosine of each patch feature with the global feature: `(D,)`, `(Hp, Wp, D)` -> `(Hp, Wp)`."""
    return F.cosine_similarity(patch_features.float(), global_feature.float().expand_as(patch_features), dim=-1)


@dataclass
class FeaturePicture:
    r"""
    One model (at one budget) on the image at one resolution.

    Args:
        resolution (`int`): the requested short side `R`.
        image (`PIL.Image.Image`): the image the model saw (without normalisation), `w x h`.
        global_feature (`torch.Tensor` of shape `(D,)`): VECA's core 1, DINOv2 / DINOv3's CLS (after the final norm).
        patch_features (`torch.Tensor` of shape `(Hp, Wp, D)`): the patch tokens, row-major.
        cosine (`torch.Tensor` of shape `(Hp, Wp)`): `global_patch_cosine` of the two.
        colours (`torch.Tensor` of shape `(Hp, Wp, 3)`): the row's joint projection of the patch features, `[0, 1]`.
    """

    resolution: int
    image: PIL.Image.Image = field(repr=False)
    global_feature: torch.Tensor = field(repr=False)
    patch_features: torch.Tensor = field(repr=False)
    cosine: torch.Tensor = field(repr=False)
    colours: torch.Tensor | None = field(default=None, repr=False)

    @property
    def size(self) -> tuple[int, int]:
        """`(h, w)` in pixels."""
        return self.image.height, self.image.width

    @property
    def grid(self) -> tuple[int, int]:
        """`(Hp, Wp)`."""
        return tuple(self.patch_features.shape[:2])


@dataclass
class FeaturePictureRow:
    r"""
    One model at one budget (a figure row), at every resolution, with one projection fitted on all of them.

    Args:
        model (`str`): the model's short name. path (`str`): its folder or Hub id. model_type (`str`): its type.
        patch_size (`int`): its patch size. budget (`int`, *optional*): VECA's budget, `None` for other models.
        pictures (`list[FeaturePicture]`): one per resolution, in order.
    """

    model: str
    path: str
    model_type: str
    patch_size: int
    budget: int | None
    pictures: list[FeaturePicture]

    @property
    def label(self) -> str:
        return self.model if self.budget is None else f"{self.model} C={self.budget}"


@dataclass
class FeaturePictures:
    r"""
    What `feature_pictures` computed: the rows (models x budgets), the projection used, the resolutions.

    Args:
        rows (`list[FeaturePictureRow]`): one per model and budget.
        projection (`str`): `"umap"` or `"pca"`.
        resolutions (`list[int]`): the requested short sides.
        max_side (`int`, *optional*): the bound on the long side.
        image_size (`tuple[int, int]`): the original image's `(w, h)`.
    """

    rows: list[FeaturePictureRow]
    projection: str
    resolutions: list[int]
    max_side: int | None
    image_size: tuple[int, int]


def _default_budgets(model: ProbeModel, budgets: Sequence[int] | None) -> list[int | None]:
    """The requested budgets (checked), or VECA's smallest and largest; `[None]` for other models."""
    if budgets is not None or not model.is_veca:
        return model.budgets(budgets)
    return list(dict.fromkeys([min(model.config.budgets), max(model.config.budgets)]))


@torch.no_grad()
def feature_pictures(
    models: Sequence[ProbeModel],
    image: PIL.Image.Image,
    resolutions: Sequence[int],
    budgets: Sequence[int] | None = None,
    projection: str = "auto",
    max_side: int | None = None,
    seed: int = 0,
) -> FeaturePictures:
    r"""
    Runs one image at several resolutions through every model (VECA at every budget) and colours each row's patch
    features with one projection fitted across its resolutions.

    Args:
        models (`Sequence[ProbeModel]`): VECA, DINOv2 or DINOv3 backbones.
        image (`PIL.Image.Image`): an RGB image (e.g. from `load_image`).
        resolutions (`Sequence[int]`): short sides, each a multiple of every model's patch size (else a
            `ValueError` naming it, from `check_resolutions`).
        budgets (`Sequence[int]`, *optional*): VECA budgets; defaults to each VECA model's smallest and largest.
        projection (`str`, *optional*, defaults to `"auto"`): see `resolve_projection`.
        max_side (`int`, *optional*): bound on the long side (memory); a capped image is logged.
        seed (`int`, *optional*, defaults to 0): UMAP's seed.
    """
    if not models:
        raise ValueError("feature_pictures needs at least one model.")
    resolutions = [int(resolution) for resolution in resolutions]
    if not resolutions:
        raise ValueError("feature_pictures needs at least one resolution.")
    check_resolutions(models, resolutions)
    method = resolve_projection(projection)  # fail (or log the fallback) before any model runs
    multiple = math.lcm(*(model.patch_size for model in models))
    if max_side is not None and max_side < multiple:
        raise ValueError(f"max_side {max_side} is below the patch size {multiple}.")
    row_budgets = [_default_budgets(model, budgets) for model in models]
    inputs = []
    for resolution in resolutions:
        resized, pixel_values = image_at_resolution(image, resolution, multiple, max_side)
        if min(resized.size) < resolution:
            capped = f"{resized.height} x {resized.width}"
            logger.warning(f"{resolution} px: the long side is capped at max_side {max_side}: {capped} pixels.")
        inputs.append((resolution, resized, pixel_values))

    rows = []
    for model, model_budgets in zip(models, row_budgets, strict=True):
        backbone = model.model
        dtype = next(backbone.parameters()).dtype
        for budget in model_budgets:
            pictures = []
            for resolution, resized, pixel_values in inputs:
                global_features, patch_features = extract_features(
                    backbone, pixel_values.to(model.device, dtype), budget
                )  # (1, D), (1, Hp, Wp, D)
                global_feature, patches = global_features[0].float().cpu(), patch_features[0].float().cpu()
                cosine = global_patch_cosine(global_feature, patches)
                pictures.append(FeaturePicture(resolution, resized, global_feature, patches, cosine))
            colours, method = project_to_rgb([p.patch_features for p in pictures], method, normalize=True, seed=seed)
            for picture, picture_colours in zip(pictures, colours, strict=True):
                picture.colours = picture_colours
            model_type = model.config.model_type
            row = FeaturePictureRow(model.name, model.name_or_path, model_type, model.patch_size, budget, pictures)
            grids = [
                f"{p.resolution} px: {p.grid[0]}x{p.grid[1]}, mean cosine {p.cosine.mean():.3f}" for p in pictures
            ]
            logger.info(f"{row.label}: {'; '.join(grids)}")
            rows.append(row)
    return FeaturePictures(rows, method, resolutions, max_side, image.size)


# ----------------------------------------------------------------------------------------------------------------
# The figure and its JSON
# ----------------------------------------------------------------------------------------------------------------


def _blend(image: PIL.Image.Image, colours: torch.Tensor, alpha: float) -> PIL.Image.Image:
    """`colours` `(Hp, Wp, 3)` upsampled (bilinear) to the image and alpha-blended over it."""
    grid = PIL.Image.fromarray((colours.numpy() * 255).round().astype(np.uint8))
    return PIL.Image.blend(image, grid.resize(image.size, PIL.Image.Resampling.BILINEAR), alpha)


def draw_feature_pictures(
    pictures: FeaturePictures,
    path: str | os.PathLike,
    title: str | None = None,
    alpha: float = 0.6,
    dpi: int = 100,
) -> Path:
    r"""
    Draws `pictures` and saves a PNG: rows = models (and budgets), columns = resolutions x three panels: the patch
    features in the row's joint RGB projection (one square per patch), the same colours upsampled over the image,
    and the global-to-patch cosine map (one colour scale per row, its mean in the corner).

    Args:
        pictures (`FeaturePictures`): from `feature_pictures`.
        path (`str` or `os.PathLike`): the PNG to write.
        title (`str`, *optional*): a figure title.
        alpha (`float`, *optional*, defaults to 0.6): the colours' opacity over the image.
        dpi (`int`, *optional*, defaults to 100): the PNG's resolution.
    """
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure state

    num_rows, num_resolutions = len(pictures.rows), len(pictures.resolutions)
    first = pictures.rows[0].pictures[0]
    aspect = first.image.width / first.image.height
    cell = 1.3
    figure = Figure(figsize=(3 * num_resolutions * cell * aspect + 1.4, num_rows * cell + 0.9), layout="constrained")
    axes = figure.subplots(num_rows, 3 * num_resolutions, squeeze=False)
    panels = ("features", "over image", "cos(global, patch)")
    for row_index, row in enumerate(pictures.rows):
        low = min(float(picture.cosine.min()) for picture in row.pictures)
        high = max(float(picture.cosine.max()) for picture in row.pictures)
        for index, picture in enumerate(row.pictures):
            width, height = picture.image.size
            extent = (0, width, height, 0)
            colours_axis, overlay_axis, cosine_axis = axes[row_index, 3 * index : 3 * index + 3]
            colours_axis.imshow(picture.colours.numpy(), extent=extent, interpolation="nearest")
            overlay_axis.imshow(_blend(picture.image, picture.colours, alpha), extent=extent)
            shown = cosine_axis.imshow(picture.cosine.numpy(), extent=extent, cmap="viridis", interpolation="nearest",
                                       vmin=low, vmax=max(high, low + 1e-6))  # fmt: skip
            cosine_axis.text(0.03, 0.04, f"{picture.cosine.mean():.2f}", color="white", fontsize=6,
                             transform=cosine_axis.transAxes,
                             bbox=dict(facecolor="black", alpha=0.5, pad=1, edgecolor="none"))  # fmt: skip
            for axis, panel in zip((colours_axis, overlay_axis, cosine_axis), panels, strict=True):
                axis.set_xticks([])
                axis.set_yticks([])
                if row_index == 0:
                    heading = (
                        f"{picture.resolution} px ({picture.grid[0]}x{picture.grid[1]})\n"
                        if panel == panels[0]
                        else "\n"
                    )
                    axis.set_title(heading + panel, fontsize=7)
        axes[row_index, 0].set_ylabel(row.label, fontsize=7)
        colorbar = figure.colorbar(shown, ax=axes[row_index, -1], fraction=0.08, pad=0.02)
        colorbar.ax.tick_params(labelsize=6)
    projection = "UMAP" if pictures.projection == "umap" else "PCA"
    figure.supxlabel(f"colours: one {projection} of each row's patch features (L2-normalised) across its resolutions; "
                     "number: mean cosine of the patches with the global feature", fontsize=7)  # fmt: skip
    if title:
        figure.suptitle(title, fontsize=9)
    figure.savefig(path, dpi=dpi)
    return Path(path)


def feature_pictures_summary(pictures: FeaturePictures) -> dict[str, Any]:
    """The JSON of a figure: the projection, and per row and resolution the shapes and the cosine statistics."""
    return {
        "projection": pictures.projection,
        "resolutions": pictures.resolutions,
        "max_side": pictures.max_side,
        "image_size": list(pictures.image_size),
        "rows": [
            {
                "label": row.label,
                "model": row.model,
                "path": row.path,
                "model_type": row.model_type,
                "patch_size": row.patch_size,
                "budget": row.budget,
                "resolutions": [
                    {
                        "resolution": picture.resolution,
                        "size": list(picture.size),
                        "grid": list(picture.grid),
                        "patch_features_shape": list(picture.patch_features.shape),
                        "global_feature_shape": list(picture.global_feature.shape),
                        "mean_cosine": float(picture.cosine.mean()),
                        "min_cosine": float(picture.cosine.min()),
                        "max_cosine": float(picture.cosine.max()),
                    }
                    for picture in row.pictures
                ],
            }
            for row in pictures.rows
        ],
    }


def write_feature_pictures(
    pictures: FeaturePictures, path: str | os.PathLike, title: str | None = None, dpi: int = 100
) -> tuple[Path, Path]:
    """Writes the PNG (`draw_feature_pictures`) and, beside it with the suffix `.json`, `feature_pictures_summary`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    png = draw_feature_pictures(pictures, path, title=title, dpi=dpi)
    summary = path.with_suffix(".json")
    summary.write_text(json.dumps(feature_pictures_summary(pictures), indent=2) + "\n")
    return png, summary
