# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tuning with `Trainer` at the budget `C` (`num_core_tokens`).

- `VecaTrainer`: a `transformers.Trainer` that keeps weight decay off the cores, the core coordinates and the
  coordinate step scales; trains at a fixed budget or at a budget drawn per optimiser step (as in distillation);
  and evaluates at a chosen budget. It works for VECA's own models and for transformers' heads with a VECA
  backbone (UperNet, DPT, Depth Anything), whose forward cannot take a budget or a `pixel_mask`.
- `evaluate_budgets`: `trainer.evaluate` at several budgets, with metrics prefixed `eval_C{C}_`;
  `evaluate_and_save_budgets` writes them (`all_results.json` with `eval_C{C}_<metric>` keys).

The fine-tuning scripts' shared flags and steps are `veca_hf.training.scripts`; see `docs/budget_picker.md` and
`docs/dense_tasks.md`.
"""

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch import nn
from transformers import Trainer
from transformers.utils import logging

from ..budgets import BudgetSampler
from ..routing import default_budget, find_veca_config, veca_call, veca_config
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
    no `num_core_tokens` or no `pixel_mask`, they reach the VECA as [`~veca_hf.routing.veca_call`] routes them.

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
        with veca_call(self.model, inputs, self.training_budget(self.state.global_step)) as inputs:
            return super().training_step(model, inputs, num_items_in_batch)

    def prediction_step(self, model: nn.Module, inputs: dict, prediction_loss_only: bool, ignore_keys=None):
        with veca_call(self.model, inputs, self.evaluation_budget) as inputs:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)


@contextlib.contextmanager
def _evaluation_budget(trainer: Trainer, budget: int) -> Iterator[None]:
    """Evaluate at `budget` inside the block: `VecaTrainer.eval_num_core_tokens`, else the VECA's config default."""
    if not isinstance(trainer, VecaTrainer):  # a plain Trainer cannot pass the budget
        with default_budget(trainer.model, budget):
            yield
        return
    previous, trainer.eval_num_core_tokens = trainer.eval_num_core_tokens, budget
    try:
        yield
    finally:
        trainer.eval_num_core_tokens = previous


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


__all__ = ["VecaTrainer", "evaluate_and_save_budgets", "evaluate_budgets"]
