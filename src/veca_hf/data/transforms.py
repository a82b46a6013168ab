# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""From decoded images to batches: the training and evaluation transforms derived from an image processor, per-step
resizing, and collation."""

from collections import Counter

import torch
import torch.nn.functional as F
from torchvision.transforms import v2
from transformers.image_processing_utils import BaseImageProcessor
from transformers.image_utils import PILImageResampling, pil_torch_interpolation_mapping
from transformers.utils import logging

from ..model.image_processing_pil_veca import VecaImageProcessorPil
from .decoding import SKIP_UNDECODABLE


logger = logging.get_logger(__name__)


def _size_value(size, key: str) -> int | None:
    """`size[key]` for a processor's `SizeDict` or plain dict (other processors may still hold dicts)."""
    return size.get(key) if isinstance(size, dict) else getattr(size, key, None)


def build_transform(image_processor, train: bool, recipe: str = "distillation") -> v2.Compose:
    """
    The training or evaluation transform of an image processor's settings, in torchvision transforms v2.

    Sizes, interpolation, rescaling and mean / std all come from the processor, so a model's saved processor, its
    training transform and its evaluation transform cannot disagree:

    - eval (`train=False`): resize (`size`, `resample`, antialiased) -> centre crop `crop_size` -> float in
      `[0, 1]` -> normalise (`image_mean`, `image_std`). On an RGB PIL image this equals the PIL processor's output
      up to float rounding (both resize with PIL and crop at the same offsets), and the torchvision processor's
      within their documented tolerance (see `image_processing_veca.py`).
    - train, `recipe="distillation"` (the distillation recipe of arXiv 2605.12491, docs/training.md): the same
      resize -> random crop `crop_size` -> horizontal flip -> TrivialAugmentWide -> the same tail.
    - train, `recipe="finetune"` (transformers' image-classification example): random resized crop to `crop_size`
      -> horizontal flip -> the same tail.

    The random transforms draw from the global torch RNG; `ImageStream` seeds it per sample inside
    `torch.random.fork_rng`, so the process's own RNG is left untouched.

    Args:
        image_processor (`BaseImageProcessor` or `int`):
            The processor whose settings to follow: a `VecaImageProcessor` / `VecaImageProcessorPil`, or any
            transformers image processor whose `size` is a shortest edge or a height and width. An int `r` is short
            for `VecaImageProcessorPil.for_resolution(r)`: short side `round(r * 288 / 256)`, square crop `r`.
        train (`bool`):
            Whether to build the random training transform or the deterministic evaluation one.
        recipe (`str`, *optional*, defaults to `"distillation"`):
            The training augmentation, `"distillation"` or `"finetune"`; not used when `train=False`.

    Returns:
        `torchvision.transforms.v2.Compose`: maps an RGB PIL image to a float32 tensor `(3, crop_h, crop_w)`.
    """
    if isinstance(image_processor, int) and not isinstance(image_processor, bool):
        image_processor = VecaImageProcessorPil.for_resolution(image_processor)  # ValueError if not positive
    if not isinstance(image_processor, BaseImageProcessor):
        raise ValueError(
            f"`image_processor` must be an image processor or a resolution (a positive int), got {image_processor!r}."
        )
    if recipe not in ("distillation", "finetune"):
        raise ValueError(f"`recipe` must be 'distillation' or 'finetune', got {recipe!r}.")

    size = image_processor.size
    if _size_value(size, "shortest_edge"):
        resize_to = _size_value(size, "shortest_edge")  # short side, aspect ratio kept
    elif _size_value(size, "height") and _size_value(size, "width"):
        resize_to = (_size_value(size, "height"), _size_value(size, "width"))
    else:
        raise ValueError(f"The processor's `size` must hold a shortest edge or a height and width, got {size}.")
    crop_size = getattr(image_processor, "crop_size", None)
    if getattr(image_processor, "do_center_crop", False) and crop_size:
        crop = (_size_value(crop_size, "height"), _size_value(crop_size, "width"))
    else:  # NOTE: a shortest-edge resize alone gives unequal sizes; crop a square of that side so batches stack
        crop = resize_to if isinstance(resize_to, tuple) else (resize_to, resize_to)
    if image_processor.do_rescale and image_processor.rescale_factor != 1 / 255:
        raise ValueError(
            f"`rescale_factor` {image_processor.rescale_factor} is not supported (only 1/255, uint8 images to [0, "
            "1]): "
            "set `do_rescale=False` and fold the scale into `image_mean` / `image_std`."
        )
    resample = image_processor.resample  # a PIL filter (an int in saved configs) or a torchvision mode
    if not isinstance(resample, v2.InterpolationMode):
        resample = pil_torch_interpolation_mapping[PILImageResampling(resample)]
    interpolation = {"interpolation": resample, "antialias": True}
    resize = [v2.Resize(resize_to, **interpolation)] if image_processor.do_resize else []

    if not train:
        head = [*resize, v2.CenterCrop(crop)]
    elif recipe == "distillation":
        head = [*resize, v2.RandomCrop(crop), v2.RandomHorizontalFlip(), v2.TrivialAugmentWide()]
    else:
        head = [v2.RandomResizedCrop(crop, **interpolation), v2.RandomHorizontalFlip()]
    tail = [v2.ToImage(), v2.ToDtype(torch.float32, scale=bool(image_processor.do_rescale))]
    if image_processor.do_normalize:
        tail.append(v2.Normalize(mean=list(image_processor.image_mean), std=list(image_processor.image_std)))
    tail.append(v2.ToPureTensor())  # a plain `torch.Tensor`, not a `tv_tensors.Image`
    return v2.Compose(head + tail)


