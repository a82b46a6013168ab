# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tuning with `Trainer` at the budget `C` (`num_core_tokens`).

- `VecaTrainer`: a `transformers.Trainer` that keeps weight decay off the cores, the core coordinates and the
  coordinate step scales; trains at a fixed budget or at a budget drawn per optimiser step (as in distillation);
  and evaluates at a chosen budget. It works for VECA's own models and for transformers' heads with a VECA
  backbone (UperNet, DPT, Depth Anything), whose forward cannot take a budget or a `pixel_mask`.
- `evaluate_budgets`: `trainer.evaluate` at several budgets, with metrics prefixed `eval_C{C}_`;
  `evaluate_and_save_budgets` writes them (`all_results.json` with `eval_C{C}_<metric>` keys).
- `setup_logging`: the example scripts' logging.

The budget flags, the samplers and `pick_budget` live in `veca_hf.budgets`. `examples/finetune_classification.py`,
`finetune_segmentation.py` and `finetune_depth.py` put these together; see `docs/budget_picker.md` and
`docs/dense_tasks.md`.
"""

import contextlib
import logging as python_logging
import os
import sys
from collections.abc import Iterator, Sequence

import torch
import transformers
from torch import nn
from transformers import HfArgumentParser, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from ..allocator import tune_cpu_allocator
from ..arguments import parse_args_with_file
from ..budgets import (
    BudgetArguments,
    BudgetSampler,
    eval_budgets_from_args,
    find_veca_config,
    split_veca_inputs,
    training_budget_description,
    veca_call_defaults,
    veca_config,
)
from ..hub import take_credentials
from ..model_card import is_hub_id, write_finetuned_model_card
from .optimization import get_parameter_groups


logger = logging.get_logger(__name__)


class VecaTrainer(Trainer):
    """
    `Trainer` for VECA models: the budget of every forward pass is chosen by the trainer, not the model's config.

    Three things differ from `Trainer`:

    - Weight decay follows `veca_hf.training.optimization.get_parameter_groups`: no decay on cores, core coordinates,
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


def parse_finetuning_args(script_arguments: tuple, logger: python_logging.Logger, batch_eval_metrics=False) -> tuple:
    """
    Parse a fine-tuning script's flags (or a JSON / YAML file of them first, later flags overriding it) into its
    argument dataclasses, `BudgetArguments` and `TrainingArguments`, and set up what every such script needs: the
    credentials off `sys.argv` and the Hub token out of `TrainingArguments` (`Trainer` pickles them into
    `training_args.bin`, checkpoints and uploads; `veca_hf.hub.take_credentials`), the CPU allocator, logging and the
    seed.

    Returns:
        `tuple`: the parsed dataclasses, in the order of `script_arguments`, then `BudgetArguments` and
        `TrainingArguments`.
    """
    parsed = parse_args_with_file(HfArgumentParser((*script_arguments, BudgetArguments, TrainingArguments)))
    training_args = parsed[-1]
    if not (training_args.do_train or training_args.do_eval):
        # NOTE: both default to False in `TrainingArguments`; without this the script would exit 0 having done nothing.
        raise ValueError("Nothing to do: pass --do_train (fine-tune) and/or --do_eval (evaluate at --eval_budgets).")
    take_credentials(*parsed)
    if training_args.device.type == "cpu":
        tune_cpu_allocator()  # glibc malloc settings for VECA's large CPU intermediates (veca_hf.allocator)
    # NOTE: with `with_transform` the image columns must reach the transform; Trainer would drop them otherwise.
    training_args.remove_unused_columns = False
    # NOTE: dense metrics keep only each batch's valid pixels (not every output map of the validation set).
    training_args.batch_eval_metrics = batch_eval_metrics
    setup_logging(training_args, logger)
    logger.info(f"Training/evaluation parameters {training_args}")
    transformers.set_seed(training_args.seed)
    return parsed


def resume_checkpoint(training_args) -> str | None:
    """
    The checkpoint `--resume_from_checkpoint` names: a `checkpoint-<step>` folder as given, or, for `latest` (as in
    `examples/distill.py`), the newest `checkpoint-<step>` in `--output_dir` (`None`, a fresh start, when there is
    none yet).
    """
    resume = training_args.resume_from_checkpoint
    if resume != "latest":
        return resume
    output_dir = training_args.output_dir
    latest = get_last_checkpoint(output_dir) if os.path.isdir(output_dir) else None
    logger.info(
        f"--resume_from_checkpoint latest: {latest or f'no checkpoint in {output_dir} yet, starting at step 0'}"
    )
    return latest


def train_evaluate_and_publish(
    trainer: Trainer,
    budget_args: BudgetArguments,
    budget_sampler: BudgetSampler | None,
    *,
    base_model: str,
    datasets: str | None,
    hub_dataset: str | None,
    task: str,
    metrics_description: str,
    description: str,
) -> None:
    """
    How every fine-tuning script ends: train (saving the model, its image processor, the metrics and the state),
    evaluate at `--eval_budgets` (`eval_C{C}_<metric>` in `all_results.json`), push with `--push_to_hub`, and write
    the VECA model card (per-budget metrics, FLOPs and latency) in place of `Trainer`'s.

    Args:
        datasets (`str`, *optional*): the training data, for the VECA card.
        hub_dataset (`str`, *optional*): the dataset `Trainer`'s card names, when it is a Hub id.
        task (`str`): the card's task, e.g. `"image-classification"`.
        metrics_description, description (`str`): what the card says about the metrics and the model.
    """
    args, model = trainer.args, trainer.model
    if args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resume_checkpoint(args))
        trainer.save_model()  # the model (label maps, default budget) and the image processor
        trainer.log_metrics("train", train_result.metrics)
        trainer.save_metrics("train", train_result.metrics)  # train_results.json, merged into all_results.json
        trainer.save_state()
    eval_metrics = None
    if args.do_eval:
        eval_metrics = evaluate_and_save_budgets(trainer, eval_budgets_from_args(budget_args, model))
    if args.push_to_hub:  # saves the model, writes Trainer's card, uploads the folder
        trainer.push_to_hub(
            # Hub ids only: this card is uploaded (and kept in the repository's history) before the VECA card
            finetuned_from=base_model if is_hub_id(base_model) else None,
            tasks=task,
            dataset=hub_dataset if hub_dataset and is_hub_id(hub_dataset) else None,
        )
    write_finetuned_model_card(
        trainer,
        base_model=base_model,
        datasets=datasets,
        training_budget=training_budget_description(budget_args, budget_sampler, model),
        eval_metrics=eval_metrics,
        metrics_description=metrics_description,
        description=description,
    )


__all__ = [
    "VecaTrainer",
    "evaluate_and_save_budgets",
    "evaluate_budgets",
    "parse_finetuning_args",
    "resume_checkpoint",
    "setup_logging",
    "train_evaluate_and_publish",
]
