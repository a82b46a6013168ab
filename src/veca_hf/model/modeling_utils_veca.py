# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What the model classes need besides the model: the checks of their input, whole parameters to initialise under
DeepSpeed ZeRO-3, and the code and `auto_map` every saved folder carries.

This file travels with saved folders (a relative import of `modeling_veca.py`), so it imports only torch,
transformers and the standard library.
"""

import contextlib
import importlib
import os
import shutil
from pathlib import Path

import torch
from torch import nn
from transformers.dynamic_module_utils import get_relative_import_files
from transformers.utils import TransformersKwargs, logging


logger = logging.get_logger(__name__)

# Written into every saved config so the folder loads with `trust_remote_code=True` where veca_hf is not installed
# (transformers itself would record only the class that was saved). No `AutoImageProcessor` entry: a model folder
# need not hold a processor, and `auto_map` names only classes whose code is in the folder; the processors'
# `save_pretrained` writes that entry into preprocessor_config.json.
VECA_AUTO_MAP = {
    "AutoConfig": "configuration_veca.VecaConfig",
    "AutoModel": "modeling_veca.VecaModel",
    "AutoModelForImageClassification": "modeling_veca.VecaForImageClassification",
    "AutoBackbone": "modeling_veca.VecaBackbone",
    "AutoModelForSemanticSegmentation": "modeling_veca_dense.VecaForSemanticSegmentation",
    "AutoModelForDepthEstimation": "modeling_veca_dense.VecaForDepthEstimation",
}


def check_model_kwargs(kwargs: dict, model_name: str) -> None:
    """A `TypeError` for keyword arguments that are not transformers' `TransformersKwargs`: a forward that passes
    `**kwargs` on would otherwise ignore a misspelt argument (`num_cores=8`) silently."""
    allowed = TransformersKwargs.__optional_keys__ | TransformersKwargs.__required_keys__
    unknown = sorted(set(kwargs) - allowed)
    if unknown:
        raise TypeError(
            f"{model_name}.forward() got unexpected keyword arguments {unknown}: besides its named arguments "
            f"(pixel_values, num_core_tokens, pixel_mask, ...) it takes only transformers' {sorted(allowed)}."
        )


def check_pixel_values(pixel_values: torch.Tensor, num_channels: int, patch_size: int) -> None:
    """A `ValueError` naming the problem and the fix for anything but a floating-point `(B >= 1, num_channels, H, W)`
    tensor with `H` and `W` positive multiples of `patch_size`."""
    if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4:
        shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
        raise ValueError(
            f"pixel_values must be a tensor of shape (batch, {num_channels}, height, width), got {shape}. Use the "
            "image processor (AutoImageProcessor) to turn images into pixel_values."
        )
    batch_size, channels, height, width = pixel_values.shape
    if batch_size == 0:
        raise ValueError(f"pixel_values {tuple(pixel_values.shape)} holds no images: the batch size must be >= 1.")
    if not pixel_values.is_floating_point():  # integer pixels are raw 0-255 values that nothing normalised
        raise ValueError(
            f"pixel_values has dtype {pixel_values.dtype}, but the model takes normalised float pixel values: use the "
            "image processor (AutoImageProcessor) to turn images into pixel_values."
        )
    if channels != num_channels:
        raise ValueError(
            f"pixel_values has {channels} channels but the model expects config.num_channels={num_channels}; "
            "convert the images (e.g. to RGB) first."
        )
    if height % patch_size or width % patch_size or height == 0 or width == 0:
        raise ValueError(
            f"Image size {height}x{width} is not a positive multiple of patch_size={patch_size}: resize or crop "
            f"to e.g. {max(patch_size, height // patch_size * patch_size)}x"
            f"{max(patch_size, width // patch_size * patch_size)} (VECA never interpolates positions)."
        )


def gathered_for_init(module: nn.Module) -> contextlib.AbstractContextManager:
    """Context in which `module`'s own parameters are whole, for `_init_weights` to write them.

    Under DeepSpeed ZeRO-3 (`deepspeed.zero.Init`) each rank holds only a slice of every parameter, and writing the
    initial core coordinates into a slice fails: gather the partitioned ones, let rank 0 write and broadcast (so all
    ranks agree), partition again on exit. Anywhere else (and for parameters already gathered, as `from_pretrained`
    does for missing weights) this is a no-op.
    """
    # only partitioned parameters that are not gathered already (`ds_status` NOT_AVAILABLE)
    partitioned = [p for p in module.parameters(recurse=False) if getattr(p, "ds_status", None) is not None]
    partitioned = [p for p in partitioned if p.ds_status.name == "NOT_AVAILABLE"]
    if not partitioned:
        return contextlib.nullcontext()
    # imported by name: transformers' check of a remote folder's requirements would otherwise require deepspeed of
    # every user of the folder, and only a ZeRO-3 run (which has it) gets here
    deepspeed = importlib.import_module("deepspeed")
    return deepspeed.zero.GatheredParameters(partitioned, modifier_rank=0)


def save_code_and_auto_map(config, save_directory: str | os.PathLike, is_main_process: bool = True) -> None:
    """Make a model folder load with `trust_remote_code=True`: copy the modules `VECA_AUTO_MAP` names that sit beside
    this file (and what they import relatively) into `save_directory`, and set `config.auto_map` to them.

    The shipped entries win over the config's own, and `repo--module` entries (code from another repository, e.g. left
    in a config loaded from elsewhere) are dropped: a re-saved folder points `trust_remote_code` at its own code only.
    """
    here = Path(__file__).parent
    shipped = {key: ref for key, ref in VECA_AUTO_MAP.items() if (here / f"{ref.split('.')[0]}.py").is_file()}
    if is_main_process:
        os.makedirs(save_directory, exist_ok=True)
        modules = {here / f"{ref.split('.')[0]}.py" for ref in shipped.values()}
        for path in modules | {Path(p) for module in modules for p in get_relative_import_files(module)}:
            shutil.copyfile(path, Path(save_directory) / path.name)
    existing = getattr(config, "auto_map", None) or {}
    foreign = {key: ref for key, ref in existing.items() if "--" in str(ref)}
    if foreign:
        logger.warning(f"Not saving auto_map entries that point at another repository's code: {foreign}.")
    config.auto_map = {**{key: ref for key, ref in existing.items() if key not in foreign}, **shipped}
