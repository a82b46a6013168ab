#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Scaling benchmark: VECA against a transformers `DINOv3ViTModel` of the same width and depth.

Both models have random weights. The DINOv3 config copies VECA's hidden size, depth and heads and takes the MLP of
the matching DINOv3 release (intermediate 1536 for S, 3072 for B, 4096 for L; plain GELU MLP), 4 register tokens,
patch 16. Both use the same attention implementation (`--attn_implementation`, default `sdpa`).

For every (mode, batch size) the models are timed *interleaved*: after the warm-up, each of the `--repeats` rounds
runs the GEMM reference and then, per resolution, DINOv3 and every VECA budget in turn, so that drift on a shared
machine affects all alike; the order of the calls rotates by one every round (round `r` starts at call `r`), so that
no point always runs right after the same neighbour (e.g. after the dense model's large allocations). Each point
reports the median latency with min and max, and every ratio comes two ways: the ratio of the medians, and the
*paired* ratio, the median over the rounds of the ratio within one round (the calls of a round run back to back, so
slow drift between rounds cancels). Per point the script also records:

- analytic FLOPs (`veca_hf.flops`) and FLOPs counted by `torch.utils.flop_counter` on the meta device (shapes only,
  no compute), inside `sdpa_kernel(SDPBackend.MATH)`: the counter does not see the CPU flash kernel of SDPA, so
  attention is counted as its matmuls. Counted must equal analytic (`flops_match`).
- images/s, achieved FLOP/s (analytic FLOPs / median latency) and that as a fraction of the device's achieved GEMM
  throughput (`torch.mm` of two `--gemm_size`^2 matrices in the same dtype), timed once in every interleaved round:
  the points are compared with the median GEMM of their own rounds, because the throughput of a shared machine
  drifts. The GEMM is also measured at the start and the end of the run (reported, not used).
- the share of time spent in attention, from extra calls under `torch.profiler` (`--profile_repeats`, median of
  the shares; the timed calls carry no hooks): forward pre/post hooks on the attention modules
  (`VecaCorePeripheryAttention`, `DINOv3ViTAttention`) open a `record_function` range, without touching the model
  code. `attention_module_share` is the time inside those modules (q/k/v/o projections, RoPE,
  attention) over the whole forward; `attention_core_share` counts only the attention kernels themselves
  (`aten::scaled_dot_product_attention`, or the eager `matmul`/`softmax`) inside those modules. Times are the
  profiler's self CPU times (CPU) or self device times (CUDA). The profiler adds overhead, so shares are
  approximate; in block mode the module share is ~1 by construction.
- memory: `forward_peak_mb` is the peak of bytes allocated by torch during the forward above what was allocated
  before it (activations and outputs; weights and inputs excluded). On CUDA it is
  `torch.cuda.max_memory_allocated()` minus the allocated bytes before the call, from a separate run. On CPU there is
  no allocator peak counter (and RSS deltas or `tracemalloc` do not see torch's allocations reliably), so it is the
  running maximum of the allocation/free events recorded by `torch.profiler(profile_memory=True)` during the
  profiled calls; with `--no_profile` it is `None` on CPU. `peak_memory_mb` adds the module's weights and the
  inputs (pixel values, or the block's hidden states).
- minor page faults per timed call (CPU, from `getrusage`): how often the kernel mapped fresh memory. glibc serves
  each tensor above 32 MiB with a fresh `mmap`, paid in 4 KiB faults on first touch (DINOv3-B at 1024 px: 0.1-0.5
  million per forward; VECA-B 0.1-0.3 million before its blocks shared their largest projection buffers, 20-60k
  since). The machine record says whether `THP_MEM_ALLOC_ENABLE` (torch's opt-in to transparent huge pages, read
  once before the first allocation) was set and the kernel's THP mode, so that runs with different
  allocator settings can be told apart.

dtype: `bf16` casts the models (weights and activations) to bfloat16, on CPU and GPU alike; no autocast. RoPE
cos/sin and softmax follow each model's own code (VECA computes cos/sin in fp32 and casts them to the activation
dtype; the attention kernels run in bf16). The GEMM reference runs in the same dtype.

Threads: on CPU set `--threads` to the number of cores that are really free. With 2 threads on 2 cores shared with
other jobs, OpenMP threads waiting on each other made single calls 10-30x slower and the medians meaningless; with 1
thread the same points were stable and VECA/DINOv3 latency ratios tracked the FLOP ratios.

Modes:
- `model`: the whole forward, `veca(pixel_values, num_core_tokens=C)` vs `dinov3(pixel_values)`.
- `block`: one attention block as in the paper's Table S.14 (q/k/v/o projections + attention, no norm, no MLP):
  `VecaCorePeripheryAttention` on `(B, C + N, D)` hidden states with core and patch RoPE vs transformers'
  `DINOv3ViTAttention` on `(B, 5 + N, D)` with DINOv3's own patch RoPE.
- `both`: the two, one after the other.
- `train`: one training step of the student alone (`StudentWithLoss` with `DistillationLoss` against fixed random
  targets, backward, AdamW unless `--no_optimizer_step`), VECA at each budget vs the dense student of
  `veca_hf.training.distillation.dense_student_config` (reported under the name DINOv3). FLOPs: forward + backward,
  analytic `3 F - patch embedding` (`veca_hf.flops.veca_training_flops`), counted likewise. The training targets
  (`train_targets` in the JSON, MET / NOT MET in the output): VECA/dense step time at most the training FLOP ratio +
  0.03 at 512 and 768 px, and the step at the smallest budget no slower than at the largest (paired ratios).

dtype `bf16_autocast`: fp32 weights under `torch.autocast(device, torch.bfloat16)` (model, block and train modes).
On CPU the machine record says whether the CPU has fast bf16 (`machine.bf16`: flags, torch's probes, and a measured
`--bf16_probe_size`^2 `torch.mm` in fp32 and bf16; `veca_hf.hardware.cpu_bf16_support`).

Outputs in `--output_dir`: `results.json` (machine, command line, GEMM reference, every point, summary),
`results.md` (a table per mode and batch size, and the summary), `latency_vs_resolution.png` and
`flops_vs_resolution.png` (log-log; one line per VECA budget plus DINOv3; a row per mode, a column per batch size).

Examples:

    # CPU, VECA-B, the default grid (run it on a quiet machine)
    python benchmarks/scaling.py --size veca-b16 --threads 8 --output_dir benchmarks/results/b16_cpu_fp32
    # the attention block only, as Table S.14
    python benchmarks/scaling.py --size veca-b16 --mode block --batch_sizes 8 --output_dir benchmarks/results/b16_block
    # GPU, bf16, up to 2048 px
    python benchmarks/scaling.py --size veca-l16 --device cuda --dtype bf16 \
        --resolutions 256,512,1024,1536,2048 --batch_sizes 1,8 --output_dir benchmarks/results/l16_cuda_bf16
    # seconds-long smoke run: tiny widths
    python benchmarks/scaling.py --tiny --resolutions 64,96 --budgets 8,16 --warmup 0 --repeats 1 --gemm_size 128
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import torch
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from veca_hf import VecaConfig, VecaModel
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
from veca_hf.hardware import cpu_bf16_support, cpu_model
from veca_hf.inference import cpu_inference_buffers
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
FORWARD_TAG = "veca_bench::forward"
ATTENTION_TAG = "veca_bench::attention"
# MLP width of the DINOv3 release that each VECA size is distilled from (DINOv3-S/16, -B/16, -L/16: 4 x hidden).
DINOV3_INTERMEDIATE = {"veca-s16": 1536, "veca-b16": 3072, "veca-l16": 4096}
# `--tiny`: the same architecture at width 64, depth 2, 2 heads (smoke tests).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170)
TINY_DINOV3_INTERMEDIATE = 256
# Ops that *are* the attention kernel (SDPA, or the eager score/value matmuls and softmax).
ATTENTION_CORE_OPS = {
    "aten::scaled_dot_product_attention",
    "aten::matmul",
    "aten::bmm",
    "aten::baddbmm",
    "aten::softmax",
    "aten::_softmax",
}
# `--dtype`: the dtype of weights and inputs, the autocast dtype (None: no autocast), the GEMM reference's dtype.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.float32}
AUTOCAST_DTYPES = {"fp32": None, "bf16": None, "bf16_autocast": torch.bfloat16}
GEMM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "bf16_autocast": torch.bfloat16}
MODE_ORDER = ["model", "block", "train"]
# Training targets: at these resolutions VECA's step time over the dense student's is at most their
# training FLOP ratio plus this margin (paired ratios of one run).
TRAIN_TARGET_RESOLUTIONS = (512, 768)
TRAIN_TARGET_MARGIN = 0.03
MIB = 2**20


# --- command line --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(
        "VECA vs DINOv3 (same width and depth): latency, FLOPs, memory and attention share.",
        resolutions=[256, 384, 512, 768, 1024],
    )
    parser.add_argument("--budgets", type=common.int_list, default=[8, 16, 32, 64], help="VECA budgets C.")
    parser.add_argument("--batch_sizes", type=common.int_list, default=[1])
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
        choices=["model", "block", "both", "train"],
        help="model: whole forward; block: one attention block; both: model then block; train: one training step "
        "of the student alone (forward, backward, optimiser) vs the same-size dense student.",
    )
    parser.add_argument(
        "--no_optimizer_step",
        action="store_true",
        help="Train mode: time forward + backward only (no AdamW step).",
    )
    parser.add_argument("--learning_rate", type=float, default=1e-5, help="Train mode: AdamW learning rate.")
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
        "--cpu_inference_buffers",
        action="store_true",
        help="Model mode: run VECA inside veca_hf.inference.cpu_inference_buffers (blocks share their large "
        "projection outputs; docs/performance.md).",
    )
    parser.add_argument("--no_plots", action="store_true")
    parser.add_argument(
        "--output_dir", default=None, help="Default: benchmarks/results/<size>_<mode>_<device>_<dtype>[_tiny]."
    )
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.profile_repeats < 1:
        parser.error("--warmup must be >= 0, --repeats and --profile_repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    for resolution in args.resolutions:
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
        name += "_tiny" if args.tiny else ""
        args.output_dir = str(Path(__file__).resolve().parent / "results" / name)
    return args


# --- configs, machine ----------------------------------------------------------------------------------------------


def build_configs(args: argparse.Namespace):
    """VECA config of the preset (or `--tiny`) and a DINOv3 config of the same width, depth and heads."""
    from transformers import DINOv3ViTConfig

    overrides = dict(TINY) if args.tiny else {}
    veca_config = VecaConfig.from_preset(args.size, **overrides)
    for budget in args.budgets:
        veca_config.check_budget(budget, name="--budgets")
    dinov3_config = DINOv3ViTConfig(
        hidden_size=veca_config.hidden_size,
        num_hidden_layers=veca_config.num_hidden_layers,
        num_attention_heads=veca_config.num_attention_heads,
        intermediate_size=TINY_DINOV3_INTERMEDIATE if args.tiny else DINOV3_INTERMEDIATE[args.size],
        patch_size=veca_config.patch_size,
        num_register_tokens=4,
        image_size=224,
    )
    for config in (veca_config, dinov3_config):
        config._attn_implementation = args.attn_implementation
    return veca_config, dinov3_config


def preset_configs(size: str, tiny: bool, budgets: list[int]):
    """`build_configs` for the other benchmark scripts: the preset `size` (or `--tiny`), default settings otherwise."""
    argv = ["--size", size, "--budgets", ",".join(map(str, budgets)), "--output_dir", "unused"]
    return build_configs(parse_args(argv + (["--tiny"] if tiny else [])))


def _loadavg() -> list[float] | None:
    try:
        return [float(v) for v in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


def _transparent_hugepage_mode() -> str | None:
    """The kernel's THP mode (the bracketed word of `.../transparent_hugepage/enabled`), or `None` off Linux."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text[text.index("[") + 1 : text.index("]")] if "[" in text else text.strip()


def minor_page_faults() -> int | None:
    """Minor page faults of this process so far (`None` where `resource` is unavailable, e.g. Windows)."""
    try:
        import resource
    except ImportError:  # pragma: no cover
        return None
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def _call_or_none(owner, name: str):
    try:
        return getattr(owner, name)()
    except Exception:  # noqa: BLE001 - informational only; private helpers move between torch releases
        return None


def cpu_has_fast_bf16(machine: dict[str, Any]) -> bool | None:
    """Whether the CPU runs bf16 matmuls fast (flags, and the measured `torch.mm` if any; `veca_hf.hardware`)."""
    if machine.get("bf16") is not None:
        return machine["bf16"]["fast_bf16"]
    flags = (machine.get("cpu_avx512_bf16"), machine.get("cpu_amx_tile"))
    return None if all(f is None for f in flags) else any(bool(f) for f in flags)


def machine_info(args: argparse.Namespace) -> dict[str, Any]:
    import transformers

    info = {
        "torch_version": torch.__version__,
        "transformers_version": transformers.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "device": args.device,
        "device_name": cpu_model(),
        "loadavg_start": _loadavg(),
        "cpu_capability": _call_or_none(torch.backends.cpu, "get_cpu_capability"),
        "cpu_avx512_bf16": _call_or_none(torch.cpu, "_is_avx512_bf16_supported"),
        "cpu_amx_tile": _call_or_none(torch.cpu, "_is_amx_tile_supported"),
        "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
        "transparent_hugepage": _transparent_hugepage_mode(),
    }
    if args.device == "cpu":
        info["bf16"] = cpu_bf16_support(args.bf16_probe_size or None)
    if args.device == "cuda":
        info["device_name"] = torch.cuda.get_device_name()
        info["cuda_version"] = torch.version.cuda
        info["cudnn_version"] = torch.backends.cudnn.version()
    return info


# --- timing --------------------------------------------------------------------------------------------------------


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], device: torch.device) -> float:
    """Wall-clock seconds of one call, synchronised on CUDA."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def make_gemm(size: int, dtype: torch.dtype, device: torch.device) -> tuple[Callable[[], Any], int]:
    """The GEMM reference: `torch.mm` of two `(size, size)` matrices, and its FLOPs."""
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    b = torch.randn(size, size, device=device, dtype=dtype, generator=generator)
    return (lambda: torch.mm(a, b)), 2 * size**3


def measure_gemm(size: int, dtype: torch.dtype, device: torch.device, repeats: int) -> list[float]:
    """Achieved FLOP/s samples of the GEMM reference (after one untimed call)."""
    gemm, flops = make_gemm(size, dtype, device)
    with torch.inference_mode():
        gemm()
        return [flops / time_call(gemm, device) for _ in range(repeats)]


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


def _count_call(fn: Callable[[], Any]) -> int:
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


def _param_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))


