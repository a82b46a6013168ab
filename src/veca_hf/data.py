# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Streaming image data for distillation: loading, robust decoding, transforms, a deterministic stream, collate.

The pieces, in the order a training script uses them:

1. `load_image_dataset` opens a local image folder, parquet shards, webdataset tars or a Hub dataset as a streamed
   `datasets.IterableDataset`; `detect_image_column` finds the image column.
2. `build_transform` derives the image transform from an image processor's settings, in torchvision transforms v2
   (train: resize the short side, random crop, flip, TrivialAugmentWide, as in the paper; eval: resize + centre
   crop; both normalised with the processor's mean/std). `VecaImageProcessorPil.for_resolution(r)` gives the
   paper's settings at crop `r` (short side `r * 288 / 256`).
3. `ImageStream` turns the dataset into a per-epoch, per-rank stream of transformed tensors. It is exactly
   reproducible: replaying the same epoch gives bit-identical tensors, which is what exact resume relies on
   (rebuild the stream and skip, before decoding, the samples already consumed: `resume_plan`, `set_skip`).
4. `collate_images` batches it and counts the images that could not be used; `resize_batch` downsizes a batch for
   per-step multi-resolution training.

```python
from torch.utils.data import DataLoader
from veca_hf import VecaImageProcessorPil
from veca_hf.data import ImageStream, build_transform, collate_images, detect_image_column, load_image_dataset

dataset = load_image_dataset("path/to/images")
processor = VecaImageProcessorPil.for_resolution(256)  # what the trained model will be saved with
stream = ImageStream(dataset, detect_image_column(dataset), build_transform(processor, train=True), seed=0)
loader = DataLoader(stream, batch_size=64, num_workers=4, collate_fn=collate_images,
                    generator=torch.Generator().manual_seed(0))  # keeps the global RNG out of it
for epoch in range(num_epochs):
    stream.set_epoch(epoch)
    for batch in loader:  # batch["pixel_values"]: (B', 3, 256, 256), B' = 64 - batch["num_skipped"]
        ...
```

Shapes: `B` batch, `H`/`W` image height/width, `r` resolution.
"""

import glob
import os
import tarfile
from collections import Counter
from collections.abc import Sequence
from typing import Any

import datasets
import numpy as np
import PIL.Image
import PIL.ImageFile
import torch
import torch.nn.functional as F
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.distributed import split_dataset_by_node
from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder
from huggingface_hub.utils import HFValidationError, validate_repo_id
from torchvision.transforms import v2
from transformers.image_processing_utils import BaseImageProcessor
from transformers.image_utils import PILImageResampling, pil_torch_interpolation_mapping
from transformers.utils import logging

from .image_processing_pil_veca import VecaImageProcessorPil


logger = logging.get_logger(__name__)

__all__ = [
    "ImageStream",
    "build_transform",
    "collate_images",
    "decode_image",
    "detect_image_column",
    "find_broken_shards",
    "infinite_batches",
    "load_image_dataset",
    "resize_batch",
    "resume_plan",
]

IMAGE_COLUMN_NAMES = ("image", "img", "jpg", "jpeg", "png", "webp")
SKIP_UNDECODABLE = "undecodable"
SKIP_TOO_SMALL = "too_small"

_IMAGE_EXTENSIONS = frozenset(extension.lower() for extension in ImageFolder.EXTENSIONS)
_GLOB_CHARACTERS = ("*", "?", "[")
_SHARD_EXTENSIONS = {"parquet": ".parquet", "webdataset": ".tar"}


# ----------------------------------------------------------------------------------------------------------------
# Loading
# ----------------------------------------------------------------------------------------------------------------


def _builder_for_files(files: list[str], source: str) -> str:
    """The packaged `datasets` builder for a list of local files: parquet, then webdataset tars, then images."""
    extensions = {os.path.splitext(file)[1].lower() for file in files}
    if ".parquet" in extensions:
        return "parquet"
    if ".tar" in extensions:
        return "webdataset"
    if extensions & _IMAGE_EXTENSIONS:
        return "imagefolder"
    raise ValueError(
        f"{source!r} holds no image, parquet or webdataset (.tar) files (found extensions: {sorted(extensions)})."
    )


def _check_tar(file: str) -> None:
    """Raise if a tar file is cut short: a member's data past the end of the file, or no end-of-archive blocks."""
    size = os.path.getsize(file)
    end = 0
    with tarfile.open(file, mode="r:") as tar:
        for member in tar:
            end = member.offset_data + member.size
            if end > size:
                raise tarfile.ReadError(
                    f"member {member.name!r} is cut off ({size - member.offset_data} of {member.size} bytes)"
                )
    if size < end + 2 * tarfile.BLOCKSIZE:  # a complete archive ends with two zero blocks
        raise tarfile.ReadError("no end-of-archive marker (the file is cut short)")


def find_broken_shards(files: Sequence[str]) -> dict[str, str]:
    """
    Local parquet and webdataset tar shards that cannot be read to the end, without reading their data.

    A parquet shard must have its footer (`pyarrow.parquet.read_metadata`); a tar shard must hold every member's
    bytes and end with the end-of-archive blocks. Other files are not checked. Truncation (a copy or download cut
    short, a disk failure) is caught; corrupt bytes inside a shard are not (they fail later, see `ImageStream`).

    Args:
        files (`Sequence[str]`): local file paths.

    Returns:
        `dict[str, str]`: each broken file and why.
    """
    import pyarrow.parquet

    broken = {}
    for file in files:
        extension = os.path.splitext(file)[1].lower()
        try:
            if extension == ".parquet":
                pyarrow.parquet.read_metadata(file)
            elif extension == ".tar":
                _check_tar(file)
        except Exception as error:  # NOTE: pyarrow and tarfile raise several types for a damaged file
            broken[file] = f"{type(error).__name__}: {error}"
    return broken


def _broken_shards_to_skip(files: list[str], builder: str, source: str, broken_shards: str) -> set[str]:
    """The broken shards among `files` (skipped with a warning naming them), or a ValueError with `"error"`."""
    if builder not in _SHARD_EXTENSIONS:
        return set()
    broken = find_broken_shards([f for f in files if f.lower().endswith(_SHARD_EXTENSIONS[builder])])
    if not broken:
        return set()
    listing = "; ".join(f"{file} ({why})" for file, why in broken.items())
    if broken_shards == "error":
        raise ValueError(
            f"{len(broken)} shard(s) of {source!r} cannot be read: {listing}. Repair or remove them, or skip them "
            "with --broken_shards skip."
        )
    logger.warning(f"Skipping {len(broken)} broken shard(s) of {source!r} (--broken_shards skip): {listing}.")
    return set(broken)


def _looks_like_hub_id(name: str) -> bool:
    """`namespace/name` or `name` as the Hub spells dataset ids (local-looking paths are never Hub ids)."""
    if name.startswith((".", "/", "~")) or "\\" in name:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def load_image_dataset(
    dataset_name: str,
    dataset_config_name: str | None = None,
    split: str = "train",
    streaming: bool = True,
    broken_shards: str = "skip",
) -> datasets.IterableDataset:
    """
    Open an image dataset, streamed by default, from a local folder, local shards or the Hub.

    What `dataset_name` may be, and the `datasets` builder used for it:

    - a local directory: scanned recursively; if it holds parquet files the `"parquet"` builder is used, else if it
      holds `.tar` files the `"webdataset"` builder, else if it holds images the `"imagefolder"` builder. All three
      get `data_dir=dataset_name`, so the usual `datasets` split inference applies (files or folders named
      `train`/`validation`/`test` form those splits; anything else is `train`).
    - a glob (`"shards/*.parquet"`, `"tars/*.tar"`, `"images/**/*.jpg"`) or a single local file: the matching files,
      sorted, become the split `split` (`data_files={split: files}`), with the builder chosen as above.
    - anything else that is a valid Hub dataset id: `datasets.load_dataset(dataset_name, dataset_config_name,
      split=split, streaming=streaming)`.

    NOTE: a streamed image folder is a single shard whatever its file count, so several ranks split it example by
    example; parquet and tar shards are split file by file, so write at least as many shards as ranks x workers.
    Webdataset columns are named after the file extensions inside the tars (`"jpg"`, `"png"`, `"cls"`, plus
    `"__key__"` and `"__url__"`).

    Args:
        dataset_name (`str`):
            A local directory, glob or file, or a Hub dataset id.
        dataset_config_name (`str`, *optional*):
            The Hub dataset configuration; ignored (with a warning) for local data.
        split (`str`, *optional*, defaults to `"train"`):
            The split to load.
        streaming (`bool`, *optional*, defaults to `True`):
            Stream the data (a `datasets.IterableDataset`). `False` returns a map-style `datasets.Dataset`.
        broken_shards (`str`, *optional*, defaults to `"skip"`):
            What to do with local parquet or tar shards that are cut short (`find_broken_shards`): `"skip"` them
            with a warning naming each, or `"error"`: raise a `ValueError` naming them. Hub datasets are not checked.

    Returns:
        `datasets.IterableDataset` (or `datasets.Dataset` when `streaming=False`).

    Raises:
        `ValueError`: if `dataset_name` is neither an existing local path nor a valid Hub id, if the local
        folder or glob holds no usable files, or if a shard is broken and `broken_shards="error"`.
    """
    if broken_shards not in ("skip", "error"):
        raise ValueError(f"--broken_shards {broken_shards!r} is not one of 'skip', 'error'.")
    if not dataset_name:
        raise ValueError("`dataset_name` is empty: pass a local folder, glob or file, or a Hub dataset id.")
    path = os.path.expanduser(dataset_name)
    is_glob = any(character in path for character in _GLOB_CHARACTERS)
    is_local = is_glob or os.path.exists(path)
    if is_local and dataset_config_name is not None:
        logger.warning(f"`dataset_config_name={dataset_config_name!r}` is ignored for local data {dataset_name!r}.")

    if os.path.isdir(path):
        files = [file for file in glob.glob(os.path.join(path, "**", "*"), recursive=True) if os.path.isfile(file)]
        if not files:
            raise ValueError(f"The folder {dataset_name!r} is empty.")
        builder = _builder_for_files(files, dataset_name)
        broken = _broken_shards_to_skip(files, builder, dataset_name, broken_shards)
        if broken:  # the same split inference as data_dir, minus the broken shards
            data_files = DataFilesDict.from_patterns(get_data_patterns(path), path)
            extension = _SHARD_EXTENSIONS[builder]
            broken = {os.path.abspath(file) for file in broken}
            data_files = {
                name: [f for f in split_files if f.lower().endswith(extension) and os.path.abspath(f) not in broken]
                for name, split_files in data_files.items()
            }
            if not data_files.get(split):
                raise ValueError(f"Every {extension} shard of split {split!r} in {dataset_name!r} is broken.")
            return datasets.load_dataset(builder, data_files=data_files, split=split, streaming=streaming)
        logger.info(f"Loading {dataset_name!r} with the {builder!r} builder (data_dir), split {split!r}.")
        return datasets.load_dataset(builder, data_dir=path, split=split, streaming=streaming)

    if is_local:
        files = sorted(file for file in glob.glob(path, recursive=True) if os.path.isfile(file))
        if not files:
            raise ValueError(f"No files match {dataset_name!r}.")
        builder = _builder_for_files(files, dataset_name)
        broken = _broken_shards_to_skip(files, builder, dataset_name, broken_shards)
        files = [file for file in files if file not in broken]
        if not files:
            raise ValueError(f"Every shard matching {dataset_name!r} is broken.")
        logger.info(f"Loading {len(files)} files matching {dataset_name!r} with the {builder!r} builder as {split!r}.")
        return datasets.load_dataset(builder, data_files={split: files}, split=split, streaming=streaming)

    if _looks_like_hub_id(dataset_name):
        logger.info(f"Loading the Hub dataset {dataset_name!r} (config {dataset_config_name!r}), split {split!r}.")
        return datasets.load_dataset(dataset_name, dataset_config_name, split=split, streaming=streaming)

    raise ValueError(
        f"{dataset_name!r} does not exist locally and is not a valid Hub dataset id: pass an image folder, a folder "
        "or glob of parquet or webdataset .tar shards, or a Hub dataset id such as 'namespace/name'."
    )


def _first_example_columns(dataset) -> list[str]:
    """Column names of a dataset whose features are unknown (some streamed Hub datasets): peek at one example."""
    for example in dataset.take(1) if hasattr(dataset, "take") else dataset:
        return list(example)
    return []


def detect_image_column(dataset, image_column: str | None = None) -> str:
    """
    Find the column of a dataset that holds the images.

    Args:
        dataset (`datasets.IterableDataset` or `datasets.Dataset`):
            The dataset.
        image_column (`str`, *optional*):
            The column asked for (e.g. `--image_column`); it is checked and returned as is.

    Returns:
        `str`: `image_column` if given, else the first column whose feature is `datasets.Image`, else the first of
        `"image"`, `"img"`, `"jpg"`, `"jpeg"`, `"png"`, `"webp"` that is present.

    Raises:
        `ValueError`: if `image_column` is absent, or if no column qualifies; the message lists the columns.
    """
    features = dataset.features
    columns = list(features) if features is not None else (dataset.column_names or _first_example_columns(dataset))
    if image_column is not None:
        if image_column not in columns:
            raise ValueError(f"Image column {image_column!r} not found; the dataset has the columns {columns}.")
        return image_column
    if features is not None:
        for name, feature in features.items():
            if isinstance(feature, datasets.Image):
                return name
    for name in IMAGE_COLUMN_NAMES:
        if name in columns:
            return name
    raise ValueError(
        f"Could not find an image column among the dataset's columns {columns}: pass it with `--image_column`."
    )


# ----------------------------------------------------------------------------------------------------------------
# Transforms
# ----------------------------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------


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
        logger.debug(f"Undecodable image {path!r}: {type(error).__name__}: {error}")
        return None, SKIP_UNDECODABLE
    finally:
        PIL.ImageFile.LOAD_TRUNCATED_IMAGES = previous


# ----------------------------------------------------------------------------------------------------------------
# The stream
# ----------------------------------------------------------------------------------------------------------------


def _sample_seed(*keys: int) -> int:
    """A well-mixed 64-bit seed from non-negative ints (seed, epoch, rank, stream, index)."""
    return int(np.random.SeedSequence(list(keys)).generate_state(1, dtype=np.uint64)[0])


class ImageStream(torch.utils.data.IterableDataset):
    """
    The deterministic per-epoch, per-rank stream of transformed images, for a `torch.utils.data.DataLoader`.

    Every epoch the dataset is rebuilt as `shuffle(seed, buffer_size)` -> `set_epoch(epoch)` ->
    `split_dataset_by_node(rank, world_size)`, so each rank reads a disjoint part and all ranks together read
    everything once; the iterator ends at the end of the epoch. The image column is cast to
    `datasets.Image(decode=False)`, so encoded bytes travel through the shuffle buffer and `decode_image` decodes
    them (bad files are reported instead of crashing the pipeline).

    DataLoader workers: when the rank's stream has at least as many shards as workers, `datasets` hands each worker
    whole shards. Otherwise (a streamed image folder is a single shard) every worker walks the rank's whole stream
    of *undecoded* examples and decodes only every `num_workers`-th one, so all workers decode and none duplicates.

    Random augmentation is seeded per sample from `(seed, epoch, rank, stream, index)`, where `index` counts the
    examples of the rank's stream (of the worker's stream when workers own whole shards, then `stream` is the worker
    id + 1), inside `torch.random.fork_rng`: the tensors depend only on those keys, not on the process's RNG, which
    they leave untouched. Replaying an epoch therefore reproduces it bit for bit, which is what exact resume needs
    (rebuild the stream, skip what was consumed), as long as `num_workers` is unchanged.

    Resuming mid-epoch: `set_skip` makes each worker pass over its first samples without decoding or augmenting
    them (the undecoded bytes are still read, and go through the shuffle buffer); `resume_plan` computes the counts
    from the batches each worker had delivered. A sample's index, hence its augmentation, does not change.

    NOTE: do not pass a DataLoader over this stream to `accelerator.prepare` in multi-process runs: with batch
    dispatching off, Accelerate wraps any iterable dataset in `IterableDatasetShard`, which keeps only 1/world_size
    of each rank's (already disjoint) part. Move the batches to `accelerator.device` instead. Ranks may also get a
    different number of batches per epoch (shards differ in size): stop the epoch when any rank runs out.

    Args:
        dataset (`datasets.IterableDataset`):
            The streamed dataset, e.g. from `load_image_dataset`.
        image_column (`str`):
            The image column (see `detect_image_column`); the other columns are dropped.
        transform (`Callable`):
            Maps an RGB PIL image to a tensor, e.g. `build_transform(resolution, train=True)`.
        seed (`int`):
            Seeds the shuffle and the augmentation; the same on every rank.
        shuffle_buffer_size (`int`, *optional*, defaults to 1000):
            Size of the `datasets` shuffle buffer (also shuffles the shard order each epoch); 0 keeps the stored
            order (for evaluation).
        rank (`int`, *optional*, defaults to 0):
            This process's rank.
        world_size (`int`, *optional*, defaults to 1):
            The number of processes.
        min_image_size (`int`, *optional*, defaults to 32):
            Images with a shorter side below this are skipped as `"too_small"`.

    Yields:
        `dict`: `{"pixel_values": tensor, "source": str, "worker": int}` with the transform's output (e.g.
        `(3, r, r)`), the example's file path (or a stream position when it has none) and the DataLoader worker id
        (0 without workers), or `{"pixel_values": None, "skipped": reason, "source": str, "worker": int}` for an
        unusable image (`"undecodable"` or `"too_small"`), so that the count survives worker processes. Batch with
        `collate_images`.
    """

    def __init__(
        self,
        dataset: datasets.IterableDataset,
        image_column: str,
        transform,
        *,
        seed: int,
        shuffle_buffer_size: int = 1000,
        rank: int = 0,
        world_size: int = 1,
        min_image_size: int = 32,
    ):
        if not isinstance(dataset, datasets.IterableDataset):
            raise ValueError(f"`dataset` must be a streamed `datasets.IterableDataset`, got {type(dataset).__name__}.")
        if seed < 0:
            raise ValueError(f"`seed` must be >= 0, got {seed}.")
        if shuffle_buffer_size < 0:
            raise ValueError(f"`shuffle_buffer_size` must be >= 0, got {shuffle_buffer_size}.")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"Need 0 <= rank < world_size, got rank={rank}, world_size={world_size}.")
        if min_image_size < 0:
            raise ValueError(f"`min_image_size` must be >= 0, got {min_image_size}.")
        detect_image_column(dataset, image_column)  # raises with the available columns if absent

        dataset = dataset.select_columns([image_column])
        if dataset.features is not None and isinstance(dataset.features[image_column], datasets.Image):
            dataset = dataset.cast_column(image_column, datasets.Image(decode=False))
        self.dataset = dataset
        self.image_column = image_column
        self.transform = transform
        self.seed = seed
        self.shuffle_buffer_size = shuffle_buffer_size
        self.rank = rank
        self.world_size = world_size
        self.min_image_size = min_image_size
        # NOTE: in shared memory (as `datasets` does), so persistent DataLoader workers see `set_epoch` too.
        self._epoch = torch.zeros((), dtype=torch.int64).share_memory_()
        self.skip_samples: tuple[int, ...] | None = None

    @property
    def epoch(self) -> int:
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch that the next iteration streams (its shuffle order and augmentation draws)."""
        if epoch < 0:
            raise ValueError(f"`epoch` must be >= 0, got {epoch}.")
        self._epoch.fill_(epoch)

    def set_skip(self, samples_per_worker: Sequence[int] | None) -> None:
        """
        Skip, before decoding, the first samples of each DataLoader worker's share in the next iterations.

        Set it before creating the DataLoader iterator (workers get a copy then), and reset it with `None` for the
        next epoch.

        Args:
            samples_per_worker (`Sequence[int]` or `None`):
                One count per DataLoader worker (one entry without workers): how many of that worker's samples to
                pass over, e.g. from `resume_plan`. `None` skips nothing.
        """
        if samples_per_worker is not None:
            samples_per_worker = tuple(int(count) for count in samples_per_worker)
            if not samples_per_worker or min(samples_per_worker) < 0:
                raise ValueError(
                    f"`samples_per_worker` must be non-negative counts, one per worker, got {samples_per_worker}."
                )
        self.skip_samples = samples_per_worker

    def _rank_dataset(self, epoch: int) -> datasets.IterableDataset:
        """This rank's part of the epoch: shuffled with the shared seed, then split by node."""
        dataset = self.dataset
        if self.shuffle_buffer_size > 0:
            dataset = dataset.shuffle(seed=self.seed, buffer_size=self.shuffle_buffer_size)
            # NOTE: only on the shuffled copy: `set_epoch(e > 0)` alone would also reorder the shards.
            dataset.set_epoch(epoch)
        if self.world_size > 1:
            dataset = split_dataset_by_node(dataset, rank=self.rank, world_size=self.world_size)
        return dataset

    def _indexed_values(self, dataset: datasets.IterableDataset, num_workers: int, worker_id: int):
        """Yield `(stream, index, value)` for the examples this process (or DataLoader worker) must decode."""
        skip = self.skip_samples[worker_id] if self.skip_samples is not None else 0
        if num_workers > 1 and dataset.num_shards >= num_workers:
            # Inside a worker, iterating a `datasets.IterableDataset` gives this worker whole shards.
            for index, example in enumerate(dataset):
                if index >= skip:
                    yield worker_id + 1, index, example[self.image_column]
            return
        # NOTE: `.iter()` does not split by worker (plain iteration would leave all but one worker idle on a
        # single-shard stream): every worker walks the same undecoded stream and keeps its own round-robin share.
        for index, batch in enumerate(dataset.iter(batch_size=1)):
            if index % num_workers == worker_id and index // num_workers >= skip:
                yield 0, index, batch[self.image_column][0]

    def _transform(self, image: PIL.Image.Image, seed: int) -> torch.Tensor:
        """The transform, drawing from a generator seeded for this sample; the global CPU RNG is restored."""
        with torch.random.fork_rng(devices=[]):
            torch.default_generator.manual_seed(seed)  # NOTE: not torch.manual_seed, which also seeds CUDA
            return self.transform(image)

    def __iter__(self):
        epoch = self.epoch
        worker = torch.utils.data.get_worker_info()
        num_workers, worker_id = (worker.num_workers, worker.id) if worker is not None else (1, 0)
        if self.skip_samples is not None and len(self.skip_samples) != num_workers:
            raise ValueError(
                f"set_skip got {len(self.skip_samples)} counts {self.skip_samples} but the stream runs with "
                f"{num_workers} DataLoader worker(s): resume with the number of workers the checkpoint was written "
                "with."
            )
        values = self._indexed_values(self._rank_dataset(epoch), num_workers, worker_id)
        while True:
            try:
                stream, index, value = next(values)
            except StopIteration:
                return
            except Exception as error:  # NOTE: a shard that breaks mid-read; images never raise (decode_image)
                raise RuntimeError(
                    f"Reading the data stream failed (rank {self.rank}, epoch {epoch}, DataLoader worker {worker_id}) "
                    f"with {type(error).__name__}: {error}. A shard is probably truncated or corrupt (the error above "
                    "may name it; for local shards `veca_hf.data.find_broken_shards` finds cut-short ones): remove or "
                    "repair it, then resume with --resume_from_checkpoint latest."
                ) from error
            # Where the example came from (its file when known), for auditing the data order of a run.
            path = value.get("path") if isinstance(value, dict) else value if isinstance(value, str) else None
            source = path or f"rank{self.rank}/stream{stream}/{index}"
            image, reason = decode_image(value, min_size=self.min_image_size)
            if image is None:
                yield {"pixel_values": None, "skipped": reason, "source": source, "worker": worker_id}
                continue
            pixel_values = self._transform(image, _sample_seed(self.seed, epoch, self.rank, stream, index))
            yield {"pixel_values": pixel_values, "source": source, "worker": worker_id}  # (3, r, r)


