#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Scaling benchmark: VECA against a transformers `DINOv3ViTModel` of the same width and depth.

Both models have random weights. The DINOv3 config copies VECA's hidden size, depth and heads and takes the MLP of
the matching DINOv3 release (intermediate 1536 for S, 3072 for B, 4096 for L; plain GELU MLP), 4 register tokens,
patch 16. Both use the same attention implementation (`--attn_implementation`, default `sdpa`). Per mode, batch
size, resolution and model (DINOv3, and VECA at every budget) it records latency (median, min, max, and the ratio to
DINOv3 as the ratio of the medians and paired within the interleaved rounds), analytic and counted FLOPs, images/s,
the fraction of the GEMM throughput, the share of time in attention, memory peaks and minor page faults. How each
is measured: "How the scaling benchmark measures" in docs/performance.md.

Modes:
- `model`: the whole forward, `veca(pixel_values, num_core_tokens=C)` vs `dinov3(pixel_values)`.
- `block`: one attention block as in the paper's Table S.14 (q/k/v/o projections + attention, no norm, no MLP):
  `VecaCorePeripheryAttention` on `(B, C + N, D)` hidden states vs transformers' `DINOv3ViTAttention` on
  `(B, 5 + N, D)`.
- `both`: the two, one after the other.
- `train`: one training step of the student alone (forward, backward, AdamW), VECA at
  each budget vs the full-attention student of `veca_hf.training.distillation.full_attention_student_config`
  (reported as DINOv3), with the training targets (MET / NOT MET).
- `memory`: peak memory against resolution, VECA at the largest budget vs DINOv3, inference at `--resolutions` and
  one training step (as in `train`) at `--train_resolutions`, every point in a fresh process (`measure_point`: what
  is measured), with the log-log slope of the call's peak against the patches N and the largest square resolution
  within `--memory_limit_gib` (`largest_resolution`).

Outputs in `--output_dir`: `results.json` (machine, command line, GEMM reference, every point, summary),
`results.md` (a table per mode and batch size, and the summary), `latency_vs_resolution.png` and
`flops_vs_resolution.png` (log-log; one line per VECA budget plus DINOv3; a row per mode, a column per batch size);
in memory mode `results.json`, `results.md` and `memory_vs_resolution.png`.

Examples (`--help` for every option):

    python benchmarks/scaling.py --size veca-b16 --threads 2 --output_dir benchmarks/results/b16_cpu_fp32
    python benchmarks/scaling.py --size veca-b16 --mode train --resolutions 224,512,768 --budgets 8,64 --threads 2
    python benchmarks/scaling.py --size veca-b16 --mode memory --threads 2 --output_dir benchmarks/results/b16_memory
    python benchmarks/scaling.py --tiny --resolutions 64,96 --budgets 8,16 --warmup 0 --repeats 1 --gemm_size 128
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import multiprocessing
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import torch
from common import MIB, fmt, paired_median, rounds_within
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from veca_hf import VecaConfig, VecaModel
from veca_hf.cpu.buffers import cpu_inference_buffers
from veca_hf.cpu.hardware import warn_if_slow_bf16
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
from veca_hf.model.modeling_veca import VecaCorePeripheryAttention, VecaRopePositionEmbedding, get_patch_coordinates
from veca_hf.training.distillation import full_attention_student_config


DINOV3 = "DINOv3"
VECA = "VECA"
GIB = 2**30
MODELS = ("DINOv3", "VECA")  # memory mode
PRELOAD = ["torch", "transformers", "veca_hf", "veca_hf.training.distillation", "transformers.models.dinov3_vit"]
# `--dtype`: the dtype of weights and inputs, and the GEMM reference's dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.float32}
GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.bfloat16}


FORWARD_TAG = "veca_bench::forward"
ATTENTION_TAG = "veca_bench::attention"
# Ops that *are* the attention kernel (SDPA, or the eager score/value matmuls and softmax).
ATTENTION_CORE_OPS = {
    "aten::scaled_dot_product_attention",
    "aten::matmul",
    "aten::bmm",
    "aten::baddbmm",
    "aten::softmax",
    "aten::_softmax",
}


