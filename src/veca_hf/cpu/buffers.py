# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Opt-in CPU inference speed-ups that the model code does not know about.

`cpu_inference_buffers(model)` temporarily replaces, on the instances of one model:

- the `forward` of every plain `nn.Linear` named `qkv_proj` or `gate_up_proj`: an output above 32 MiB is written with
  `torch.addmm(..., out=buffer)` into one buffer per name, allocated by the first block and reused by the others;
- the `forward` of every `VecaSwiGLUMLP` with SiLU: the activation and the gating run in place inside the projection's
  output (no fresh `(B, T, I)` tensor).

NOTE (why): glibc serves every CPU tensor above 32 MiB with a fresh `mmap` that the kernel maps in 4 KiB pages on
first touch. At 1024 px VECA-B's fused qkv (38 MiB) and SwiGLU input (68 MiB) are that large in every block; sharing
them saves those page faults (without `tune_cpu_allocator`'s settings; with them it adds little: docs/performance.md,
"The allocator"). Smaller outputs come from glibc's free lists, which hand back recently freed, cache-warm memory:
they keep the plain call. A shared buffer is overwritten by the next block, which
is safe because each block consumes its projections before the next one runs, but not for autograd (backward needs
them), hooks that keep outputs, autocast or `torch.compile`: there every call falls back to the module's own forward.

    with torch.no_grad(), cpu_inference_buffers(model):
        outputs = model(pixel_values, num_core_tokens=64)
"""

import contextlib
import math
import threading
from collections.abc import Iterator

import torch
from torch import nn
from transformers.activations import SiLUActivation

from ..model.modeling_veca import VecaSwiGLUMLP


# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): larger blocks are mapped fresh on every call.
FRESH_MMAP_BYTES = 32 * 2**20
SHARED_PROJECTIONS = ("qkv_proj", "gate_up_proj")


def _fast_path(module: nn.Module, hidden_states: torch.Tensor) -> bool:
    """Whether a call may write into shared or reused memory (plain CPU inference, nothing watching the output)."""
    return not (
        torch.is_grad_enabled()
        or hidden_states.device.type != "cpu"
        or torch.is_autocast_enabled("cpu")
        or torch.compiler.is_compiling()
        or module._forward_hooks
        or module._forward_pre_hooks
    )


def _shared_linear_forward(linear: nn.Linear, buffers: threading.local, name: str):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        shape = (*hidden_states.shape[:-1], linear.out_features)
        large = math.prod(shape) * hidden_states.element_size() > FRESH_MMAP_BYTES
        if not (large and _fast_path(linear, hidden_states)):
            return nn.Linear.forward(linear, hidden_states)
        thread_buffers = vars(buffers)  # NOTE: per thread: threads calling one model must not share a buffer
        buffer = thread_buffers.get(name)
        if buffer is None or buffer.shape != shape or buffer.dtype != hidden_states.dtype:
            buffer = thread_buffers[name] = hidden_states.new_empty(shape)
        inputs, outputs = hidden_states.reshape(-1, hidden_states.shape[-1]), buffer.view(-1, linear.out_features)
        if linear.bias is None:
            torch.mm(inputs, linear.weight.t(), out=outputs)
        else:
            torch.addmm(linear.bias, inputs, linear.weight.t(), out=outputs)
        return buffer

    return forward


def _in_place_swiglu_forward(mlp: VecaSwiGLUMLP):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        if not _fast_path(mlp, hidden_states):
            return VecaSwiGLUMLP.forward(mlp, hidden_states)
        gate, up = mlp.gate_up_proj(hidden_states).chunk(2, dim=-1)  # (B, T, I) each, views of one fresh output
        return mlp.down_proj(nn.functional.silu(gate, inplace=True).mul_(up))

    return forward


@contextlib.contextmanager
def cpu_inference_buffers(model: nn.Module) -> Iterator[nn.Module]:
    """Within the context, `model`'s blocks share their largest projection outputs and gate SwiGLU in place.

    Only instances inside `model` change (their `forward` attribute), and only for the duration of the context; the
    values are the same as without it (same kernels). See the module docstring for when calls fall back. Threads may
    call the model inside the context (each gets its own buffers); enter the context once, around all of them.

    Args:
        model (`nn.Module`):
            A VECA model (or anything holding one); layers that are not a plain `nn.Linear` (PEFT adapters,
            quantised layers) are left alone.
    """
    buffers = threading.local()  # one dict of buffers per thread: shared buffers would mix threads' outputs
    patched = []
    for qualified_name, module in model.named_modules():
        name = qualified_name.rsplit(".", 1)[-1]
        if name in SHARED_PROJECTIONS and type(module) is nn.Linear:
            module.forward = _shared_linear_forward(module, buffers, name)
            patched.append(module)
        elif isinstance(module, VecaSwiGLUMLP) and isinstance(module.act_fn, (nn.SiLU, SiLUActivation)):
            module.forward = _in_place_swiglu_forward(module)
            patched.append(module)
    try:
        yield model
    finally:
        for module in patched:
            del module.forward  # the class's forward again
        vars(buffers).clear()  # this thread's; the others' go with `buffers`