def autocast_context(args, device: torch.device):
    """`torch.autocast(device, bf16)` for `--dtype bf16_autocast`, else a no-op context."""
    autocast_dtype = AUTOCAST_DTYPES[args.dtype]
    if autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=autocast_dtype)


def build_cases(mode: str, args, veca_config, dinov3_config, device, dtype) -> list[Case]:
    """DINOv3 (in train mode: the dense student) first, then VECA at each budget (the order of the interleaved
    timing)."""
    from transformers import DINOv3ViTModel
    from transformers.models.dinov3_vit.modeling_dinov3_vit import DINOv3ViTAttention

    torch.manual_seed(args.seed)
    patch = veca_config.patch_size
    prefix = 1 + dinov3_config.num_register_tokens
    cases: list[Case] = []

    def add_cases(dinov3_module, veca_module, make_call, analytic_flops, counted_flops, prefix=prefix) -> None:
        """DINOv3, then VECA at each budget; the callables take `(budget, resolution, batch)`, budget None = DINOv3."""
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
                    lambda r, t=extra_tokens: num_patches_for(r, r, patch) + t,
                )
            )

    if mode == "model":
        dinov3 = DINOv3ViTModel(dinov3_config).to(device=device, dtype=dtype).eval()
        veca = VecaModel(veca_config).to(device=device, dtype=dtype).eval()
        # One graph per model for every budget and resolution (docs/usage.md); the first call compiles.
        compile_kwargs = dict(dynamic=True, backend=args.compile_backend)
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

        add_cases(dinov3, veca, model_call, model_flops, counted_model_flops)
    elif mode == "block":
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
            cores = dict(num_prefix_tokens=prefix) if c is None else dict(num_cores=c)
            return attention_block_flops(veca_config.hidden_size, num_patches_for(r, r, patch), batch_size=b, **cores)

        def counted_block_flops(c, r, b):
            return _count_call(block_call(c, r, b, meta=True))

        add_cases(dinov3_block, veca_block, block_call, block_flops, counted_block_flops)
    elif mode == "train":
        # The student alone, as in a distillation step once the teacher's targets exist: StudentWithLoss (the
        # student and DistillationLoss) against fixed random targets, backward, AdamW. The dense control is
        # `dense_student_config(veca_config)`: a DINOv3ViTModel with VECA's width, depth and SwiGLU MLP, one CLS
        # token, no registers.
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
        batches: dict = {}

        def train_batch(resolution, batch, where=device):
            """Pixels and fixed random targets (CLS `(B, D)`, patches `(B, N, D)`), shared by all students."""
            key = (resolution, batch, str(where))
            if key not in batches:
                shapes = [(batch, 3, resolution, resolution), (batch, width),
                          (batch, num_patches_for(resolution, resolution, patch), width)]  # fmt: skip
                if str(where) == "meta":
                    batches[key] = [torch.empty(shape, device="meta") for shape in shapes]
                else:
                    batches.pop(next((k for k in batches if k[2] != "meta"), None), None)
                    generator = torch.Generator().manual_seed(args.seed)
                    batches[key] = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
            return batches[key]

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

        dense_prefix = 1 + dense_config.num_register_tokens
        add_cases(dense, veca, train_call, train_flops, counted_train_flops, prefix=dense_prefix)
    else:
        raise ValueError(mode)
    return cases


