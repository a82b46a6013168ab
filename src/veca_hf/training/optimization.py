# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The distillation optimisers and learning-rate schedule of the paper (arXiv 2605.12491).

- `adamw`: AdamW for every parameter, with no weight decay on cores, core coordinates, coordinate step scales,
  norms and biases (`get_parameter_groups`).
- `normuon`: the paper's split. NorMuon (`pytorch_optimizer.NorMuon`) for the 2-D weights of the blocks' linear
  layers (attention qkv and output, SwiGLU in and out), except the last block's MLP output weight; AdamW, inside the
  same optimiser, for everything else (patch embedding, core tokens and coordinates, coordinate heads, norms,
  biases, a projection head, a dense student's CLS token and LayerScale). One learning rate serves both: the
  orthogonalised update is rescaled to AdamW's RMS as in Moonlight (`0.2 * sqrt(max(rows, columns))`), with the
  Polar Express Newton-Schulz coefficients. The Newton-Schulz iteration runs in bf16 as pytorch-optimizer runs it,
  except on a CPU without bf16 instructions, where it runs in fp32 (`newton_schulz_dtype`).
- `cosine_schedule_with_warmup`: linear warm-up (from 0, or from the minimum as in the paper), then cosine to a
  minimum learning rate.
"""

import contextlib
import functools
import re
from unittest import mock

import torch
from torch import nn
from transformers import (
    get_constant_schedule,
    get_cosine_with_min_lr_schedule_with_warmup,
    get_cosine_with_min_lr_schedule_with_warmup_lr_rate,
)


OPTIMIZERS = ("adamw", "normuon")
NEWTON_SCHULZ_DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}

# Parameters that must not be weight-decayed, by a component of their name (plus every 1-D tensor).
NO_DECAY_NAMES = ("core_tokens", "core_coordinates", "step", "bias")

# A linear layer inside a transformer block: `...layer.<index>.<rest>` (VECA: `encoder.layer.3.mlp.down_proj`;
# DINOv3: `layer.3.mlp.down_proj`).
_BLOCK_LINEAR = re.compile(r"(?:^|\.)layer\.(\d+)\.(.+)$")
# The MLP output projection, whose last-block instance the paper keeps on AdamW (it writes the final features).
_MLP_OUTPUT = "mlp.down_proj"


def get_parameter_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """AdamW groups with no weight decay on cores, core coordinates, coordinate step scales, norms and biases.

    NOTE: `Trainer`'s default rule decays everything that is not a norm or a bias, which would pull the cores and
    their coordinates towards zero.
    """
    decay, no_decay = [], []
    for name, parameter in model.named_parameters():
        if not parameter.requires_grad:
            continue
        parts = name.split(".")
        if parameter.ndim <= 1 or any(part in NO_DECAY_NAMES for part in parts):
            no_decay.append(parameter)
        else:
            decay.append(parameter)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def normuon_parameter_names(model: nn.Module) -> list[str]:
    """The parameters the paper trains with NorMuon: the weights of every `nn.Linear` inside a transformer block
    (`...layer.<i>.`), except the last block's MLP output projection (`mlp.down_proj`). Works for `VecaModel`, a
    dense `DINOv3ViTModel` student, and either wrapped (`StudentWithLoss`)."""
    linears = {}
    for name, module in model.named_modules():
        match = _BLOCK_LINEAR.search(name)
        if match and isinstance(module, nn.Linear) and module.weight.requires_grad:
            linears[name] = (int(match.group(1)), match.group(2))
    if not linears:
        return []
    last_block = max(index for index, _ in linears.values())
    return [f"{name}.weight" for name, (index, rest) in linears.items()
            if not (index == last_block and rest == _MLP_OUTPUT)]  # fmt: skip


def build_optimizer(
    model: nn.Module,
    name: str = "adamw",
    learning_rate: float = 4e-4,
    weight_decay: float = 0.015,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    newton_schulz: str = "auto",
) -> torch.optim.Optimizer:
    """
    The optimiser `name` (`"adamw"` or `"normuon"`) over `model`'s trainable parameters, as in the paper.

    Args:
        model (`nn.Module`): what is trained (e.g. `StudentWithLoss`).
        name (`str`): `"adamw"` (`torch.optim.AdamW`) or `"normuon"` (`pytorch_optimizer.NorMuon` for the blocks'
            hidden matrices, its AdamW groups for the rest; needs `pip install veca_hf[train]`).
        learning_rate (`float`): the peak learning rate of every group.
        weight_decay (`float`): decoupled weight decay, off for cores, coordinates, step scales, norms and biases.
        betas, eps: AdamW's (for the AdamW part).
        newton_schulz (`str`, *optional*, defaults to `"auto"`): NorMuon's Newton-Schulz iteration dtype:
            `"bfloat16"` (pytorch-optimizer's), `"float32"`, or `"auto"` ([`newton_schulz_dtype`] of the device).

    Returns:
        `torch.optim.Optimizer`; with `"normuon"` its groups carry `use_muon` (True for the hidden matrices).
    """
    check_optimizer_backend(name, uses_deepspeed=False)
    if newton_schulz != "auto" and newton_schulz not in NEWTON_SCHULZ_DTYPES:
        raise ValueError(f"newton_schulz {newton_schulz!r} is not one of auto, {', '.join(NEWTON_SCHULZ_DTYPES)}.")
    adamw_groups = get_parameter_groups(model, weight_decay)
    if name == "adamw":
        return torch.optim.AdamW(adamw_groups, lr=learning_rate, betas=betas, eps=eps)
    try:
        normuon = _normuon_class()
    except ImportError:
        raise ImportError(
            "--optimizer normuon needs the pytorch-optimizer package: pip install 'veca_hf[train]' (or "
            "pip install pytorch-optimizer)."
        ) from None
    parameters = dict(model.named_parameters())
    hidden = [parameters[n] for n in normuon_parameter_names(model)]
    hidden_ids = {id(p) for p in hidden}
    groups = [{"params": hidden, "weight_decay": weight_decay, "use_muon": True}]
    for group in adamw_groups:
        rest = [p for p in group["params"] if id(p) not in hidden_ids]
        groups.append({**group, "params": rest, "use_muon": False, "betas": betas, "eps": eps})
    device = hidden[0].device if hidden else torch.device("cpu")
    if newton_schulz == "bfloat16":  # as asked, with the slowdown said where bf16 is slow
        from ..cpu.hardware import warn_if_slow_bf16

        warn_if_slow_bf16(device, "NorMuon's Newton-Schulz iteration in bfloat16")
    iteration_dtype = newton_schulz_dtype(device) if newton_schulz == "auto" else NEWTON_SCHULZ_DTYPES[newton_schulz]
    return normuon(
        groups,
        newton_schulz_dtype=iteration_dtype,
        lr=learning_rate,
        adamw_lr=learning_rate,
        ns_coeffs="polar_express",
        # Moonlight's RMS matching: the orthogonalised update scaled by 0.2 * sqrt(max(rows, columns)), so one
        # learning rate suits the NorMuon and the AdamW groups.
        update_scale="preserve_norm",
        use_adjusted_lr=True,
    )


def newton_schulz_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype of NorMuon's Newton-Schulz iteration on `device`: bf16 (pytorch-optimizer's choice), except on a CPU
    whose flags list neither `avx512_bf16` nor `amx_bf16`: there torch runs bf16 matmuls on fallback kernels (one
    1152 x 384 iteration took 1.28 s in bf16 and 0.11 s in fp32 on an AMD EPYC with AVX2 only), so fp32."""
    from ..cpu.hardware import cpu_bf16_support

    if torch.device(device).type == "cpu" and cpu_bf16_support(measure_size=None)["fast_bf16"] is False:
        return torch.float32
    return torch.bfloat16


@functools.cache
def _normuon_class() -> type:
    """`pytorch_optimizer.NorMuon` with the dtype of its Newton-Schulz iteration as an argument."""
    from pytorch_optimizer import NorMuon
    from pytorch_optimizer.optimizer.muon import base, normuon
    from pytorch_optimizer.optimizer.utils.matrix import zero_power_via_newton_schulz_5

    # the modules whose NorMuon code paths (foreach and per-tensor) call the iteration by its imported name
    callers = [m for m in (base, normuon) if getattr(m, "zero_power_via_newton_schulz_5", None) is not None]

    class NorMuonWithIterationDtype(NorMuon):
        def __init__(self, params, newton_schulz_dtype: torch.dtype = torch.bfloat16, **kwargs):
            super().__init__(params, **kwargs)
            self.newton_schulz_dtype = newton_schulz_dtype

        def step(self, closure=None):
            if self.newton_schulz_dtype == torch.bfloat16:
                return super().step(closure)
            # NOTE: NorMuon calls the iteration with its default dtype (bf16) and takes no argument for it, so the
            # function its modules look up is swapped for the duration of this step only.
            iteration = functools.partial(zero_power_via_newton_schulz_5, dtype=self.newton_schulz_dtype)
            with contextlib.ExitStack() as stack:
                for module in callers:
                    stack.enter_context(mock.patch.object(module, "zero_power_via_newton_schulz_5", iteration))
                return super().step(closure)

    return NorMuonWithIterationDtype


def check_optimizer_backend(name: str, uses_deepspeed: bool) -> None:
    """A clear error for an unknown optimiser, and for NorMuon under DeepSpeed (before any work)."""
    if name not in OPTIMIZERS:
        raise ValueError(f"--optimizer {name!r} is not one of {', '.join(OPTIMIZERS)}.")
    if name == "normuon" and uses_deepspeed:
        raise ValueError(
            "--optimizer normuon does not run under DeepSpeed: NorMuon orthogonalises each hidden weight matrix "
            "whole, but ZeRO flattens and partitions parameters and optimiser state across ranks. Launch with DDP "
            "(examples/configs/multi_gpu.yaml) for NorMuon, or keep DeepSpeed with --optimizer adamw."
        )


def cosine_schedule_with_warmup(
    optimizer: torch.optim.Optimizer,
    learning_rate: float,
    min_learning_rate: float,
    warmup_steps: int,
    total_steps: int,
    warmup_from_min: bool = False,
) -> torch.optim.lr_scheduler.LambdaLR:
    """
    Linear warm-up to `learning_rate`, then cosine down to `min_learning_rate` at `total_steps`.

    The warm-up starts from 0 (`transformers.get_cosine_with_min_lr_schedule_with_warmup`), or, with
    `warmup_from_min`, from `min_learning_rate` as in the paper's schedule. A zero `learning_rate` (a control that
    must not learn) has no minimum to decay to: the schedule is constant.
    """
    if learning_rate <= 0:
        return get_constant_schedule(optimizer)
    if not 0 <= min_learning_rate <= learning_rate:
        raise ValueError(
            f"min_learning_rate {min_learning_rate} must lie between 0 and learning_rate {learning_rate}."
        )
    ratio = min_learning_rate / learning_rate
    if warmup_from_min:
        return get_cosine_with_min_lr_schedule_with_warmup_lr_rate(
            optimizer, warmup_steps, total_steps, min_lr_rate=ratio, warmup_lr_rate=ratio
        )
    return get_cosine_with_min_lr_schedule_with_warmup(optimizer, warmup_steps, total_steps, min_lr_rate=ratio)


def optimizer_group_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    """The parameter names of each of `optimizer`'s groups, in group order (to log and to test the split)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]


__all__ = [
    "NEWTON_SCHULZ_DTYPES",
    "NO_DECAY_NAMES",
    "OPTIMIZERS",
    "build_optimizer",
    "check_optimizer_backend",
    "cosine_schedule_with_warmup",
    "get_parameter_groups",
    "newton_schulz_dtype",
    "normuon_parameter_names",
    "optimizer_group_names",
]
