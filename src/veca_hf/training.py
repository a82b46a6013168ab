# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tuning and serving helpers around the budget `C` (`num_core_tokens`).

- `VecaTrainer`: a `transformers.Trainer` that keeps weight decay off the cores, the core coordinates and the
  coordinate step scales; trains at a fixed budget or at a budget drawn per optimiser step (as in distillation);
  and evaluates at a chosen budget. It works for VECA's own models and for transformers' heads with a VECA
  backbone (UperNet, DPT, Depth Anything), whose forward cannot take a budget or a `pixel_mask`.
- `BudgetArguments` and what the fine-tuning scripts build from them: `budget_sampler_from_args`,
  `eval_budgets_from_args`, `evaluate_and_save_budgets` (`all_results.json` with `eval_C{C}_<metric>` keys).
- `evaluate_budgets`: `trainer.evaluate` at several budgets, with metrics prefixed `eval_C{C}_`.
- `veca_call_defaults`: a budget or a `pixel_mask` for the VECA inside any model, for one block of code.
- `setup_logging`: the example scripts' logging.
- `pick_budget`: measures the model at every budget on the current device and returns the largest budget whose
  median latency meets a target.

`examples/finetune_classification.py`, `finetune_segmentation.py` and `finetune_depth.py` put these together; see
`docs/budget_picker.md` and `docs/dense_tasks.md`.
"""

import contextlib
import inspect
import logging as python_logging
import statistics
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PreTrainedModel, Trainer
from transformers.utils import logging

from .configuration_veca import VecaConfig
from .distillation import DEFAULT_BUDGET_WEIGHTS, DEFAULT_BUDGETS, BudgetSampler
from .modeling_veca import VecaModel
from .optimization import get_parameter_groups


logger = logging.get_logger(__name__)


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


class VecaTrainer(Trainer):
    """
    `Trainer` for VECA models: the budget of every forward pass is chosen by the trainer, not the model's config.

    Three things differ from `Trainer`:

    - Weight decay follows `veca_hf.optimization.get_parameter_groups`: no decay on cores, core coordinates,
      coordinate step scales, norms and biases. (`Trainer`'s default decays everything that is not a norm or a bias,
      which pulls the cores, and the cores' positions, towards zero.) Only `get_decay_parameter_names` is
      overridden, so `--optim`, `--optim_args` and the rest of `Trainer.create_optimizer` work as usual.
    - Training steps run at `budget_sampler(step)` if a sampler is given, else at `num_core_tokens`. The budget is a
      function of `state.global_step`, so every gradient-accumulation micro-batch of a step, every process and every
      resumed run uses the same one.
    - Evaluation and prediction run at `eval_num_core_tokens` (default: `num_core_tokens`). `evaluate_budgets`
      sweeps it.

    A budget left at `None` is not passed to the model, which then uses `config.default_num_core_tokens` (the whole
    bank if that is `None` too).

    The model can be a VECA model or any model with a VECA inside (`UperNetForSemanticSegmentation`,
    `DPTForDepthEstimation`, `DepthAnythingForDepthEstimation` with a `VecaConfig` backbone): where its forward takes
    no `num_core_tokens` or no `pixel_mask`, they reach the VECA through [`veca_call_defaults`].

    NOTE: a step at a budget below the bank leaves the unused core chunks without gradients. Under
    `DistributedDataParallel` that needs `find_unused_parameters=True`, which is `Trainer`'s default for transformers
    models unless activation checkpointing is on (then set `ddp_find_unused_parameters=True` and non-re-entrant
    checkpointing).

    Args:
        num_core_tokens (`int`, *optional*):
            The training budget when `budget_sampler` is `None`, and the default evaluation budget.
        budget_sampler (`BudgetSampler`, *optional*):
            Draws the budget of each training step from its step index, e.g.
            `BudgetSampler(model.config.budgets, weights=None, seed=args.seed)`.
        eval_num_core_tokens (`int`, *optional*):
            The budget for `evaluate` and `predict`; defaults to `num_core_tokens`.
        args, kwargs:
            Everything else, as for `Trainer`.

    Example:

    ```python
    trainer = VecaTrainer(
        model=model, args=training_args, train_dataset=train, eval_dataset=validation,
        budget_sampler=BudgetSampler(model.config.budgets, weights=None, seed=training_args.seed),
        eval_num_core_tokens=16,
    )
    trainer.train()
    ```
    """

    def __init__(
        self,
        *args,
        num_core_tokens: int | None = None,
        budget_sampler: BudgetSampler | None = None,
        eval_num_core_tokens: int | None = None,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        self.num_core_tokens = num_core_tokens
        self.budget_sampler = budget_sampler
        self.eval_num_core_tokens = eval_num_core_tokens
        config = find_veca_config(self.model) if self.model is not None else None
        if config is not None:  # fail now rather than at the first sampled step
            for name, budget in (("num_core_tokens", num_core_tokens), ("eval_num_core_tokens", eval_num_core_tokens)):
                if budget is not None:
                    config.check_budget(budget, name=name)
            for budget in budget_sampler.values if budget_sampler is not None else ():
                config.check_budget(budget, name="a budget of budget_sampler")

    def training_budget(self, step: int) -> int | None:
        """The budget of optimiser step `step` (`None`: the model's own default)."""
        return self.budget_sampler(step) if self.budget_sampler is not None else self.num_core_tokens

    @property
    def evaluation_budget(self) -> int | None:
        """The budget of `evaluate` and `predict` (`None`: the model's own default)."""
        return self.eval_num_core_tokens if self.eval_num_core_tokens is not None else self.num_core_tokens

    def get_decay_parameter_names(self, model: nn.Module) -> list[str]:
        """The parameters `get_parameter_groups` decays: tensors of 2+ dimensions other than cores and coordinates."""
        decayed = {id(parameter) for parameter in get_parameter_groups(model, self.args.weight_decay)[0]["params"]}
        return [name for name, parameter in model.named_parameters() if id(parameter) in decayed]

    def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None) -> torch.Tensor:
        inputs, hooked = split_veca_inputs(self.model, inputs, self.training_budget(self.state.global_step))
        with veca_call_defaults(self.model, **hooked):
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        inputs, hooked = split_veca_inputs(self.model, inputs, self.evaluation_budget)
        with veca_call_defaults(self.model, **hooked):
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


@contextlib.contextmanager
def _evaluation_budget(trainer: Trainer, budget: int) -> Iterator[None]:
    """Evaluate at `budget` inside the block: `VecaTrainer.eval_num_core_tokens`, else the model's config default."""
    if isinstance(trainer, VecaTrainer):
        owner, attribute = trainer, "eval_num_core_tokens"
    else:  # a plain Trainer cannot pass the budget; the model reads its (VECA's) config
        owner, attribute = veca_config(trainer.model), "default_num_core_tokens"
    previous = getattr(owner, attribute)
    setattr(owner, attribute, budget)
    try:
        yield
    finally:
        setattr(owner, attribute, previous)


def evaluate_budgets(
    trainer: Trainer, eval_dataset=None, budgets: Sequence[int] | None = None, ignore_keys: list[str] | None = None
) -> dict[int, dict[str, float]]:
    """
    Run `trainer.evaluate` once per budget.

    Args:
        trainer (`Trainer`):
            A `VecaTrainer` (its `eval_num_core_tokens` is set for each call), or any `Trainer` whose model holds a
            VECA (the VECA's `config.default_num_core_tokens` is set for each call). Both are restored afterwards.
        eval_dataset (`Dataset`, *optional*):
            Defaults to `trainer.eval_dataset`.
        budgets (`Sequence[int]`, *optional*):
            Defaults to every budget of the model (`model.config.budgets`).
        ignore_keys (`list[str]`, *optional*):
            Passed to `trainer.evaluate`.

    Returns:
        `dict[int, dict[str, float]]`: budget -> the metrics of that evaluation, keyed `eval_C{C}_<name>`
        (`eval_C8_loss`, `eval_C8_accuracy`, `eval_C8_runtime`, ...); merge the dicts for `trainer.save_metrics`.
    """
    config = veca_config(trainer.model)
    budgets = list(config.budgets if budgets is None else budgets)
    for budget in budgets:
        config.check_budget(budget)
    results = {}
    for budget in budgets:
        with _evaluation_budget(trainer, budget):
            results[budget] = trainer.evaluate(
                eval_dataset=eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=f"eval_C{budget}"
            )
    return results


@dataclass
class BudgetArguments:
    """How many cores (the budget C) to train and evaluate with: the flags every fine-tuning script shares."""

    num_core_tokens: int | None = field(
        default=None,
        metadata={"help": "Training budget (without --sample_budgets), saved as the model's default budget."},
    )
    sample_budgets: bool = field(default=False, metadata={"help": "Draw the budget of every optimiser step."})
    budgets: str | None = field(
        default=None, metadata={"help": "Budgets to draw from, e.g. '8,16,32,64' (default: all of the model's)."}
    )
    budget_weights: str | None = field(
        default=None,
        metadata={"help": "Their weights, e.g. '1,1,2,2' (default: 1,1,2,2,3,3,4,4 for 8..64, else equal)."},
    )
    eval_budgets: str | None = field(
        default=None,
        metadata={"help": "Budgets to evaluate at, e.g. '8,16,64' (default: smallest, training default, largest)."},
    )


def parse_number_list(text: str | None, cast=int) -> list | None:
    """'8, 16,64' -> [8, 16, 64]; None stays None."""
    return None if text is None else [cast(part) for part in text.replace(" ", "").split(",") if part]


def budget_sampler_from_args(budget_args: BudgetArguments, model: nn.Module, seed: int) -> BudgetSampler | None:
    """The per-step budget sampler of `--sample_budgets` (`--budgets`, `--budget_weights`), or `None` without it.

    Without `--budget_weights`, the paper's weights 1,1,2,2,3,3,4,4 for the budgets 8..64, equal weights otherwise.
    """
    if not budget_args.sample_budgets:
        return None
    budgets = parse_number_list(budget_args.budgets) or veca_config(model).budgets
    weights = parse_number_list(budget_args.budget_weights, float)
    if weights is None and tuple(budgets) == DEFAULT_BUDGETS:
        weights = DEFAULT_BUDGET_WEIGHTS
    logger.info(f"Sampling one budget per step from {budgets} with weights {weights or 'equal'}.")
    return BudgetSampler(budgets, weights, seed=seed)


def eval_budgets_from_args(budget_args: BudgetArguments, model: nn.Module) -> list[int]:
    """`--eval_budgets`, else the smallest budget, the model's default and the largest."""
    config = veca_config(model)
    default_budget = config.default_num_core_tokens or config.num_core_tokens
    return parse_number_list(budget_args.eval_budgets) or sorted(
        {config.budgets[0], default_budget, config.budgets[-1]}
    )


def training_budget_description(
    budget_args: BudgetArguments, budget_sampler: BudgetSampler | None, model: nn.Module
) -> int | str:
    """What the model card says the training budget was."""
    if budget_sampler is not None:
        return f"sampled per step from {list(budget_sampler.values)}"
    config = veca_config(model)
    return budget_args.num_core_tokens or config.default_num_core_tokens or config.num_core_tokens


def evaluate_and_save_budgets(trainer: Trainer, budgets: Sequence[int], eval_dataset=None) -> dict[str, float]:
    """
    [`evaluate_budgets`] at `budgets`, the per-budget metrics merged into one dict (`eval_C8_loss`,
    `eval_C8_mean_iou`, ...), logged and saved as `eval_results.json` (merged into `all_results.json`).

    Returns:
        `dict[str, float]`: the merged metrics.
    """
    metrics = {}
    for budget_metrics in evaluate_budgets(trainer, eval_dataset=eval_dataset, budgets=budgets).values():
        metrics.update(budget_metrics)
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)  # eval_results.json, merged into all_results.json
    return metrics


