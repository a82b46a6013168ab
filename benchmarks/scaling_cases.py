# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What `scaling.py` benchmarks: one `Case` per line of the plots (DINOv3, or VECA at one budget) in each mode,
with its call, its analytic FLOPs and its FLOPs counted on the meta device, and the inputs of the attention blocks."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import common  # noqa: F401 - first: the offline Hub defaults, and veca_hf from a source checkout
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from veca_hf import VecaConfig, VecaModel
from veca_hf.cpu.buffers import cpu_inference_buffers
from veca_hf.flops import (
    attention_block_flops,
    count_flops,
    count_training_flops,
    dinov3_model_flops,
    dinov3_training_flops,
    num_patches_for,
    veca_model_flops,
    veca_training_flops,
)
from veca_hf.model.modeling_veca import (
    VecaCorePeripheryAttention,
    VecaRopePositionEmbedding,
    get_patch_coordinates,
)
from veca_hf.training.distillation import (
    DistillationLoss,
    StudentWithLoss,
    dense_student_config,
)
from veca_hf.training.optimization import get_parameter_groups


DINOV3 = "DINOv3"
VECA = "VECA"
# `--dtype`: the dtype of weights and inputs, the autocast dtype (None: no autocast), the GEMM reference's dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.float32}
AUTOCAST_DTYPES = {"fp32": None, "bf16": None, "bf16_autocast": torch.bfloat16}
GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.bfloat16}


# --- inputs for the attention blocks -------------------------------------------------------------------------------
# NOTE: keep the VECA block's calling convention in this one helper: the attention module's signature may change.


def _hidden_states(shape: tuple, dtype: torch.dtype, device: torch.device, generator: torch.Generator | None):
    """Random `(B, T, D)` block inputs; empty ones on the meta device (counting FLOPs needs only the shape)."""
    if device.type == "meta":
        return torch.empty(shape, device=device, dtype=dtype)
    return torch.randn(shape, generator=generator).to(device=device, dtype=dtype)


def make_veca_block_inputs(
    config: VecaConfig,
    batch_size: int,
    height: int,
    width: int,
    num_cores: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> tuple[tuple, dict]:
    """`(args, kwargs)` for one `VecaCorePeripheryAttention` call: `(B, C + N, D)` hidden states, core and patch RoPE.

    Core RoPE uses random core positions in `[-1, 1]^2` (shape `(1, C, Hd)`, shared by the batch, as in the model's
    first block); patch RoPE is the patch grid's `(N, Hd)`. Both come from the public `VecaRopePositionEmbedding` and
    `get_patch_coordinates`, exactly as `VecaModel` builds them.
    """
    device = torch.device(device)
    patch_size = config.patch_size
    num_patches = num_patches_for(height, width, patch_size)
    rope = VecaRopePositionEmbedding(config).to(device)
    on_meta = device.type == "meta"
    core_positions = (
        torch.empty(1, num_cores, 2, device=device)
        if on_meta
        else torch.rand(1, num_cores, 2, generator=generator).mul(2).sub(1).to(device)
    )
    patch_coordinates = get_patch_coordinates(
        height // patch_size, width // patch_size, dtype=torch.float32, device=device
    )  # (N, 2)
    core_cos, core_sin = rope(core_positions)  # (1, C, Hd)
    patch_cos, patch_sin = rope(patch_coordinates)  # (N, Hd)
    hidden_states = _hidden_states((batch_size, num_cores + num_patches, config.hidden_size), dtype, device, generator)
    args = (hidden_states, (core_cos, core_sin), (patch_cos, patch_sin))
    return args, {}


def make_dinov3_block_inputs(
    config: Any,
    batch_size: int,
    height: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device | str,
    generator: torch.Generator | None = None,
) -> tuple[tuple, dict]:
    """`(args, kwargs)` for one transformers `DINOv3ViTAttention` call: `(B, 1 + registers + N, D)` and patch RoPE."""
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTRopePositionEmbedding

    device = torch.device(device)
    num_patches = num_patches_for(height, width, config.patch_size)
    rope = DINOv3ViTRopePositionEmbedding(config).to(device).eval()
    pixel_values = torch.empty(1, config.num_channels, height, width, device=device, dtype=dtype)
    cos, sin = rope(pixel_values)  # (N, Hd), in `dtype`, as in DINOv3ViTModel
    shape = (batch_size, 1 + config.num_register_tokens + num_patches, config.hidden_size)
    return (_hidden_states(shape, dtype, device, generator),), {"position_embeddings": (cos, sin)}


def count_call(fn: Callable[[], Any]) -> int:
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), counter:
        fn()
    return int(counter.get_total_flops())


# --- what is benchmarked -------------------------------------------------------------------------------------------


