# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Decoding whatever a streamed example holds into an RGB image, never raising for bad data.

Two things are refused before they cost anything: an image with more pixels than a limit (read from the file's
header, before any pixel is decoded), and a path outside the dataset's own folder (rows of parquet or webdataset
shards carry their image bytes; a row that names a file or a URL instead must not make a worker read it).
"""

import io
import os
import re
import stat
import urllib.parse
from typing import Any

import numpy as np
import PIL.Image
import PIL.ImageFile
import PIL.ImageOps
from datasets.download import DownloadConfig
from datasets.utils.file_utils import xopen
from transformers.utils import logging

from ..arguments import redact_urls
from .sources import is_remote


logger = logging.get_logger(__name__)

SKIP_UNDECODABLE = "undecodable"
SKIP_TOO_SMALL = "too_small"
SKIP_TOO_LARGE = "too_large"
SKIP_PATH_NOT_ALLOWED = "path_not_allowed"

# 64 MP keeps every camera photo up to 61 MP (9504 x 6336) and bounds what one decode adds to a DataLoader worker at
# about 1.2 GB (measured: an RGBA PNG at the limit, composited on white; 0.85 GB for 16-bit greyscale); training
# crops are at most a few megapixels anyway.
DEFAULT_MAX_IMAGE_PIXELS = 64_000_000


class _PathNotAllowed(Exception):
    """A path that `decode_image` does not read (outside its root, or not a regular file)."""


def check_max_pixels(max_pixels: Any, name: str = "max_pixels") -> None:
    """A ValueError unless `max_pixels` is a positive int or None (no limit)."""
    if max_pixels is not None and (not isinstance(max_pixels, int) or isinstance(max_pixels, bool) or max_pixels < 1):
        raise ValueError(
            f"`{name}` must be a positive int or None, got {max_pixels!r}: the most pixels (width x height) an image "
            f"may have, e.g. {DEFAULT_MAX_IMAGE_PIXELS} (None: no limit of ours; PIL still refuses images above "
            "2 x PIL.Image.MAX_IMAGE_PIXELS)."
        )


def _url_inside(url: str, root: str) -> bool:
    """Whether `url` lies under the URL prefix `root` (a folder ending in `/`, or a Hub repository's `...@`)."""
    prefix = root if root.endswith(("/", "@")) else root + "/"
    if not url.startswith(prefix):
        return False
    rest = urllib.parse.unquote(url[len(prefix) :].split("?", 1)[0])
    return ".." not in re.split(r"[/\\]", rest)  # no climbing out of the root


def _read_inside(path: str, root: str | os.PathLike | None) -> bytes:
    """The bytes of `path` if it is a regular file inside `root`, else `_PathNotAllowed`."""
    if root is None:
        raise _PathNotAllowed("no root is given, so only images carried as bytes are read")
    root = os.fspath(root)
    if is_remote(path) or is_remote(root):
        if not (is_remote(path) and is_remote(root) and _url_inside(path, root)):
            raise _PathNotAllowed(f"it is not under {root!r}")
        with xopen(path, "rb", download_config=DownloadConfig()) as file:  # as `datasets.Image` reads a URL
            return file.read()
    # Links are resolved first: one inside the folder may point anywhere.
    real, real_root = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, real_root]) != real_root:
        raise _PathNotAllowed(f"it is not inside {root!r}")
    if not stat.S_ISREG(os.stat(real).st_mode):  # a FIFO would block the worker, a device never end
        raise _PathNotAllowed("it is not a regular file")
    # NOTE: O_NONBLOCK and a second check on the open file: a file swapped for a FIFO since cannot block either.
    with open(os.open(real, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)), "rb") as file:
        if not stat.S_ISREG(os.fstat(file.fileno()).st_mode):
            raise _PathNotAllowed("it is not a regular file")
        return file.read()


def _open(value: Any, root: str | os.PathLike | None) -> PIL.Image.Image:
    """`value` opened lazily (the header read, no pixels decoded), whatever form it comes in."""
    if isinstance(value, PIL.Image.Image):
        return value
    if isinstance(value, (bytes, bytearray, memoryview)):
        value = {"bytes": bytes(value), "path": None}
    elif isinstance(value, (str, os.PathLike)):
        value = {"bytes": None, "path": os.fspath(value)}
    if not isinstance(value, dict):
        raise TypeError(f"cannot decode an image from a {type(value).__name__}")
    data = value.get("bytes")
    if data is None:
        if not value.get("path"):
            raise ValueError("the image has neither bytes nor a path")
        data = _read_inside(value["path"], root)
    return PIL.Image.open(io.BytesIO(data))