def setup_logging(training_args, logger: python_logging.Logger) -> None:
    """The logging of the example scripts, as transformers' examples set it up: stdout, the process's log level for
    the script, transformers and datasets (warnings only on processes other than the main one)."""
    python_logging.basicConfig(
        format="%(asctime)s - %(levelname)s - %(name)s - %(message)s",
        datefmt="%m/%d/%Y %H:%M:%S",
        handlers=[python_logging.StreamHandler(sys.stdout)],
    )
    log_level = training_args.get_process_log_level()
    logger.setLevel(log_level)
    logging.set_verbosity(log_level)
    import datasets  # only the scripts need it

    datasets.utils.logging.set_verbosity(log_level)


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
    """

    num_core_tokens: int
    latencies_ms: dict[int, float]
    latency_target_ms: float
    image_size: tuple[int, int]
    batch_size: int
    device: str

    def table(self) -> str:
        """The measurements as a Markdown table, the chosen budget marked."""
        lines = ["| budget | median latency (ms) | fits |", "|---|---|---|"]
        for budget, latency in self.latencies_ms.items():
            fits = "yes" if latency <= self.latency_target_ms else "no"
            lines.append(f"| {budget} | {latency:.3f} | {'**chosen**' if budget == self.num_core_tokens else fits} |")
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
) -> dict[int, float]:
    """
    The median latency in milliseconds of one forward pass at each budget, `{budget: ms}`, measured round-robin (a
    change in machine load hits every budget alike). The arguments are those of [`pick_budget`].
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

    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for budget in budgets:
                for _ in range(warmup):
                    _forward_at(model, pixel_values, budget)
            timings = {budget: [] for budget in budgets}
            for _ in range(repeats):
                for budget in budgets:
                    _synchronize(device)
                    start = time.perf_counter()
                    _forward_at(model, pixel_values, budget)
                    _synchronize(device)
                    timings[budget].append((time.perf_counter() - start) * 1e3)
    finally:
        model.train(was_training)
    return {budget: statistics.median(values) for budget, values in timings.items()}


