# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""A budget per image: `num_core_tokens` a list of one budget per image, or `"auto"` (a fitted policy picks).

Each image's outputs equal a forward of that image alone at its budget. A batch of several budgets runs either as one
sub-batch per budget, its outputs laid out for the largest budget with zeros in the cores an image did not use
(`config.group_image_budgets=True`, the default: each image pays only for its own cores), or as one forward at the
largest budget with those cores hidden from every attention call (`VecaModel.forward`'s masked path: one graph).
`"auto"` runs every image at the policy's smallest budget, and again, by budget groups, at the larger budget the
policy picks from that first pass (`config.adaptive_budget`, written by `veca_hf.AdaptiveBudget`).

This file travels with saved folders (a relative import of `modeling_veca.py`): it imports only torch and
transformers. Shapes: B batch, C cores (the largest budget of the batch), N patches, D hidden size.
"""

import math
from typing import TYPE_CHECKING

import torch
from torch import nn
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs


if TYPE_CHECKING:
    from .modeling_veca import VecaModelOutput


AUTO_BUDGET = "auto"  # `num_core_tokens="auto"`: every image's budget picked by `config.adaptive_budget`
# what `num_core_tokens` takes: one budget, one per image (a list or 1-D tensor), AUTO_BUDGET, or None (the default)
NumCoreTokens = int | list[int] | tuple[int, ...] | torch.Tensor | str | None


def is_integer_dtype(dtype: torch.dtype) -> bool:
    """Whether a tensor of `dtype` holds budgets: `int()` would truncate 8.5, or turn True into 1, silently."""
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


def budget_policy_features(outputs: "VecaModelOutput") -> torch.Tensor:
    """What the budget policy reads from a forward's outputs: the global feature and the mean of the image's own
    patch tokens, each scaled to unit length, side by side: `(B, 2 * D)`."""
    num_cores = outputs.core_positions.shape[1]
    patches = outputs.last_hidden_state[:, num_cores:].float()  # (B, N, D)
    if outputs.patch_mask is None:
        mean_patch = patches.mean(dim=1)  # (B, D)
    else:  # padded patches left out
        weights = outputs.patch_mask[..., None].float()  # (B, N, 1)
        mean_patch = (patches * weights).sum(dim=1) / weights.sum(dim=1)
    global_feature = nn.functional.normalize(outputs.pooler_output.float(), dim=-1)  # (B, D)
    return torch.cat((global_feature, nn.functional.normalize(mean_patch, dim=-1)), dim=-1)


def first_budget_within(predicted: torch.Tensor, threshold: float) -> torch.Tensor:
    """Each image's index into the policy's budgets: the first budget whose predicted distance `(n, K - 1)` is
    within `threshold`, else the last (the largest budget, distance 0 by definition)."""
    within = torch.cat((predicted <= threshold, predicted.new_ones(len(predicted), 1, dtype=torch.bool)), dim=1)
    return within.int().argmax(dim=1)  # argmax returns the first maximum


def budgets_picked_by(policy: dict, features: torch.Tensor) -> list[int]:
    """The budgets a policy (`config.adaptive_budget`) picks from `(n, F)` first-pass features: the smallest whose
    predicted `1 - cos(global feature, global feature at the largest budget)` is within the policy's threshold."""
    features = features.double().cpu()
    weight = torch.tensor(policy["weight"], dtype=torch.float64)  # (K - 1, F): a ridge regression
    mean, bias = torch.tensor(policy["feature_mean"], dtype=torch.float64), torch.tensor(policy["bias"]).double()
    predicted = (features - mean) @ weight.T + bias  # (n, K - 1)
    return [policy["budgets"][index] for index in first_budget_within(predicted, policy["threshold"]).tolist()]


class VecaImageBudgetsMixin:
    """`VecaModel`'s handling of one budget per image: resolving the budgets, running them by groups, and the
    policy's cascade for `"auto"`. It calls the model's own `forward` for each group."""

    def resolve_image_budgets(self, num_core_tokens, batch_size: int) -> list[int] | None:
        """Every image's budget when `num_core_tokens` holds one per image (a list, tuple, array or 1-D tensor of
        `batch_size` budgets), else `None`: one budget serves the batch ([`resolve_num_core_tokens`])."""
        if isinstance(num_core_tokens, torch.Tensor) or type(num_core_tokens).__module__ == "numpy":
            if num_core_tokens.ndim > 1 and math.prod(num_core_tokens.shape) > 1:
                raise ValueError(
                    f"num_core_tokens of shape {tuple(num_core_tokens.shape)}: pass one int for the batch, or one "
                    "budget per image as a list or a 1-D tensor."
                )
            if num_core_tokens.ndim != 1 or len(num_core_tokens) < 2:
                return None  # one budget
            if isinstance(num_core_tokens, torch.Tensor) and not is_integer_dtype(num_core_tokens.dtype):
                raise ValueError(f"num_core_tokens={num_core_tokens!r} must hold integers, one budget per image.")
            budgets = num_core_tokens.tolist()
        elif isinstance(num_core_tokens, (list, tuple)) and len(num_core_tokens) > 1:
            budgets = list(num_core_tokens)
        else:
            return None
        if len(budgets) != batch_size:
            raise ValueError(
                f"num_core_tokens holds {len(budgets)} budgets for a batch of {batch_size} images: pass one budget "
                "per image, or a single int for the whole batch."
            )
        return [
            self.config.check_budget(budget, name=f"num_core_tokens[{index}]") for index, budget in enumerate(budgets)
        ]

    def picks_budgets(self, num_core_tokens) -> bool:
        """Whether this call picks every image's budget with the fitted policy: `num_core_tokens="auto"`, or no
        budget passed and `config.default_num_core_tokens="auto"` (pipelines)."""
        if num_core_tokens is None:
            num_core_tokens = self.config.default_num_core_tokens
        if not isinstance(num_core_tokens, str):
            return False
        if num_core_tokens != AUTO_BUDGET:
            raise ValueError(
                f"num_core_tokens={num_core_tokens!r} is not a budget: pass an int, one per image, or 'auto'."
            )
        if self.config.adaptive_budget is None:
            raise ValueError(
                "num_core_tokens='auto' needs a budget policy in config.adaptive_budget: fit one with "
                "veca_hf.AdaptiveBudget.fit(model, pixel_values, target_mean_cost=...)."
            )
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            # a graph would keep the budgets picked for the example inputs, whatever the images it later sees
            raise ValueError(
                "num_core_tokens='auto' picks budgets from each batch's first pass, which a traced, compiled or "
                "exported graph cannot do: run the model eagerly with 'auto' and pass its picks "
                "(outputs.core_mask.sum(1).tolist()) to the graph, or pass one budget."
            )
        return True

    def pick_image_budgets(self, first_pass: "VecaModelOutput") -> list[int]:
        """Every image's budget by the fitted policy (`config.adaptive_budget`), from the outputs of the first pass
        at the policy's smallest budget ([`budgets_picked_by`])."""
        return budgets_picked_by(self.config.adaptive_budget, budget_policy_features(first_pass))

    def _forward_picked_budgets(
        self,
        pixel_values: torch.Tensor,
        pixel_mask: torch.Tensor | None,
        output_core_positions: bool,
        **kwargs: Unpack[TransformersKwargs],
    ) -> "VecaModelOutput":
        """The policy's cascade: every image at the smallest budget, then the images it sends further at theirs (by
        budget groups; the first pass's outputs are kept for the images that stay)."""
        smallest = self.config.adaptive_budget["budgets"][0]
        first_pass = self.forward(
            pixel_values, smallest, pixel_mask, output_core_positions, return_dict=True, **kwargs
        )
        image_budgets = self.pick_image_budgets(first_pass)
        if set(image_budgets) == {smallest}:  # often the whole batch: the first pass is the answer, no regrouping
            first_pass.core_mask = torch.ones(
                len(image_budgets), smallest, dtype=torch.bool, device=first_pass.last_hidden_state.device
            )  # (B, C)
            return first_pass
        return self._forward_budget_groups(
            pixel_values, image_budgets, pixel_mask, output_core_positions, first_pass=(smallest, first_pass), **kwargs
        )

    def groups_image_budgets(self) -> bool:
        """Whether a batch of different budgets runs as one sub-batch per budget (each image pays only for its own
        cores) rather than as one call at the largest budget with the unused cores masked (one graph)."""
        if "flash" in self.config._attn_implementation or "flex" in self.config._attn_implementation:
            return True  # these kernels take no additive mask (see the padding check in `forward`)
        if torch.jit.is_tracing() or torch.compiler.is_compiling():
            return False  # a graph cannot branch on the budgets' values
        return self.config.group_image_budgets

    def _forward_budget_groups(
        self,
        pixel_values: torch.Tensor,
        image_budgets: list[int],
        pixel_mask: torch.Tensor | None,
        output_core_positions: bool,
        first_pass: tuple[int, "VecaModelOutput"] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> "VecaModelOutput":
        """One forward per budget on the images of that budget, laid out as the masked forward's outputs: the cores of
        every image padded with zeros to the largest budget, the images in their order. `first_pass`, a budget and
        the outputs of every image at it, serves that budget's images instead of a new forward."""
        largest = max(image_budgets)

        def with_cores_padded(tensor: torch.Tensor, budget: int, dims: tuple[int, ...]) -> torch.Tensor:
            for dim in dims:  # zeros after the first `budget` entries along `dim`, up to `largest`
                zeros = list(tensor.shape)
                zeros[dim] = largest - budget
                rest = tensor.narrow(dim, budget, tensor.shape[dim] - budget)
                tensor = torch.cat((tensor.narrow(dim, 0, budget), tensor.new_zeros(zeros), rest), dim=dim)
            return tensor

        budgets = torch.tensor(image_budgets)
        groups, group_outputs = [], []
        for budget in sorted(set(image_budgets)):
            indices = (budgets == budget).nonzero().flatten()  # the images at this budget
            group_pixel_mask = pixel_mask[indices.to(pixel_mask.device)] if pixel_mask is not None else None
            if first_pass is not None and first_pass[0] == budget:
                outputs = type(first_pass[1])(**{
                    name: tuple(v[indices.to(v.device)] for v in value) if isinstance(value, tuple)
                    else value[indices.to(value.device)]
                    for name, value in first_pass[1].items()
                })  # fmt: skip
            else:
                outputs = self.forward(
                    pixel_values[indices.to(pixel_values.device)],
                    budget,
                    group_pixel_mask,
                    output_core_positions,
                    return_dict=True,
                    **kwargs,
                )
            groups.append(indices)
            group_outputs.append((budget, outputs))
        order = torch.cat(groups).argsort()  # row of each image in the groups' concatenation

        def assembled(field: str, dims: tuple[int, ...] = ()) -> torch.Tensor | tuple | None:
            values = [(budget, getattr(outputs, field)) for budget, outputs in group_outputs]
            if values[0][1] is None:
                return None
            if isinstance(values[0][1], tuple):  # one tensor per block
                return tuple(
                    torch.cat(
                        [with_cores_padded(value[block], budget, dims) for budget, value in values]
                    ).index_select(0, order.to(values[0][1][block].device))
                    for block in range(len(values[0][1]))
                )
            joined = torch.cat([with_cores_padded(value, budget, dims) for budget, value in values])
            return joined.index_select(0, order.to(joined.device))

        return type(group_outputs[0][1])(  # the forward's own output class
            last_hidden_state=assembled("last_hidden_state", dims=(1,)),
            pooler_output=assembled("pooler_output"),
            hidden_states=assembled("hidden_states", dims=(1,)),
            attentions=assembled("attentions", dims=(2, 3)),
            core_positions=assembled("core_positions", dims=(1,)),
            all_core_positions=assembled("all_core_positions", dims=(1,)),
            patch_mask=assembled("patch_mask"),
            core_mask=(torch.arange(largest) < budgets[:, None]).to(pixel_values.device),  # (B, C)
        )
