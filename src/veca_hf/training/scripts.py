# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The glue the fine-tuning scripts share (`examples/finetune_classification.py`, `finetune_segmentation.py`,
`finetune_depth.py`).

- What the budget flags (`veca_hf.arguments.BudgetArguments`) mean for a model: `budget_sampler_from_args`,
  `eval_budgets_from_args`, `training_budget_description`.
- `parse_finetuning_args`: flags (or an args file) into dataclasses, then the set-up every script needs: credentials
  off `sys.argv` and out of `TrainingArguments`, the CPU allocator, logging (`setup_logging`) and the seed. It has
  process-wide effects by design: scripts call it once, first.
- `finetuning_trainer`: the `VecaTrainer` at the budget flags; `resume_checkpoint` and `train_evaluate_and_publish`:
  how every script resumes and ends.
"""

import logging as python_logging
import os
import sys

import transformers
from torch import nn
from transformers import HfArgumentParser, Trainer, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint
from transformers.utils import logging

from ..arguments import BudgetArguments, parse_args_with_file
from ..budgets import BudgetSampler, parse_number_list, training_budgets
from ..cpu.allocator import tune_cpu_allocator
from ..hub.access import take_credentials
from ..hub.cards import is_hub_id, write_finetuned_model_card
from ..routing import veca_config
from .trainer import VecaTrainer, evaluate_and_save_budgets


logger = logging.get_logger(__name__)


def budget_sampler_from_args(budget_args: BudgetArguments, model: nn.Module, seed: int) -> BudgetSampler | None:
    """The per-step budget sampler of `--sample_budgets` (`--budgets`, `--budget_weights`, as [`training_budgets`]
    reads them), or `None` without it."""
    if not budget_args.sample_budgets:
        return None
    budgets, weights = training_budgets(veca_config(model), budget_args.budgets, budget_args.budget_weights)
    logger.info(f"Sampling one budget per step from {budgets} with weights {weights}.")
    return BudgetSampler(budgets, weights, seed=seed)


def eval_budgets_from_args(budget_args: BudgetArguments, model: nn.Module) -> list[int]:
    """`--eval_budgets`, else the smallest budget, the model's default and the largest (the smallest and the largest
    when the default is `"auto"`: each image's budget is picked, there is no one default)."""
    config = veca_config(model)
    default_budget = config.default_num_core_tokens or config.core_bank_size
    if not isinstance(default_budget, int):  # "auto"
        default_budget = config.budgets[-1]
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
    `training_args.bin`, checkpoints and uploads; `veca_hf.hub.access.take_credentials`), the CPU allocator, logging
    and the seed.

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
        tune_cpu_allocator()  # glibc malloc settings for VECA's large CPU intermediates (veca_hf.cpu.allocator)
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


def finetuning_trainer(
    model: nn.Module,
    training_args: TrainingArguments,
    budget_args: BudgetArguments,
    train_dataset=None,
    eval_dataset=None,
    **trainer_kwargs,
) -> VecaTrainer:
    """
    The `VecaTrainer` of a fine-tuning script: at `--num_core_tokens`, or at a budget drawn per step with
    `--sample_budgets` (`--budgets`, `--budget_weights`). `trainer_kwargs` are `Trainer`'s (`compute_metrics`,
    `data_collator`, `processing_class`, ...).
    """
    return VecaTrainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        eval_dataset=eval_dataset,
        num_core_tokens=budget_args.num_core_tokens,
        budget_sampler=budget_sampler_from_args(budget_args, model, seed=training_args.seed),
        **trainer_kwargs,
    )


def train_evaluate_and_publish(
    trainer: Trainer,
    budget_args: BudgetArguments,
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
        training_budget=training_budget_description(budget_args, getattr(trainer, "budget_sampler", None), model),
        eval_metrics=eval_metrics,
        metrics_description=metrics_description,
        description=description,
    )


__all__ = [
    "budget_sampler_from_args",
    "eval_budgets_from_args",
    "finetuning_trainer",
    "parse_finetuning_args",
    "resume_checkpoint",
    "setup_logging",
    "train_evaluate_and_publish",
    "training_budget_description",
]
