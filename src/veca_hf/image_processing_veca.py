# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Image processor class for VECA (PIL / NumPy backend).

VECA's evaluation preprocessing (spec section 5) is the classic "resize-shortest-edge, then center-crop" recipe:

1. convert the image to RGB (grayscale, RGBA, CMYK, palette ... PIL images all become 3-channel RGB),
2. resize with bicubic filtering so that the *short* side equals `size["shortest_edge"]` (288 by default, i.e.
   `256 * 1.125`), keeping the aspect ratio,
3. center crop to `crop_size` (256x256 by default),
4. rescale pixel values by `1 / 255`,
5. normalize with the ImageNet mean `(0.485, 0.456, 0.406)` and std `(0.229, 0.224, 0.225)`.

This module follows the transformers >= 5 backend layout: `VecaImageProcessor` inherits from
[`~image_processing_backends.PilBackend`], so it only needs PIL and NumPy (no torchvision) and all the standard
machinery (`__call__`, `save_pretrained`, `from_pretrained`, `to_dict`, ...) comes from the backend. The batched
torchvision variant lives in `image_processing_veca_fast.py` (`VecaImageProcessorFast`).

The module only imports `transformers` so that it can be copied into a flat folder and loaded with
`trust_remote_code=True`.
"""

from transformers.image_processing_backends import PilBackend
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, PILImageResampling
from transformers.processing_utils import ImagesKwargs, Unpack


class VecaImageProcessingDefaults:
    """VECA's preprocessing settings (spec section 5), shared by the PIL and the torchvision processors."""

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


class VecaImageProcessor(VecaImageProcessingDefaults, PilBackend):
    r"""
    Constructs a VECA image processor (PIL / NumPy backend, no torchvision required).

    The pipeline is: convert to RGB -> bicubic resize of the shortest edge -> center crop -> rescale -> normalize.
    Every argument below can also be passed to `__call__` / `preprocess` to override the stored value for one call.

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
            Resampling filter used when resizing.
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
    >>> from veca_hf.image_processing_veca import VecaImageProcessor

    >>> processor = VecaImageProcessor()
    >>> image = Image.new("RGB", (400, 300))
    >>> processor(image, return_tensors="pt")["pixel_values"].shape
    torch.Size([1, 3, 256, 256])
    ```
    """

    def __init__(self, **kwargs: Unpack[ImagesKwargs]):
        super().__init__(**kwargs)


__all__ = ["VecaImageProcessor"]
