# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What the machine offers for reduced precision: CPU bf16 instructions, and a measured matmul throughput.

bf16 on a CPU is fast only where the CPU has bf16 dot-product instructions (AVX512-BF16, or AMX tiles); elsewhere
torch's bf16 matmuls fall back to slow kernels (seen: under 1 GFLOP/s on an AMD EPYC without them, 2.2x fp32 on one
with `avx512_bf16`). [`cpu_bf16_support`] reads the flags and can time `torch.mm` in both dtypes, so a benchmark can
say which case it ran in, and [`warn_if_slow_bf16`] tells a user who asked for bf16 on such a CPU how much slower it
will be, measured on the spot. Only `torch` is imported here.
"""

from __future__ import annotations

import functools
import logging
import platform
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


__all__ = [
    "cpu_bf16_support",
    "cpu_flags",
    "cpu_kind",
    "cpu_model",
    "linear_throughput",
    "matmul_throughput",
    "slow_bf16_warning",
    "warn_if_slow_bf16",
]

logger = logging.getLogger(__name__)

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


def cpu_kind(flags: set[str] | None = None) -> str | None:
    """Which bf16 instructions the CPU has, the kind the docs' precision table is keyed by: `"amx"` (`amx_bf16`),
    `"avx512_bf16"`, `"no native bf16"`, or `None` where the flags cannot be read. `flags` defaults to
    [`cpu_flags`]."""
    flags = cpu_flags() if flags is None else flags
    if flags is None:
        return None
    if "amx_bf16" in flags:
        return "amx"
    return "avx512_bf16" if "avx512_bf16" in flags else "no native bf16"


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


def linear_throughput(
    dtype: torch.dtype = torch.float32, tokens: int = 512, features: int = 768, repeats: int = 3
) -> float:
    """Achieved FLOP/s of `F.linear` with a bias on a `(tokens, features)` input and a `(features, features)` weight
    on the CPU: the op the models' projections run, which takes other kernels than `torch.mm` (without bf16
    instructions a bf16 `F.linear` ran 6.5-8x slower than fp32 on an AMD EPYC, a bf16 `torch.mm` 70-400x). Median of
    `repeats` timed calls after one untimed call.

    Returns:
        `float`: FLOP/s (multiply-add = 2).
    """
    generator = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(tokens, features, generator=generator).to(dtype)
    weight = torch.randn(features, features, generator=generator).to(dtype)
    bias = torch.randn(features, generator=generator).to(dtype)
    samples = []
    with torch.inference_mode():
        for index in range(repeats + 1):
            start = time.perf_counter()
            F.linear(x, weight, bias)
            if index:
                samples.append(time.perf_counter() - start)
    samples.sort()
    return 2 * tokens * features**2 / samples[len(samples) // 2]


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
        `dict`: `cpu_model`, `cpu_kind` ([`cpu_kind`]), `flags` (the bf16-related flags present),
        `torch_avx512_bf16`, `torch_amx_tile`, `cpu_capability`, and with timing `mm_size`, `bf16_mm_size` (at most
        1024 without bf16 instructions), `fp32_gflops_per_s`, `bf16_gflops_per_s`, `bf16_speedup` (of `torch.mm`),
        `linear_fp32_gflops_per_s` and `linear_bf16_gflops_per_s` ([`linear_throughput`]); then `fast_bf16`.
    """
    flags = cpu_flags()
    capability = None
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except Exception:  # noqa: BLE001
        pass
    info: dict[str, Any] = {
        "cpu_model": cpu_model(),
        "cpu_kind": None if flags is None else cpu_kind(flags),
        "flags": None if flags is None else sorted(f for f in BF16_FLAGS if f in flags),
        "torch_avx512_bf16": _torch_probe("_is_avx512_bf16_supported"),
        "torch_amx_tile": _torch_probe("_is_amx_tile_supported"),
        "cpu_capability": capability,
        "num_threads": torch.get_num_threads(),
    }
    if flags is not None:
        has_instructions = info["cpu_kind"] != "no native bf16"
    elif info["torch_avx512_bf16"] is not None or info["torch_amx_tile"] is not None:
        has_instructions = bool(info["torch_avx512_bf16"] or info["torch_amx_tile"])
    else:
        has_instructions = None
    fast = has_instructions
    if measure_size:
        # NOTE: without bf16 instructions a 2048^2 bf16 torch.mm takes about a minute; 1024^2 tells the same.
        bf16_size = measure_size if has_instructions is not False else min(measure_size, 1024)
        fp32 = matmul_throughput(measure_size, torch.float32, "cpu", repeats)
        bf16 = matmul_throughput(bf16_size, torch.bfloat16, "cpu", repeats)
        linear_fp32, linear_bf16 = _linear_rates_gflops(torch.get_num_threads())
        info.update(mm_size=measure_size, bf16_mm_size=bf16_size, fp32_gflops_per_s=fp32 / 1e9,
                    bf16_gflops_per_s=bf16 / 1e9, bf16_speedup=bf16 / fp32, linear_fp32_gflops_per_s=linear_fp32,
                    linear_bf16_gflops_per_s=linear_bf16)  # fmt: skip
        fast = bool(has_instructions is not False and bf16 >= fp32)
    info["fast_bf16"] = fast
    return info


@functools.cache
def _linear_rates_gflops(num_threads: int) -> tuple[float, float]:
    """(fp32, bf16) `F.linear` GFLOP/s on this CPU with `num_threads` threads; measured once per process."""
    return linear_throughput(torch.float32) / 1e9, linear_throughput(torch.bfloat16) / 1e9


def slow_bf16_warning(device: str | torch.device = "cpu") -> str | None:
    """The warning for running bf16 on `device`, or `None` where bf16 is not known to be slow there.

    On a CPU whose flags list neither `avx512_bf16` nor `amx_bf16`, times the models' projection op (`F.linear`) in
    fp32 and bf16 with the current threads (about 0.3 s, once per process) and says how much slower bf16 is. GPUs,
    CPUs with bf16 instructions and CPUs whose flags cannot be read give `None`.

    Args:
        device (`str` or `torch.device`, *optional*, defaults to `"cpu"`): where bf16 would run.

    Returns:
        `str` or `None`: the warning text, with both measured rates and the slowdown.
    """
    device = torch.device(device)
    if device.type != "cpu" or cpu_bf16_support(measure_size=None)["fast_bf16"] is not False:
        return None
    fp32, bf16 = _linear_rates_gflops(torch.get_num_threads())
    return (
        f"this CPU ({cpu_model() or 'unknown model'}) has neither avx512_bf16 nor amx_bf16, so torch runs bf16 "
        f"matmuls on slow fallback kernels: measured now, a bf16 F.linear ran at {bf16:.1f} GFLOP/s against "
        f"{fp32:.1f} in fp32, so bf16 will be about {fp32 / bf16:.1f}x slower, not faster. Use fp32 on this CPU; "
        "bf16 pays off on CPUs with AVX512-BF16 or AMX and on GPUs (docs/performance.md, 'Which precision should I "
        "use on my CPU?')."
    )


def warn_if_slow_bf16(device: str | torch.device, requested_by: str) -> str | None:
    """Logs [`slow_bf16_warning`] for `device`, naming what asked for bf16 (e.g. `"--dtype bfloat16"`). It only warns:
    the caller goes on in bf16, never silently in fp32. Returns the text, or `None` when there was nothing to say."""
    text = slow_bf16_warning(device)
    if text is not None:
        text = f"{requested_by}: {text}"
        logger.warning(text)
    return text
