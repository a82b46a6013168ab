# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What the machine offers for reduced precision: CPU bf16 instructions, and a measured matmul throughput.

bf16 on a CPU is fast only where the CPU has bf16 dot-product instructions (AVX512-BF16, or AMX tiles); elsewhere
torch's bf16 matmuls fall back to slow kernels (seen: under 1 GFLOP/s on an AMD EPYC without them, 2.2x fp32 on one
with `avx512_bf16`). [`cpu_bf16_support`] reads the flags and can time `torch.mm` in both dtypes, so a benchmark can
say which case it ran in. Only `torch` is imported here.
"""

from __future__ import annotations

import platform
import time
from pathlib import Path
from typing import Any

import torch


__all__ = ["cpu_bf16_support", "cpu_flags", "cpu_model", "matmul_throughput"]

BF16_FLAGS = ("avx512_bf16", "amx_bf16", "amx_tile")


def cpu_flags() -> set[str] | None:
    """The CPU's feature flags from `/proc/cpuinfo` (the `flags` line, as `lscpu` shows them), `None` off Linux."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("flags") or line.startswith("Features"):
            return set(line.split(":", 1)[1].split())
    return None


def cpu_model() -> str | None:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or None


def _torch_probe(name: str) -> bool | None:
    """torch's own (private, release-dependent) CPU capability probes; `None` when absent."""
    probe = getattr(torch.cpu, name, None)
    try:
        return None if probe is None else bool(probe())
    except Exception:  # noqa: BLE001 - informational only
        return None


def matmul_throughput(
    size: int = 2048, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", repeats: int = 3
) -> float:
    """Achieved FLOP/s of `torch.mm` on two `(size, size)` matrices: the median of `repeats` timed calls after one
    untimed call.

    Args:
        size (`int`, *optional*, defaults to 2048): side of the square matrices.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): their dtype.
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`): where they live.
        repeats (`int`, *optional*, defaults to 3): timed calls.

    Returns:
        `float`: FLOP/s (multiply-add = 2).
    """
    device = torch.device(device)
    generator = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    samples = []
    with torch.inference_mode():
        for index in range(repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            start = time.perf_counter()
            torch.mm(a, b)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if index:
                samples.append(time.perf_counter() - start)
    samples.sort()
    return 2 * size**3 / samples[len(samples) // 2]


def cpu_bf16_support(measure_size: int | None = 2048, repeats: int = 3) -> dict[str, Any]:
    """Whether this CPU runs bf16 fast: its flags, torch's probes, and optionally measured `torch.mm` throughputs.

    `fast_bf16` is `True` when the flags list `avx512_bf16` or `amx_bf16` (or, where the flags cannot be read,
    torch's probes say so) and, if measured, a bf16 `torch.mm` is at least as fast as an fp32 one; `False` when
    either says no; `None` when nothing could tell.

    Args:
        measure_size (`int`, *optional*, defaults to 2048): side of the `torch.mm` to time in fp32 and bf16 with
            the current number of threads; `None` or 0 to skip timing.
        repeats (`int`, *optional*, defaults to 3): timed calls per dtype.

    Returns:
        `dict`: `cpu_model`, `flags` (the bf16-related flags present), `torch_avx512_bf16`, `torch_amx_tile`,
        `cpu_capability`, and with timing `mm_size`, `fp32_gflops_per_s`, `bf16_gflops_per_s`, `bf16_speedup`;
        then `fast_bf16`.
    """
    flags = cpu_flags()
    capability = None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        pass
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "flags": None if flags is None else sorted(f for f in BF16_FLAGS if f in flags),
        "torch_avx512_bf16": _torch_probe("_is_avx512_bf16_supported"),
        "torch_amx_tile": _torch_probe("_is_amx_tile_supported"),
        "cpu_capability": capability,
        "num_threads": torch.get_num_threads(),
    }
    if flags is not None:
        has_instructions = bool({"avx512_bf16", "amx_bf16"} & flags)
    elif info["torch_avx512_bf16"] is not None or info["torch_amx_tile"] is not None:
        has_instructions = bool(info["torch_avx512_bf16"] or info["torch_amx_tile"])
    else:
        has_instructions = None
    fast = has_instructions
    if measure_size:
        fp32 = matmul_throughput(measure_size, torch.float32, "cpu", repeats)
        bf16 = matmul_throughput(measure_size, torch.bfloat16, "cpu", repeats)
        info.update(mm_size=measure_size, fp32_gflops_per_s=fp32 / 1e9, bf16_gflops_per_s=bf16 / 1e9,
                    bf16_speedup=bf16 / fp32)  # fmt: skip
        fast = bool(has_instructions is not False and bf16 >= fp32)
    info["fast_bf16"] = fast
    return info
