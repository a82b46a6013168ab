# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""A budget per image, picked from the image: fit the policy that `num_core_tokens="auto"` runs.

The policy is a cascade with a learned exit. Every image first runs at the smallest budget of a ladder (by default
`8, 16, 32, 64`); a ridge regression from that pass's features (`budget_policy_features`: the global feature and the
mean patch token) predicts, for every smaller budget of the ladder, how far the image's global feature there is from
the one at the largest budget (`1 - cos`). The image then runs at the smallest budget predicted within a threshold,
reusing the first pass when that is the smallest budget. The threshold is fitted so that the mean cost on the
fitting images, the first pass included, meets a target: FLOPs as a fraction of the largest budget's
(`veca_hf.flops.veca_model_flops`).

    policy = AdaptiveBudget.fit(model, pixel_values, target_mean_cost=0.6)  # also sets model.config.adaptive_budget
    outputs = model(pixel_values, num_core_tokens="auto")  # outputs.core_mask.sum(1): each image's budget
    model.save_pretrained(folder)  # the policy travels in config.json

Whether it pays, and when: docs/budget_picker.md, "A budget per image, picked by the model".
"""

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

from .flops import veca_model_flops
from .model.image_budgets_veca import budget_policy_features, budgets_picked_by, first_budget_within
from .model.modeling_veca import VecaModel
from .routing import veca_config


RIDGE_PENALTIES = (1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)


@dataclass
class AdaptiveBudget:
    """A fitted per-image budget policy, as `config.adaptive_budget` stores it (`asdict`).

    Args:
        budgets (`list[int]`): the ladder, smallest first; the first is the first pass.
        threshold (`float`): the largest predicted `1 - cos` to the largest budget's global feature accepted.
        feature_mean (`list[float]`): the fitting images' mean feature (`2 * hidden_size`).
        weight (`list[list[float]]`): `(len(budgets) - 1, 2 * hidden_size)` ridge weights.
        bias (`list[float]`): one per budget but the largest.
        target_mean_cost (`float`): what the threshold was fitted for: mean FLOPs per image over the largest
            budget's, the first pass counted.
        mean_cost (`float`): the mean cost reached on the fitting images (predictions made without the image).
        fit_resolution (`list[int]`): height and width of the fitting images (costs are relative at that size).
        ridge_penalty (`float`): the penalty chosen by cross-validation.
    """

    budgets: list[int]
    threshold: float
    feature_mean: list[float]
    weight: list[list[float]]
    bias: list[float]
    target_mean_cost: float
    mean_cost: float
    fit_resolution: list[int] = field(default_factory=list)
    ridge_penalty: float = 1.0

    @classmethod
    def from_model(cls, model: nn.Module) -> "AdaptiveBudget":
        """The policy in the VECA's `config.adaptive_budget` (e.g. of a loaded folder)."""
        policy = veca_config(model).adaptive_budget
        if policy is None:
            raise ValueError("This model's config.adaptive_budget is None: fit a policy with AdaptiveBudget.fit.")
        return cls(**policy)

    @classmethod
    def fit(
        cls,
        model: nn.Module,
        pixel_values: torch.Tensor | Iterable[torch.Tensor],
        target_mean_cost: float,
        budgets: Sequence[int] | None = None,
        batch_size: int = 32,
        num_folds: int = 5,
        seed: int = 0,
    ) -> "AdaptiveBudget":
        """Fits the policy on images (held out from whatever it will be judged on) and sets it as the model's
        `config.adaptive_budget`.

        Args:
            model: a [`VecaModel`] (or a model holding one: the policy reads the VECA's own outputs).
            pixel_values: `(n, 3, H, W)` processed images of one size, or batches of them.
            target_mean_cost (`float`): mean FLOPs per image as a fraction of the largest budget's, the first
                pass included: between the smallest budget's cost and `1 +` that (every image run twice).
            budgets (`Sequence[int]`, *optional*): the ladder; default `8, 16, 32, 64` as the bank allows.
            batch_size (`int`): images per forward while fitting.
            num_folds (`int`): cross-fitting folds: the threshold is set on predictions made without the image.
            seed (`int`): the folds' shuffle.
        """
        veca = next((module for module in model.modules() if isinstance(module, VecaModel)), None)
        if veca is None:
            raise ValueError(f"{type(model).__name__} holds no VecaModel: a budget policy applies to VECA models.")
        config = veca.config
        ladder = ladder_for(config, budgets)
        batches = [pixel_values] if isinstance(pixel_values, torch.Tensor) else list(pixel_values)
        height, width = batches[0].shape[-2:]
        if any(batch.shape[-2:] != (height, width) for batch in batches):
            raise ValueError("AdaptiveBudget.fit takes images of one size: resize them, or fit one policy per size.")
        costs = relative_costs(config, height, width, ladder)
        check_target(target_mean_cost, costs)
        features, distances = policy_training_data(veca, batches, ladder, batch_size)  # (n, F), (n, K - 1)
        policy = cls.from_training_data(features, distances, ladder, costs, target_mean_cost, num_folds, seed)
        policy.fit_resolution = [int(height), int(width)]
        config.adaptive_budget = asdict(policy)
        config._check_adaptive_budget(config.adaptive_budget)
        return policy

    @classmethod
    def from_training_data(
        cls,
        features: torch.Tensor,
        distances: torch.Tensor,
        ladder: list[int],
        costs: torch.Tensor,
        target_mean_cost: float,
        num_folds: int = 5,
        seed: int = 0,
    ) -> "AdaptiveBudget":
        """The policy from [`policy_training_data`]'s features `(n, F)` and distances `(n, K - 1)` and the ladder's
        [`relative_costs`] `(K,)`: what `fit` does once the forwards are run."""
        check_target(target_mean_cost, costs)
        features, distances = features.double().cpu(), distances.double().cpu()
        if len(features) < 2 * num_folds:
            raise ValueError(f"AdaptiveBudget.fit needs at least {2 * num_folds} images, got {len(features)}.")
        folds = torch.randperm(len(features), generator=torch.Generator().manual_seed(seed)) % num_folds
        penalty, predicted = cross_fitted_ridge(features, distances, folds)
        threshold, mean_cost = threshold_for_cost(predicted, costs, target_mean_cost)
        mean = features.mean(dim=0)
        weight, bias = ridge(features - mean, distances, penalty)
        return cls(
            budgets=list(ladder),
            threshold=threshold,
            feature_mean=mean.tolist(),
            weight=weight.T.tolist(),
            bias=bias.tolist(),
            target_mean_cost=float(target_mean_cost),
            mean_cost=mean_cost,
            ridge_penalty=penalty,
        )

    def pick(self, features: torch.Tensor) -> list[int]:
        """The budgets the policy picks from `(n, F)` first-pass features (what `num_core_tokens="auto"` runs)."""
        return budgets_picked_by(asdict(self), features)


