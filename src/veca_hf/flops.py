# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Analytic FLOP counts for VECA (and the dense DINOv3 ViT it is compared with), and a measured counter.

Convention: one multiply-add is 2 FLOPs, as in `torch.utils.flop_counter`. Like that counter, the analytic counts
include matmuls, linears and convolutions only; biases, elementwise ops (RoPE, SwiGLU gating, residuals, layer
scale), LayerNorms and softmax are free. With these rules the analytic counts equal what
[`count_flops`] measures on the real models exactly.

Notation: `N` patches, `C` active cores, `P` prefix tokens of a dense ViT (DINOv3: 1 CLS + 4 registers = 5),
`T` tokens in the sequence, `D` hidden size, `I` MLP hidden size, `p` patch size, `L` blocks.

    VECA block (T = N + C):   q/k/v/out projections  8 T D^2
                              attention              4 (C T + N C) D     (cores over all T, patches over C)
                              SwiGLU MLP             6 T D I             (D -> 2I, then I -> D)
    dense block (T = N + P):  projections 8 T D^2,   attention 4 T^2 D,  MLP 4 T D I (6 T D I if gated)

VECA's attention is linear in `N` for a fixed budget `C`; dense attention is quadratic in `N`.

Only `torch` is imported here; configs are read by attribute.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode


if TYPE_CHECKING:
    from .model.configuration_veca import VecaConfig


__all__ = [
    "attention_block_flops",
    "count_flops",
    "count_training_flops",
    "dense_twin_model_flops",
    "dinov3_model_flops",
    "dinov3_training_flops",
    "num_patches_for",
    "patch_embedding_flops",
    "training_flops",
    "veca_model_flops",
    "veca_training_flops",
]