def resume_plan(worker_batches: Sequence[int], last_worker: int, batch_size: int) -> tuple[list[int], int]:
    """
    How to restart a DataLoader over an `ImageStream` mid-epoch so that it yields the batch an interrupted one
    would have yielded next, skipping the consumed samples before decoding.

    A DataLoader over an iterable dataset takes batches from its workers in turn (0, 1, ..., W-1, 0, ...; a worker
    that runs out drops out of the cycle), and worker `w`'s `k`-th batch holds its samples `k*B .. (k+1)*B - 1`.
    A fresh DataLoader starts its cycle at worker 0, but the interrupted one would continue after `last_worker`:
    so workers `0..last_worker` replay their last delivered batch, which the caller discards (at most W-1 batches
    are decoded again), and every other consumed batch is skipped undecoded.

    Args:
        worker_batches (`Sequence[int]`):
            The number of batches each worker had delivered in this epoch (one entry without workers).
        last_worker (`int`):
            The worker of the last delivered batch.
        batch_size (`int`):
            The DataLoader's batch size.

    Returns:
        `tuple`: `(samples_per_worker, discard)`: the counts for `ImageStream.set_skip`, and how many batches the new
        DataLoader yields first that were already consumed (discard them).
    """
    num_workers = len(worker_batches)
    if not 0 <= last_worker < num_workers:
        raise ValueError(f"`last_worker`={last_worker} is not one of the {num_workers} worker(s).")
    wraps = last_worker == num_workers - 1  # the interrupted cycle was complete: the next batch is worker 0's
    replayed = [int(not wraps and worker <= last_worker and count > 0) for worker, count in enumerate(worker_batches)]
    return [(count - replay) * batch_size for count, replay in zip(worker_batches, replayed, strict=False)], sum(
        replayed
    )