def relative_costs(config, height: int, width: int, ladder: list[int]) -> torch.Tensor:
    """Each budget's forward FLOPs at `height x width` over the largest budget's: `(K,)`."""
    flops = [veca_model_flops(config, height, width, budget) for budget in ladder]
    return torch.tensor(flops, dtype=torch.float64) / flops[-1]


def check_target(target_mean_cost: float, costs: torch.Tensor) -> None:
    """A `ValueError` unless a cascade over budgets of `costs` can meet `target_mean_cost` on average."""
    if not costs[0] <= target_mean_cost <= 1 + costs[0]:
        raise ValueError(
            f"target_mean_cost={target_mean_cost!r} is out of reach: every image pays the first pass "
            f"({costs[0]:.3f} of the largest budget) and at most one more forward, so use a value in "
            f"[{costs[0]:.3f}, {1 + costs[0]:.3f}]."
        )


def ladder_for(config, budgets: Sequence[int] | None) -> list[int]:
    """The policy's budgets: `budgets` checked, or `8, 16, 32, 64` (as far as the bank goes) and the whole bank."""
    if budgets is None:
        budgets = [budget for budget in (8, 16, 32, 64) if budget in config.budgets] or config.budgets[:1]
        budgets = sorted({*budgets, config.core_bank_size})
    ladder = [config.check_budget(budget, name="budgets[...]") for budget in budgets]
    if len(ladder) < 2 or ladder != sorted(set(ladder)):
        raise ValueError(f"budgets={list(budgets)!r} must be two or more increasing budgets.")
    return ladder