@dataclass
class Case:
    """One line of the plots: DINOv3, or VECA at one budget, in one mode."""

    model: str  # DINOV3 or VECA
    budget: int | None
    module: nn.Module  # the real module (hooks for the attention share are put on its attention modules)
    make_call: Callable[[int, int], Callable[[], Any]]  # (resolution, batch) -> a zero-argument call
    analytic_flops: Callable[[int, int], int]
    counted_flops: Callable[[int, int], int]
    num_tokens: Callable[[int], int]  # per image

    @property
    def label(self) -> str:
        return DINOV3 if self.model == DINOV3 else f"VECA C={self.budget}"


def autocast_context(args, device: torch.device):
    """`torch.autocast(device, bf16)` for `--dtype bf16_autocast`, else a no-op context."""
    autocast_dtype = AUTOCAST_DTYPES[args.dtype]
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype)


def _dinov3_then_veca(args, patch_size, prefix, dinov3_module, veca_module, make_call, analytic_flops, counted_flops):
    """DINOv3, then VECA at each budget (the order of the interleaved timing). The callables take
    `(budget, resolution, batch)`, budget None = DINOv3; `prefix` is the dense model's tokens besides the patches."""
    cases = []
    for model, module, budget in [(DINOV3, dinov3_module, None)] + [(VECA, veca_module, c) for c in args.budgets]:
        extra_tokens = prefix if budget is None else budget
        cases.append(
            Case(
                model,
                budget,
                module,
                lambda r, b, c=budget: make_call(c, r, b),
                lambda r, b, c=budget: analytic_flops(c, r, b),
                lambda r, b, c=budget: counted_flops(c, r, b),
                lambda r, t=extra_tokens: num_patches_for(r, r, patch_size) + t,
            )
        )
    return cases


def model_cases(args, veca_config, dinov3_config, device, dtype) -> list[Case]:
    """The whole forward: `veca(pixel_values, num_core_tokens=C)` vs `dinov3(pixel_values)`."""
    from transformers import DINOv3ViTModel

    dinov3 = DINOv3ViTModel(dinov3_config).to(device=device, dtype=dtype).eval()
    veca = VecaModel(veca_config).to(device=device, dtype=dtype).eval()
    # One graph per model for every budget and resolution (docs/usage.md); the first call compiles.
    compile_kwargs = dict(dynamic=True, backend=args.compile_backend, mode=args.compile_mode)
    compiled_dinov3 = torch.compile(dinov3, **compile_kwargs) if args.compile else dinov3
    compiled_veca = torch.compile(veca, **compile_kwargs) if args.compile else veca

    def run_veca(x, **kwargs):
        buffers = cpu_inference_buffers(veca) if args.cpu_inference_buffers else contextlib.nullcontext()
        with buffers, autocast_context(args, device):
            return compiled_veca(x, **kwargs)

    def run_dinov3(x):
        with autocast_context(args, device):
            return compiled_dinov3(x)

    with torch.device("meta"):
        meta_dinov3 = DINOv3ViTModel(dinov3_config).eval()
        meta_veca = VecaModel(veca_config).eval()
    pixels: dict = {}

    def pixel_values(resolution, batch):  # one input per point, shared by all models
        key = (resolution, batch)
        if key not in pixels:
            pixels.clear()
            generator = torch.Generator().manual_seed(args.seed)
            pixels[key] = torch.randn(batch, 3, resolution, resolution, generator=generator).to(device, dtype)
        return pixels[key]

    def meta_pixels(resolution, batch):
        return torch.empty(batch, 3, resolution, resolution, device="meta")

    def model_call(c, r, b):
        x = pixel_values(r, b)
        return (lambda: run_dinov3(x)) if c is None else (lambda: run_veca(x, num_core_tokens=c))

    def model_flops(c, r, b):
        if c is None:
            return dinov3_model_flops(dinov3_config, r, r, batch_size=b)
        return veca_model_flops(veca_config, r, r, c, batch_size=b)

    def counted_model_flops(c, r, b):
        if c is None:
            return count_flops(meta_dinov3, meta_pixels(r, b))
        return count_flops(meta_veca, meta_pixels(r, b), num_core_tokens=c)

    prefix = 1 + dinov3_config.num_register_tokens
    return _dinov3_then_veca(
        args, veca_config.patch_size, prefix, dinov3, veca, model_call, model_flops, counted_model_flops
    )


