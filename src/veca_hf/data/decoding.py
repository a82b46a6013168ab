# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Decoding whatever a streamed example holds into an RGB image, never raising for bad data."""

import os
from typing import Any

import datasets
import numpy as np
import PIL.Image
import PIL.ImageFile
from transformers.utils import logging

from ..arguments import redact_urls


logger = logging.get_logger(__name__)

SKIP_UNDECODABLE = "undecodable"
SKIP_TOO_SMALL = "too_small"


def _to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """Any PIL mode -> RGB: transparency is composited on white, 16/32-bit images are scaled to 8 bits."""
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I") or image.mode == "F":  # I, I;16, I;16B, I;16L, F: PIL's convert would clip
        array = np.asarray(image, dtype=np.float64)  # (H, W)
        if array.size and array.max() > 255:
            array = array / 257.0  # 16-bit range 0..65535 -> 0..255
        image = PIL.Image.fromarray(np.clip(np.rint(array), 0, 255).astype(np.uint8))  # mode L
        return image.convert("RGB")
    has_alpha = image.mode in ("RGBA", "LA", "PA", "La", "RGBa") or "transparency" in image.info
    if has_alpha:
        image = image.convert("RGBA")
        background = PIL.Image.new("RGBA", image.size, (255, 255, 255, 255))
        return PIL.Image.alpha_composite(background, image).convert("RGB")
    return image.convert("RGB")  # L, 1, P, CMYK, YCbCr, ...


def decode_image(value: Any, min_size: int = 32) -> tuple[PIL.Image.Image | None, str | None]:
    """
    Decode what a streamed example holds for an image column into an RGB PIL image, never raising for bad data.

    Truncated files count as undecodable: decoding runs with `PIL.ImageFile.LOAD_TRUNCATED_IMAGES = False`
    (restored afterwards) and loads the pixels fully. EXIF orientation is applied (as `datasets.Image` does).

    Args:
        value (`PIL.Image.Image`, `dict`, `bytes` or `str`):
            A PIL image, a `{"bytes": ..., "path": ...}` dict (from `datasets.Image(decode=False)`; local or remote
            `path` when `bytes` is None), raw encoded bytes, or a path.
        min_size (`int`, *optional*, defaults to 32):
            Images whose shorter side is below this are rejected as `"too_small"`.

    Returns:
        `tuple`: `(image, None)` with an RGB image, or `(None, reason)` with `reason` `"undecodable"` or
        `"too_small"`.
    """
    if min_size < 0:
        raise ValueError(f"`min_size` must be >= 0, got {min_size}.")
    previous = PIL.ImageFile.LOAD_TRUNCATED_IMAGES
    PIL.ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        if isinstance(value, PIL.Image.Image):
            image = value
            image.load()
        else:
            if isinstance(value, (bytes, bytearray, memoryview)):
                value = {"bytes": bytes(value), "path": None}
            elif isinstance(value, (str, os.PathLike)):
                value = {"bytes": None, "path": os.fspath(value)}
            if not isinstance(value, dict):
                logger.debug(f"Cannot decode an image from a {type(value).__name__}.")
                return None, SKIP_UNDECODABLE
            # Local paths, remote (fsspec) paths, bytes; loads fully and applies EXIF orientation.
            image = datasets.Image().decode_example(value)
        if min(image.size) < min_size:
            return None, SKIP_TOO_SMALL
        return _to_rgb(image), None
    except Exception as error:  # NOTE: bad data must never stop the stream: PIL raises many exception types
        path = value.get("path") if isinstance(value, dict) else None
        logger.debug(redact_urls(f"Undecodable image {path!r}: {type(error).__name__}: {error}"))
        return None, SKIP_UNDECODABLE
    finally:
        PIL.ImageFile.LOAD_TRUNCATED_IMAGES = previous
