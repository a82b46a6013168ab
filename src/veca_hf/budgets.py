# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Budgets: how many cores `C` a call runs with, in one place.

- Training draws one budget per optimiser step (the paper's elastic training, arXiv 2605.12491): `BudgetSampler`,
  the defaults (`default_budgets`, `paper_budget_weights`: 8..64 weighted 1,1,2,2,3,3,4,4), and `training_budgets`,
  which reads `--budgets` / `--budget_weights`, the flags of `SampledBudgetArguments` that distillation and
  fine-tuning share (`BudgetArguments` adds fine-tuning's fixed and evaluation budgets).
- Any model holding a VECA runs at a budget: `split_veca_inputs` passes it where `forward` takes it, and
  `veca_call_defaults` hands it (or a `pixel_mask`) to the VECA inside heads whose forward cannot (UperNet, DPT,
  Depth Anything).
- Serving picks one: `time_budgets` measures every budget, `pick_budget` returns the largest within a latency target.

It imports only torch, transformers and the model, so every other module can import it.
"""

import contextlib
import functools
import inspect
import math
import statistics
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import logging

from .flops import dense_twin_model_flops, veca_model_flops
from .model.configuration_veca import VecaConfig
from .model.modeling_veca import VecaModel


logger = logging.get_logger(__name__)

# The paper's elastic training: budgets 8..64 drawn with weights 1,1,2,2,3,3,4,4 (E[C] = 44).
DEFAULT_BUDGETS = (8, 16, 24, 32, 40, 48, 56, 64)
DEFAULT_BUDGET_WEIGHTS = (1, 1, 2, 2, 3, 3, 4, 4)


def _step_generator(seed: int, step: int, stream: int) -> torch.Generator:
    """A generator that depends only on (seed, step, stream): every rank and every resume draws the same value."""
    return torch.Generator().manual_seed((seed * 1_000_003 + step * 7_919 + stream) % (2**63 - 1))


class WeightedChoice:
    """Draws one of `values` with probability proportional to `weights`, as a function of the step.

    NOTE: drawing from (seed, step) instead of a running RNG needs no broadcast between ranks, no state in
    checkpoints, and gives the same value on every gradient-accumulation micro-batch of a step.

    Args:
        values (`Sequence[int]`): the choices.
        weights (`Sequence[float]`, *optional*): non-negative weights, one per value (uniform by default).
        seed (`int`): the run's seed.
        stream (`int`): separates independent draws made at the same step (budget vs resolution).
    """

    def __init__(self, values: Sequence[int], weights: Sequence[float] | None = None, seed: int = 0, stream: int = 0):
        values = [int(v) for v in values]
        weights = [1.0] * len(values) if weights is None else [float(w) for w in weights]
        if not values:
            raise ValueError("WeightedChoice needs at least one value.")
        if len(weights) != len(values):
            raise ValueError(f"Got {len(values)} values {values} but {len(weights)} weights {weights}.")
        if any(w < 0 or not math.isfinite(w) for w in weights) or sum(weights) <= 0:
            raise ValueError(f"Weights must be finite, non-negative and not all zero, got {weights}.")
        self.values = values
        self.probabilities = torch.tensor(weights, dtype=torch.float64) / sum(weights)
        self.seed = seed
        self.stream = stream

    def __call__(self, step: int) -> int:
        index = torch.multinomial(self.probabilities, 1, generator=_step_generator(self.seed, step, self.stream))
        return self.values[int(index)]


class BudgetSampler(WeightedChoice):
    """The elastic budget of each optimiser step (the paper's elastic training); `sampler(step) -> C`."""

    def __init__(
        self,
        budgets: Sequence[int] = DEFAULT_BUDGETS,
        weights: Sequence[float] | None = DEFAULT_BUDGET_WEIGHTS,
        seed: int = 0,
    ):
        super().__init__(budgets, weights, seed=seed, stream=1)


def paper_budget_weights(count: int) -> list[int]:
    """Sampling weights growing with the budget as in the paper: `ceil(4 * i / count)` for the i-th smallest budget,
    i = 1..count.

    For the paper's 8 budgets this is `(1, 1, 2, 2, 3, 3, 4, 4)`; for 2 budgets `(2, 4)`, for 4 `(1, 2, 3, 4)`.
    """
    if count < 1:
        raise ValueError(f"Need at least one budget, got count={count}.")
    return [math.ceil(4 * i / count) for i in range(1, count + 1)]


def parse_number_list(text: str | Sequence | None, name: str = "value", cast=int) -> list | None:
    """`"8, 16,64"` or `[8, 16, 64]` -> `[8, 16, 64]`; `None` stays `None`; anything else is a `ValueError` naming
    the flag `--name`."""
    if text is None:
        return None
    items = text.replace(" ", "").split(",") if isinstance(text, str) else list(text)
    try:
        return [cast(item) for item in items if item != ""]
    except (TypeError, ValueError):
        raise ValueError(f"--{name} {text!r} is not a comma-separated list of numbers, e.g. '8,16,24'.") from None


def default_budgets(config: VecaConfig) -> tuple[list[int], list[int]]:
    """
    The elastic training budgets of a student and their sampling weights, when none are given.

    Every multiple of `config.core_chunk_size` up to `config.core_bank_size` (`config.budgets`), weighted by
    [`paper_budget_weights`] so that larger budgets are drawn more often, as in the paper (arXiv 2605.12491): a bank of
    64 cores in chunks of 8 gives `8, 16, ..., 64` with weights `1, 1, 2, 2, 3, 3, 4, 4`; 16 cores give `8, 16` with
    weights `2, 4`.

    Args:
        config (`VecaConfig`): the student's configuration.

    Returns:
        `tuple`: `(budgets, weights)`, two lists of ints of the same length.
    """
    budgets = config.budgets
    return budgets, paper_budget_weights(len(budgets))


def training_budgets(
    config: VecaConfig, budgets: str | Sequence[int] | None = None, budget_weights: str | Sequence[float] | None = None
) -> tuple[list[int], list[float]]:
    """
    The budgets to sample and their weights, from `--budgets` / `--budget_weights` (either may be None), checked.

    - neither given: [`default_budgets`] of `config`;
    - only `budgets`: weighted by [`paper_budget_weights`] in increasing budget order;
    - only `budget_weights`: for `config.budgets`, so it must have one weight per valid budget.

    Args:
        config (`VecaConfig`): the student's configuration; every budget must be valid for it.
        budgets (`str` or `Sequence[int]`, *optional*): e.g. `"8,16,32"`.
        budget_weights (`str` or `Sequence[float]`, *optional*): e.g. `"1,2,4"`.

    Returns:
        `tuple`: `(budgets, weights)`.

    Raises:
        `ValueError`: for an invalid budget, or a number of weights that differs from the number of budgets.
    """
    if budgets is None:
        values = config.budgets
    else:
        values = parse_number_list(budgets, "budgets")
        for budget in values:
            config.check_budget(budget, name="--budgets entry")
    if budget_weights is None:
        rank = {budget: i for i, budget in enumerate(sorted(set(values)))}
        ranked = paper_budget_weights(len(rank))
        return values, [float(ranked[rank[budget]]) for budget in values]
    weights = parse_number_list(budget_weights, "budget_weights", float)
    if len(weights) != len(values):
        source = (
            "--budgets" if budgets is not None else f"the student's budgets (core_bank_size={config.core_bank_size})"
        )
        raise ValueError(
            f"--budget_weights {budget_weights!r} has {len(weights)} weights but {source} {values} has {len(values)} "
            "budgets: give one weight per budget, or leave --budget_weights out for the default weights."
        )
    return values, weights


def find_veca_config(model: nn.Module) -> VecaConfig | None:
    """The config the VECA inside `model` reads (its first `VecaModel`'s), or `None` if it holds none.

    For VECA's own models it is `model.config`; for transformers' heads with a VECA backbone (UperNet, DPT, Depth
    Anything) it is the backbone's, where `default_num_core_tokens` lives.
    """
    for module in model.modules():
        if isinstance(module, VecaModel):
            return module.config
    return None


def veca_config(model: nn.Module) -> VecaConfig:
    """[`find_veca_config`], or a `ValueError` if `model` holds no VECA."""
    config = find_veca_config(model)
    if config is None:
        raise ValueError(f"{type(model).__name__} holds no VecaModel: budgets apply to VECA models only.")
    return config


def _takes_argument(model: nn.Module, name: str) -> bool:
    """Whether `model.forward` takes `name` and hands it to its VECA.

    NOTE: a `**kwargs` of a wrapper (PEFT, `torch.compile`) reaches the wrapped VECA model, but one of a transformers
    model need not: UperNet and Depth Anything drop theirs, DPT hands them to its backbone. So a transformers model
    takes only the arguments it names.
    """
    parameters = inspect.signature(model.forward).parameters
    if name in parameters:
        return True
    var_keyword = any(parameter.kind == inspect.Parameter.VAR_KEYWORD for parameter in parameters.values())
    return var_keyword and not isinstance(model, PreTrainedModel)


@contextlib.contextmanager
def veca_call_defaults(model: nn.Module, **defaults) -> Iterator[None]:
    """
    Inside the block, every `VecaModel` in `model` gets `defaults` for the arguments it is called without (or with
    `None`): how a budget or a `pixel_mask` reaches the VECA backbone of a head whose forward cannot pass them.

    transformers' UperNet, DPT and Depth Anything call their backbone with the pixels only; their budget is otherwise
    `default_num_core_tokens`, fixed in the config, and a padded batch would show its padding to the cores.

    Args:
        model (`nn.Module`):
            Any model holding a `VecaModel` (a head, a backbone, a VECA model, a PEFT or DDP wrapper of one).
        defaults:
            `VecaModel.forward` arguments, e.g. `num_core_tokens=16, pixel_mask=mask`; `None` values are skipped.

    Example:

    ```python
    with veca_call_defaults(upernet, num_core_tokens=16, pixel_mask=inputs["pixel_mask"]):
        logits = upernet(inputs["pixel_values"]).logits
    ```
    """
    defaults = {name: value for name, value in defaults.items() if value is not None}
    if not defaults:
        yield
        return

    positional = list(inspect.signature(VecaModel.forward).parameters)[1:]  # without `self`

    def fill_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        for name, value in defaults.items():
            if name not in positional[: len(args)] and kwargs.get(name) is None:
                kwargs[name] = value
        return args, kwargs

    handles = [
        module.register_forward_pre_hook(fill_in, with_kwargs=True)
        for module in model.modules()
        if isinstance(module, VecaModel)
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def split_veca_inputs(model: nn.Module, inputs: dict, num_core_tokens: int | None) -> tuple[dict, dict]:
    """`(inputs for model.forward, arguments for its VECA through veca_call_defaults)`: the budget and `pixel_mask`
    go into the inputs where `model.forward` takes them, into the second dict where it does not."""
    inputs, hooked = dict(inputs), {}
    if num_core_tokens is not None:
        if _takes_argument(model, "num_core_tokens"):
            inputs["num_core_tokens"] = num_core_tokens
        else:
            hooked["num_core_tokens"] = num_core_tokens
    if "pixel_mask" in inputs and not _takes_argument(model, "pixel_mask"):
        hooked["pixel_mask"] = inputs.pop("pixel_mask")
    return inputs, hooked


@dataclass
class SampledBudgetArguments:
    """The budgets drawn per optimiser step: the flags distillation and fine-tuning share."""

    budgets: str | None = field(
        default=None,
        metadata={
            "help": "Budgets drawn per step, e.g. '8,16,32'. Default: every budget of the model (the multiples of "
            "core_chunk_size up to num_core_tokens: 8,16,...,64 for the presets)."
        },
    )
    budget_weights: str | None = field(
        default=None,
        metadata={
            "help": "Sampling weights of --budgets. Default: ceil(4 i / K) for the i-th smallest of K budgets "
            "(1,1,2,2,3,3,4,4 for 8 budgets, as in the paper)."
        },
    )


@dataclass
class BudgetArguments(SampledBudgetArguments):
    """How many cores (the budget C) to train and evaluate with: the flags every fine-tuning script shares."""

    num_core_tokens: int | None = field(
        default=None,
        metadata={"help": "Training budget (without --sample_budgets), saved as the model's default budget."},
    )
    sample_budgets: bool = field(default=False, metadata={"help": "Draw the budget of every optimiser step."})
    eval_budgets: str | None = field(
        default=None,
        metadata={"help": "Budgets to evaluate at, e.g. '8,16,64' (default: smallest, training default, largest)."},
    )


def budget_sampler_from_args(budget_args: BudgetArguments, model: nn.Module, seed: int) -> BudgetSampler | None:
    """The per-step budget sampler of `--sample_budgets` (`--budgets`, `--budget_weights`, as [`training_budgets`]
    reads them), or `None` without it."""
    if not budget_args.sample_budgets:
        return None
    budgets, weights = training_budgets(veca_config(model), budget_args.budgets, budget_args.budget_weights)
    logger.info(f"Sampling one budget per step from {budgets} with weights {weights}.")
    return BudgetSampler(budgets, weights, seed=seed)


def eval_budgets_from_args(budget_args: BudgetArguments, model: nn.Module) -> list[int]:
    """`--eval_budgets`, else the smallest budget, the model's default and the largest."""
    config = veca_config(model)
    default_budget = config.default_num_core_tokens or config.core_bank_size
    return parse_number_list(budget_args.eval_budgets, "eval_budgets") or sorted(
        {config.budgets[0], default_budget, config.budgets[-1]}
    )


def training_budget_description(
    budget_args: BudgetArguments, budget_sampler: BudgetSampler | None, model: nn.Module
) -> int | str:
    """What the model card says the training budget was."""
    if budget_sampler is not None:
        return f"sampled per step from {list(budget_sampler.values)}"
    config = veca_config(model)
    return budget_args.num_core_tokens or config.default_num_core_tokens or config.core_bank_size


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
    """One forward pass at `budget`, passed as an argument where the model takes one."""
    inputs, hooked = split_veca_inputs(model, {}, budget)
    with veca_call_defaults(model, **hooked):
        return model(pixel_values, **inputs)


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
    the same rounds, on the same input). The arguments are those of [`pick_budget`].
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
    model: nn.Module,
    image_size: tuple[int, int] | int,
    latency_target_ms: float,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    budgets: Sequence[int] | None = None,
    warmup: int = 2,
    repeats: int = 5,
    dense_model: nn.Module | None = None,
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
        model (`nn.Module`):
            A VECA model taking `(pixel_values, num_core_tokens=C)`: `VecaModel`, `VecaForImageClassification`,
            `VecaForSemanticSegmentation`, `VecaBackbone`, or a compiled one; or a head with a VECA backbone
            (UperNet, DPT, Depth Anything), whose budget is then set through [`veca_call_defaults`].
        image_size (`int` or `tuple[int, int]`):
            Input side, or `(height, width)`; multiples of the patch size.
        latency_target_ms (`float`):
            The largest acceptable median latency of one forward pass of the batch, in milliseconds.
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
            rounds; `BudgetChoice.dense_latency_ms` then holds its median.

    Returns:
        [`BudgetChoice`]: the chosen budget, the median latency and the FLOP ratio to a dense ViT of every budget.

    Raises:
        `ValueError`: if even the fastest budget is slower than the target (the message gives the fastest measured
        latency), or if an argument is invalid.
    """
    if not latency_target_ms > 0:
        raise ValueError(f"latency_target_ms must be positive, got {latency_target_ms!r}.")
    latencies_ms = time_budgets(model, image_size, batch_size, device, budgets, warmup, repeats, dense_model)
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


__all__ = [
    "DEFAULT_BUDGETS",
    "DEFAULT_BUDGET_WEIGHTS",
    "BudgetArguments",
    "BudgetChoice",
    "BudgetSampler",
    "SampledBudgetArguments",
    "WeightedChoice",
    "budget_sampler_from_args",
    "default_budgets",
    "eval_budgets_from_args",
    "find_veca_config",
    "paper_budget_weights",
    "parse_number_list",
    "pick_budget",
    "split_veca_inputs",
    "time_budgets",
    "training_budget_description",
    "training_budgets",
    "veca_call_defaults",
    "veca_config",
]