def pick_budget(
    model: nn.Module,
    image_size: tuple[int, int] | int,
    latency_target_ms: float,
    batch_size: int = 1,
    device: str | torch.device | None = None,
    budgets: Sequence[int] | None = None,
    warmup: int = 2,
    repeats: int = 5,
) -> BudgetChoice:
    """
    The largest budget that meets a latency target, measured on this machine.

    Every budget is timed: `warmup` untimed forward passes each, then `repeats` timed rounds over all budgets
    (round-robin, so that a change in machine load affects every budget alike), each pass timed with
    `time.perf_counter` under `torch.no_grad()` with the device synchronised around it; the latency of a budget is
    its median. The input is a random batch in the model's dtype. The model is put in eval mode for the measurement
    and its mode restored afterwards. The choice is the largest budget whose median is at most the target (latency
    grows with the budget, so in practice every smaller budget fits too; `BudgetChoice.latencies_ms` shows them all).

    Measure what you serve: the same batch size, image size, dtype, attention implementation and, if you use it,
    `torch.compile`d model (warm-up then absorbs the compilation of each budget; raise `warmup` if a budget
    recompiles more than once).

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

    Returns:
        [`BudgetChoice`]: the chosen budget and the median latency of every budget.

    Raises:
        `ValueError`: if even the fastest budget is slower than the target (the message gives the fastest measured
        latency), or if an argument is invalid.
    """
    if not latency_target_ms > 0:
        raise ValueError(f"latency_target_ms must be positive, got {latency_target_ms!r}.")
    latencies_ms = time_budgets(model, image_size, batch_size, device, budgets, warmup, repeats)
    height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    device = next(model.parameters()).device
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
    )
    measured = ", ".join(f"C={budget}: {ms:.1f} ms" for budget, ms in latencies_ms.items())
    logger.info(
        f"pick_budget: C={choice.num_core_tokens} is the largest budget within {latency_target_ms:g} ms per batch "
        f"of {batch_size} at {height}x{width} ({measured})."
    )
    return choice


__all__ = [
    "BudgetArguments",
    "BudgetChoice",
    "VecaTrainer",
    "budget_sampler_from_args",
    "eval_budgets_from_args",
    "evaluate_and_save_budgets",
    "evaluate_budgets",
    "find_veca_config",
    "parse_number_list",
    "pick_budget",
    "time_budgets",
    "setup_logging",
    "split_veca_inputs",
    "training_budget_description",
    "veca_call_defaults",
    "veca_config",
]