def block_cases(args, veca_config, dinov3_config, device, dtype) -> list[Case]:
    """One attention block (Table S.14): `VecaCorePeripheryAttention` vs transformers' `DINOv3ViTAttention`."""
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention

    patch = veca_config.patch_size
    prefix = 1 + dinov3_config.num_register_tokens
    dinov3_block = DINOv3ViTAttention(dinov3_config).to(device=device, dtype=dtype).eval()
    veca_block = VecaCorePeripheryAttention(veca_config).to(device=device, dtype=dtype).eval()
    with torch.device("meta"):
        meta_dinov3_block = DINOv3ViTAttention(dinov3_config).eval()
        meta_veca_block = VecaCorePeripheryAttention(veca_config).eval()

    def block_call(c, r, b, meta=False):
        generator = torch.Generator().manual_seed(args.seed)
        where, dt = ("meta", torch.float32) if meta else (device, dtype)
        if c is None:
            module = meta_dinov3_block if meta else dinov3_block
            call_args, call_kwargs = make_dinov3_block_inputs(dinov3_config, b, r, r, dt, where, generator)
        else:
            module = meta_veca_block if meta else veca_block
            call_args, call_kwargs = make_veca_block_inputs(veca_config, b, r, r, c, dt, where, generator)
        if meta:
            return lambda: module(*call_args, **call_kwargs)

        def call():
            with autocast_context(args, device):
                return module(*call_args, **call_kwargs)

        return call

    def block_flops(c, r, b):
        cores = dict(num_prefix_tokens=prefix) if c is None else dict(num_core_tokens=c)
        return attention_block_flops(veca_config.hidden_size, num_patches_for(r, r, patch), batch_size=b, **cores)

    def counted_block_flops(c, r, b):
        return count_call(block_call(c, r, b, meta=True))

    return _dinov3_then_veca(
        args, patch, prefix, dinov3_block, veca_block, block_call, block_flops, counted_block_flops
    )


def _train_batches(seed: int, width: int, patch_size: int, device: torch.device):
    """`(resolution, batch, where) -> [pixels, CLS targets (B, D), patch targets (B, N, D)]`: fixed random targets,
    shared by all students; one real batch is kept at a time, meta ones (shapes only) are all kept."""
    batches: dict = {}

    def train_batch(resolution, batch, where=device):
        key = (resolution, batch, str(where))
        if key not in batches:
            shapes = [(batch, 3, resolution, resolution), (batch, width),
                      (batch, num_patches_for(resolution, resolution, patch_size), width)]  # fmt: skip
            if str(where) == "meta":
                batches[key] = [torch.empty(shape, device="meta") for shape in shapes]
            else:
                batches.pop(next((k for k in batches if k[2] != "meta"), None), None)
                generator = torch.Generator().manual_seed(seed)
                batches[key] = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
        return batches[key]

    return train_batch


def train_cases(args, veca_config, dinov3_config, device, dtype) -> list[Case]:
    """One training step of the student alone, as in a distillation step once the teacher's targets exist:
    `StudentWithLoss` (the student and `DistillationLoss`) against fixed random targets, backward, AdamW. The dense
    control is `dense_student_config(veca_config)` (a `DINOv3ViTModel` with VECA's width, depth and SwiGLU MLP, one
    CLS token, no registers), reported under the name DINOv3; `dinov3_config` is not used."""
    from transformers import DINOv3ViTModel

    dense_config = dense_student_config(veca_config)
    dense_config._attn_implementation = args.attn_implementation
    width = veca_config.hidden_size

    def wrap(student):
        return StudentWithLoss(student, DistillationLoss(width, width)).train()

    dense = wrap(DINOv3ViTModel(dense_config)).to(device=device, dtype=dtype)
    veca = wrap(VecaModel(veca_config)).to(device=device, dtype=dtype)
    optimizers = {}
    if not args.no_optimizer_step:
        for module in (dense, veca):
            optimizers[id(module)] = torch.optim.AdamW(get_parameter_groups(module, 0.05), lr=args.learning_rate)
    with torch.device("meta"):
        meta_dense, meta_veca = wrap(DINOv3ViTModel(dense_config)), wrap(VecaModel(veca_config))
    train_batch = _train_batches(args.seed, width, veca_config.patch_size, device)

    def train_call(c, r, b):
        module = dense if c is None else veca
        optimizer = optimizers.get(id(module))
        x, cls, patches = train_batch(r, b)
        x = x.to(dtype)

        def step():
            with autocast_context(args, device):
                loss = module(x, c, cls, patches)["loss"]
            loss.backward()
            if optimizer is not None:
                optimizer.step()
            module.zero_grad(set_to_none=True)
            return loss

        return step

    def train_flops(c, r, b):
        if c is None:
            return dinov3_training_flops(dense_config, r, r, batch_size=b)
        return veca_training_flops(veca_config, r, r, c, batch_size=b)

    def counted_train_flops(c, r, b):
        module = meta_dense if c is None else meta_veca
        x, cls, patches = train_batch(r, b, "meta")
        return count_training_flops(lambda: module(x, c, cls, patches)["loss"])

    prefix = 1 + dense_config.num_register_tokens
    return _dinov3_then_veca(
        args, veca_config.patch_size, prefix, dense, veca, train_call, train_flops, counted_train_flops
    )


CASE_BUILDERS = {"model": model_cases, "block": block_cases, "train": train_cases}


def build_cases(mode: str, args, veca_config, dinov3_config, device, dtype) -> list[Case]:
    """The cases of `mode`: DINOv3 (in train mode: the dense student) first, then VECA at each budget."""
    if mode not in CASE_BUILDERS:
        raise ValueError(mode)
    torch.manual_seed(args.seed)
    return CASE_BUILDERS[mode](args, veca_config, dinov3_config, device, dtype)