def num_patches_for(height: int, width: int, patch_size: int) -> int:
    """Number of patches `N = (height / patch_size) * (width / patch_size)` of an image.

    Args:
        height (`int`): Image height in pixels, a positive multiple of `patch_size`.
        width (`int`): Image width in pixels, a positive multiple of `patch_size`.
        patch_size (`int`): Side of the square patches.

    Returns:
        `int`: the number of patches.
    """
    if height <= 0 or width <= 0 or height % patch_size or width % patch_size:
        raise ValueError(f"Image size {height}x{width} is not a positive multiple of patch_size={patch_size}.")
    return (height // patch_size) * (width // patch_size)


def attention_block_flops(
    hidden_size: int,
    num_patches: int,
    num_core_tokens: int | None = None,
    num_prefix_tokens: int = 0,
    batch_size: int = 1,
) -> int:
    """FLOPs of one attention block: the q/k/v/out projections plus the two attention matmuls (scores and values).

    - VECA (`num_core_tokens=C`): `8 T D^2 + 4 (C T + N C) D` with `T = N + C`: the cores attend to all `T` tokens, the
      patches to the `C` cores only.
    - dense (`num_core_tokens=None`): `8 T D^2 + 4 T^2 D` with `T = N + num_prefix_tokens`. For DINOv3 pass
      `num_prefix_tokens=5` (1 CLS + 4 registers): that reproduces the DINOv3 column of the paper's attention-block
      FLOP table exactly.

    The norm, RoPE, softmax and biases are not counted (as in `torch.utils.flop_counter`).

    Args:
        hidden_size (`int`): Width `D`.
        num_patches (`int`): Number of patches `N`.
        num_core_tokens (`int`, *optional*): Active cores `C` for VECA; `None` for dense attention.
        num_prefix_tokens (`int`, *optional*, defaults to 0): Dense only: tokens in front of the patches (CLS,
            registers). Must be 0 for VECA, whose only extra tokens are the cores.
        batch_size (`int`, *optional*, defaults to 1): Every count scales linearly with it.

    Returns:
        `int`: the FLOPs (multiply-add = 2).

    Example:

    ```python
    >>> from veca_hf.flops import attention_block_flops

    >>> round(attention_block_flops(768, 64 * 64, num_core_tokens=64) / 1e9, 3)  # VECA-B, 1024 px
    21.253
    >>> round(attention_block_flops(768, 64 * 64, num_prefix_tokens=5) / 1e9, 3)  # DINOv3-B, 1024 px
    71.016

    ```
    """
    hidden_size, num_patches = int(hidden_size), int(num_patches)
    if num_core_tokens is None:
        num_tokens = num_patches + int(num_prefix_tokens)
        flops = 8 * num_tokens * hidden_size**2 + 4 * num_tokens**2 * hidden_size
    else:
        if num_prefix_tokens:
            raise ValueError(
                "num_prefix_tokens is for dense attention; VECA's only extra tokens are its num_core_tokens."
            )
        num_core_tokens = int(num_core_tokens)
        num_tokens = num_patches + num_core_tokens
        flops = (
            8 * num_tokens * hidden_size**2
            + 4 * (num_core_tokens * num_tokens + num_patches * num_core_tokens) * hidden_size
        )
    return batch_size * flops


def veca_model_flops(
    config: VecaConfig,
    height: int,
    width: int,
    num_core_tokens: int | None = None,
    batch_size: int = 1,
) -> int:
    """FLOPs of one [`VecaModel`] forward (the efficient two-call attention, i.e. `output_attentions=False`).

    `2 N D (3 p^2)` for the patch conv, plus per block `8 T D^2 + 4 (C T + N C) D + 6 T D I`, plus `4 C D` for each
    of the `L - 1` coordinate heads (`Linear(D, 2)` on the cores), with `T = N + C`. This equals what
    [`count_flops`] measures on the model exactly. With `output_attentions=True` the model instead multiplies the
    assembled `(T x T)` map by the values, which costs more and is not what this counts.

    Args:
        config ([`VecaConfig`]): The model configuration.
        height (`int`): Image height, a multiple of `config.patch_size`.
        width (`int`): Image width, a multiple of `config.patch_size`.
        num_core_tokens (`int`, *optional*): The budget `C`; defaults, as in the model, to
            `config.default_num_core_tokens`, else the whole bank.
        batch_size (`int`, *optional*, defaults to 1): Every count scales linearly with it.

    Returns:
        `int`: the FLOPs (multiply-add = 2).
    """
    if num_core_tokens is None:
        num_core_tokens = getattr(config, "default_num_core_tokens", None) or config.core_bank_size
    if isinstance(num_core_tokens, str):
        raise ValueError(
            f"num_core_tokens={num_core_tokens!r} has no FLOP count of its own: with 'auto' each image's cost "
            "depends on the budget picked for it. Pass a budget, or read the fitted policy's mean_cost "
            "(veca_hf.AdaptiveBudget)."
        )
    if hasattr(config, "check_budget"):
        num_core_tokens = config.check_budget(int(num_core_tokens))
    hidden_size, intermediate_size = config.hidden_size, config.intermediate_size
    patch_size, num_layers = config.patch_size, config.num_hidden_layers
    num_patches = num_patches_for(height, width, patch_size)
    num_tokens = num_patches + num_core_tokens

    patch_embedding = 2 * num_patches * hidden_size * config.num_channels * patch_size**2
    attention = attention_block_flops(hidden_size, num_patches, num_core_tokens=num_core_tokens)
    mlp = 6 * num_tokens * hidden_size * intermediate_size
    coordinate_head = 2 * num_core_tokens * hidden_size * 2
    total = patch_embedding + num_layers * (attention + mlp) + (num_layers - 1) * coordinate_head
    return batch_size * total


def dinov3_model_flops(config: Any, height: int, width: int, batch_size: int = 1) -> int:
    """FLOPs of one transformers `DINOv3ViTModel` forward, for comparison with [`veca_model_flops`].

    `2 N D (3 p^2)` for the patch conv plus per block `8 T D^2 + 4 T^2 D` (attention) and `4 T D I` (`6 T D I` with
    `config.use_gated_mlp`), with `T = N + 1 + config.num_register_tokens`.

    Args:
        config (`DINOv3ViTConfig`): The model configuration.
        height (`int`): Image height, a multiple of `config.patch_size`.
        width (`int`): Image width, a multiple of `config.patch_size`.
        batch_size (`int`, *optional*, defaults to 1): Every count scales linearly with it.

    Returns:
        `int`: the FLOPs (multiply-add = 2).
    """
    hidden_size, intermediate_size = config.hidden_size, config.intermediate_size
    patch_size = config.patch_size
    num_patches = num_patches_for(height, width, patch_size)
    num_prefix_tokens = 1 + config.num_register_tokens
    num_tokens = num_patches + num_prefix_tokens

    patch_embedding = 2 * num_patches * hidden_size * config.num_channels * patch_size**2
    attention = attention_block_flops(hidden_size, num_patches, num_prefix_tokens=num_prefix_tokens)
    mlp = (6 if getattr(config, "use_gated_mlp", False) else 4) * num_tokens * hidden_size * intermediate_size
    return batch_size * (patch_embedding + config.num_hidden_layers * (attention + mlp))


def dense_twin_model_flops(config: VecaConfig, height: int, width: int, batch_size: int = 1) -> int:
    """FLOPs of one forward of the dense ViT of VECA's size: the same width, depth, patch size and SwiGLU MLP, one CLS
    token, no registers (`veca_hf.training.distillation.full_attention_student_config`), so that only the attention
    pattern differs. Its MLP costs what DINOv3's GELU MLP of the same size costs (VECA-B: `6 T D 2048` against
    `4 T D 3072`): the comparison [`veca_hf.latency.pick_budget`] reports.

    Args:
        config (`VecaConfig`): The VECA model configuration.
        height (`int`): Image height, a multiple of `config.patch_size`.
        width (`int`): Image width, a multiple of `config.patch_size`.
        batch_size (`int`, *optional*, defaults to 1): Every count scales linearly with it.

    Returns:
        `int`: the FLOPs (multiply-add = 2).
    """
    twin = SimpleNamespace(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        patch_size=config.patch_size,
        num_channels=config.num_channels,
        num_register_tokens=0,
        use_gated_mlp=True,
    )
    return dinov3_model_flops(twin, height, width, batch_size)


def count_flops(model: torch.nn.Module, pixel_values: torch.Tensor, **forward_kwargs) -> int:
    """Measures the FLOPs of `model(pixel_values, **forward_kwargs)` with `torch.utils.flop_counter`.

    The forward runs without gradients inside `sdpa_kernel(SDPBackend.MATH)`, so that
    `scaled_dot_product_attention` is counted as its matmuls (the counter does not see the CPU flash kernel). The
    model's train/eval mode is left as it is. Works on the meta device too (shapes only, no compute).

    Args:
        model (`torch.nn.Module`): Any model, e.g. [`VecaModel`].
        pixel_values (`torch.Tensor`): The first positional input.
        forward_kwargs: Passed to the forward, e.g. `num_core_tokens=16`.

    Returns:
        `int`: the total FLOPs counted (multiply-add = 2).

    Example:

    ```python
    >>> import torch
    >>> from veca_hf import VecaConfig, VecaModel
    >>> from veca_hf.flops import count_flops, veca_model_flops

    >>> config = VecaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170)
    >>> model = VecaModel(config).eval()
    >>> count_flops(model, torch.randn(1, 3, 64, 48), num_core_tokens=16) == veca_model_flops(config, 64, 48, 16)
    True

    ```
    """
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        model(pixel_values, **forward_kwargs)
    return int(counter.get_total_flops())


def patch_embedding_flops(config: Any, height: int, width: int, batch_size: int = 1) -> int:
    """FLOPs of the patch embedding (a `p x p` stride-`p` convolution, or the same GEMM): `2 N D (channels p^2)`."""
    patch_size = config.patch_size
    patch_size = patch_size[0] if isinstance(patch_size, (tuple, list)) else int(patch_size)
    num_patches = num_patches_for(height, width, patch_size)
    return batch_size * 2 * num_patches * config.hidden_size * config.num_channels * patch_size**2


def training_flops(forward_flops: int, patch_embedding: int) -> int:
    """FLOPs of one training step (forward + backward) from those of the forward: `3 F - patch embedding`.

    The backward of every matmul computes the gradient of its input and of its weight, each as costly as the
    forward; the patch embedding's input is the image, which needs no gradient, so its backward is the weight
    gradient alone. This is what `torch.utils.flop_counter` counts for [`VecaModel`] and `DINOv3ViTModel` under
    the distillation loss (tested); the usual "3x forward" overstates it by the patch embedding's forward. The
    optimiser step and the loss are elementwise and not counted.

    Args:
        forward_flops (`int`): FLOPs of the forward ([`veca_model_flops`], [`dinov3_model_flops`]).
        patch_embedding (`int`): FLOPs of the patch embedding in that forward ([`patch_embedding_flops`]).

    Returns:
        `int`: the FLOPs of forward and backward.
    """
    return 3 * int(forward_flops) - int(patch_embedding)


def veca_training_flops(
    config: VecaConfig, height: int, width: int, num_core_tokens: int | None = None, batch_size: int = 1
) -> int:
    """FLOPs of a [`VecaModel`] forward and backward (see [`training_flops`]; arguments as [`veca_model_flops`])."""
    forward = veca_model_flops(config, height, width, num_core_tokens, batch_size=batch_size)
    return training_flops(forward, patch_embedding_flops(config, height, width, batch_size))


def dinov3_training_flops(config: Any, height: int, width: int, batch_size: int = 1) -> int:
    """FLOPs of a `DINOv3ViTModel` forward and backward (see [`training_flops`]; arguments as
    [`dinov3_model_flops`])."""
    forward = dinov3_model_flops(config, height, width, batch_size=batch_size)
    return training_flops(forward, patch_embedding_flops(config, height, width, batch_size))


def count_training_flops(step: Callable[[], torch.Tensor]) -> int:
    """Measures the FLOPs of `step().backward()` (forward and backward) with `torch.utils.flop_counter`.

    As in [`count_flops`], SDPA runs as its matmuls (`SDPBackend.MATH`); works on the meta device.

    Args:
        step (`Callable[[], torch.Tensor]`): runs the forward and returns the scalar loss.

    Returns:
        `int`: the total FLOPs counted (multiply-add = 2).
    """
    counter = FlopCounterMode(display=False)
    with sdpa_kernel(SDPBackend.MATH), counter:
        step().backward()
    return int(counter.get_total_flops())