def infinite_batches(stream: ImageStream, loader_kwargs: dict, seed: int, position: dict, empty_message: str):
    """
    Batches of `stream` forever, epoch after epoch, from `position` on (a resume skips the consumed samples before
    decoding, [`resume_plan`]; the stream is deterministic, so the next batch is the one the interrupted run would
    have drawn).

    `loader_kwargs` are `DataLoader` arguments (`batch_size`, `num_workers` required); each epoch's loader is seeded
    with `seed + epoch`. `position` holds `epoch`, `batches` consumed in it and, from a checkpoint, `worker_batches`
    and `last_worker`; it is updated in place (save it with the checkpoint). A fresh epoch with no batch raises a
    `ValueError` with `empty_message`; one with no decodable image, or a checkpoint written with another number of
    workers, raises one too.
    """
    num_workers, batch_size = max(1, loader_kwargs["num_workers"]), loader_kwargs["batch_size"]
    epoch, consumed = position["epoch"], position["batches"]
    if consumed and "worker_batches" in position:
        if len(position["worker_batches"]) != num_workers:
            raise ValueError(
                f"The checkpoint was written with {len(position['worker_batches'])} DataLoader worker(s) per process "
                f"and this run has --dataloader_num_workers {loader_kwargs['num_workers']}: resume with the same "
                "number of workers."
            )
        skip, discard = resume_plan(position["worker_batches"], position["last_worker"], batch_size)
    else:  # a fresh epoch, or a checkpoint without per-worker positions: decode and discard the consumed batches
        skip, discard = None, consumed
    while True:
        stream.set_epoch(epoch)
        stream.set_skip(skip)
        worker_batches = [count // batch_size for count in skip] if skip else [0] * num_workers
        # A DataLoader without a generator would draw its workers' seeds from the global RNG.
        loader = torch.utils.data.DataLoader(
            stream, generator=torch.Generator().manual_seed(seed + epoch), **loader_kwargs
        )
        position.update(epoch=epoch, batches=consumed, worker_batches=worker_batches, last_worker=num_workers - 1)
        batches, usable = 0, 0
        for index, batch in enumerate(loader):
            worker_batches[batch["worker"]] += 1
            position["last_worker"] = batch["worker"]
            if index < discard:
                continue
            position["batches"] += 1
            batches += 1
            usable += 0 if batch["pixel_values"] is None else len(batch["pixel_values"])
            yield batch
        if consumed == 0 and batches == 0:
            raise ValueError(empty_message)
        if consumed == 0 and usable == 0:  # the caller would wait forever for a usable batch
            raise ValueError(
                "The training stream has no decodable images in this process's share of the data "
                f"({batches} batch(es), every image skipped as undecodable or smaller than --min_image_size)."
            )
        epoch, consumed, skip, discard = epoch + 1, 0, None, 0


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
