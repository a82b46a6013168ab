# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""How a budget and a padding mask reach the VECA inside any model.

A budget reaches a VECA one of two ways: as the call argument `num_core_tokens` where the model's `forward` takes one
(VECA's own models, PEFT and compiled wrappers of them), else as the VECA's `config.default_num_core_tokens`, which
transformers' heads with a VECA backbone (UperNet, DPT, Depth Anything) and pipelines use because they call the
backbone with the pixels only. [`veca_call`] picks the way for one call; [`default_budget`] sets the default for a
block. A `pixel_mask` (mixed-size batches) is an argument where `forward` takes one, else handed to the VECA by a
forward pre-hook for the duration of the call.
"""

import contextlib
import inspect
from collections.abc import Iterator

import torch
from torch import nn
from transformers import PreTrainedModel

from .model.configuration_veca import VecaConfig
from .model.modeling_veca import VecaModel


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


def takes_argument(model: nn.Module, name: str) -> bool:
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
def default_budget(model: nn.Module, num_core_tokens: int | None) -> Iterator[None]:
    """
    Inside the block, the VECA in `model` runs at `num_core_tokens` whenever it is called without a budget: its
    `config.default_num_core_tokens` is set, then restored. `None` changes nothing.

    Example:

    ```python
    with torch.no_grad(), default_budget(upernet, 16):  # UperNet calls its VECA backbone with the pixels only
        logits = upernet(pixel_values).logits
    ```
    """
    if num_core_tokens is None:
        yield
        return
    config = veca_config(model)
    config.check_budget(num_core_tokens)
    previous = config.default_num_core_tokens
    config.default_num_core_tokens = num_core_tokens
    try:
        yield
    finally:
        config.default_num_core_tokens = previous


@contextlib.contextmanager
def _pixel_mask_to_veca(model: nn.Module, pixel_mask: torch.Tensor) -> Iterator[None]:
    """Every `VecaModel` in `model` called without a `pixel_mask` gets `pixel_mask` inside the block (a forward
    pre-hook): transformers' heads call their backbone with the pixels only, which would show the cores the padding."""

    position = list(inspect.signature(VecaModel.forward).parameters).index("pixel_mask") - 1  # without `self`

    def fill_in(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if len(args) <= position and kwargs.get("pixel_mask") is None:
            kwargs["pixel_mask"] = pixel_mask
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


@contextlib.contextmanager
def veca_call(model: nn.Module, inputs: dict, num_core_tokens: int | None) -> Iterator[dict]:
    """
    The inputs of `model(**inputs)` at budget `num_core_tokens`, valid inside the block: the budget and `inputs`'
    `pixel_mask` are call arguments where `model.forward` takes them; otherwise the budget is the VECA's config default
    ([`default_budget`]) and the mask reaches the VECA through a forward pre-hook, both for the block only.

    Args:
        model (`nn.Module`): any model holding a `VecaModel` (a head, a backbone, a PEFT or DDP wrapper of one).
        inputs (`dict`): the batch, e.g. `{"pixel_values": ..., "pixel_mask": ..., "labels": ...}`; not modified.
        num_core_tokens (`int`, *optional*): the budget; `None` leaves the model at its own default.

    Example:

    ```python
    with veca_call(model, batch, num_core_tokens=16) as inputs:
        loss = model(**inputs).loss
    ```
    """
    inputs = dict(inputs)
    with contextlib.ExitStack() as stack:
        if num_core_tokens is not None:
            if takes_argument(model, "num_core_tokens"):
                inputs["num_core_tokens"] = num_core_tokens
            else:
                stack.enter_context(default_budget(model, num_core_tokens))
        if inputs.get("pixel_mask") is not None and not takes_argument(model, "pixel_mask"):
            stack.enter_context(_pixel_mask_to_veca(model, inputs.pop("pixel_mask")))
        yield inputs


__all__ = ["default_budget", "find_veca_config", "takes_argument", "veca_call", "veca_config"]