def _to_rgb(image: PIL.Image.Image) -> PIL.Image.Image:
    """Any PIL mode -> RGB: transparency is composited on white, 16/32-bit images are scaled to 8 bits."""
    if image.mode == "RGB":
        return image
    if image.mode.startswith("I") or image.mode == "F":  # I, I;16, I;16B, I;16L, F: PIL's convert would clip
        array = np.asarray(image, dtype=np.float32)  # (H, W); float32 is exact for 16-bit values
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


def decode_image(
    value: Any,
    min_size: int = 32,
    max_pixels: int | None = DEFAULT_MAX_IMAGE_PIXELS,
    root: str | os.PathLike | None = None,
) -> tuple[PIL.Image.Image | None, str | None]:
    """
    Decode what a streamed example holds for an image column into an RGB PIL image, never raising for bad data.

    The size is read from the file's header first: an image with more than `max_pixels` pixels is refused before
    any pixel is decoded (PIL's `Image.MAX_IMAGE_PIXELS` semantics, without touching that process-wide setting; an
    image PIL itself refuses as a decompression bomb is `"too_large"` too). Truncated files count as undecodable:
    decoding runs with `PIL.ImageFile.LOAD_TRUNCATED_IMAGES = False` (restored afterwards) and loads the pixels
    fully. EXIF orientation is applied (as `datasets.Image` does).

    A path (a `str`, a path-like, or a dict's `path` when its `bytes` are None) is read only inside `root`: a local
    folder (after resolving links, and only a regular file: never a FIFO, a device or a directory), or a URL prefix
    for remote image folders. Without `root`, only images carried as bytes (or PIL images) are decoded.

    Args:
        value (`PIL.Image.Image`, `dict`, `bytes` or `str`):
            A PIL image, a `{"bytes": ..., "path": ...}` dict (from `datasets.Image(decode=False)`), raw encoded
            bytes, or a path.
        min_size (`int`, *optional*, defaults to 32):
            Images whose shorter side is below this are rejected as `"too_small"`.
        max_pixels (`int`, *optional*, defaults to `DEFAULT_MAX_IMAGE_PIXELS` = 64,000,000):
            Images with more pixels (width x height) are rejected as `"too_large"`; `None` for no limit.
        root (`str` or `os.PathLike`, *optional*):
            Where paths may be read: the image folder being streamed (`veca_hf.data.dataset_root`), or a URL
            prefix (`https://host/images/`, `hf://datasets/org/name@`). Paths elsewhere are `"path_not_allowed"`.

    Returns:
        `tuple`: `(image, None)` with an RGB image, or `(None, reason)` with `reason` `"undecodable"`,
        `"too_small"`, `"too_large"` or `"path_not_allowed"`.
    """
    if min_size < 0:
        raise ValueError(f"`min_size` must be >= 0, got {min_size}.")
    check_max_pixels(max_pixels)
    previous = PIL.ImageFile.LOAD_TRUNCATED_IMAGES
    PIL.ImageFile.LOAD_TRUNCATED_IMAGES = False
    try:
        image = _open(value, root)
        width, height = image.size
        if max_pixels is not None and width * height > max_pixels:
            return None, SKIP_TOO_LARGE
        if min(width, height) < min_size:
            return None, SKIP_TOO_SMALL
        opened = image is not value
        image.load()
        if opened and image.getexif().get(PIL.Image.ExifTags.Base.Orientation) is not None:
            image = PIL.ImageOps.exif_transpose(image)
        return _to_rgb(image), None
    except _PathNotAllowed as why:
        logger.debug(redact_urls(f"Not reading the image path {value!r}: {why}."))
        return None, SKIP_PATH_NOT_ALLOWED
    except PIL.Image.DecompressionBombError:
        return None, SKIP_TOO_LARGE
    except Exception as error:  # NOTE: bad data must never stop the stream: PIL raises many exception types
        path = value.get("path") if isinstance(value, dict) else None
        logger.debug(redact_urls(f"Undecodable image {path!r}: {type(error).__name__}: {error}"))
        return None, SKIP_UNDECODABLE
    finally:
        PIL.ImageFile.LOAD_TRUNCATED_IMAGES = previous
