# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What each budget costs on this machine, and the largest budget within a latency target.

`time_budgets` measures the median forward latency of every budget (round-robin, against a dense model when given);
`pick_budget` returns the largest budget within a latency target as a `BudgetChoice`, with every budget's FLOPs
against a dense ViT of the same size. Model cards report `time_budgets_at_resolutions`.
"""

import functools
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers.utils import logging

from .flops import dense_twin_model_flops, veca_model_flops
from .routing import veca_call, veca_config


logger = logging.get_logger(__name__)


@dataclass
class BudgetChoice:
    """
    What `pick_budget` measured and chose.

    Args:
        num_core_tokens (`int`): the largest budget whose median latency met the target.
        latencies_ms (`dict[int, float]`): the median forward latency of every measured budget, in milliseconds.
        latency_target_ms (`float`): the target.
        image_size (`tuple[int, int]`): `(height, width)` of the measured inputs.
        batch_size (`int`): images per forward pass.
        device (`str`): where it was measured.
        flops_vs_dense (`dict[int, float]`): every budget's forward FLOPs over those of the dense ViT of the same
            size at this image size ([`~veca_hf.flops.dense_twin_model_flops`]); above 1, VECA does more work.
        dense_latency_ms (`float`, *optional*): the median latency of `dense_model`, when one was timed with them.
    """

    num_core_tokens: int
    latencies_ms: dict[int, float]
    latency_target_ms: float
    image_size: tuple[int, int]
    batch_size: int
    device: str
    flops_vs_dense: dict[int, float] = field(default_factory=dict)
    dense_latency_ms: float | None = None

    @property
    def budgets_cheaper_than_dense(self) -> list[int]:
        """The budgets faster than the dense model (measured, when `dense_latency_ms` is set) or, without one, with
        fewer FLOPs than the dense ViT of the same size. Empty at small images, where the cores outweigh the saving."""
        if self.dense_latency_ms is not None:
            return [budget for budget, ms in self.latencies_ms.items() if ms < self.dense_latency_ms]
        return [budget for budget, ratio in self.flops_vs_dense.items() if ratio < 1]

    def table(self) -> str:
        """The measurements as a Markdown table, the chosen budget marked."""
        dense = self.dense_latency_ms
        lines = ["| budget | median latency (ms) | FLOPs / dense | fits |", "|---|---|---|---|"]
        for budget, latency in self.latencies_ms.items():
            fits = "yes" if latency <= self.latency_target_ms else "no"
            ratio = self.flops_vs_dense.get(budget)
            lines.append(
                f"| {budget} | {latency:.3f} | {'' if ratio is None else f'{ratio:.3f}'} | "
                f"{'**chosen**' if budget == self.num_core_tokens else fits} |"
            )
        if dense is not None:
            lines.append(f"| dense model | {dense:.3f} | 1 | {'yes' if dense <= self.latency_target_ms else 'no'} |")
        return "\n".join(lines)


def _synchronize(device: torch.device) -> None:
    """Waits for queued kernels, so that a timer around a forward pass measures the pass (no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu" and hasattr(getattr(torch, device.type, None), "synchronize"):  # mps, xpu, ...
        getattr(torch, device.type).synchronize()


def _forward_at(model: nn.Module, pixel_values: torch.Tensor, budget: int):
    """One forward pass at `budget` (the call argument where the model takes one, else its VECA's default)."""
    with veca_call(model, {"pixel_values": pixel_values}, budget) as inputs:
        return model(**inputs)


def time_budgets(
    model: nn.Module,
    image_size: tuple[int, int] | int,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    budgets: Sequence[int] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    dense_model: nn.Module | None = None,
) -> dict[int | str, float]:
    """
    The median latency in milliseconds of one forward pass at each budget, `{budget: ms}`, measured round-robin (a
    change in machine load hits every budget alike), and `"dense": ms` for `dense_model` when one is given (timed in
    the same rounds, on the same input); [`pick_budget`] says how it measures.

    Args:
        model (`nn.Module`):
            A VECA model taking `(pixel_values, num_core_tokens=C)`: `VecaModel`, `VecaForImageClassification`,
            `VecaForSemanticSegmentation`, `VecaBackbone`, or a compiled one; or a head with a VECA backbone
            (UperNet, DPT, Depth Anything), whose budget is then its VECA's default for the call
            ([`~veca_hf.routing.default_budget`]).
        image_size (`int` or `tuple[int, int]`):
            Input side, or `(height, width)`; multiples of the patch size.
        batch_size (`int`, *optional*, defaults to 1):
            Images per forward pass.
        device (`str` or `torch.device`, *optional*):
            Where to measure; defaults to the device of the model's parameters. If given, the model is moved there
            (in place).
        budgets (`Sequence[int]`, *optional*):
            The budgets to consider; defaults to every budget of the model (`model.config.budgets`).
        warmup (`int`, *optional*, defaults to 2):
            Untimed passes per budget.
        repeats (`int`, *optional*, defaults to 5):
            Timed passes per budget (the median is taken over them).
        dense_model (`nn.Module`, *optional*):
            A model taking `pixel_values` (e.g. a `DINOv3ViTModel`) to time against, on the same device, input and
            rounds: its median is the `"dense"` entry ([`pick_budget`]'s `BudgetChoice.dense_latency_ms`).

    Returns:
        `dict`: `{budget: median ms}`, and `"dense": ms` with `dense_model`.
    """
    if batch_size < 1 or warmup < 0 or repeats < 1:
        raise ValueError(f"Need batch_size >= 1, warmup >= 0 and repeats >= 1; got {batch_size}, {warmup}, {repeats}.")
    config = veca_config(model)
    budgets = sorted({config.check_budget(int(budget)) for budget in (config.budgets if budgets is None else budgets)})
    if not budgets:
        raise ValueError("`budgets` is empty.")
    height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    parameter = next(model.parameters())
    if device is None:
        device = parameter.device
    else:
        device = torch.device(device)
        model.to(device)
    pixel_values = torch.randn(batch_size, config.num_channels, height, width, device=device, dtype=parameter.dtype)

    calls = {budget: functools.partial(_forward_at, model, pixel_values, budget) for budget in budgets}
    if dense_model is not None:
        dense_model.to(device=device)
        calls["dense"] = functools.partial(dense_model, pixel_values)
    modes = [(module, module.training) for module in (model, dense_model) if module is not None]
    for module, _ in modes:
        module.eval()
    try:
        with torch.no_grad():
            for call in calls.values():
                for _ in range(warmup):
                    call()
            timings = {key: [] for key in calls}
            for _ in range(repeats):
                for key, call in calls.items():
                    _synchronize(device)
                    start = time.perf_counter()
                    call()
                    _synchronize(device)
                    timings[key].append((time.perf_counter() - start) * 1e3)
    finally:
        for module, was_training in modes:
            module.train(was_training)
    return {key: statistics.median(values) for key, values in timings.items()}


def pick_budget(
    model: nn.Module, image_size: tuple[int, int] | int, latency_target_ms: float, **timing
) -> BudgetChoice:
    """
    The largest budget that meets a latency target, measured on this machine, and whether any budget is cheaper than
    a dense ViT there.

    Every budget is timed: `warmup` untimed forward passes each, then `repeats` timed rounds over all budgets
    (round-robin, so that a change in machine load affects every budget alike), each pass timed with
    `time.perf_counter` under `torch.no_grad()` with the device synchronised around it; the latency of a budget is
    its median. The input is a random batch in the model's dtype. The model is put in eval mode for the measurement
    and its mode restored afterwards. The choice is the largest budget whose median is at most the target (latency
    grows with the budget, so in practice every smaller budget fits too; `BudgetChoice.latencies_ms` shows them all).

    Measure what you serve: the same batch size, image size, dtype, attention implementation and, if you use it,
    `torch.compile`d model (warm-up then absorbs the compilation of each budget; raise `warmup` if a budget
    recompiles more than once).

    VECA adds its `C` cores to every block, so at small images it can do more work than a dense ViT of the same size
    (VECA-B/16 does more than DINOv3-B up to 384 px at C = 64, up to 160 px at C = 8: docs/budget_picker.md).
    The choice reports every budget's FLOPs against that dense ViT (`flops_vs_dense`) and, with `dense_model` (e.g.
    the DINOv3 model you would serve instead), its measured latency in the same rounds; a warning is logged when no
    budget is cheaper than the dense model.

    Args:
        model (`nn.Module`), image_size (`int` or `tuple[int, int]`):
            As for [`time_budgets`].
        latency_target_ms (`float`):
            The largest acceptable median latency of one forward pass of the batch, in milliseconds.
        timing:
            The other arguments of [`time_budgets`]: `batch_size`, `device`, `budgets`, `warmup`, `repeats`,
            `dense_model`.

    Returns:
        [`BudgetChoice`]: the chosen budget, the median latency and the FLOP ratio to a dense ViT of every budget.

    Raises:
        `ValueError`: if even the fastest budget is slower than the target (the message gives the fastest measured
        latency), or if an argument is invalid.
    """
    if not latency_target_ms > 0:
        raise ValueError(f"latency_target_ms must be positive, got {latency_target_ms!r}.")
    latencies_ms = time_budgets(model, image_size, **timing)
    batch_size, repeats = timing.get("batch_size", 1), timing.get("repeats", 5)
    dense_latency_ms = latencies_ms.pop("dense", None)
    height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    device = next(model.parameters()).device
    config = veca_config(model)
    dense_flops = dense_twin_model_flops(config, height, width)
    flops_vs_dense = {
        budget: veca_model_flops(config, height, width, num_core_tokens=budget) / dense_flops
        for budget in latencies_ms
    }
    fitting = [budget for budget, latency in latencies_ms.items() if latency <= latency_target_ms]
    if not fitting:
        fastest = min(latencies_ms, key=latencies_ms.get)
        raise ValueError(
            f"No budget meets the {latency_target_ms:g} ms target: the fastest measured was "
            f"{latencies_ms[fastest]:.3f} ms (budget {fastest}, median of {repeats}) for a batch of {batch_size} "
            f"{height}x{width} images on {device}. Raise the target, or lower the batch size or the image size."
        )
    choice = BudgetChoice(
        num_core_tokens=max(fitting),
        latencies_ms=latencies_ms,
        latency_target_ms=latency_target_ms,
        image_size=(height, width),
        batch_size=batch_size,
        device=str(device),
        flops_vs_dense=flops_vs_dense,
        dense_latency_ms=dense_latency_ms,
    )
    measured = ", ".join(f"C={budget}: {ms:.1f} ms" for budget, ms in latencies_ms.items())
    logger.info(
        f"pick_budget: C={choice.num_core_tokens} is the largest budget within {latency_target_ms:g} ms per batch "
        f"of {batch_size} at {height}x{width} ({measured})."
    )
    if not choice.budgets_cheaper_than_dense:
        against = (
            f"the dense model's {dense_latency_ms:.1f} ms"
            if dense_latency_ms is not None
            else f"the FLOPs of a dense ViT of the same size (fewest: {min(flops_vs_dense.values()):.2f}x)"
        )
        logger.warning(
            f"pick_budget: no budget beats {against} at {height}x{width}: VECA's cores outweigh the attention it "
            "saves at this image size. A dense model is the cheaper choice here, or use larger images."
        )
    return choice


def device_description(device: torch.device) -> str:
    """Where a timing ran, for a results table or a model card: the GPU's name, or the CPU and its threads."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    if device.type == "cpu":
        threads = torch.get_num_threads()
        return f"CPU ({platform.machine()}, {threads} thread{'s' if threads != 1 else ''}), torch {torch.__version__}"
    return f"{device.type}, torch {torch.__version__}"


def time_budgets_at_resolutions(
    model, resolutions: Sequence[int], repeats: int
) -> tuple[dict[int, dict[int, float]], str]:
    """`{resolution: {budget: median ms}}` at batch 1, and how and where it was measured."""
    latencies = {resolution: time_budgets(model, resolution, warmup=1, repeats=repeats) for resolution in resolutions}
    parameter = next(model.parameters())
    return latencies, f"{str(parameter.dtype).removeprefix('torch.')} on {device_description(parameter.device)}"


__all__ = ["BudgetChoice", "device_description", "pick_budget", "time_budgets", "time_budgets_at_resolutions"]
