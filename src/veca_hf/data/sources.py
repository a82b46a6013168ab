# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Finding the data: local image folders, parquet and webdataset shards, globs and Hub datasets, opened as streamed
`datasets` datasets; broken shards; the image column."""

import glob
import os
import tarfile
from collections.abc import Sequence

import datasets
from datasets.data_files import DataFilesDict, get_data_patterns
from datasets.packaged_modules.imagefolder.imagefolder import ImageFolder
from huggingface_hub.utils import HFValidationError, validate_repo_id
from transformers.utils import logging


logger = logging.get_logger(__name__)

IMAGE_COLUMN_NAMES = ("image", "img", "jpg", "jpeg", "png", "webp")

_IMAGE_EXTENSIONS = frozenset(extension.lower() for extension in ImageFolder.EXTENSIONS)
_GLOB_CHARACTERS = ("*", "?", "[")
_SHARD_EXTENSIONS = {"parquet": ".parquet", "webdataset": ".tar"}


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
