# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Image processor class for VECA (torchvision backend).

`VecaImageProcessor` implements the pipeline and defaults of `VecaImageProcessingDefaults` (convert to RGB ->
bicubic resize of the shortest edge to 288 -> centre crop 256x256 -> rescale by 1/255 -> ImageNet normalisation;
arXiv 2605.12491, docs/usage.md) on `torch.Tensor`s with `torchvision.transforms.v2.functional`. Images of the same
shape are processed as one batch, and `device="cuda"` can be passed to run the whole pipeline on a GPU. This is the
processor `AutoImageProcessor` picks when torchvision is installed; `VecaImageProcessorPil`
(`image_processing_pil_veca.py`) is the same pipeline on PIL / NumPy, picked without torchvision or with
`backend="pil"`. The layout follows transformers 5 (`models/vit/image_processing_vit.py`).

Numerical agreement with the PIL variant: both resize with a bicubic (`a=-0.5`) filter *with antialiasing* (PIL
always antialiases; torchvision is called with `antialias=True`), both run the two separable passes on `uint8` data
(PIL inputs reach this processor as `uint8` tensors, so torchvision's uint8 kernel is used) and both crop, rescale
and normalise identically. Measured on CPU (torch 2.14.1, torchvision 0.29.1, Pillow 13.0) against
`VecaImageProcessorPil`, on random images with sides between 100 and 1000 px, default settings:

- smooth / natural-like content (blurred noise, sinusoids), landscape and portrait: max abs difference `0.035`
  (2 uint8 levels, `2 / 255 / 0.224`), mean abs difference < `3e-4`;
- landscape (or square) images of any content: max abs difference `0.035`;
- portrait images with saturated high-frequency 2-D detail: isolated pixels can differ by more (measured `0.10` on
  hard-edged rectangles and `0.31` on pure uniform noise), mean abs difference still < `6e-3`.

The last case is not a bug in either backend: bicubic filtering overshoots `[0, 255]` and both libraries clip to
`uint8` between the horizontal and the vertical pass, but Pillow (>= 13 at least) sometimes runs the vertical pass
first for tall images, whereas torchvision always runs the horizontal pass first. Compare the two variants with
`atol=0.04` on natural images. Inputs given as *float* tensors take torchvision's float path (no clipping or
rounding between passes), which differs from PIL by up to ~20 uint8 levels on noisy content.

The module imports only `transformers` and its sibling, so that both can be copied into a flat folder and loaded
with `trust_remote_code=True`; it imports without torchvision, but the processor then refuses to be built.
"""

from transformers.image_processing_backends import TorchvisionBackend
from transformers.processing_utils import ImagesKwargs, Unpack
from transformers.utils import requires_backends

from .image_processing_pil_veca import VecaImageProcessingDefaults


class VecaImageProcessor(VecaImageProcessingDefaults, TorchvisionBackend):
    r"""
    Constructs a VECA image processor (torchvision backend, batched, optionally on GPU).

    Same pipeline, arguments and defaults as [`VecaImageProcessorPil`]: convert to RGB -> bicubic (antialiased)
    resize of the shortest edge to 288 -> centre crop 256x256 -> rescale -> ImageNet normalise. Every argument can
    also be passed to `__call__` / `preprocess` to override the stored value for one call.

    Example:

    ```python
    >>> from PIL import Image
    >>> from veca_hf import VecaImageProcessor

    >>> processor = VecaImageProcessor()
    >>> image = Image.new("RGB", (400, 300))
    >>> processor(image, return_tensors="pt")["pixel_values"].shape
    torch.Size([1, 3, 256, 256])
    ```
    """

    def __init__(self, **kwargs: Unpack[ImagesKwargs]):
        # NOTE: transformers replaces its own torchvision processors by dummies that raise when torchvision is
        # missing; this class stays importable (the base install has no torchvision), so it raises here instead.
        requires_backends(self, ["torchvision"])
        super().__init__(**kwargs)

    def convert_to_rgb(self, image, input_data_format=None):
        """Same as the backend's, but a 4-channel integer image other than uint8 raises a `ValueError`.

        NOTE: the backend blends RGBA on white in float and casts back, which torchvision refuses for int16/32/64
        (a RuntimeError from `to_dtype`).
        """
        channels_first = image.ndim == 3 and input_data_format in (None, "channels_first")
        rgba = image.ndim == 3 and image.shape[0 if channels_first else -1] == 4
        if rgba and not image.is_floating_point() and str(image.dtype) not in ("torch.uint8", "torch.bool"):
            raise ValueError(
                f"Got a 4-channel (RGBA) image of dtype {image.dtype}: only uint8 (0-255) or float (0-1) RGBA images "
                "can be converted to RGB. Convert it to uint8 first, or drop the alpha channel."
            )
        return super().convert_to_rgb(image, input_data_format=input_data_format)


__all__ = ["VecaImageProcessingDefaults", "VecaImageProcessor"]
