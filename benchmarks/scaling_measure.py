# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""How `scaling.py` measures: timing, paired ratios, the GEMM reference, profiling (attention shares, CPU memory),
CUDA memory peaks, page faults and the machine record. Method: docs/performance.md."""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # noqa: F401 - first: the offline Hub defaults, and veca_hf from a source checkout
import torch
from torch import nn

from veca_hf.cpu.hardware import cpu_bf16_support, cpu_kind, cpu_model
from veca_hf.model.modeling_veca import VecaCorePeripheryAttention


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


# --- machine -------------------------------------------------------------------------------------------------------


def loadavg() -> list[float] | None:
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
    """Whether the CPU runs bf16 matmuls fast (flags, and the measured `torch.mm` if any; `veca_hf.cpu.hardware`)."""
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
        "cpu_kind": cpu_kind(),  # amx / avx512_bf16 / no native bf16
        "cpu_count": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "device": args.device,
        "device_name": cpu_model(),
        "loadavg_start": loadavg(),
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


# --- paired ratios -------------------------------------------------------------------------------------------------


def _round_ratios(numerators: list, denominators: list) -> list[float]:
    """`numerators[i] / denominators[i]` per round, skipping rounds where either call failed."""
    return [a / b for a, b in zip(numerators, denominators, strict=False) if a is not None and b is not None]


def paired_median(numerators: list, denominators: list) -> float | None:
    """Median over the rounds of `numerators[i] / denominators[i]`, skipping rounds where either call failed."""
    ratios = _round_ratios(numerators, denominators)
    return statistics.median(ratios) if ratios else None


def rounds_within(numerators: list, denominators: list, limit: float) -> str:
    """How many rounds' ratios are at most `limit`, as "k/n": the paired median's support, round by round."""
    ratios = _round_ratios(numerators, denominators)
    return f"{sum(r <= limit for r in ratios)}/{len(ratios)}"


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
    synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    fn()
    synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def param_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in list(module.parameters()) + list(module.buffers()))
