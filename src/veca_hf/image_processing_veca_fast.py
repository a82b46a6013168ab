# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Deprecated: `VecaImageProcessorFast` is now `VecaImageProcessor` in `veca_hf.image_processing_veca`.

transformers 5 names image processors by backend (`VecaImageProcessor` torchvision, `VecaImageProcessorPil` PIL) and
has no `*_fast.py` files. This module stays importable, with a `FutureWarning`, for code written before the rename.
"""

import warnings

from .image_processing_veca import VecaImageProcessor


warnings.warn(
    "`veca_hf.image_processing_veca_fast` is deprecated: import `VecaImageProcessor` (torchvision backend, the old "
    "`VecaImageProcessorFast`) from `veca_hf` or `veca_hf.image_processing_veca` instead.",
    FutureWarning,
    stacklevel=2,
)

VecaImageProcessorFast = VecaImageProcessor

__all__ = ["VecaImageProcessorFast"]