# --- command line --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    common.add_model_arguments(parser, resolutions=[256, 384, 512, 768, 1024])
    parser.add_argument("--budgets", type=common.int_list, default=[8, 16, 32, 64], help="VECA budgets C.")
    parser.add_argument("--batch_sizes", type=common.int_list, default=[1])
    parser.add_argument(
        "--num_hidden_layers", type=int, default=None, help="Depth of both models (default: the preset's)."
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=sorted(DTYPES),
        help="fp32; bf16: weights and inputs cast to bfloat16 (inference only); bf16_autocast: fp32 weights under "
        "torch.autocast(device, torch.bfloat16) (inference and training).",
    )
    parser.add_argument(
        "--mode",
        default="model",
        choices=["model", "block", "both", "train", "memory"],
        help="model: whole forward; block: one attention block; both: model then block; train: one training step "
        "of the student alone (forward, backward, optimiser) vs the same-size dense student; memory: peak memory, "
        "each point in a fresh process.",
    )
    parser.add_argument(
        "--train_resolutions", type=common.int_list_or_empty, default=[512, 768], help="Memory mode: training points."
    )
    parser.add_argument(
        "--memory_limit_gib", type=float, default=24.0, help="Memory mode: the limit to extrapolate to."
    )
    parser.add_argument(
        "--fit_min_patches", type=int, default=1024, help="Memory mode: fit over points with N >= this."
    )
    parser.add_argument("--point_timeout", type=float, default=3600, help="Memory mode: seconds per point.")
    parser.add_argument(
        "--bf16_probe_size",
        type=int,
        default=2048,
        help="CPU: side of the fp32 and bf16 torch.mm timed to tell whether this CPU has fast bf16 (0: flags only).",
    )
    parser.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"], help="For both models.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed calls per model and point.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per model and point (interleaved).")
    parser.add_argument("--gemm_size", type=int, default=4096, help="Side of the square torch.mm GEMM reference.")
    parser.add_argument("--gemm_repeats", type=int, default=5, help="Timed GEMMs at the start and again at the end.")
    parser.add_argument(
        "--profile_repeats", type=int, default=3, help="Profiled calls per point (attention share: their median)."
    )
    parser.add_argument("--no_profile", action="store_true", help="Skip profiling (attention share, CPU memory).")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Model mode: time torch.compile(model, dynamic=True) of both models (inductor; the warm-up compiles). "
        "Implies --no_profile (the profiler's module hooks do not fire inside compiled graphs).",
    )
    parser.add_argument("--compile_backend", default="inductor", help="torch.compile backend for --compile.")
    parser.add_argument(
        "--compile_mode",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="torch.compile mode for --compile (max-autotune: inductor's tuned GEMM templates; compiles longer).",
    )
    parser.add_argument(
        "--cpu_inference_buffers",
        action="store_true",
        help="Model mode: run VECA inside veca_hf.cpu.buffers.cpu_inference_buffers (blocks share their large "
        "projection outputs; docs/performance.md).",
    )
    parser.add_argument("--no_plots", action="store_true")
    parser.add_argument(
        "--output_dir", default=None, help="Default: benchmarks/results/<size>_<mode>_<device>_<dtype>[_tiny]."
    )
    parser.set_defaults(resolutions=None)
    args = parser.parse_args(argv)
    if args.resolutions is None:
        args.resolutions = [256, 384, 512, 768, 1024] + ([1536, 2048] if args.mode == "memory" else [])
    if args.mode == "memory" and len(args.batch_sizes) > 1:
        parser.error("--mode memory takes one batch size")
    if args.mode == "memory" and args.dtype == "bf16" and args.train_resolutions:
        parser.error("training points take --dtype fp32 or bf16_autocast (pass --train_resolutions '' to skip)")
    if args.warmup < 0 or args.repeats < 1 or args.profile_repeats < 1:
        parser.error("--warmup must be >= 0, --repeats and --profile_repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    for resolution in args.resolutions + (args.train_resolutions if args.mode == "memory" else []):
        if resolution % 16:
            parser.error(f"resolution {resolution} is not a multiple of the patch size 16")
    if args.mode == "train" and args.dtype == "bf16":
        parser.error("--mode train takes --dtype fp32 or bf16_autocast (bf16 weights have no fp32 master copy)")
    if args.compile:
        if args.mode != "model":
            parser.error("--compile applies to --mode model only")
        args.no_profile = True
    if args.output_dir is None:
        name = f"{args.size}_{args.mode}_{args.device}_{args.dtype}" + ("_compiled" if args.compile else "")
        args.output_dir = common.default_output_dir(name, args.tiny)
    return args


# --- configs and cases --------------------------------------------------------------------------------------------


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
    return common.autocast(device, args.dtype == "bf16_autocast")


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
    `common.student_with_loss` against fixed random targets, backward, AdamW. The dense control (the dense student of
    `full_attention_student_config`) is reported under the name DINOv3; `dinov3_config` is not used."""
    dense_config = full_attention_student_config(veca_config)
    width = veca_config.hidden_size

    def students():
        return [common.student_with_loss(veca_config, dense, attn_implementation=args.attn_implementation)
                for dense in (True, False)]  # fmt: skip

    dense, veca = (module.to(device=device, dtype=dtype) for module in students())
    optimizers = {id(module): common.adamw(module, 1e-5) for module in (dense, veca)}
    with torch.device("meta"):
        meta_dense, meta_veca = students()
    train_batch = _train_batches(args.seed, width, veca_config.patch_size, device)

    def train_call(c, r, b):
        module = dense if c is None else veca
        x, cls, patches = train_batch(r, b)
        x = x.to(dtype)
        return lambda: common.train_step(
            module, x, c, cls, patches, optimizers.get(id(module)), lambda: autocast_context(args, device)
        )

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
    torch.manual_seed(args.seed)
    return CASE_BUILDERS[mode](args, veca_config, dinov3_config, device, dtype)


# --- profiling (attention share, CPU memory), CUDA memory ----------------------------------------------------------


def _attention_modules(module: nn.Module) -> list[nn.Module]:
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention

    kinds = (VecaCorePeripheryAttention, DINOv3ViTAttention)
    return [m for m in module.modules() if isinstance(m, kinds)]


def _tag_modules(modules: list[nn.Module], name: str) -> list:
    """Forward pre/post hooks that wrap each module's forward in `record_function(name)`; returns the handles."""
    from torch.autograd.profiler import record_function

    handles = []
    for module in modules:
        stack: list = []

        def pre_hook(_module, _args, stack=stack):
            ctx = record_function(name)
            ctx.__enter__()
            stack.append(ctx)

        def post_hook(_module, _args, _output, stack=stack):
            stack.pop().__exit__(None, None, None)

        handles.append(module.register_forward_pre_hook(pre_hook))
        handles.append(module.register_forward_hook(post_hook))
    return handles


def _ancestors(event) -> list:
    out = []
    parent = event.cpu_parent
    while parent is not None:
        out.append(parent)
        parent = parent.cpu_parent
    return out


def profile_call(fn: Callable[[], Any], module: nn.Module, device: torch.device) -> dict[str, Any]:
    """One profiled call: attention shares, and on CPU the forward's peak of allocated bytes."""
    from torch.autograd import DeviceType
    from torch.autograd.profiler import record_function
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    handles = _tag_modules(_attention_modules(module), ATTENTION_TAG)
    try:
        common.synchronize(device)
        with profile(activities=activities, profile_memory=device.type == "cpu") as prof:
            with record_function(FORWARD_TAG):
                fn()
            common.synchronize(device)
    finally:
        for handle in handles:
            handle.remove()

    use_device = device.type == "cuda"
    total = attention = core = 0.0
    for event in prof.events():
        if event.device_type != DeviceType.CPU:  # device-side kernels are summed on their CPU op (self device time)
            continue
        names = [event.name] + [a.name for a in _ancestors(event)]
        if FORWARD_TAG not in names:
            continue
        self_time = event.self_device_time_total if use_device else event.self_cpu_time_total
        total += self_time
        if ATTENTION_TAG in names:
            attention += self_time
            chain = names[: names.index(ATTENTION_TAG)]  # this op and its ancestors inside the attention module
            if any(n in ATTENTION_CORE_OPS for n in chain) and "aten::linear" not in chain:
                core += self_time
    result: dict[str, Any] = {
        "attention_module_share": attention / total if total > 0 else None,
        "attention_core_share": core / total if total > 0 else None,
        "profile_time_basis": "self device time" if use_device else "self CPU time",
    }
    if device.type == "cpu":
        result["forward_peak_bytes"] = _cpu_peak_bytes(prof)
    return result


def merge_profiles(runs: list[dict], device: torch.device) -> dict[str, Any]:
    """Median attention shares over the profiled calls (one call can be hit by a preemption); max CPU peak."""
    merged: dict[str, Any] = {"profile_time_basis": runs[0]["profile_time_basis"], "profile_calls": len(runs)}
    for key in ("attention_module_share", "attention_core_share"):
        values = [r[key] for r in runs if r[key] is not None]
        merged[key] = statistics.median(values) if values else None
    if device.type == "cpu":
        peaks = [r["forward_peak_bytes"] for r in runs if r.get("forward_peak_bytes") is not None]
        merged["forward_peak_bytes"] = max(peaks) if peaks else None
    return merged


def _cpu_peak_bytes(prof) -> int | None:
    """Running maximum of the profiler's CPU allocation/free events (bytes above the level at the start)."""
    try:
        events = prof.profiler.kineto_results.events()
    except AttributeError:  # pragma: no cover - private API moved
        return None
    memory = sorted(
        (e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and str(e.device_type()).endswith("CPU")
    )
    current = peak = 0
    for _, nbytes in memory:
        current += nbytes
        peak = max(peak, current)
    return peak


def cuda_forward_peak_bytes(fn: Callable[[], Any], device: torch.device) -> int:
    common.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    common.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# --- the benchmark -------------------------------------------------------------------------------------------------


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_mode(mode, args, veca_config, dinov3_config, device, dtype, log) -> list[dict]:
    cases = build_cases(mode, args, veca_config, dinov3_config, device, dtype)
    # NOTE: the GEMM reference is timed inside the interleaved rounds too: on a shared machine the throughput drifts
    # (82 and 129 GFLOP/s at the start and end of one run here), and the points are compared with their own rounds.
    gemm, gemm_flops = common.make_gemm(args.gemm_size, GEMM_DTYPES[args.dtype], device)
    points: list[dict] = []
    for batch in args.batch_sizes:
        # NOTE: every resolution runs in the same rounds, so that ratios across resolutions (latency per token) are
        # paired in time as the VECA/DINOv3 ratios are.
        keys = [(resolution, case) for resolution in args.resolutions for case in cases]
        log(f"[{mode}] batch {batch}, resolutions {', '.join(map(str, args.resolutions))} px, interleaved")
        calls: dict[tuple, Callable | None] = {}
        errors: dict[tuple, str] = {}

        def attempt(key, action, errors=errors, calls=calls):
            try:
                return action()
            except Exception as error:  # noqa: BLE001 - record OOM (or anything) and go on
                if not _is_oom(error) and not isinstance(error, RuntimeError):
                    raise
                errors[key] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                calls[key] = None
                _release(device)
                return None

        # NOTE: train mode needs autograd; the others run without it.
        with torch.inference_mode() if mode != "train" else contextlib.nullcontext():
            for resolution, case in keys:
                key = (resolution, case.label)
                calls[key] = attempt(key, lambda r=resolution, case=case, batch=batch: case.make_call(r, batch))
            first_call: dict[tuple, float] = {}  # the first warm-up call's seconds: with --compile, the compile too
            for _ in range(args.warmup):
                for key, call in calls.items():
                    if call is not None:
                        start = time.perf_counter()
                        attempt(key, call)
                        first_call.setdefault(key, time.perf_counter() - start)
            # One round: the GEMM, then per resolution DINOv3 and each budget (rotated). Lists are indexed by round;
            # None where a call failed.
            samples: dict[tuple, list[float | None]] = {key: [] for key in calls}
            faults: dict[tuple, list[int]] = {key: [] for key in calls}
            gemm_samples = []
            order = list(calls)
            for round_index in range(args.repeats):
                gemm_samples.append(gemm_flops / common.time_call(gemm, device))
                shift = round_index % len(order)
                for key in order[shift:] + order[:shift]:  # rotated: no point always follows the same one
                    call = calls[key]
                    seconds = None
                    if call is not None:
                        faults_before = common.minor_page_faults()
                        seconds = attempt(key, lambda call=call: common.time_call(call, device))
                        if seconds is not None and faults_before is not None:
                            faults[key].append(common.minor_page_faults() - faults_before)
                    samples[key].append(seconds)
            extra: dict[tuple, dict] = {key: {"first_call_s": first_call.get(key)} for key in calls}
            for resolution, case in keys:
                key = (resolution, case.label)
                call = calls[key]
                if call is None:
                    continue
                if device.type == "cuda":
                    peak = attempt(key, lambda call=call: cuda_forward_peak_bytes(call, device))
                    extra[key]["forward_peak_bytes"] = peak
                if not args.no_profile:
                    runs = [
                        attempt(key, lambda call=call, case=case: profile_call(call, case.module, device))
                        for _ in range(args.profile_repeats)
                    ]
                    if all(runs):
                        extra[key].update(merge_profiles(runs, device))

        gemm_reference = statistics.median(gemm_samples)
        for resolution in args.resolutions:
            num_patches = num_patches_for(resolution, resolution, veca_config.patch_size)
            log(f"    {resolution} px (N = {num_patches})")
            mode_points = []
            for case in cases:
                key = (resolution, case.label)
                if mode == "model":
                    input_bytes = batch * 3 * resolution**2 * dtype.itemsize
                else:
                    input_bytes = batch * case.num_tokens(resolution) * veca_config.hidden_size * dtype.itemsize
                analytic = case.analytic_flops(resolution, batch)
                counted = case.counted_flops(resolution, batch)
                rounds = samples[key]
                times = [t for t in rounds if t is not None]
                point: dict[str, Any] = {
                    "mode": mode,
                    "batch_size": batch,
                    "resolution": resolution,
                    "num_patches": num_patches,
                    "model": case.model,
                    "budget": case.budget,
                    "label": case.label,
                    "num_tokens": case.num_tokens(resolution),
                    "flops_analytic": analytic,
                    "flops_counted": counted,
                    "flops_match": analytic == counted,
                    "error": errors.get(key),
                }
                if times:
                    median = statistics.median(times)
                    achieved = analytic / median
                    point.update(
                        latency_ms={
                            "median": 1e3 * median,
                            "min": 1e3 * min(times),
                            "max": 1e3 * max(times),
                            "samples": [None if t is None else 1e3 * t for t in rounds],  # one per round
                        },
                        images_per_s=batch / median,
                        achieved_gflops_per_s=achieved / 1e9,
                        gemm_reference_gflops_per_s=gemm_reference / 1e9,
                        gemm_fraction=achieved / gemm_reference,
                        latency_per_token_us=1e6 * median / (batch * case.num_tokens(resolution)),
                        minor_page_faults_per_call=statistics.median(faults[key]) if faults[key] else None,
                    )
                else:
                    point["latency_ms"] = None
                peak = extra[key].get("forward_peak_bytes")
                weights = common.param_bytes(case.module)
                point.update(
                    first_call_s=extra[key]["first_call_s"],  # with --compile: compile + one call
                    attention_module_share=extra[key].get("attention_module_share"),
                    attention_core_share=extra[key].get("attention_core_share"),
                    forward_peak_mb=None if peak is None else peak / MIB,
                    weights_mb=weights / MIB,
                    peak_memory_mb=None if peak is None else (peak + weights + input_bytes) / MIB,
                    memory_method=(
                        "torch.cuda.max_memory_allocated - allocated before the call"
                        if device.type == "cuda"
                        else ("torch.profiler allocation events (running max)" if peak is not None else None)
                    ),
                )
                mode_points.append(point)

            dense = next(p for p in mode_points if p["model"] == DINOV3)
            dense_rounds = samples[(resolution, DINOV3)]
            for point in mode_points:
                point["flop_ratio_vs_dinov3"] = point["flops_analytic"] / dense["flops_analytic"]
                both = point["latency_ms"] and dense["latency_ms"]
                point["latency_ratio_vs_dinov3"] = (
                    point["latency_ms"]["median"] / dense["latency_ms"]["median"] if both else None
                )
                point["paired_latency_ratio_vs_dinov3"] = paired_median(
                    samples[(resolution, point["label"])], dense_rounds
                )
                log("    " + one_line(point))
            points.extend(mode_points)
        calls.clear()
        _release(device)
    return points


# --- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.mode == "memory":
        return run_memory(args, argv)
    device, dtype, output_dir = torch.device(args.device), DTYPES[args.dtype], Path(args.output_dir)

    def log(message: str) -> None:
        print(message, flush=True)

    veca_config, dinov3_config = common.model_configs(
        args.size, args.tiny, args.budgets, args.num_hidden_layers, args.attn_implementation
    )
    modes = ["model", "block"] if args.mode == "both" else [args.mode]
    machine = common.start(args, args.bf16_probe_size)
    allocator = machine["cpu_allocator"]
    log(
        f"device {machine['device_name']}, torch {machine['torch_version']}, {machine['torch_num_threads']} threads, "
        f"glibc malloc settings: {'veca_hf' if allocator['tuned'] else 'default'} ({allocator['reason']})"
    )

    gemm_dtype = GEMM_DTYPES[args.dtype]
    if machine.get("bf16"):
        bf16 = machine["bf16"]
        timing = (
            f"; torch.mm {bf16['mm_size']}^2 fp32 {bf16['fp32_gflops_per_s']:.1f}, {bf16['bf16_mm_size']}^2 bf16 "
            f"{bf16['bf16_gflops_per_s']:.1f} GFLOP/s; F.linear fp32 {bf16['linear_fp32_gflops_per_s']:.1f}, bf16 "
            f"{bf16['linear_bf16_gflops_per_s']:.1f} GFLOP/s"
            if bf16.get("mm_size")
            else ""
        )
        log(f"CPU {bf16['cpu_kind']}: flags {bf16['flags']}{timing}; fast bf16: {bf16['fast_bf16']}")
    gemm_start = common.measure_gemm(args.gemm_size, gemm_dtype, device, args.gemm_repeats)
    log(f"GEMM {args.gemm_size}^2 {args.dtype}: {statistics.median(gemm_start) / 1e9:.1f} GFLOP/s (start)")

    notes = [
        "Random weights. dtype bf16 = models and inputs cast to bfloat16 (no autocast); bf16_autocast = fp32 "
        "weights under torch.autocast(device, torch.bfloat16) (the GEMM reference then runs in bf16).",
        "FLOPs count matmuls/linears/convs only (multiply-add = 2), as torch.utils.flop_counter does; counted on the "
        "meta device under sdpa_kernel(SDPBackend.MATH) because the counter does not see the CPU flash SDPA kernel.",
        "Attention share comes from a profiled run (profiler overhead included); the timed runs have no hooks.",
    ]
    if "train" in modes:
        notes.append(
            "Train mode: one step of the student alone (StudentWithLoss with DistillationLoss against fixed random "
            "targets, backward, AdamW step at learning rate 1e-5), VECA vs "
            "the full-attention student of veca_hf.training.distillation.full_attention_student_config "
            "(DINOv3ViTModel, same width, "
            "depth and SwiGLU MLP, CLS, no registers), both in train mode. Training FLOPs: analytic 3 x forward - "
            "patch embedding (its input needs no gradient), which is what the counter measures; the optimiser step "
            "and the loss are elementwise and not counted. The attention share is that of the forward's attention "
            "modules in the whole step."
        )
    warning = gemm_dtype == torch.bfloat16 and warn_if_slow_bf16(device, f"--dtype {args.dtype}")
    if warning:  # logged; the results say it too
        notes.append(warning + " The bf16 timings below mostly measure those fallback kernels (GEMM fraction > 1).")
    if device.type == "cpu":
        notes.append(
            "CPU memory: from torch.profiler allocation events (tensor allocations through torch's CPU allocator); "
            "RSS is not used (allocator caching and other processes make it unreliable)."
        )
    points: list[dict] = []
    for mode in modes:
        points += run_mode(mode, args, veca_config, dinov3_config, device, dtype, log)

    gemm_end = common.measure_gemm(args.gemm_size, gemm_dtype, device, args.gemm_repeats)
    gemm_all = gemm_start + gemm_end
    gemm_reference = statistics.median(gemm_all)
    log(f"GEMM {args.gemm_size}^2 {args.dtype}: {statistics.median(gemm_end) / 1e9:.1f} GFLOP/s (end)")
    machine["loadavg_end"] = common.loadavg()
    if any(not p["flops_match"] for p in points):
        notes.append("Some counted FLOPs differ from the analytic ones: see flops_match in results.json.")

    summary = summarize(points, args)
    targets = train_targets(points, args) if "train" in modes else []
    shared = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "models": {
            "veca": {k: getattr(veca_config, k) for k in (*shared, "core_bank_size")},
            "dinov3": {k: getattr(dinov3_config, k) for k in (*shared, "num_register_tokens", "use_gated_mlp")},
        },
        "gemm": {
            "size": args.gemm_size,
            "dtype": args.dtype,
            "median_gflops_per_s": gemm_reference / 1e9,
            "start_median_gflops_per_s": statistics.median(gemm_start) / 1e9,
            "end_median_gflops_per_s": statistics.median(gemm_end) / 1e9,
            "samples_gflops_per_s": [g / 1e9 for g in gemm_all],
        },  # fmt: skip
        "points": points,
        "summary": summary,
        "train_targets": targets,
        "notes": notes,
    }
    if "train" in modes:  # train mode's "DINOv3" is the dense student, not dinov3_config
        dense = full_attention_student_config(veca_config)
        result["models"]["dense_student"] = {
            k: getattr(dense, k) for k in (*shared, "num_register_tokens", "use_gated_mlp")
        }
    common.write_results(output_dir, result, markdown(result))
    if not args.no_plots:
        plot(points, args, output_dir)
    log(
        "\n".join(
            ["", "Summary", *summary_lines(summary)]
            + (["Training targets", *train_target_lines(targets)] if targets else [])
            + [f"wrote {output_dir}"]
        )
    )
    return result


# --- memory mode: one point in a fresh process ---------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets this process's resident high-water mark (`VmHWM`); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _ru_maxrss_bytes() -> int:
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def build_point(spec: dict[str, Any]):
    """The module and a zero-argument call of one point (also used by the tests)."""
    from transformers import DINOv3ViTModel

    veca_config, dinov3_config = common.model_configs(
        spec["size"], spec["tiny"], [spec["budget"]], attn_implementation=spec["attn_implementation"]
    )
    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    torch.manual_seed(spec["seed"])
    r, b, veca = spec["resolution"], spec["batch_size"], spec["model"] == "VECA"
    budget = spec["budget"] if veca else None
    generator = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(b, 3, r, r, generator=generator).to(device, dtype)

    def context():
        return common.autocast(device, spec["dtype"] == "bf16_autocast")

    if spec["phase"] == "inference":
        model = VecaModel(veca_config) if veca else DINOv3ViTModel(dinov3_config)
        model = model.to(device=device, dtype=dtype).eval()
        kwargs = {"num_core_tokens": budget} if veca else {}

        def call():
            with torch.inference_mode(), context():
                model(x, **kwargs)

        return model, call
    model = common.student_with_loss(veca_config, not veca, attn_implementation=spec["attn_implementation"])
    model = model.to(device)
    optimizer = common.adamw(model, 1e-5)
    width = veca_config.hidden_size
    cls = torch.randn(b, width, generator=generator).to(device)
    patches = torch.randn(b, (r // 16) ** 2, width, generator=generator).to(device)
    return model, lambda: common.train_step(model, x, budget, cls, patches, optimizer, context)


def measure_point(spec: dict[str, Any]) -> dict[str, Any]:
    """Builds one point, runs its call once, and returns its peak memory, in a fresh process forked from a server that
    imported torch, transformers and veca_hf but allocated no model. CPU: the resident set's high-water mark (`VmHWM`,
    reset through `/proc/self/clear_refs` just before the call; else the process's `ru_maxrss`); CUDA:
    `max_memory_allocated`. `peak_mb`: all of it (weights and input included); `call_peak_mb`: above the start."""
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    common.apply_cpu_allocator(argparse.Namespace(cpu_allocator=spec["cpu_allocator"]))  # this fresh process's
    model, call = build_point(spec)
    out: dict[str, Any] = {"weights_mb": common.param_bytes(model) / MIB}
    if spec["device"] == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated()
        out.update(method="torch.cuda.max_memory_allocated", before_mb=before / MIB, peak_mb=peak / MIB,
                   call_peak_mb=(peak - before) / MIB)  # fmt: skip
        return out
    rss_before = (_status_kib("VmRSS") or 0) * 1024
    reset = _reset_peak_rss()
    start = time.perf_counter()
    call()
    out["seconds"] = time.perf_counter() - start
    if reset:
        peak, method = _status_kib("VmHWM") * 1024, "VmHWM after clear_refs (fresh process)"
    else:
        peak, method = _ru_maxrss_bytes(), "ru_maxrss (fresh process)"
    out.update(method=method, before_mb=rss_before / MIB, peak_mb=peak / MIB,
               call_peak_mb=max(0, peak - rss_before) / MIB)  # fmt: skip
    return out


def _child(spec: dict[str, Any], queue) -> None:
    try:
        queue.put(measure_point(spec))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"})


def run_point(context, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    queue = context.Queue()
    process = context.Process(target=_child, args=(spec, queue))
    process.start()
    result = None
    try:
        result = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - queue.Empty on timeout, or the child died
        pass
    process.join(timeout=30)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        reason = f"timed out after {timeout:.0f} s" if process.exitcode in (None, -9) else "died"
        result = {"error": f"process {reason} (exit code {process.exitcode}; killed for memory?)"}
    return result


# --- fits, summary, outputs ----------------------------------------------------------------------------------------


def fit_loglog(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares line through `(log x, log y)`: `slope`, `log_intercept` (natural log), `r2`."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=False) if x > 0 and y > 0]
    if len(pairs) < 2 or len({p[0] for p in pairs}) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    sxx = sum((p[0] - mx) ** 2 for p in pairs)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pairs)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((p[1] - my) ** 2 for p in pairs)
    ss_res = sum((p[1] - intercept - slope * p[0]) ** 2 for p in pairs)
    return {"slope": slope, "log_intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "num_points": len(pairs)}  # fmt: skip


def largest_resolution(points: list[dict], fit: dict | None, limit_mb: float, patch: int = 16) -> dict[str, Any]:
    """Largest square resolution within `limit_mb`: measured if a run point reached the limit, else extrapolated."""
    ok = [p for p in points if p.get("peak_mb") is not None]
    within = [p["resolution"] for p in ok if p["peak_mb"] <= limit_mb]
    over = [p["resolution"] for p in points if (p.get("peak_mb") or 0) > limit_mb or p.get("error")]
    best = max(within) if within else None
    if over and best is not None and min(over) > best:
        return {"resolution": best, "extrapolated": False, "note": f"measured: {min(over)} px did not fit or failed"}
    if fit is None or not ok:
        return {"resolution": best, "extrapolated": False, "note": "no fit"}
    base = sorted(p["before_mb"] for p in ok)[len(ok) // 2]
    if limit_mb <= base:
        return {"resolution": None, "extrapolated": True, "note": "the limit is below the memory before the call"}
    # Through the largest measured point, with the local slope but at least 1: activations grow at least linearly in
    # N, and a smaller slope (fixed costs still visible) would over-reach.
    slope = max(fit["slope"], 1.0)
    last = max(ok, key=lambda p: p["num_patches"])
    scale = last["call_peak_mb"] / last["num_patches"] ** slope
    num_patches = ((limit_mb - base) / scale) ** (1 / slope)
    resolution = int(math.sqrt(num_patches)) * patch
    extrapolated = best is None or resolution > best
    return {"resolution": resolution, "extrapolated": extrapolated, "num_patches": num_patches,
            "slope_used": slope,
            "note": (f"extrapolated: base + a N^{slope:.2f} through the largest point" if extrapolated
                     else "measured")}  # fmt: skip


def memory_summary(points: list[dict], args) -> dict[str, Any]:
    limit_mb = args.memory_limit_gib * GIB / MIB
    out: dict[str, Any] = {"memory_limit_gib": args.memory_limit_gib, "fits": {}, "largest_resolution": {}}
    for phase in ("inference", "train"):
        for model in MODELS:
            mine = [p for p in points if p["phase"] == phase and p["model"] == model and p.get("call_peak_mb")]
            used = [p for p in mine if p["num_patches"] >= args.fit_min_patches]
            if len(used) < 2:  # too few large points (tiny runs): fit over all of them
                used = mine
            fit = fit_loglog([p["num_patches"] for p in used], [p["call_peak_mb"] for p in used])
            key = f"{phase}/{model}"
            out["fits"][key] = fit and {**fit, "fitted_resolutions": [p["resolution"] for p in used]}
            if phase == "inference":
                # NOTE: extrapolate with the local slope of the two largest points: at small N the fixed part of
                # the call peak (allocator, kernel scratch) flattens the whole-range fit, which then over-reaches.
                last = sorted(mine, key=lambda p: p["num_patches"])[-2:]
                local = fit_loglog([p["num_patches"] for p in last], [p["call_peak_mb"] for p in last])
                out["fits"][f"{key} (two largest, for the limit)"] = local and {
                    **local,
                    "fitted_resolutions": [p["resolution"] for p in last],
                }
                every = [p for p in points if p["phase"] == phase and p["model"] == model]
                out["largest_resolution"][key] = largest_resolution(every, local, limit_mb)
    return out


def memory_markdown(result: dict) -> str:
    args, machine = result["args"], result["machine"]
    out = [
        f"# Peak memory vs resolution: {args['size']}{' (tiny)' if args['tiny'] else ''}, {args['device']}, "
        f"{args['dtype']}, {args['attn_implementation']}, batch {args['batch_sizes'][0]}, "
        f"VECA C={max(args['budgets'])}",
        "",
        f"- command: `{result['command']}`",
        common.machine_line(machine) + f"; {machine['threads']} threads per point",
        "- each point in a fresh process (forked from a server that imported torch only); peak = "
        + ("CUDA max_memory_allocated" if args["device"] == "cuda" else "resident high-water mark (VmHWM / ru_maxrss)")
        + "; call peak = peak - memory just before the call",
        "",
    ]

    def f(point, key, spec=".1f"):
        return "-" if point.get(key) is None else format(point[key], spec)

    columns = [
        "phase",
        "model",
        "res",
        "N",
        "peak MB",
        "call peak MB",
        "before MB",
        "weights MB",
        "s",
        "method / error",
    ]
    out += common.table(columns, [[p["phase"], p["model"], p["resolution"], p["num_patches"], f(p, "peak_mb"),
                                   f(p, "call_peak_mb"), f(p, "before_mb"), f(p, "weights_mb"), f(p, "seconds", ".2f"),
                                   p.get("error") or p.get("method")] for p in result["points"]])  # fmt: skip
    out += ["", "## Fits and limits", ""] + memory_summary_lines(result["summary"]) + [""]
    return "\n".join(out)


def memory_summary_lines(summary: dict) -> list[str]:
    lines = []
    for key, fit in summary["fits"].items():
        if fit is None:
            lines.append(f"- {key}: no fit (fewer than 2 points)")
            continue
        lines.append(
            f"- {key}: log-log slope of the call peak vs N {fit['slope']:.3f} (r^2 {fit['r2']:.4f}, "
            f"{fit['num_points']} points: {', '.join(map(str, fit['fitted_resolutions']))} px)"
        )
    for key, entry in summary["largest_resolution"].items():
        lines.append(
            f"- {key}: largest resolution within {summary['memory_limit_gib']:g} GiB: {entry['resolution']} px "
            f"({entry['note']})"
        )
    return lines


def memory_plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for phase, style in (("inference", "-"), ("train", "--")):
        for model, color in (("DINOv3", "black"), ("VECA", "tab:green")):
            mine = [p for p in result["points"] if (p["phase"], p["model"]) == (phase, model) and p.get("peak_mb")]
            if mine:
                ax.plot([p["num_patches"] for p in mine], [p["peak_mb"] for p in mine], style, marker="o",
                        color=color, label=f"{model} {phase}")  # fmt: skip
    ax.axhline(result["summary"]["memory_limit_gib"] * 1024, color="red", linewidth=1, label="limit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("patches N")
    ax.set_ylabel("peak memory (MB)")
    args = result["args"]
    ax.set_title(f"{args['size']}{' tiny' if args['tiny'] else ''} {args['device']} {args['dtype']}, "
                 f"batch {args['batch_sizes'][0]}")  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_memory(args: argparse.Namespace, argv: list[str] | None) -> dict:
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(PRELOAD)

    machine = common.machine_info(args.device) | {
        "threads": args.threads or common.torch.get_num_threads(),
        "start_method": context.get_start_method(),
        "cpu_allocator": args.cpu_allocator,  # applied in each point's process
    }
    plan = [("inference", r) for r in sorted(args.resolutions)] + [
        ("train", r) for r in sorted(args.train_resolutions)
    ]
    points = []
    failed: set = set()
    for phase, resolution in plan:
        for model in MODELS:  # the two models of one resolution back to back
            spec = {"phase": phase, "model": model, "resolution": resolution, "size": args.size, "tiny": args.tiny,
                    "budget": max(args.budgets), "batch_size": args.batch_sizes[0], "device": args.device,
                    "dtype": args.dtype, "attn_implementation": args.attn_implementation, "threads": args.threads,
                    "seed": args.seed, "cpu_allocator": args.cpu_allocator}  # fmt: skip
            point = {k: spec[k] for k in ("phase", "model", "resolution")} | {"num_patches": (resolution // 16) ** 2}
            if (phase, model) in failed:
                point["error"] = "skipped: a smaller resolution already failed"
            else:
                point.update(run_point(context, spec, args.point_timeout))
                if point.get("error"):
                    failed.add((phase, model))
            points.append(point)
            shown = (
                "failed: " + point["error"]
                if point.get("error")
                else (
                    f"peak {point['peak_mb']:.1f} MB, call peak {point['call_peak_mb']:.1f} MB, "
                    f"{point['seconds']:.2f} s"
                )
            )
            print(f"{phase:9s} {model:6s} {resolution:5d} px  {shown}", flush=True)
    summary = memory_summary(points, args)
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "points": points,
        "summary": summary,
    }
    common.write_results(output_dir, result, memory_markdown(result))
    if not args.no_plots:
        memory_plot(result, output_dir / "memory_vs_resolution.png")
    for line in memory_summary_lines(summary):
        print(line)
    print(f"wrote {output_dir}")
    return result


# --- report -------------------------------------------------------------------------------------------------------


MODE_ORDER = ["model", "block", "train"]
# Training targets: at these resolutions VECA's step time over the dense student's is at most their
# training FLOP ratio plus this margin (paired ratios of one run).
TRAIN_TARGET_RESOLUTIONS = (512, 768)
TRAIN_TARGET_MARGIN = 0.03


def one_line(p: dict) -> str:
    """The log line of a point (every number is in results.json and results.md)."""
    lat = p["latency_ms"]
    text = f"{p['label']:<12} {p['flops_analytic'] / 1e9:9.3f} GFLOPs"
    text += f"  {lat['median']:9.2f} ms [{lat['min']:.2f}-{lat['max']:.2f}]" if lat else "  (failed)"
    if p["model"] == VECA and p.get("paired_latency_ratio_vs_dinov3") is not None:
        text += f"  x{p['paired_latency_ratio_vs_dinov3']:.3f} time (paired), x{p['flop_ratio_vs_dinov3']:.3f} FLOPs"
    return text + ("" if p["flops_match"] else f"  COUNTED {p['flops_counted']} != ANALYTIC {p['flops_analytic']}")


def _find(points, mode, batch, resolution, model, budget=None):
    for p in points:
        if (p["mode"], p["batch_size"], p["resolution"], p["model"]) == (mode, batch, resolution, model) and (
            model == DINOV3 or p["budget"] == budget
        ):
            return p
    return None


def _median(p):
    return p["latency_ms"]["median"] if p and p.get("latency_ms") else None


def summarize(points: list[dict], args) -> list[dict]:
    """The speed targets per mode and batch size, for the largest budget (C = 64 by default).

    - at the largest resolution and at 512 px (or the smallest, if 512 was not run or is the largest): latency
      ratio VECA/DINOv3 vs FLOP ratio;
    - VECA's latency per token (latency / (B (N + C))) at the largest resolution over that at 512 px: 1 means
      linear scaling in tokens;
    - each latency ratio also paired: the median over the interleaved rounds of the ratio within one round;
    - VECA's (and DINOv3's) achieved fraction of the GEMM throughput at the largest resolution.
    """
    budget = max(args.budgets)
    largest = max(args.resolutions)
    reference = 512 if 512 in args.resolutions and 512 < largest else min(args.resolutions)
    summaries = []
    modes = sorted({p["mode"] for p in points}, key=MODE_ORDER.index)
    for mode in modes:
        for batch in args.batch_sizes:
            entry: dict[str, Any] = {
                "mode": mode,
                "batch_size": batch,
                "budget": budget,
                "largest_resolution": largest,
                "reference_resolution": reference,
                "ratios": {},
            }
            for resolution in sorted({largest, reference}):
                veca = _find(points, mode, batch, resolution, VECA, budget)
                entry["ratios"][str(resolution)] = {
                    "latency_ratio": veca.get("latency_ratio_vs_dinov3") if veca else None,
                    "paired_latency_ratio": veca.get("paired_latency_ratio_vs_dinov3") if veca else None,
                    "flop_ratio": veca.get("flop_ratio_vs_dinov3") if veca else None,
                }
            veca_large = _find(points, mode, batch, largest, VECA, budget)
            veca_ref = _find(points, mode, batch, reference, VECA, budget)
            dense_large = _find(points, mode, batch, largest, DINOV3)
            dense_ref = _find(points, mode, batch, reference, DINOV3)

            def per_token_ratio(a, b):
                if a is not b and a and b and a.get("latency_per_token_us") and b.get("latency_per_token_us"):
                    return a["latency_per_token_us"] / b["latency_per_token_us"]
                return None

            def paired_per_token_ratio(a, b):
                if a is b or not (a and b and a.get("latency_ms") and b.get("latency_ms")):
                    return None
                ratio = paired_median(a["latency_ms"]["samples"], b["latency_ms"]["samples"])
                return None if ratio is None else ratio * b["num_tokens"] / a["num_tokens"]

            entry["veca_per_token_latency_ratio"] = per_token_ratio(veca_large, veca_ref)
            entry["dinov3_per_token_latency_ratio"] = per_token_ratio(dense_large, dense_ref)
            entry["veca_paired_per_token_latency_ratio"] = paired_per_token_ratio(veca_large, veca_ref)
            entry["dinov3_paired_per_token_latency_ratio"] = paired_per_token_ratio(dense_large, dense_ref)
            entry["veca_gemm_fraction_at_largest"] = veca_large.get("gemm_fraction") if veca_large else None
            entry["dinov3_gemm_fraction_at_largest"] = dense_large.get("gemm_fraction") if dense_large else None
            summaries.append(entry)
    return summaries


def train_targets(points: list[dict], args) -> list[dict]:
    """The training targets, from the paired rounds of one run, per batch size and resolution:

    - per budget: VECA's step time over the dense student's (paired) is at most their training FLOP ratio + 0.03
      (targets at 512 and 768 px: `target_resolution`);
    - the step at the smallest budget (C = 8) takes at most as long as at the largest (C = 64): paired ratio <= 1.
    """
    out = []
    small, large = min(args.budgets), max(args.budgets)
    for batch in args.batch_sizes:
        for resolution in args.resolutions:
            dense = _find(points, "train", batch, resolution, DINOV3)
            if dense is None:
                continue
            at_target = resolution in TRAIN_TARGET_RESOLUTIONS
            for budget in args.budgets:
                veca = _find(points, "train", batch, resolution, VECA, budget)
                paired, flop_ratio = veca.get("paired_latency_ratio_vs_dinov3"), veca["flop_ratio_vs_dinov3"]
                limit = flop_ratio + TRAIN_TARGET_MARGIN
                rounds = None
                if veca.get("latency_ms") and dense.get("latency_ms"):
                    rounds = rounds_within(veca["latency_ms"]["samples"], dense["latency_ms"]["samples"], limit)
                out.append({
                    "target": "step time VECA / dense <= training FLOP ratio + 0.03",
                    "batch_size": batch, "resolution": resolution, "budget": budget, "target_resolution": at_target,
                    "paired_ratio": paired, "ratio_of_medians": veca.get("latency_ratio_vs_dinov3"),
                    "flop_ratio": flop_ratio, "limit": limit, "met": None if paired is None else paired <= limit,
                    "rounds_within_limit": rounds,
                })  # fmt: skip
            if small != large:
                a, b = (
                    _find(points, "train", batch, resolution, VECA, small),
                    _find(points, "train", batch, resolution, VECA, large),
                )
                paired = rounds = None
                if a.get("latency_ms") and b.get("latency_ms"):
                    paired = paired_median(a["latency_ms"]["samples"], b["latency_ms"]["samples"])
                    rounds = rounds_within(a["latency_ms"]["samples"], b["latency_ms"]["samples"], 1.0)
                out.append({
                    "target": f"step time C={small} <= C={large}",
                    "batch_size": batch, "resolution": resolution, "budget": [small, large], "target_resolution": True,
                    "paired_ratio": paired, "ratio_of_medians": _safe_ratio(_median(a), _median(b)),
                    "flop_ratio": a["flops_analytic"] / b["flops_analytic"], "limit": 1.0,
                    "met": None if paired is None else paired <= 1.0, "rounds_within_limit": rounds,
                })  # fmt: skip
    return out


def _safe_ratio(a, b):
    return None if a is None or b is None else a / b


def train_target_lines(targets: list[dict]) -> list[str]:
    lines = []
    for t in targets:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        where = "" if t["target_resolution"] else " (not a target resolution)"
        budget = t["budget"] if isinstance(t["budget"], list) else f"C={t['budget']}"
        lines.append(
            f"  - train, batch {t['batch_size']}, {t['resolution']} px, {budget}: {t['target']}: paired "
            f"{fmt(t['paired_ratio'])} (medians {fmt(t['ratio_of_medians'])}) vs limit {t['limit']:.3f} "
            f"(FLOP ratio {t['flop_ratio']:.3f}; rounds within it: {t['rounds_within_limit']}): {verdict}{where}"
        )
    return lines


def summary_lines(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        c, big, ref = s["budget"], s["largest_resolution"], s["reference_resolution"]
        lines.append(f"{s['mode']} mode, batch {s['batch_size']}, VECA C={c}:")
        for resolution, r in s["ratios"].items():
            lines.append(
                f"  - {resolution} px: VECA/DINOv3 latency ratio {fmt(r['latency_ratio'])} "
                f"(paired {fmt(r.get('paired_latency_ratio'))}) vs FLOP ratio {fmt(r['flop_ratio'])}"
            )
        lines.append(
            f"  - latency per token (latency / (B (N + C))), {big} px over {ref} px: VECA "
            f"{fmt(s['veca_per_token_latency_ratio'])} (paired {fmt(s.get('veca_paired_per_token_latency_ratio'))};"
            f" 1 = linear in tokens), DINOv3 {fmt(s['dinov3_per_token_latency_ratio'])} "
            f"(paired {fmt(s.get('dinov3_paired_per_token_latency_ratio'))})"
        )
        fraction = s["veca_gemm_fraction_at_largest"]
        dense = s["dinov3_gemm_fraction_at_largest"]
        lines.append(
            f"  - fraction of GEMM throughput at {big} px: VECA {fmt(fraction and 100 * fraction, '.1f')}%, "
            f"DINOv3 {fmt(dense and 100 * dense, '.1f')}%"
        )
    return lines


def _ratio_cell(p: dict) -> str:
    paired = p.get("paired_latency_ratio_vs_dinov3")
    return fmt(p["latency_ratio_vs_dinov3"]) + ("" if paired is None else f" ({paired:.3f})")


def markdown(result: dict) -> str:
    args, machine, gemm, models = result["args"], result["machine"], result["gemm"], result["models"]
    out = [
        f"# VECA vs DINOv3 scaling: {args['size']}{' (tiny)' if args['tiny'] else ''}, {args['device']}, "
        f"{args['dtype']}, {args['attn_implementation']}",
        "",
        f"- command: `{result['command']}`",
        f"- device: {args['device']} ({machine['device_name']}); CPU: {machine['cpu_model']}; "
        f"torch {machine['torch_version']}, transformers {machine['transformers_version']}; "
        f"threads {machine['torch_num_threads']}; "
        f"load average start {machine['loadavg_start']}, end {machine.get('loadavg_end')}; "
        f"THP_MEM_ALLOC_ENABLE={machine.get('thp_mem_alloc_enable')}, kernel THP mode "
        f"{machine.get('transparent_hugepage')}",
        f"- models: VECA {models['veca']}; DINOv3 {models['dinov3']}"
        + (f"; train mode's dense student {models['dense_student']}" if "dense_student" in models else ""),
        f"- GEMM reference: `torch.mm` {gemm['size']}x{gemm['size']} {args['dtype']}, timed in every interleaved "
        f"round (column `GEMM GFLOP/s`: the median of the rounds); alone at the start "
        f"{gemm['start_median_gflops_per_s']:.1f} and the end {gemm['end_median_gflops_per_s']:.1f} GFLOP/s",
        f"- timing: {args['warmup']} warm-up + {args['repeats']} timed calls per model and resolution, in "
        f"{args['repeats']} interleaved rounds (the GEMM, then per resolution DINOv3 and each budget, the order "
        "rotated by one every round); latency = median [min-max]; ratio = ratio of the medians, and in brackets "
        "the paired ratio: the median over the rounds of the ratio within each round",
        "- GFLOPs: analytic (`veca_hf.flops`) and counted (`torch.utils.flop_counter` on meta, SDPA as MATH); "
        "% GEMM = analytic FLOPs / median latency / the point's GEMM reference",
        "- attention share: time inside the attention modules / whole forward, and in brackets the attention "
        f"kernels alone (SDPA or eager matmul+softmax), median of {args['profile_repeats']} `torch.profiler` runs",
        "- forward peak: bytes allocated during the call above the level before it (activations + outputs); "
        + ("CUDA max_memory_allocated" if args["device"] == "cuda" else "CPU: torch.profiler allocation events"),
        "",
    ]
    header = (
        "| res | N | model | C | GFLOPs analytic | GFLOPs counted | latency ms median [min-max] | img/s | "
        "GEMM GFLOP/s | % GEMM | attention share (kernel) | fwd peak MB | page faults / call | "
        "latency ratio vs DINOv3 (paired) | FLOP ratio vs DINOv3 |"
    )
    points = result["points"]
    for mode in sorted({p["mode"] for p in points}, key=MODE_ORDER.index):
        title = {
            "model": "whole model",
            "block": "one attention block (q/k/v/o + attention, Table S.14)",
            "train": "training step of the student (forward, backward, optimiser); DINOv3 = the dense student",
        }[mode]
        for batch in args["batch_sizes"]:
            out += [f"## {mode} mode: {title}, batch {batch}", "", header, "|" + "---|" * 15]
            for p in points:
                if p["mode"] != mode or p["batch_size"] != batch:
                    continue
                lat = p["latency_ms"]
                latency = f"{lat['median']:.2f} [{lat['min']:.2f}-{lat['max']:.2f}]" if lat else (p["error"] or "-")
                share = "-"
                if p.get("attention_module_share") is not None:
                    share = f"{100 * p['attention_module_share']:.1f}% ({100 * p['attention_core_share']:.1f}%)"
                counted = f"{p['flops_counted'] / 1e9:.3f}" + ("" if p["flops_match"] else " (!= analytic)")
                out.append(
                    f"| {p['resolution']} | {p['num_patches']} | {p['model']} | {p['budget'] or '-'} | "
                    f"{p['flops_analytic'] / 1e9:.3f} | {counted} | {latency} | "
                    f"{fmt(p.get('images_per_s'), '.2f')} | "
                    f"{fmt(p.get('gemm_reference_gflops_per_s'), '.1f')} | "
                    f"{fmt(p.get('gemm_fraction') and 100 * p['gemm_fraction'], '.1f')} | {share} | "
                    f"{fmt(p.get('forward_peak_mb'), '.1f')} | "
                    f"{fmt(p.get('minor_page_faults_per_call'), '.0f')} | "
                    f"{_ratio_cell(p) if p['model'] == VECA else '-'} | "
                    f"{fmt(p['flop_ratio_vs_dinov3']) if p['model'] == VECA else '-'} |"
                )
            out.append("")
    out += ["## Summary", ""] + summary_lines(result["summary"]) + [""]
    if result.get("train_targets"):
        out += ["## Training targets", ""] + train_target_lines(result["train_targets"]) + [""]
    if result["notes"]:
        out += ["## Notes", ""] + [f"- {note}" for note in result["notes"]] + [""]
    return "\n".join(out)


def plot(points: list[dict], args, output_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    modes = sorted({p["mode"] for p in points}, key=MODE_ORDER.index)
    written = []
    for kind, ylabel, filename in (
        ("latency", "median latency (ms)", "latency_vs_resolution.png"),
        ("flops", "GFLOPs (analytic)", "flops_vs_resolution.png"),
    ):
        rows, cols = len(modes), len(args.batch_sizes)
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        for i, mode in enumerate(modes):
            for j, batch in enumerate(args.batch_sizes):
                ax = axes[i][j]
                labels = [DINOV3] + [f"VECA C={c}" for c in args.budgets]
                for k, label in enumerate(labels):
                    xs, ys = [], []
                    for p in points:
                        if (p["mode"], p["batch_size"], p["label"]) != (mode, batch, label):
                            continue
                        value = _median(p) if kind == "latency" else p["flops_analytic"] / 1e9
                        if value:
                            xs.append(p["resolution"])
                            ys.append(value)
                    if xs:
                        dense = label == DINOV3
                        ax.plot(
                            xs,
                            ys,
                            marker="s" if dense else "o",
                            linestyle="--" if dense else "-",
                            color="black" if dense else plt.cm.viridis(0.85 * (k - 1) / max(1, len(labels) - 2)),
                            linewidth=2 if dense else 1.5,
                            label=label,
                        )
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xticks(args.resolutions)
                ax.set_xticklabels([str(r) for r in args.resolutions])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xlabel("resolution (px, square)")
                ax.set_ylabel(ylabel)
                name = args.size + (" tiny" if args.tiny else "")
                ax.set_title(f"{name} {mode}, batch {batch}, {args.dtype}, {args.device}")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = output_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written


if __name__ == "__main__":
    main()