def resize_batch(pixel_values: torch.Tensor, resolution: int) -> torch.Tensor:
    """
    Resize a normalised batch to `resolution x resolution` (bicubic, antialiased), for multi-resolution steps.

    NOTE: resizing commutes with the per-channel normalisation (interpolation weights sum to one), so downsizing a
    normalised crop equals normalising a downsized one up to rounding.

    Args:
        pixel_values (`torch.Tensor` of shape `(B, 3, H, W)`):
            The batch, as the stream yields it (at the largest resolution of the schedule).
        resolution (`int`):
            The target side.

    Returns:
        `torch.Tensor` of shape `(B, 3, resolution, resolution)`, same dtype; the input itself if already that size.
    """
    if not isinstance(resolution, int) or isinstance(resolution, bool) or resolution <= 0:
        raise ValueError(f"`resolution` must be a positive int, got {resolution!r}.")
    if pixel_values.ndim != 4:
        raise ValueError(f"`pixel_values` must have shape (B, C, H, W), got {tuple(pixel_values.shape)}.")
    if pixel_values.shape[-2:] == (resolution, resolution):
        return pixel_values
    # NOTE: antialiased bicubic has no bf16/fp16 CPU kernel (torch 2.14); compute in float32.
    resized = F.interpolate(
        pixel_values.float(), size=(resolution, resolution), mode="bicubic", align_corners=False, antialias=True
    )  # (B, 3, r, r)
    return resized.to(pixel_values.dtype)


def collate_images(examples: list[dict]) -> dict:
    """
    Batch `ImageStream` examples, dropping (and counting) the skipped ones.

    Args:
        examples (`list[dict]`):
            Items yielded by `ImageStream`.

    Returns:
        `dict` with `pixel_values` (`torch.Tensor` of shape `(B', 3, H, W)` stacking the usable images, or `None`
        when every image of the batch was skipped; callers must then skip the step), `num_skipped` (`int`),
        `skipped_reasons` (`collections.Counter` of reason -> count) and `sources` (the usable images' sources).
    """
    pixel_values = [example["pixel_values"] for example in examples if example.get("pixel_values") is not None]
    skipped_reasons = Counter(
        example.get("skipped", SKIP_UNDECODABLE) for example in examples if example.get("pixel_values") is None
    )
    return {
        "pixel_values": torch.stack(pixel_values) if pixel_values else None,  # (B', 3, H, W)
        "num_skipped": sum(skipped_reasons.values()),
        "skipped_reasons": skipped_reasons,
        "sources": [example.get("source") for example in examples if example.get("pixel_values") is not None],
        "worker": examples[0].get("worker", 0) if examples else 0,  # a DataLoader batch comes from one worker
    }