# --- profiling: attention share and CPU memory ---------------------------------------------------------------------


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
        synchronize(device)
        with profile(activities=activities, profile_memory=device.type == "cpu") as prof:
            with record_function(FORWARD_TAG):
                fn()
            synchronize(device)
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


def _merge_profiles(runs: list[dict], device: torch.device) -> dict[str, Any]:
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
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


# --- the benchmark -------------------------------------------------------------------------------------------------


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def _round_ratios(numerators: list, denominators: list) -> list[float]:
    """`numerators[i] / denominators[i]` per round, skipping rounds where either call failed."""
    return [a / b for a, b in zip(numerators, denominators, strict=False) if a is not None and b is not None]


def _paired_median(numerators: list, denominators: list) -> float | None:
    """Median over the rounds of `numerators[i] / denominators[i]`, skipping rounds where either call failed."""
    ratios = _round_ratios(numerators, denominators)
    return statistics.median(ratios) if ratios else None


def _rounds_within(numerators: list, denominators: list, limit: float) -> str:
    """How many rounds' ratios are at most `limit`, as "k/n": the paired median's support, round by round."""
    ratios = _round_ratios(numerators, denominators)
    return f"{sum(r <= limit for r in ratios)}/{len(ratios)}"


def run_mode(mode, args, veca_config, dinov3_config, device, dtype, log) -> list[dict]:
    cases = build_cases(mode, args, veca_config, dinov3_config, device, dtype)
    # NOTE: the GEMM reference is timed inside the interleaved rounds too: on a shared machine the throughput drifts
    # (82 and 129 GFLOP/s at the start and end of one run here), and the points are compared with their own rounds.
    gemm, gemm_flops = make_gemm(args.gemm_size, GEMM_DTYPES[args.dtype], device)
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
            for _ in range(args.warmup):
                for key, call in calls.items():
                    if call is not None:
                        attempt(key, call)
            # One round: the GEMM, then per resolution DINOv3 and each budget (rotated). Lists are indexed by round;
            # None where a call failed.
            samples: dict[tuple, list[float | None]] = {key: [] for key in calls}
            faults: dict[tuple, list[int]] = {key: [] for key in calls}
            gemm_samples = []
            order = list(calls)
            for round_index in range(args.repeats):
                gemm_samples.append(gemm_flops / time_call(gemm, device))
                shift = round_index % len(order)
                for key in order[shift:] + order[:shift]:  # rotated: no point always follows the same one
                    call = calls[key]
                    seconds = None
                    if call is not None:
                        faults_before = minor_page_faults()
                        seconds = attempt(key, lambda call=call: time_call(call, device))
                        if seconds is not None and faults_before is not None:
                            faults[key].append(minor_page_faults() - faults_before)
                    samples[key].append(seconds)
            extra: dict[tuple, dict] = {key: {} for key in calls}
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
                        extra[key].update(_merge_profiles(runs, device))

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
                weights = _param_bytes(case.module)
                point.update(
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
                point["paired_latency_ratio_vs_dinov3"] = _paired_median(
                    samples[(resolution, point["label"])], dense_rounds
                )
                log("    " + _one_line(point))
            points.extend(mode_points)
        calls.clear()
        _release(device)
    return points


def _one_line(p: dict) -> str:
    lat = p["latency_ms"]
    text = f"{p['label']:<12} {p['flops_analytic'] / 1e9:9.3f} GFLOPs"
    text += f"  {lat['median']:9.2f} ms [{lat['min']:.2f}-{lat['max']:.2f}]" if lat else "  (failed)"
    if p.get("gemm_fraction") is not None:
        text += f"  {100 * p['gemm_fraction']:5.1f}% GEMM"
    if p.get("minor_page_faults_per_call") is not None:
        text += f"  {p['minor_page_faults_per_call'] / 1e3:.1f}k faults"
    if p.get("attention_core_share") is not None:
        text += f"  attn {100 * p['attention_module_share']:4.1f}%/{100 * p['attention_core_share']:4.1f}%"
    if p["model"] == VECA and p.get("latency_ratio_vs_dinov3") is not None:
        text += (
            f"  x{p['latency_ratio_vs_dinov3']:.3f} time (paired x{_fmt(p.get('paired_latency_ratio_vs_dinov3'))}),"
            f" x{p['flop_ratio_vs_dinov3']:.3f} FLOPs vs DINOv3"
        )
    if not p["flops_match"]:
        text += f"  COUNTED {p['flops_counted']} != ANALYTIC {p['flops_analytic']}"
    return text


# --- summary, markdown, plots --------------------------------------------------------------------------------------


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
                ratio = _paired_median(a["latency_ms"]["samples"], b["latency_ms"]["samples"])
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
                    rounds = _rounds_within(veca["latency_ms"]["samples"], dense["latency_ms"]["samples"], limit)
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
                    paired = _paired_median(a["latency_ms"]["samples"], b["latency_ms"]["samples"])
                    rounds = _rounds_within(a["latency_ms"]["samples"], b["latency_ms"]["samples"], 1.0)
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
            f"{_fmt(t['paired_ratio'])} (medians {_fmt(t['ratio_of_medians'])}) vs limit {t['limit']:.3f} "
            f"(FLOP ratio {t['flop_ratio']:.3f}; rounds within it: {t['rounds_within_limit']}): {verdict}{where}"
        )
    return lines


