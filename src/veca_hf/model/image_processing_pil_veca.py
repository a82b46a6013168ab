# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Image processor class for VECA (PIL / NumPy backend), and the settings both VECA processors share.

VECA's evaluation preprocessing (arXiv 2605.12491; docs/usage.md) is the classic "resize the short side, then
centre crop" recipe:

1. convert the image to RGB (grayscale, RGBA, CMYK, palette ... PIL images all become 3-channel RGB),
2. resize with bicubic filtering so that the *short* side equals `size["shortest_edge"]` (288 by default, the
   paper's 288 / 256 ratio times the 256 crop), keeping the aspect ratio,
3. centre crop to `crop_size` (256x256 by default),
4. rescale pixel values by `1 / 255`,
5. normalise with the ImageNet mean `(0.485, 0.456, 0.406)` and std `(0.229, 0.224, 0.225)`.

The layout follows transformers 5 (`models/vit/`): `image_processing_veca.py` holds `VecaImageProcessor` on the
torchvision backend, this file `VecaImageProcessorPil` on [`~image_processing_backends.PilBackend`] (PIL and NumPy
only, so it works without torchvision). `VecaImageProcessingDefaults` is the one place the settings live; the
training and evaluation transforms of `veca_hf.data.build_transform` are derived from a processor's settings too.

The module imports only `transformers` (with its own dependencies, NumPy and `huggingface_hub`) and the standard
library, so that it can be copied into a flat folder and loaded with `trust_remote_code=True`.
"""

import math
import numbers
import os
import shutil
import sys
from pathlib import Path
from typing import Annotated, get_args, get_origin

import numpy as np
from huggingface_hub.dataclasses import validate_typed_dict
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers.image_processing_backends import PilBackend
from transformers.image_processing_utils import BatchFeature
from transformers.image_utils import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    ImageType,
    PILImageResampling,
    SizeDict,
    get_image_type,
    is_valid_image,
    torch_pil_interpolation_mapping,
)
from transformers.processing_utils import ImagesKwargs


# The processor classes a saved folder ships, by backend: module (file name without `.py`) and class name.
VECA_IMAGE_PROCESSOR_CLASSES = {
    "torchvision": ("image_processing_veca", "VecaImageProcessor"),
    "pil": ("image_processing_pil_veca", "VecaImageProcessorPil"),
}


def check_image(image):
    """Returns `image` (a bfloat16 / float8 tensor as float32), or raises a `ValueError` naming what is wrong with it.

    NOTE: both backends would otherwise fail deep inside with a ZeroDivisionError (a side of 0 px), a TypeError
    (NumPy has no bfloat16) or silently pass NaN through (torchvision).
    """
    image_type = get_image_type(image)
    if image_type == ImageType.PIL:
        if min(image.size) == 0:
            raise ValueError(f"Got an empty image of {image.size[0]}x{image.size[1]} (width x height) pixels.")
        return image
    shape = tuple(image.shape)
    if 0 in shape:
        raise ValueError(f"Got an empty image of shape {shape}: every side must be at least 1 pixel.")
    if len(shape) == 3 and shape[0] not in (1, 3, 4) and shape[-1] not in (1, 3, 4):
        raise ValueError(
            f"Got an image of shape {shape}: use (height, width, channels) or (channels, height, width) with 1, 3 "
            "or 4 channels (grayscale, RGB, RGBA)."
        )
    if image_type == ImageType.TORCH:
        if image.is_complex():
            raise ValueError(f"Images of dtype {image.dtype} are not supported: use uint8 (0-255) or float (0-1).")
        if image.is_floating_point() and str(image.dtype) not in ("torch.float16", "torch.float32", "torch.float64"):
            image = image.float()  # NumPy (the PIL backend) has neither bfloat16 nor float8
        is_float, finite = image.is_floating_point(), lambda: bool(image.isfinite().all())
    else:
        if image.dtype.kind not in "biuf":
            raise ValueError(f"Images of dtype {image.dtype} are not supported: use uint8 (0-255) or float (0-1).")
        is_float, finite = image.dtype.kind == "f", lambda: bool(np.isfinite(image).all())
    if is_float and not finite():
        raise ValueError(f"Got an image of shape {shape} with NaN or infinite values; pixel values must be finite.")
    return image


class VecaImageProcessorKwargs(ImagesKwargs, total=False):
    r"""
    ensure_multiple_of (`int`, *optional*):
        Resize each image, keeping its aspect ratio as far as possible, so that both sides are multiples of this
        value (set it to the model's `patch_size`): the size that `size` gives is rounded, side by side, to the
        nearest multiple (at least one multiple, and not above a `longest_edge` / `max_height` / `max_width`
        bound). Same name and rounding as DPT's and Depth Anything's processors. Use it with `do_center_crop=False`.
    """

    ensure_multiple_of: int | None


def with_channel_axis(images):
    """`images` (one image or nested lists) with every 2-D array or tensor `(H, W)` as `(1, H, W)`."""
    if isinstance(images, (list, tuple)):
        return [with_channel_axis(image) for image in images]
    if is_valid_image(images) and get_image_type(images) != ImageType.PIL and images.ndim == 2:
        return images[None]
    return images


def check_settings(
    size=None,
    crop_size=None,
    pad_size=None,
    resample=None,
    rescale_factor=None,
    image_mean=None,
    image_std=None,
    do_convert_rgb=None,
    ensure_multiple_of=None,
    **kwargs,
) -> None:
    """Raises a `ValueError` naming the setting, its value and what is allowed, for any setting (already standardised:
    sizes as `SizeDict`) that would make either backend fail deep inside or return empty or non-finite pixels."""
    for name, sides, example in (
        ("size", size, {"shortest_edge": 288}),
        ("crop_size", crop_size, {"height": 256, "width": 256}),
        ("pad_size", pad_size, {"height": 256, "width": 256}),
    ):
        for key, side in dict(sides or {}).items():
            if not isinstance(side, int) or isinstance(side, bool) or side <= 0:
                raise ValueError(
                    f"{name}={dict(sides)} has {key}={side!r}: every side must be a positive int (pixels), e.g. "
                    f"{name}={example}."
                )
    # NOTE: ints are PIL's filters (0 to 5); torchvision's InterpolationMode is accepted as the backends map it.
    filters = {int(member) for member in PILImageResampling}
    is_filter = isinstance(resample, int) and not isinstance(resample, bool) and resample in filters
    if resample is not None and not (is_filter or resample in tuple(torch_pil_interpolation_mapping)):
        names = ", ".join(f"{member.name} ({int(member)})" for member in PILImageResampling)
        raise ValueError(
            f"resample={resample!r} is not a resampling filter: use a PILImageResampling ({names}), e.g. "
            "resample=PILImageResampling.BICUBIC (the default)."
        )
    if rescale_factor is not None and not (_is_finite_number(rescale_factor) and rescale_factor > 0):
        raise ValueError(
            f"rescale_factor={rescale_factor!r} must be a positive finite number, e.g. 1 / 255 (0-255 pixels to 0-1)."
        )
    for name, values, default, positive in (
        ("image_mean", image_mean, IMAGENET_DEFAULT_MEAN, False),
        ("image_std", image_std, IMAGENET_DEFAULT_STD, True),
    ):
        if values is None:
            continue
        is_sequence = isinstance(values, (list, tuple))
        # one number for all channels, or one per channel: 3 once images are converted to RGB (without conversion,
        # the backends match the count to each image's channels)
        count_ok = not is_sequence or (len(values) == 3 if do_convert_rgb else len(values) > 0)
        entries = values if is_sequence else [values]
        if not count_ok or not all(_is_finite_number(x) and (x > 0 or not positive) for x in entries):
            raise ValueError(
                f"{name}={values!r} must be {'positive ' if positive else ''}finite numbers, one per RGB channel (or "
                f"one for all channels), e.g. {name}={tuple(default)}."
            )
    if ensure_multiple_of is not None and (
        not isinstance(ensure_multiple_of, int) or isinstance(ensure_multiple_of, bool) or ensure_multiple_of <= 0
    ):
        raise ValueError(f"ensure_multiple_of={ensure_multiple_of!r} must be a positive int: the model's patch size.")


def _is_finite_number(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


class VecaImageProcessingDefaults:
    """VECA's preprocessing settings, shared by `VecaImageProcessor` and `VecaImageProcessorPil`.

    Besides the settings it gives both processors `for_resolution` (the paper's resize ratio at any crop), the
    aspect-preserving mode for batches of different sizes (`for_any_size`: `ensure_multiple_of`, and `do_pad` with a
    `pixel_mask`), and a `save_pretrained` whose folder carries the code of both, so that `trust_remote_code=True`
    finds either backend.
    """

    model_input_names = ["pixel_values"]
    valid_kwargs = VecaImageProcessorKwargs

    resample = PILImageResampling.BICUBIC
    image_mean = IMAGENET_DEFAULT_MEAN
    image_std = IMAGENET_DEFAULT_STD
    # NOTE: `size` and `crop_size` together store the paper's resize ratio (288 / 256 = 1.125): `for_resolution`
    # derives every other crop from them, so the ratio is written nowhere else.
    size = {"shortest_edge": 288}
    default_to_square = False
    crop_size = {"height": 256, "width": 256}
    do_resize = True
    do_center_crop = True
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    do_convert_rgb = True
    ensure_multiple_of = None

    def _set_attributes(self, **kwargs):
        """The backend's `_set_attributes`, then the checks of `_validate_preprocess_kwargs` on the stored settings, so
        that a bad setting fails when the processor is built (or loaded), not at its first call."""
        super()._set_attributes(**kwargs)
        self._validate_preprocess_kwargs(**{name: getattr(self, name, None) for name in self._valid_kwargs_names})

    def _validate_preprocess_kwargs(self, **kwargs):
        check_settings(**kwargs)
        super()._validate_preprocess_kwargs(**kwargs)

    def preprocess(self, images, *args, **kwargs):
        """The backend's `preprocess`; a per-call setting of the wrong type is a `ValueError` naming the setting.

        NOTE: transformers checks the types of per-call settings (not of stored ones) and raises a huggingface_hub
        error that is no `ValueError` and names no fix.
        """
        annotations = self.valid_kwargs.__annotations__
        for name, value in kwargs.items():
            if name not in annotations:
                continue  # other arguments (`image_like_kwargs`, or a typo) are the backend's to handle
            try:
                validate_typed_dict(self.valid_kwargs, {name: value})
            except StrictDataclassFieldValidationError as error:
                expected = annotations[name]
                expected = get_args(expected)[0] if get_origin(expected) is Annotated else expected
                example = getattr(self, name, None)  # the stored setting, which passed the checks
                example = dict(example) if isinstance(example, SizeDict) else example
                raise ValueError(
                    f"{name}={value!r} is not of type {expected}: pass e.g. {name}={example!r}."
                ) from error
        return super().preprocess(images, *args, **kwargs)

    @classmethod
    def for_resolution(cls, resolution: int, **kwargs):
        r"""
        The processor for square `resolution x resolution` crops, with the short side resized by the paper's ratio.

        The ratio is the one stored in the class defaults, `size["shortest_edge"] / crop_size["height"]` (288 / 256),
        so the short side becomes `round(resolution * 288 / 256)`: 288 for 256, 252 for 224, 36 for 32.

        Args:
            resolution (`int`):
                The side of the centre crop (any positive int: patch 16 and patch 14 models both occur).
            kwargs (`dict[str, Any]`, *optional*):
                Any other processor setting, as in the constructor.

        Returns:
            An instance of this class with `size={"shortest_edge": round(resolution * ratio)}` and
            `crop_size={"height": resolution, "width": resolution}`.
        """
        if not isinstance(resolution, int) or isinstance(resolution, bool) or resolution <= 0:
            raise ValueError(f"`resolution` must be a positive int (the crop side in pixels), got {resolution!r}.")
        ratio = cls.size["shortest_edge"] / cls.crop_size["height"]
        return cls(
            size={"shortest_edge": round(resolution * ratio)},
            crop_size={"height": resolution, "width": resolution},
            **kwargs,
        )

    def _prepare_images_structure(self, images, expected_ndims: int = 3) -> list:
        """The backend's flat list of images, each passed through `check_image`; an empty list raises.

        NOTE: a 2-D array or tensor (`np.asarray` of an `"L"` image) is a grayscale image: it gets a leading channel
        axis here, since transformers refuses a lone one and the PIL backend one inside a list.
        """
        images = super()._prepare_images_structure(with_channel_axis(images), expected_ndims=expected_ndims)
        if len(images) == 0:
            raise ValueError("Got an empty list of images: pass one image or a non-empty list of images.")
        return [check_image(image) for image in images]

    @classmethod
    def for_any_size(cls, shortest_edge: int, patch_size: int = 16, **kwargs):
        r"""
        The aspect-preserving processor for batches of images of different sizes ([`VecaModel`] takes them in one
        batch, exactly: see `pixel_mask` in [`VecaModel.forward`]).

        Each image is resized so that its short side is about `shortest_edge`, both sides rounded to multiples of
        `patch_size`, without a centre crop; a batch of different sizes is padded (bottom and right) to its largest
        size and returned with a `pixel_mask`.

        Args:
            shortest_edge (`int`):
                The target short side in pixels.
            patch_size (`int`, *optional*, defaults to 16):
                The model's `config.patch_size`.
            kwargs (`dict[str, Any]`, *optional*):
                Any other processor setting, e.g. `size={"shortest_edge": 224, "longest_edge": 448}` to bound the
                long side as well, or `pad_size={"height": 448, "width": 448}` to pad every image to one fixed size
                (what pipelines need to batch images of different sizes).

        Returns:
            An instance of this class with `size={"shortest_edge": shortest_edge}`, `do_center_crop=False`,
            `ensure_multiple_of=patch_size` and `do_pad=True`.
        """
        settings = dict(
            size={"shortest_edge": shortest_edge}, do_center_crop=False, ensure_multiple_of=patch_size, do_pad=True
        )
        return cls(**{**settings, **kwargs})

    @staticmethod
    def get_aspect_preserving_size(height: int, width: int, size: SizeDict, multiple: int = 1) -> SizeDict:
        """The `(height, width)` that `size` gives an image, each side rounded to the nearest multiple of `multiple`.

        `size` is `{"shortest_edge"}` (optionally with `"longest_edge"`), `{"longest_edge"}`, `{"max_height",
        "max_width"}` or `{"height", "width"}`; a side never drops below one multiple, nor rounds up past its bound.
        """
        bound_height = bound_width = None
        if size.shortest_edge:
            scale = size.shortest_edge / min(height, width)
            if size.longest_edge:
                scale = min(scale, size.longest_edge / max(height, width))
                bound_height = bound_width = size.longest_edge
        elif size.longest_edge:
            scale = size.longest_edge / max(height, width)
            bound_height = bound_width = size.longest_edge
        elif size.max_height and size.max_width:
            scale = min(size.max_height / height, size.max_width / width)
            bound_height, bound_width = size.max_height, size.max_width
        elif size.height and size.width:
            scale, height, width = 1.0, size.height, size.width
        else:
            raise ValueError(
                "With `ensure_multiple_of`, `size` must have 'shortest_edge' (and optionally 'longest_edge'), "
                f"'longest_edge', 'max_height' and 'max_width', or 'height' and 'width'; got {dict(size)}."
            )

        def constrain(value: float, bound: int | None) -> int:
            rounded = round(value / multiple) * multiple
            if bound is not None and rounded > bound:
                rounded = bound // multiple * multiple
            return max(multiple, rounded)

        return SizeDict(height=constrain(height * scale, bound_height), width=constrain(width * scale, bound_width))

    def _preprocess(
        self,
        images: list,
        do_resize: bool,
        size: SizeDict,
        resample,
        ensure_multiple_of: int | None = None,
        do_pad: bool | None = None,
        pad_size: SizeDict | None = None,
        return_tensors=None,
        **kwargs,
    ) -> BatchFeature:
        """The backend's `_preprocess`, plus the aspect-preserving resize of `ensure_multiple_of` (or of a lone
        `longest_edge`) and, with `do_pad`, padding to one size with a `pixel_mask` (as DETR's processors)."""
        if do_resize and (ensure_multiple_of or (size.longest_edge and not size.shortest_edge)):
            # NOTE: one image at a time, each to its own size, before the backend's (grouped) pipeline runs.
            multiple = ensure_multiple_of or 1
            sizes = [self.get_aspect_preserving_size(*image.shape[-2:], size, multiple) for image in images]
            images = [self.resize(image, own, resample=resample) for image, own in zip(images, sizes, strict=False)]
            do_resize = False
        if not do_pad:
            return super()._preprocess(
                images,
                do_resize=do_resize,
                size=size,
                resample=resample,
                do_pad=do_pad,
                pad_size=pad_size,
                return_tensors=return_tensors,
                **kwargs,
            )
        processed = super()._preprocess(
            images,
            do_resize=do_resize,
            size=size,
            resample=resample,
            do_pad=False,
            pad_size=None,
            return_tensors=None,
            **kwargs,
        )["pixel_values"]  # a list
        pixel_values, pixel_mask = self.pad(processed, pad_size=pad_size, return_mask=True)  # bottom and right
        return BatchFeature(data={"pixel_values": pixel_values, "pixel_mask": pixel_mask}, tensor_type=return_tensors)

    def _remote_code(self) -> dict[str, tuple[Path, str]]:
        """By backend, the processor file beside this class's module and its `auto_map` entry, if the file exists."""
        folder = Path(sys.modules[type(self).__module__].__file__).parent
        code = {}
        for backend, (module, class_name) in VECA_IMAGE_PROCESSOR_CLASSES.items():
            if (folder / f"{module}.py").is_file():
                code[backend] = (folder / f"{module}.py", f"{module}.{class_name}")
        return code

    def save_pretrained(self, save_directory: str | os.PathLike, *args, **kwargs):
        """Same as the backend's `save_pretrained`; once registered for `AutoImageProcessor`, the folder also gets
        the code of both processors (the `auto_map` names both, see `to_dict`)."""
        if self._auto_class is not None:
            os.makedirs(save_directory, exist_ok=True)
            for path, _ in self._remote_code().values():
                shutil.copyfile(path, Path(save_directory) / path.name)
        return super().save_pretrained(save_directory, *args, **kwargs)

    def to_dict(self) -> dict:
        """The backend's `to_dict`; an `AutoImageProcessor` entry of `auto_map` names every processor class shipped.

        NOTE: transformers writes only the saved class there; a dict by backend (which `AutoImageProcessor` reads)
        lets a folder loaded with `trust_remote_code=True` pick the backend that is installed.
        """
        output = super().to_dict()
        auto_map = output.get("auto_map")
        if self._auto_class is not None and auto_map and self._auto_class in auto_map:
            auto_map[self._auto_class] = {backend: ref for backend, (_, ref) in self._remote_code().items()}
        return output


class VecaImageProcessorPil(VecaImageProcessingDefaults, PilBackend):
    r"""
    Constructs a VECA image processor (PIL / NumPy backend, no torchvision required).

    The pipeline is: convert to RGB -> bicubic resize of the shortest edge -> centre crop -> rescale -> normalise.
    Every argument below can also be passed to `__call__` / `preprocess` to override the stored value for one call.
    Settings are checked when the processor is built (or loaded) and per call: a bad one (a side that is not a positive
    int, a zero or non-finite `image_std`, an unknown `resample`) raises a `ValueError` naming it.
    [`VecaImageProcessor`] is the same pipeline on the torchvision backend (batched, optionally on GPU).

    Args:
        do_convert_rgb (`bool`, *optional*, defaults to `True`):
            Whether to convert the image to RGB. PIL images keep their mode information, so grayscale (`"L"`),
            `"RGBA"`, `"CMYK"` and palette images are all converted to 3-channel RGB (transparency on white).
        do_resize (`bool`, *optional*, defaults to `True`):
            Whether to resize the image so that its shortest edge matches `size["shortest_edge"]`.
        size (`dict[str, int]`, *optional*, defaults to `{"shortest_edge": 288}`):
            Size of the image after resizing. With `{"shortest_edge": s}` the short side becomes `s` and the aspect
            ratio is preserved (the long side is truncated to an int, as in torchvision's `Resize`). An `int` is
            interpreted as `{"shortest_edge": int}` (because `default_to_square=False`). `{"height": h, "width": w}`
            resizes to exactly `(h, w)`.
        resample (`PILImageResampling`, *optional*, defaults to `PILImageResampling.BICUBIC`):
            Resampling filter used when resizing.
        do_center_crop (`bool`, *optional*, defaults to `True`):
            Whether to centre crop the resized image to `crop_size`.
        crop_size (`dict[str, int]`, *optional*, defaults to `{"height": 256, "width": 256}`):
            Output size of the centre crop. Images smaller than the crop are zero-padded symmetrically first.
        do_rescale (`bool`, *optional*, defaults to `True`):
            Whether to rescale pixel values by `rescale_factor`.
        rescale_factor (`int` or `float`, *optional*, defaults to `1/255`):
            Scale factor applied when rescaling.
        do_normalize (`bool`, *optional*, defaults to `True`):
            Whether to normalise the image with `image_mean` and `image_std`.
        image_mean (`float` or `list[float]`, *optional*, defaults to `IMAGENET_DEFAULT_MEAN`):
            Per-channel mean, `(0.485, 0.456, 0.406)`.
        image_std (`float` or `list[float]`, *optional*, defaults to `IMAGENET_DEFAULT_STD`):
            Per-channel standard deviation, `(0.229, 0.224, 0.225)`.
        default_to_square (`bool`, *optional*, defaults to `False`):
            How an integer `size` is interpreted: `False` means "shortest edge", `True` means a square.

    Example:

    ```python
    >>> from PIL import Image
    >>> from veca_hf.model.image_processing_pil_veca import VecaImageProcessorPil

    >>> processor = VecaImageProcessorPil()
    >>> image = Image.new("RGB", (400, 300))
    >>> processor(image, return_tensors="pt")["pixel_values"].shape
    torch.Size([1, 3, 256, 256])
    >>> VecaImageProcessorPil.for_resolution(224).size["shortest_edge"]
    252
    ```
    """


__all__ = ["VecaImageProcessingDefaults", "VecaImageProcessorPil", "check_image", "check_settings"]
