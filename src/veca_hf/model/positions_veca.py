# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Where VECA's tokens are: patch and core coordinates, the padding mask of mixed-size batches, and 2D RoPE.

Every position is an `(x, y)` in `[-1, 1]^2` (the image's own patch grid, whatever its size); RoPE rotates queries
and keys by these positions, so no position table is ever interpolated (docs/architecture.md, "Coordinates" and
"2D RoPE").

Shape legend: B batch, M core bank, N patches (Hp * Wp), Hd head size.

NOTE: this file imports only torch, transformers and the sibling config: `modeling_veca.py` imports it relatively,
so `save_pretrained` ships it with the model code and a saved folder loads with `trust_remote_code=True`.
"""

import math

import torch
from torch import nn
from transformers.pytorch_utils import compile_compatible_method_lru_cache

from .configuration_veca import VecaConfig


@compile_compatible_method_lru_cache(maxsize=32)
def get_patch_coordinates(
    num_patches_h: int, num_patches_w: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Centres of an `Hp x Wp` patch grid as `(x, y)` in `[-1, 1]^2`, row-major: `(N, 2)`."""
    y = (torch.arange(num_patches_h, dtype=dtype, device=device) + 0.5) / num_patches_h * 2 - 1
    x = (torch.arange(num_patches_w, dtype=dtype, device=device) + 0.5) / num_patches_w * 2 - 1
    grid_y, grid_x = torch.meshgrid(y, x, indexing="ij")  # (Hp, Wp) each
    return torch.stack([grid_x, grid_y], dim=-1).flatten(0, 1)  # (N, 2)


def get_patch_mask(pixel_mask: torch.Tensor, pixel_values_shape: torch.Size, patch_size: int) -> torch.Tensor:
    """The patch mask of a padded batch: `pixel_mask (B, H, W)` -> `(B, Hp, Wp)`, `True` where a patch is real.

    A patch is real iff all its pixels are; a patch with both real and padded pixels, or real patches that do not
    form one rectangle per image, raise a `ValueError` (pad on patch boundaries, e.g. the image processor's
    `ensure_multiple_of=patch_size` with `do_pad=True`).
    """
    batch_size, _, height, width = pixel_values_shape
    if not isinstance(pixel_mask, torch.Tensor) or tuple(pixel_mask.shape) != (batch_size, height, width):
        shape = tuple(pixel_mask.shape) if isinstance(pixel_mask, torch.Tensor) else type(pixel_mask)
        raise ValueError(
            f"pixel_mask must be a tensor of shape (batch, height, width) = {(batch_size, height, width)} (1 for "
            f"real pixels, 0 for padding, as the image processor returns with do_pad=True), got {shape}."
        )
    rows, cols = height // patch_size, width // patch_size
    pixels = pixel_mask.bool().reshape(batch_size, rows, patch_size, cols, patch_size)
    patch_mask = pixels.all(dim=4).all(dim=2)  # (B, Hp, Wp)
    if bool((pixels.any(dim=4).any(dim=2) != patch_mask).any()):
        raise ValueError(
            f"pixel_mask pads inside a patch: with patch_size={patch_size}, every {patch_size}x{patch_size} patch "
            "must "
            f"be all real or all padding. Resize each image to multiples of {patch_size} before padding (image "
            f"processor: ensure_multiple_of={patch_size}, do_pad=True)."
        )
    valid_rows, valid_cols = patch_mask.any(dim=2), patch_mask.any(dim=1)  # (B, Hp), (B, Wp)
    is_rectangle = (valid_rows[:, :, None] & valid_cols[:, None, :]) == patch_mask
    is_contiguous = (valid_rows.int().diff(dim=1) == 1).sum(1) + valid_rows[:, 0] <= 1
    is_contiguous &= (valid_cols.int().diff(dim=1) == 1).sum(1) + valid_cols[:, 0] <= 1
    if not bool(is_rectangle.all() and is_contiguous.all() and valid_rows.any(dim=1).all()):
        raise ValueError(
            "pixel_mask must mark one non-empty rectangle of real pixels per image (the image, padded on any side); "
            "got an empty image or a real region of another shape."
        )
    return patch_mask


def get_padded_patch_coordinates(patch_mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per image, its own grid's patch centres, placed where its patches sit: `(B, Hp, Wp) -> (B, N, 2)`.

    Image `i`'s patches (a rectangle, checked by `get_patch_mask`) get exactly the coordinates that
    `get_patch_coordinates(hp_i, wp_i)` gives them in a forward of that image alone; padded patches get `(0, 0)`.
    NOTE: built from `get_patch_coordinates` itself (one call per distinct size, cached) rather than from a batched
    formula, so that every coordinate is bit-identical to the single-image one on every device.
    """
    batch_size, num_rows, num_cols = patch_mask.shape
    valid_rows, valid_cols = patch_mask.any(dim=2), patch_mask.any(dim=1)  # (B, Hp), (B, Wp)
    boxes = torch.stack(
        (valid_rows.int().argmax(1), valid_cols.int().argmax(1), valid_rows.sum(1), valid_cols.sum(1)), dim=1
    ).tolist()  # per image: first row, first column, rows, columns
    coordinates = torch.zeros(batch_size, num_rows, num_cols, 2, dtype=dtype, device=patch_mask.device)
    for index, (top, left, rows, cols) in enumerate(boxes):
        own = get_patch_coordinates(rows, cols, dtype=dtype, device=patch_mask.device)  # (rows * cols, 2)
        coordinates[index, top : top + rows, left : left + cols] = own.view(rows, cols, 2)
    return coordinates.flatten(1, 2)  # (B, N, 2)


def augment_patch_coordinates(
    coords: torch.Tensor, shift: float | None, jitter: float | None, rescale: float | None
) -> torch.Tensor:
    """DINOv3's train-time RoPE augmentation, one draw per call shared by the whole batch: `(..., N, 2)` kept."""
    if shift is not None:
        coords = coords + torch.empty(2, dtype=coords.dtype, device=coords.device).uniform_(-shift, shift)
    if jitter is not None:
        log_jitter = math.log(jitter)
        coords = (
            coords * torch.empty(2, dtype=coords.dtype, device=coords.device).uniform_(-log_jitter, log_jitter).exp()
        )
    if rescale is not None:
        log_rescale = math.log(rescale)
        coords = (
            coords * torch.empty(1, dtype=coords.dtype, device=coords.device).uniform_(-log_rescale, log_rescale).exp()
        )
    return coords


def farthest_point_core_coordinates(
    num_cores: int, num_candidates: int, init_range: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Initial raw core coordinates `rho`: `(M, 2)` (arXiv 2605.12491; docs/architecture.md, "The core bank").

    Farthest-point sampling over uniform candidates, starting from the one nearest the origin, so every prefix of
    the bank (every budget) covers the image evenly and core 1 starts near the centre.
    """
    candidates = (torch.rand(num_candidates, 2, generator=generator) * 2 - 1) * init_range  # (P, 2)
    chosen = [int(candidates.norm(dim=-1).argmin())]
    distance = (candidates - candidates[chosen[0]]).norm(dim=-1)  # (P,) distance to the chosen set
    for _ in range(num_cores - 1):
        chosen.append(int(distance.argmax()))
        distance = torch.minimum(distance, (candidates - candidates[chosen[-1]]).norm(dim=-1))
    return torch.atanh(candidates[chosen].clamp(-0.999, 0.999))


def rope_inv_freq(config: VecaConfig) -> torch.Tensor:
    """RoPE inverse periods `(Hd / 4,)`: DINOv3's `1 / theta^(4f / Hd)`, the longest periods zeroed (not rotated)."""
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / config.rope_theta ** torch.arange(0, 1, 4 / head_dim, dtype=torch.float32)  # (Hd/4,)
    num_zeroed = round(config.rope_zero_frequency_ratio * inv_freq.numel())
    if num_zeroed > 0:
        inv_freq[-num_zeroed:] = 0.0
    return inv_freq


class VecaRopePositionEmbedding(nn.Module):
    """2D axial RoPE of any `(x, y)` positions, DINOv3 style.

    Channel layout of the returned `(..., Hd)` cos/sin, for HF's half-split `rotate_half` (channel `i` rotates with
    channel `i + Hd/2`)::

        [ x f_0 .. x f_{Hd/4-1} | y f_0 .. y f_{Hd/4-1} | x f_0 .. x f_{Hd/4-1} | y f_0 .. y f_{Hd/4-1} ]

    The reference code rotates interleaved pairs `(2m, 2m+1)` instead; conversion permutes the q/k projection rows
    so that both give identical attention.
    """

    inv_freq: torch.Tensor

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (..., 2) -> (..., 2, Hd/4) -> (..., Hd/2) -> (..., Hd)
        angles = 2 * math.pi * coords.float()[..., None] * self.inv_freq
        angles = angles.flatten(-2).tile(2)
        return angles.cos(), angles.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin`, or with `inverse` its transpose (what the gradient of `x` needs), as one
    product and two in-place half updates: one allocation instead of `rotate_half`'s four."""
    half = x.shape[-1] // 2
    rotated = x * cos
    if inverse:  # dx1 = g1 c1 + g2 s2, dx2 = g2 c2 - g1 s1
        rotated[..., :half].addcmul_(x[..., half:], sin[..., half:])
        rotated[..., half:].addcmul_(x[..., :half], sin[..., :half], value=-1)
    else:  # y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2
        rotated[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
        rotated[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return rotated


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _concatenate(segments: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Token-axis segments `(..., L_i, Hd)` broadcast to one leading shape and concatenated: `(..., sum L_i, Hd)`."""
    if len(segments) == 1:
        return segments[0]
    leading = torch.broadcast_shapes(*(segment.shape[:-2] for segment in segments))
    return torch.cat([segment.expand(*leading, *segment.shape[-2:]) for segment in segments], dim=-2)


class _RotaryEmbedding(torch.autograd.Function):
    """The rotation with its gradient written out. Autograd through the in-place half updates zero-fills and copies
    full-size buffers for every slice, and a concatenated cos/sin would get a gradient for every token; here each
    cos/sin segment gets one over its own tokens only, and only when it needs one (the cores' moving positions)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, num_segments: int, *cos_sin: torch.Tensor) -> torch.Tensor:
        cos = _concatenate(cos_sin[:num_segments]).to(x.dtype)
        sin = _concatenate(cos_sin[num_segments:]).to(x.dtype)
        ctx.save_for_backward(x, cos, sin)
        ctx.segments = [(segment.shape, segment.dtype) for segment in cos_sin]
        return _rotate(x, cos, sin)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, cos, sin = ctx.saved_tensors
        grad_x = _rotate(grad, cos, sin, inverse=True) if ctx.needs_input_grad[0] else None
        num_segments = len(ctx.segments) // 2
        lengths = [shape[-2] for shape, _ in ctx.segments[:num_segments]]
        grads = []
        for index, (shape, dtype) in enumerate(ctx.segments):
            if not ctx.needs_input_grad[2 + index]:
                grads.append(None)
                continue
            start = sum(lengths[: index % num_segments])
            tokens = slice(start, start + shape[-2])
            x_tokens = x[..., tokens, :] if index < num_segments else _rotate_half(x[..., tokens, :])
            # d/dcos = x, d/dsin = rotate_half(x), summed over what cos/sin broadcast over (q/k, heads), in their
            # own dtype (fp32 under autocast): the terms nearly cancel
            grads.append((grad[..., tokens, :].to(dtype) * x_tokens.to(dtype)).sum_to_size(shape))
        return grad_x, None, *grads


def apply_rotary_pos_emb(
    x: torch.Tensor,
    cos: torch.Tensor | tuple[torch.Tensor, ...],
    sin: torch.Tensor | tuple[torch.Tensor, ...],
) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for `x (..., L, Hd)`, `rotate_half(x) = cat(-x2, x1)`, in `x`'s dtype.

    `cos` and `sin` broadcast to `x`: each a tensor, or a tuple of tensors that tile the token axis in order (the
    cores' then the patches'), concatenated here so that only the segments that need a gradient pay for one.
    """
    cos, sin = (cos,) if torch.is_tensor(cos) else tuple(cos), (sin,) if torch.is_tensor(sin) else tuple(sin)
    if len(cos) != len(sin):
        raise ValueError(f"cos and sin need the same segments, got {len(cos)} and {len(sin)}")
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, *cos, *sin)):
        return _RotaryEmbedding.apply(x, len(cos), *cos, *sin)
    return _rotate(x, _concatenate(cos).to(x.dtype), _concatenate(sin).to(x.dtype))


__all__ = [
    "VecaRopePositionEmbedding",
    "apply_rotary_pos_emb",
    "augment_patch_coordinates",
    "farthest_point_core_coordinates",
    "get_padded_patch_coordinates",
    "get_patch_coordinates",
    "get_patch_mask",
    "rope_inv_freq",
]