@torch.no_grad()
def policy_training_data(
    veca: VecaModel, batches: list[torch.Tensor], ladder: list[int], batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass's features `(n, F)` and, per budget but the largest, `1 - cos(global feature there, global
    feature at the largest budget)` `(n, K - 1)`."""
    was_training = veca.training
    veca.eval()
    features, distances = [], []
    try:
        for batch in batches:
            for chunk in batch.split(batch_size):
                chunk = chunk.to(veca.device)  # held-out images may sit on the CPU while the model is on a GPU
                outputs = {budget: veca(chunk, num_core_tokens=budget) for budget in ladder}
                features.append(budget_policy_features(outputs[ladder[0]]).double())
                largest = outputs[ladder[-1]].pooler_output.double()
                distances.append(
                    torch.stack(
                        [1 - torch.cosine_similarity(outputs[b].pooler_output.double(), largest) for b in ladder[:-1]],
                        dim=1,
                    )
                )
    finally:
        veca.train(was_training)
    return torch.cat(features).cpu(), torch.cat(distances).cpu()


def ridge(features: torch.Tensor, targets: torch.Tensor, penalty: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Ridge regression on centred `features` `(n, F)`: weights `(F, K)` and the bias `(K,)` (the targets' mean)."""
    bias = targets.mean(dim=0)
    u, s, vh = torch.linalg.svd(features, full_matrices=False)  # the dual form: n may be smaller than F
    weight = vh.T @ ((s / (s**2 + penalty))[:, None] * (u.T @ (targets - bias)))
    return weight, bias


def cross_fitted_ridge(
    features: torch.Tensor, targets: torch.Tensor, folds: torch.Tensor
) -> tuple[float, torch.Tensor]:
    """The penalty of `RIDGE_PENALTIES` with the least out-of-fold squared error, and its out-of-fold predictions."""
    best = (math.inf, None, None)
    for penalty in RIDGE_PENALTIES:
        predicted = torch.empty_like(targets)
        for fold in folds.unique():
            train, held_out = folds != fold, folds == fold
            mean = features[train].mean(dim=0)
            weight, bias = ridge(features[train] - mean, targets[train], penalty)
            predicted[held_out] = (features[held_out] - mean) @ weight + bias
        error = float((predicted - targets).pow(2).mean())
        if error < best[0]:
            best = (error, penalty, predicted)
    return best[1], best[2]


def cascade_costs(indices: torch.Tensor, costs: torch.Tensor) -> torch.Tensor:
    """Each image's cost in the cascade: the first pass, plus its budget's forward unless that is the first."""
    return costs[0] + torch.where(indices > 0, costs[indices], torch.zeros_like(costs[indices]))


def threshold_for_cost(predicted: torch.Tensor, costs: torch.Tensor, target_mean_cost: float) -> tuple[float, float]:
    """The smallest threshold (most cores) whose mean cascade cost is within `target_mean_cost`, and that cost.

    The mean cost falls as the threshold rises (more images stop early), so the first candidate that meets the
    target, in increasing order, is the most accurate one that does.
    """
    lowest = predicted.new_tensor([predicted.min().item() - 1.0])  # every image escalates
    for threshold in torch.cat((lowest, predicted.flatten().unique())).tolist():
        mean_cost = float(cascade_costs(first_budget_within(predicted, threshold), costs).mean())
        if mean_cost <= target_mean_cost + 1e-12:
            return float(threshold), mean_cost
    # above every prediction: every image stops at the first pass (the caller checked that this meets the target)
    return float(predicted.max()) + 1.0, float(costs[0])


__all__ = ["AdaptiveBudget"]
