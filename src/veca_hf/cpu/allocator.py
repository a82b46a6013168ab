# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""glibc malloc settings that keep VECA's large CPU intermediates in the heap instead of fresh mmaps.

Why: glibc serves every allocation above its mmap threshold (adaptive, at most 32 MiB on 64-bit) with a fresh `mmap`,
which the kernel fills in 4 KiB pages on first touch (a minor page fault each, zeroed), and unmaps on free. At
1024 px VECA-B's fused qkv output (38 MiB) and SwiGLU input (68 MiB) are above that cap in every block, so each
forward pays about 276k page faults (4.38 s against 4.14 s with these settings on a 2-core AMD EPYC;
docs/performance.md, "The allocator"). With mmap off for the heap and its top kept (`M_MMAP_MAX=0`,
`M_TRIM_THRESHOLD=1 GiB`, `M_TOP_PAD=64 MiB`), those buffers are reused from the heap like any smaller tensor. The
values computed do not change (same kernels, same inputs).

When: only when called. `tune_cpu_allocator()` is one line at the start of a CPU job (the project's scripts and
benchmarks call it); the model never does, and importing `veca_hf` changes nothing: a process-wide setting is the
application's choice, not a library's.

What it costs: the settings are process-wide and stay. Memory a process frees (up to 1 GiB at the heap's top, and
large blocks below live ones) is kept for reuse instead of going back to the OS, so the resident size after a large
forward stays near its peak. Off glibc (macOS, Windows, musl) nothing happens.

Opt out of the scripts' call: set `VECA_HF_TUNE_MALLOC=0` in the environment.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading


__all__ = [
    "MALLOC_SETTINGS",
    "OPT_OUT_VARIABLE",
    "cpu_allocator_state",
    "tune_cpu_allocator",
]

OPT_OUT_VARIABLE = "VECA_HF_TUNE_MALLOC"
# glibc's mallopt parameter numbers (malloc.h) and the values set.
_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_MAX = -1, -2, -4
MALLOC_SETTINGS = {"M_MMAP_MAX": 0, "M_TRIM_THRESHOLD": 2**30, "M_TOP_PAD": 64 * 2**20}
_PARAMETERS = {"M_MMAP_MAX": _M_MMAP_MAX, "M_TRIM_THRESHOLD": _M_TRIM_THRESHOLD, "M_TOP_PAD": _M_TOP_PAD}

_lock = threading.Lock()
_state = {"tuned": False, "settled": False, "reason": "not applied: tune_cpu_allocator() was not called"}


def _glibc() -> ctypes.CDLL | None:
    """The C library if it is glibc (it has `gnu_get_libc_version` and `mallopt`), else `None`."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.mallopt  # noqa: B018 (raises AttributeError where it is missing)
    except (OSError, AttributeError):
        return None
    return libc


def opted_out() -> bool:
    return os.environ.get(OPT_OUT_VARIABLE, "1").strip().lower() in ("0", "false", "no", "off")


def tune_cpu_allocator() -> bool:
    """Apply [`MALLOC_SETTINGS`] to this process's glibc malloc, once (later calls return the first outcome). Call it
    at the start of a CPU job, before the first large forward: VECA-B/16 at 1024 px then runs about 5% faster with no
    page faults per call (docs/performance.md, "The allocator").

    Returns:
        `bool`: whether the settings are in effect (`False` off glibc or with `VECA_HF_TUNE_MALLOC=0`).
    """
    with _lock:
        if _state["settled"]:  # applied, or impossible here
            return _state["tuned"]
        if opted_out():
            _state["reason"] = f"opted out ({OPT_OUT_VARIABLE}={os.environ[OPT_OUT_VARIABLE]})"
            return False
        libc = _glibc()
        if libc is None:
            _state.update(settled=True, reason="not glibc: nothing to tune")
            return False
        for name, value in MALLOC_SETTINGS.items():
            if libc.mallopt(_PARAMETERS[name], value) != 1:  # mallopt returns 1 on success
                _state.update(settled=True, reason=f"mallopt({name}, {value}) failed")
                return False
        _state.update(tuned=True, settled=True, reason="applied", glibc=libc.gnu_get_libc_version().decode())
        return True


def cpu_allocator_state() -> dict:
    """`{"tuned": bool, "reason": str, "settings": MALLOC_SETTINGS, ...}`, for benchmarks to record what ran."""
    return {**_state, "settings": dict(MALLOC_SETTINGS), "opt_out_variable": OPT_OUT_VARIABLE}