def _fmt(value, spec=".3f", none="-"):
    return none if value is None else format(value, spec)


def summary_lines(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        c, big, ref = s["budget"], s["largest_resolution"], s["reference_resolution"]
        lines.append(f"{s['mode']} mode, batch {s['batch_size']}, VECA C={c}:")
        for resolution, r in s["ratios"].items():
            lines.append(
                f"  - {resolution} px: VECA/DINOv3 latency ratio {_fmt(r['latency_ratio'])} "
                f"(paired {_fmt(r.get('paired_latency_ratio'))}) vs FLOP ratio {_fmt(r['flop_ratio'])}"
            )
        lines.append(
            f"  - latency per token (latency / (B (N + C))), {big} px over {ref} px: VECA "
            f"{_fmt(s['veca_per_token_latency_ratio'])} (paired {_fmt(s.get('veca_paired_per_token_latency_ratio'))};"
            f" 1 = linear in tokens), DINOv3 {_fmt(s['dinov3_per_token_latency_ratio'])} "
            f"(paired {_fmt(s.get('dinov3_paired_per_token_latency_ratio'))})"
        )
        fraction = s["veca_gemm_fraction_at_largest"]
        dense = s["dinov3_gemm_fraction_at_largest"]
        lines.append(
            f"  - fraction of GEMM throughput at {big} px: VECA {_fmt(fraction and 100 * fraction, '.1f')}%, "
            f"DINOv3 {_fmt(dense and 100 * dense, '.1f')}%"
        )
    return lines


def _ratio_cell(p: dict) -> str:
    paired = p.get("paired_latency_ratio_vs_dinov3")
    return _fmt(p["latency_ratio_vs_dinov3"]) + ("" if paired is None else f" ({paired:.3f})")


def markdown(result: dict) -> str:
    args, machine, gemm = result["args"], result["machine"], result["gemm"]
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
        f"- models: VECA {result['models']['veca']}; DINOv3 {result['models']['dinov3']}",
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
                    f"{_fmt(p.get('images_per_s'), '.2f')} | "
                    f"{_fmt(p.get('gemm_reference_gflops_per_s'), '.1f')} | "
                    f"{_fmt(p.get('gemm_fraction') and 100 * p['gemm_fraction'], '.1f')} | {share} | "
                    f"{_fmt(p.get('forward_peak_mb'), '.1f')} | "
                    f"{_fmt(p.get('minor_page_faults_per_call'), '.0f')} | "
                    f"{_ratio_cell(p) if p['model'] == VECA else '-'} | "
                    f"{_fmt(p['flop_ratio_vs_dinov3']) if p['model'] == VECA else '-'} |"
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


# --- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    veca_config, dinov3_config = build_configs(args)
    modes = ["model", "block"] if args.mode == "both" else [args.mode]
    allocator = common.apply_cpu_allocator(args)
    machine = machine_info(args)
    machine["cpu_allocator"] = allocator
    log(
        f"device {machine['device_name']}, torch {machine['torch_version']}, {machine['torch_num_threads']} threads, "
        f"glibc malloc settings: {'veca_hf' if allocator['tuned'] else 'default'} ({allocator['reason']})"
    )

    gemm_dtype = GEMM_DTYPES[args.dtype]
    if machine.get("bf16"):
        bf16 = machine["bf16"]
        timing = (
            f"; torch.mm {bf16['mm_size']}^2 fp32 {bf16['fp32_gflops_per_s']:.1f}, bf16 "
            f"{bf16['bf16_gflops_per_s']:.1f} "
            f"GFLOP/s (x{bf16['bf16_speedup']:.2f})"
            if bf16.get("mm_size")
            else ""
        )
        log(f"CPU bf16: flags {bf16['flags']}{timing}; fast bf16: {bf16['fast_bf16']}")
    gemm_start = measure_gemm(args.gemm_size, gemm_dtype, device, args.gemm_repeats)
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
            "targets, backward, " + ("no optimiser step" if args.no_optimizer_step else "AdamW step") + "), VECA vs "
            "the dense student of veca_hf.training.distillation.dense_student_config (DINOv3ViTModel, same width, "
            "depth and SwiGLU MLP, CLS, no registers), both in train mode. Training FLOPs: analytic 3 x forward - "
            "patch embedding (its input needs no gradient), which is what the counter measures; the optimiser step "
            "and the loss are elementwise and not counted. The attention share is that of the forward's attention "
            "modules in the whole step."
        )
    if device.type == "cpu" and gemm_dtype == torch.bfloat16 and cpu_has_fast_bf16(machine) is False:
        warning = (
            f"This CPU ({machine['cpu_capability']}) has neither AVX512-BF16 nor AMX: torch's bf16 matmuls fall back "
            "to slow kernels (seen here: bf16 torch.mm ~50x slower than fp32, and F.linear faster than torch.mm), so "
            "bf16 timings mostly measure that fallback and the GEMM fraction can exceed 1."
        )
        notes.append(warning)
        log("WARNING: " + warning)
    if device.type == "cpu":
        notes.append(
            "CPU memory: from torch.profiler allocation events (tensor allocations through torch's CPU allocator); "
            "RSS is not used (allocator caching and other processes make it unreliable)."
        )
    points: list[dict] = []
    for mode in modes:
        points += run_mode(mode, args, veca_config, dinov3_config, device, dtype, log)

    gemm_end = measure_gemm(args.gemm_size, gemm_dtype, device, args.gemm_repeats)
    gemm_all = gemm_start + gemm_end
    gemm_reference = statistics.median(gemm_all)
    log(f"GEMM {args.gemm_size}^2 {args.dtype}: {statistics.median(gemm_end) / 1e9:.1f} GFLOP/s (end)")
    machine["loadavg_end"] = _loadavg()
    if any(not p["flops_match"] for p in points):
        notes.append("Some counted FLOPs differ from the analytic ones: see flops_match in results.json.")

    summary = summarize(points, args)
    targets = train_targets(points, args) if "train" in modes else []
    shared = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    result = {
        "command": shlex.join(["python", sys.argv[0], *(sys.argv[1:] if argv is None else argv)]),
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
        },
        "points": points,
        "summary": summary,
        "train_targets": targets,
        "notes": notes,
    }
    common.write_results(output_dir, result, markdown(result))
    if not args.no_plots:
        plot(points, args, output_dir)
    log("")
    log("Summary")
    for line in summary_lines(summary):
        log(line)
    if targets:
        log("Training targets")
        for line in train_target_lines(targets):
            log(line)
    log(f"wrote {output_dir}")
    return result


if __name__ == "__main__":
    main()
