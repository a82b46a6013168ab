# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Which budget each training step draws (the paper's elastic training, arXiv 2605.12491).

`BudgetSampler` draws one budget per optimiser step as a function of the step, so every rank, every micro-batch and
every resumed run draws the same one. `training_budgets` reads `--budgets` / `--budget_weights` (by default every
budget of the model, weighted by `paper_budget_weights`: 8..64 weighted 1,1,2,2,3,3,4,4).

How a budget reaches a model is `veca_hf.routing`; timing budgets and picking one for a latency target is
`veca_hf.latency`.
"""

import math
from collections.abc import Sequence

import torch

from .model.configuration_veca import VecaConfig


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
    """The elastic budget of each optimiser step (the paper's elastic training); `sampler(step) -> C`.

    `weights=None` draws uniformly; [`training_budgets`] gives the paper's weights.
    """

    def __init__(self, budgets: Sequence[int], weights: Sequence[float] | None = None, seed: int = 0):
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


def training_budgets(
    config: VecaConfig, budgets: str | Sequence[int] | None = None, budget_weights: str | Sequence[float] | None = None
) -> tuple[list[int], list[float]]:
    """
    The budgets to sample and their weights, from `--budgets` / `--budget_weights` (either may be None), checked.

    - neither given: `config.budgets`, weighted by [`paper_budget_weights`];
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


__all__ = ["BudgetSampler", "WeightedChoice", "paper_budget_weights", "parse_number_list", "training_budgets"]
