# Copyright 2025 The VECA Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
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

This module imports only `transformers` (whose torchvision backend needs `torch` and `torchvision`), so it can be
copied into a flat folder and loaded with `trust_remote_code=True`.
"""

from transformers.image_processing_backends import TorchvisionBackend
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling
from transformers.processing_utils import ImagesKwargs, Unpack


class VecaImageProcessorFast(TorchvisionBackend):
    r"""
    Constructs a fast VECA image processor (torchvision backend, batched, optionally on GPU).

    Same pipeline and defaults as [`VecaImageProcessor`]: convert to RGB -> bicubic (antialiased) resize of the
    shortest edge -> center crop -> rescale -> normalize (rescale and normalize are fused into one op). Every
    argument below can also be passed to `__call__` / `preprocess` to override the stored value for one call.

    Args:
        do_convert_rgb (`bool`, *optional*, defaults to `True`):
            Whether to convert the image to RGB. PIL images keep their mode information, so grayscale (`"L"`),
            `"RGBA"`, `"CMYK"` and palette images are all converted to 3-channel RGB.
        do_resize (`bool`, *optional*, defaults to `True`):
            Whether to resize the image so that its shortest edge matches `size["shortest_edge"]`.
        size (`dict[str, int]`, *optional*, defaults to `{"shortest_edge": 288}`):
            Size of the image after resizing. With `{"shortest_edge": s}` the short side becomes `s` and the aspect
            ratio is preserved. An `int` is interpreted as `{"shortest_edge": int}` (because
            `default_to_square=False`). `{"height": h, "width": w}` resizes to exactly `(h, w)`.
        resample (`PILImageResampling`, *optional*, defaults to `PILImageResampling.BICUBIC`):
            Resampling filter used when resizing (mapped to the matching torchvision `InterpolationMode`).
        do_center_crop (`bool`, *optional*, defaults to `True`):
            Whether to center crop the resized image to `crop_size`.
        crop_size (`dict[str, int]`, *optional*, defaults to `{"height": 256, "width": 256}`):
            Output size of the center crop. Images smaller than the crop are zero-padded symmetrically first.
        do_rescale (`bool`, *optional*, defaults to `True`):
            Whether to rescale pixel values by `rescale_factor`.
        rescale_factor (`int` or `float`, *optional*, defaults to `1/255`):
            Scale factor applied when rescaling.
        do_normalize (`bool`, *optional*, defaults to `True`):
            Whether to normalize the image with `image_mean` and `image_std`.
        image_mean (`float` or `list[float]`, *optional*, defaults to `IMAGENET_DEFAULT_MEAN`):
            Per-channel mean, `(0.485, 0.456, 0.406)`.
        image_std (`float` or `list[float]`, *optional*, defaults to `IMAGENET_DEFAULT_STD`):
            Per-channel standard deviation, `(0.229, 0.224, 0.225)`.
        default_to_square (`bool`, *optional*, defaults to `False`):
            How an integer `size` is interpreted: `False` means "shortest edge", `True` means a square.

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

    model_input_names = ["pixel_values"]

    resample = PILImageResampling.BICUBIC
    image_mean = IMAGENET_DEFAULT_MEAN
    image_std = IMAGENET_DEFAULT_STD
    size = {"shortest_edge": 288}
    default_to_square = False
    crop_size = {"height": 256, "width": 256}
    do_resize = True
    do_center_crop = True
    do_rescale = True
    rescale_factor = 1 / 255
    do_normalize = True
    do_convert_rgb = True

    def __init__(self, **kwargs: Unpack[ImagesKwargs]):
        super().__init__(**kwargs)


__all__ = ["VecaImageProcessorFast"]
