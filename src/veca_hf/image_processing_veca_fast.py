# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fast image processor class for VECA (torchvision backend).

`VecaImageProcessorFast` implements exactly the same pipeline and defaults as
[`~image_processing_veca.VecaImageProcessor`] (convert to RGB -> bicubic resize of the shortest edge to 288 ->
center crop 256x256 -> rescale by 1/255 -> ImageNet normalization), but on `torch.Tensor`s with
`torchvision.transforms.v2.functional`. Images of the same shape are processed as one batch, and
`device="cuda"` can be passed to run the whole pipeline on a GPU.

Numerical agreement with the PIL variant: both resize with a bicubic (`a=-0.5`) filter *with antialiasing* (PIL
always antialiases; torchvision is called with `antialias=True`), both run the two separable passes on `uint8` data
(PIL inputs reach this processor as `uint8` tensors, so torchvision's uint8 kernel is used) and both crop, rescale
and normalize identically. Measured on CPU (torch 2.14.1, torchvision 0.29.1, Pillow 13.0) against
`VecaImageProcessor`, on random images with sides between 100 and 1000 px, default settings:

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

The settings come from `VecaImageProcessingDefaults`, shared with the PIL variant.
"""

from transformers.image_processing_backends import TorchvisionBackend
from transformers.processing_utils import ImagesKwargs, Unpack

from .image_processing_veca import VecaImageProcessingDefaults


class VecaImageProcessorFast(VecaImageProcessingDefaults, TorchvisionBackend):
    r"""
    Constructs a fast VECA image processor (torchvision backend, batched, optionally on GPU).

    Same pipeline, arguments and defaults as [`VecaImageProcessor`]: convert to RGB -> bicubic (antialiased) resize
    of the shortest edge to 288 -> center crop 256x256 -> rescale -> ImageNet normalize. Every argument can also be
    passed to `__call__` / `preprocess` to override the stored value for one call.

    Example:

    ```python
    >>> from PIL import Image
    >>> from veca_hf.image_processing_veca_fast import VecaImageProcessorFast

    >>> processor = VecaImageProcessorFast()
    >>> image = Image.new("RGB", (400, 300))
    >>> processor(image, return_tensors="pt")["pixel_values"].shape
    torch.Size([1, 3, 256, 256])
    ```
    """

    def __init__(self, **kwargs: Unpack[ImagesKwargs]):
        super().__init__(**kwargs)


__all__ = ["VecaImageProcessorFast"]
