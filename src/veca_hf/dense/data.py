# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Data for dense fine-tuning: loading the splits, checking columns, one transform for an image and its label or
depth map, the collator that pads a batch, and the label names."""

import io
import json
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
from transformers.utils import logging


logger = logging.get_logger(__name__)

# A column holding each row's position in its split, so that errors raised at batch time can name the sample.
SAMPLE_INDEX_COLUMN = "__sample_index__"


def load_dense_dataset(
    name: str | None = None,
    config_name: str | None = None,
    cache_dir: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
):
    """`datasets.DatasetDict` of a Hub id, a local folder `load_dataset` reads (Parquet files named by split, an
    image folder with metadata), or one `.parquet` file (its `"train"` split); or of Parquet data files given per
    split (`train_file`, `validation_file`: a path, a glob or an fsspec URL such as
    `hf://datasets/org/name@revision/dir/*.parquet`), for Hub copies whose splits or revisions `load_dataset(name)`
    does not find by itself.

    Raises:
        `ValueError`: for neither or both of `name` and the data files.
    """
    from datasets import load_dataset

    data_files = {split: files for split, files in (("train", train_file), ("validation", validation_file)) if files}
    if (name is None) == (not data_files):
        raise ValueError(
            f"Give either --dataset_name ({name!r}) or --train_file/--validation_file ({data_files or None}), "
            "not both and not neither."
        )
    if data_files:
        return load_dataset("parquet", data_files=data_files, cache_dir=cache_dir)
    if name.endswith(".parquet") and Path(name).is_file():
        return load_dataset("parquet", data_files={"train": name}, cache_dir=cache_dir)
    return load_dataset(name, config_name, cache_dir=cache_dir)


@dataclass
class DenseDataArguments:
    """The data flags both dense scripts take (each adds its target's columns): where the splits come from, the image
    column, the resolution and the subsets. `load()` reads the splits."""

    dataset_name: str | None = field(
        default=None, metadata={"help": "A Hub dataset id, a local dataset folder or a .parquet file."}
    )
    train_file: str | None = field(
        default=None,
        metadata={
            "help": "Instead of --dataset_name: the training split's Parquet file(s), a path, glob or fsspec URL "
            "(hf://datasets/org/name@revision/dir/*.parquet)."
        },
    )
    validation_file: str | None = field(
        default=None, metadata={"help": "With --train_file: the validation split's Parquet file(s)."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    image_column_name: str = field(
        default="image", metadata={"help": "The column holding the images.", "aliases": ["--image_column"]}
    )
    shortest_edge: int = field(default=512, metadata={"help": "Images are resized to about this short side."})
    longest_edge: int | None = field(default=None, metadata={"help": "Bound the long side too."})
    train_val_split: float = field(
        default=0.15, metadata={"help": "Fraction of train held out for validation when there is no validation split."}
    )
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many validation images."})

    @property
    def source(self) -> str | None:
        """What the data is, for the model card: the dataset, else the training files."""
        return self.dataset_name or self.train_file

    def load(self, cache_dir: str | None = None):
        """The `DatasetDict` of these flags ([`load_dense_dataset`])."""
        return load_dense_dataset(
            self.dataset_name,
            self.dataset_config_name,
            cache_dir,
            train_file=self.train_file,
            validation_file=self.validation_file,
        )

    def load_splits(self, training_args, target_column: tuple[str, str], cache_dir: str | None = None):
        """`(train, validation)` as [`prepare_splits`] makes them from [`load`], after checking that every split has
        the image column and `target_column` (`(flag, column)`, e.g. `("--depth_column", "depth")`)."""
        dataset = self.load(cache_dir)
        check_columns(dataset, {"--image_column_name": self.image_column_name, target_column[0]: target_column[1]})
        return prepare_splits(
            dataset,
            training_args.do_train,
            training_args.do_eval,
            self.train_val_split,
            self.max_train_samples,
            self.max_eval_samples,
            seed=training_args.seed,
        )


def check_columns(dataset, columns: Mapping[str, str]) -> None:
    """A `ValueError` naming the flag and the column if a split of `dataset` (a `DatasetDict`) lacks a column.

    Args:
        dataset (`datasets.DatasetDict`): the splits to check.
        columns (`Mapping[str, str]`): flag -> column, e.g. `{"--image_column_name": "image"}`.
    """
    for split, table in dataset.items():
        for flag, column in columns.items():
            if column not in table.column_names:
                raise ValueError(
                    f"Column {column!r} ({flag}) not found in the {split!r} split, whose columns are "
                    f"{table.column_names}: set {flag} to the column holding it."
                )


def with_sample_index(dataset):
    """`dataset` (a `Dataset`) with `SAMPLE_INDEX_COLUMN`, each row's index, which `DenseTransform` names in errors."""
    if SAMPLE_INDEX_COLUMN in dataset.column_names:
        return dataset
    return dataset.add_column(SAMPLE_INDEX_COLUMN, list(range(len(dataset))))


def _to_pil(value: Any) -> PIL.Image.Image:
    """A PIL image from what a dataset column holds: an image, `{"bytes", "path"}`, a path, or an array (`(H, W, 3)`,
    `(3, H, W)` or `(H, W)`; floats are read as `[0, 1]`)."""
    if isinstance(value, PIL.Image.Image):
        return value
    if isinstance(value, Mapping) and (value.get("bytes") or value.get("path")):
        return PIL.Image.open(io.BytesIO(value["bytes"]) if value.get("bytes") else value["path"])
    if isinstance(value, (str, os.PathLike)):
        return PIL.Image.open(value)
    array = np.asarray(value)
    if array.ndim == 3 and array.shape[0] in (1, 3) and array.shape[-1] not in (1, 3):
        array = array.transpose(1, 2, 0).squeeze(-1) if array.shape[0] == 1 else array.transpose(1, 2, 0)  # CHW
    if np.issubdtype(array.dtype, np.floating):  # NOTE: float images (e.g. NumPy exports) hold [0, 1]
        if array.size and not 0.0 <= array.min() <= array.max() <= 1.0:
            raise ValueError(
                f"holds floats in [{array.min():g}, {array.max():g}]; an image stored as floats must be in [0, 1] "
                "(store uint8 values as integers)"
            )
        array = (array * 255.0).round().astype(np.uint8)
    return PIL.Image.fromarray(array)


def _to_map(value: Any) -> np.ndarray:
    """A `(H, W)` array from a label or depth map: an image (mode `L`, `P`, `I`, `I;16`, `F`), a nested list or an
    array; `(1, H, W)` and `(H, W, 1)` are squeezed."""
    if isinstance(value, (PIL.Image.Image, Mapping, str, os.PathLike)):
        image = _to_pil(value)
        if len(image.getbands()) != 1:
            raise ValueError(f"has {len(image.getbands())} channels (mode {image.mode}); a map needs one")
        value = np.asarray(image)
    array = np.asarray(value)
    if array.ndim == 3 and 1 in (array.shape[0], array.shape[-1]):
        array = array.squeeze(0 if array.shape[0] == 1 else -1)
    if array.ndim != 2:
        raise ValueError(f"has shape {array.shape}; a map needs (height, width)")
    return array


def _reduce_labels(labels: np.ndarray, ignore_index: int) -> np.ndarray:
    """Label 0 (background) becomes the ignore index, every other label `k` becomes `k - 1`; the ignore index stays
    (transformers' `do_reduce_labels`)."""
    return np.where((labels == 0) | (labels == ignore_index), ignore_index, labels - 1)


class DenseTransform:
    """
    Per-example preprocessing for `datasets.Dataset.with_transform`: each image through the image processor (resized
    to its own size, a multiple of the patch size, not padded), its map checked and resized to the same size by
    nearest neighbour (class indices and depths are never blended), and in training a random horizontal flip of both.

    Args:
        image_processor (`VecaImageProcessor` or `VecaImageProcessorPil`):
            Usually `VecaImageProcessor.for_any_size(...)` (`build_dense_processor`).
        task (`str`):
            `"segmentation"` (the map holds class indices) or `"depth"` (depths; 0 or NaN = no ground truth).
        image_column, target_column (`str`):
            The columns of the images and of their maps.
        num_labels (`int`, *optional*):
            Segmentation: every label must be in `[0, num_labels)` or the ignore index.
        ignore_index (`int`, *optional*, defaults to 255):
            Segmentation: the label of pixels without a class.
        reduce_labels (`bool`, *optional*, defaults to `False`):
            Segmentation: label 0 is background (ignored) and every other label `k` becomes `k - 1` (ADE20K's
            layout), as transformers' `do_reduce_labels`.
        depth_scale (`float`, *optional*, defaults to 1.0):
            Depth: stored values are divided by it (1000 for 16-bit PNGs in millimetres, 256 for KITTI's).
        train (`bool`, *optional*, defaults to `False`):
            Flip image and map together with probability 0.5.
        split (`str`, *optional*, defaults to `"train"`):
            Named in error messages.

    Raises (when a batch is read):
        `ValueError` naming the sample (its index in the split, from `SAMPLE_INDEX_COLUMN` when present) and the
        column: a map whose size differs from its image's, a map that is not single-channel, a label outside
        `[0, num_labels)` other than the ignore index, a depth map without any valid pixel or with negative depths.
    """

    def __init__(
        self,
        image_processor,
        task: str,
        image_column: str,
        target_column: str,
        num_labels: int | None = None,
        ignore_index: int = 255,
        reduce_labels: bool = False,
        depth_scale: float = 1.0,
        train: bool = False,
        split: str = "train",
    ):
        if task not in ("segmentation", "depth"):
            raise ValueError(f"task must be 'segmentation' or 'depth', got {task!r}.")
        if task == "segmentation" and not (num_labels and num_labels > 0):
            raise ValueError(f"Segmentation needs num_labels >= 1, got {num_labels!r}.")
        if not (math.isfinite(depth_scale) and depth_scale > 0):
            raise ValueError(f"depth_scale must be a positive number, got {depth_scale!r}.")
        self.image_processor = image_processor
        self.task = task
        self.image_column, self.target_column = image_column, target_column
        self.num_labels, self.ignore_index, self.reduce_labels = num_labels, ignore_index, reduce_labels
        self.depth_scale = depth_scale
        self.train = train
        self.split = split

    def _sample(self, index: int | None, position: int) -> str:
        return f"sample {index if index is not None else position} of the {self.split!r} split"

    def check_target(self, target: Any, image_size: tuple[int, int], sample: str) -> np.ndarray:
        """The checked map of one sample: int64 class indices (labels reduced if asked) or float32 depths."""
        column = f"column {self.target_column!r}"
        try:
            array = _to_map(target)
        except (ValueError, TypeError, OSError) as error:
            raise ValueError(f"The map of {sample} ({column}) {error}.") from None
        if array.shape != image_size:
            raise ValueError(
                f"The map of {sample} ({column}) is {array.shape[0]}x{array.shape[1]} (height x width) but its image "
                f"is {image_size[0]}x{image_size[1]}: each map must have its image's size."
            )
        if self.task == "depth":
            depth = array.astype(np.float32) / np.float32(self.depth_scale)
            if np.any(depth < 0):
                raise ValueError(
                    f"The depth map of {sample} ({column}) holds negative depths (min {np.nanmin(depth)})."
                )
            valid = np.isfinite(depth) & (depth > 0)
            if not valid.any():
                raise ValueError(
                    f"The depth map of {sample} ({column}) has no valid pixel (all 0 or NaN): drop the sample, or "
                    "check the column and --depth_scale."
                )
            return np.where(valid, depth, 0.0).astype(np.float32)
        if np.issubdtype(array.dtype, np.floating) and not np.all(array == np.round(array)):
            raise ValueError(f"The label map of {sample} ({column}) holds non-integer labels.")
        labels = array.astype(np.int64)
        if self.reduce_labels:
            labels = _reduce_labels(labels, self.ignore_index)
        invalid = (labels != self.ignore_index) & ((labels < 0) | (labels >= self.num_labels))
        if invalid.any():
            raise ValueError(
                f"The label map of {sample} ({column}) holds labels {np.unique(labels[invalid]).tolist()[:10]} "
                f"outside [0, {self.num_labels}) (num_labels={self.num_labels}, ignore index {self.ignore_index}"
                f"{', after --reduce_labels' if self.reduce_labels else ''}): check id2label, --reduce_labels and "
                "--ignore_index."
            )
        return labels

    def __call__(self, batch: dict) -> dict:
        images, targets = batch[self.image_column], batch[self.target_column]
        indices = batch.get(SAMPLE_INDEX_COLUMN, [None] * len(images))
        pixel_values, labels = [], []
        for position, (image, target, index) in enumerate(zip(images, targets, indices, strict=True)):
            sample = self._sample(index, position)
            try:
                image = _to_pil(image).convert("RGB")
            except (ValueError, TypeError) as error:
                raise ValueError(f"The image of {sample} ({self.image_column}) {error}.") from error
            target = self.check_target(target, (image.height, image.width), sample)
            processed = self.image_processor(image, do_pad=False, return_tensors="pt")["pixel_values"][0]  # (3, h, w)
            height, width = processed.shape[-2:]
            dtype = np.float32 if self.task == "depth" else np.int32  # PIL modes F and I: nearest keeps values
            resized = PIL.Image.fromarray(target.astype(dtype)).resize((width, height), PIL.Image.Resampling.NEAREST)
            target = torch.from_numpy(np.asarray(resized).astype(np.float32 if self.task == "depth" else np.int64))
            if self.train and torch.rand(()) < 0.5:
                processed, target = processed.flip(-1), target.flip(-1)
            pixel_values.append(processed)
            labels.append(target)
        return {"pixel_values": pixel_values, "labels": labels}


class DenseCollator:
    """
    Pads a batch of images of different sizes (each a multiple of the patch size) bottom and right to the largest,
    as `VecaImageProcessor(do_pad=True)` does, and returns `pixel_values` `(B, 3, H, W)` (0 in the padding),
    `pixel_mask` `(B, H, W)` (1 = image) and `labels` `(B, H, W)` padded with `label_pad_value`.

    Args:
        label_pad_value (`int` or `float`):
            The ignore index for segmentation (255), 0 ("no ground truth") for depth: the loss and the metrics skip
            padded pixels either way.
    """

    def __init__(self, label_pad_value: float):
        self.label_pad_value = label_pad_value

    def __call__(self, examples: Sequence[dict]) -> dict[str, torch.Tensor]:
        height = max(example["pixel_values"].shape[-2] for example in examples)
        width = max(example["pixel_values"].shape[-1] for example in examples)
        first = examples[0]
        pixel_values = first["pixel_values"].new_zeros(len(examples), first["pixel_values"].shape[0], height, width)
        pixel_mask = torch.zeros(len(examples), height, width, dtype=torch.long)
        labels = None
        if "labels" in first:
            labels = torch.full((len(examples), height, width), self.label_pad_value, dtype=first["labels"].dtype)
        for index, example in enumerate(examples):
            h, w = example["pixel_values"].shape[-2:]
            pixel_values[index, :, :h, :w] = example["pixel_values"]
            pixel_mask[index, :h, :w] = 1
            if labels is not None:
                labels[index, :h, :w] = example["labels"]
        batch = {"pixel_values": pixel_values, "pixel_mask": pixel_mask}
        if labels is not None:
            batch["labels"] = labels
        return batch


def resolve_id2label(
    id2label_file: str | None,
    dataset_name: str | None,
    train_dataset=None,
    label_column: str = "label",
    reduce_labels: bool = False,
    ignore_index: int = 255,
) -> dict[int, str]:
    """
    The class names: `--id2label_file` (a JSON object `{"0": "wall", ...}`), else `id2label.json` in the dataset's
    local folder or Hub repository, else found in the data: every label the training maps hold (after
    `reduce_labels`, without `ignore_index`), named by its index.

    Args:
        id2label_file (`str`, *optional*): a local JSON file.
        dataset_name (`str`, *optional*): `--dataset_name`, looked into for `id2label.json`.
        train_dataset (`datasets.Dataset`, *optional*): scanned when no file is found.
        label_column, reduce_labels, ignore_index: how its label maps are read (see `DenseTransform`).
    """
    path = id2label_file
    if path is None and dataset_name:
        local = Path(dataset_name)
        if local.exists():
            candidate = (local if local.is_dir() else local.parent) / "id2label.json"
            path = str(candidate) if candidate.is_file() else None
        else:
            try:
                from huggingface_hub import hf_hub_download

                path = hf_hub_download(dataset_name, "id2label.json", repo_type="dataset")
            except Exception as error:  # offline, or no such file: fall back to the data
                logger.info(f"No id2label.json for {dataset_name} ({type(error).__name__}); reading the labels.")
    if path is not None:
        with open(path) as handle:
            return {int(key): str(value) for key, value in json.load(handle).items()}
    if train_dataset is None:
        raise ValueError("No class names: pass --id2label_file (a JSON object {'0': 'name', ...}).")
    logger.warning(
        f"No id2label file: reading all {len(train_dataset)} training label maps for their labels (slow for large "
        "sets; pass --id2label_file)."
    )
    labels = set()
    for row in train_dataset.select_columns([label_column]):
        array = _to_map(row[label_column]).astype(np.int64)
        if reduce_labels:
            array = _reduce_labels(array, ignore_index)
        labels.update(np.unique(array[array != ignore_index]).tolist())
    if not labels or min(labels) < 0:
        raise ValueError(
            f"Cannot take class names from the data (labels {sorted(labels)[:10]}): pass --id2label_file."
        )
    return {index: str(index) for index in range(max(labels) + 1)}


def prepare_splits(
    dataset,
    do_train: bool,
    do_eval: bool,
    train_val_split: float = 0.15,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    seed: int = 0,
) -> tuple[Any, Any]:
    """
    `(train, validation)` of a `DatasetDict` (`None` where not asked for), each with `SAMPLE_INDEX_COLUMN`.

    The validation split is `"validation"`, else a `train_val_split` fraction held out of `"train"` (seeded);
    `max_*_samples` keep a seeded random subset.

    Raises:
        `ValueError`: for `do_eval` without a validation split and `train_val_split == 0`, or `do_train` without a
        `"train"` split.
    """
    if "validation" not in dataset and "train" in dataset and do_eval and train_val_split > 0:
        split = dataset["train"].train_test_split(train_val_split, seed=seed)
        dataset = {**dataset, "train": split["train"], "validation": split["test"]}
    train = validation = None
    if do_train:
        if "train" not in dataset:
            raise ValueError(f"--do_train needs a 'train' split; the dataset has {list(dataset)}.")
        train = dataset["train"]
        if max_train_samples is not None:
            train = train.shuffle(seed=seed).select(range(min(max_train_samples, len(train))))
        train = with_sample_index(train)
    if do_eval:
        if "validation" not in dataset:
            raise ValueError("--do_eval needs a 'validation' split, or --train_val_split > 0 to hold one out.")
        validation = dataset["validation"]
        if max_eval_samples is not None:
            validation = validation.shuffle(seed=seed).select(range(min(max_eval_samples, len(validation))))
        validation = with_sample_index(validation)
    return train, validation


def mean_depth(dataset, depth_column: str, depth_scale: float = 1.0, max_samples: int = 64) -> float:
    """Mean valid depth (finite, > 0) of up to `max_samples` maps of `dataset`: where a new linear depth head
    starts (see `build_depth_model`)."""
    total, count = 0.0, 0
    for target in dataset.select(range(min(max_samples, len(dataset))))[depth_column]:
        depth = _to_map(target).astype(np.float64) / depth_scale
        valid = np.isfinite(depth) & (depth > 0)
        total, count = total + float(depth[valid].sum()), count + int(valid.sum())
    return total / count if count else 1.0
