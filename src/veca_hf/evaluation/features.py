# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Frozen-backbone features for the probes: the backbones, their token layouts, and a feature cache.

`ProbeModel` wraps a checkpoint (loaded on first use, so a fully cached run never loads weights);
`extract_features` turns any supported backbone's output into `(global, patches)`:

    VECA            [ core_1 ... core_C | patch_(0,0) ... patch_(Hp-1,Wp-1) ]   global = core_1
    DINOv2 / v3     [ CLS | register_1 ... register_R | patch_(0,0) ... ]        global = CLS

`compute_features` runs it over an `ImageSet`; `FeatureCache` computes features once per (model, budget,
resolution, image set) and keeps them as safetensors files. `global_feature_cosine` compares a student's global
features with its teacher's on the same images.

Shape legend: N images, B batch, C active cores, Hp x Wp patch grid, D hidden size, R resolution (crop side).
"""

import math
import os
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from transformers import AutoConfig, AutoModel
from transformers.utils import logging

from ..cpu.hardware import warn_if_slow_bf16
from .datasets import ImageSet, content_hash, preprocess_image


logger = logging.get_logger(__name__)

__all__ = [
    "FeatureCache",
    "ProbeModel",
    "check_resolutions",
    "compute_features",
    "extract_features",
    "global_feature_cosine",
]

DINO_MODEL_TYPES = ("dinov2", "dinov2_with_registers", "dinov3_vit")
_CACHE_FORMAT = "2"  # bump when the preprocessing or the stored layout changes (2: the processor's geometry)


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


def backbone_of(model: nn.Module) -> nn.Module:
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
        outputs = backbone_of(model)(pixel_values, num_core_tokens=num_core_tokens, return_dict=True)
        num_prefix = outputs.core_positions.shape[1]
    else:
        if num_core_tokens is not None:
            raise ValueError(f"num_core_tokens only applies to VECA models, not to {config.model_type}.")
        outputs = backbone_of(model)(pixel_values=pixel_values)
        num_prefix = _num_prefix_tokens(config)
    tokens = outputs.last_hidden_state  # (B, prefix + Hp * Wp, D)
    if tokens.shape[1] != num_prefix + grid[0] * grid[1]:
        raise ValueError(
            f"Expected {num_prefix} + {grid[0]} x {grid[1]} tokens for {height}x{width} pixels, got {tokens.shape[1]}."
        )
    return tokens[:, 0], tokens[:, num_prefix:].reshape(batch_size, *grid, -1)


def global_feature_cosine(student: torch.Tensor, teacher: torch.Tensor) -> dict[str, float]:
    r"""
    How well a student's global feature follows its teacher's on the same images (e.g. VECA's core 1 vs DINOv2's
    CLS, both after their final norm, equal widths).

    `cosine` is the mean per-image cosine similarity, the quantity the global distillation loss maximises.
    `centred_cosine` subtracts each model's mean feature over the images first: features that share a large
    common direction have a high raw cosine whatever they say about the individual image, so this one shows whether
    the student follows the teacher's image-to-image variation.

    Args:
        student (`torch.Tensor` of shape `(N, D)`): the student's global features.
        teacher (`torch.Tensor` of shape `(N, D)`): the teacher's, for the same images in the same order.

    Returns:
        `{"cosine": float, "centred_cosine": float, "num_images": int}`.
    """
    if student.shape != teacher.shape or student.ndim != 2:
        raise ValueError(f"Need two (N, D) feature matrices of equal shape, got {tuple(student.shape)} and "
                         f"{tuple(teacher.shape)}.")  # fmt: skip
    student, teacher = student.double(), teacher.double()
    cosine = F.cosine_similarity(student, teacher, dim=-1, eps=1e-8)
    centred = F.cosine_similarity(student - student.mean(0), teacher - teacher.mean(0), dim=-1, eps=1e-8)
    return {"cosine": float(cosine.mean()), "centred_cosine": float(centred.mean()), "num_images": len(student)}


def patch_feature_cosine(student: torch.Tensor, teacher: torch.Tensor) -> dict[str, float]:
    r"""
    How well a student's patch features follow its teacher's: [`global_feature_cosine`] over every patch of every
    image (`(N, Hp, Wp, D)` each, same grid), i.e. the mean per-patch cosine, raw and centred (each model's mean
    patch feature subtracted).
    """
    if student.shape != teacher.shape or student.ndim < 2:
        raise ValueError(f"Need two patch-feature tensors of equal shape, got {tuple(student.shape)} and "
                         f"{tuple(teacher.shape)}.")  # fmt: skip
    result = global_feature_cosine(student.flatten(0, -2), teacher.flatten(0, -2))
    return {
        "cosine": result["cosine"],
        "centred_cosine": result["centred_cosine"],
        "num_patches": result["num_images"],
    }


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
        return content_hash(*parts)[:16]

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
            if self.dtype == torch.bfloat16:
                warn_if_slow_bf16(self.device, f"{self.name} in bfloat16")
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
        from ..model import modeling_veca

        return content_hash(Path(modeling_veca.__file__).read_bytes())
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
