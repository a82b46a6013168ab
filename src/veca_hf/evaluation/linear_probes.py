# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Linear probes on frozen features (the protocol of the paper, arXiv 2605.12491; see docs/evaluation.md).

`train_linear_classifier` trains a linear layer on the global feature (SGD, momentum 0.9, cosine lr, the paper's lr
0.05). The dense probes share one body (`LinearDenseProbe`, `_train_dense_probe`): a linear layer on `[patch; global]`
per patch (AdamW lr 0.01, wd 1e-4, poly schedule), its outputs bilinearly upsampled to the label map's resolution;
`train_linear_segmenter` trains K class logits with cross-entropy (`ignore_index=255`), `train_linear_depth_estimator`
one depth with a squared error over the pixels that have ground truth. `run_linear_probes` runs them for every model,
resolution and budget and scores them with the metric modules of `veca_hf.metrics` (top-1 accuracy, mIoU, depth
RMSE / AbsRel / delta1), the same definitions `Trainer` fine-tuning uses; with `ProbeSettings.knn_k > 0` it also
scores a cosine k-NN classifier (`knn.knn_classify`), and every classification result carries a 95% Wilson interval
(`statistics.wilson_interval`) and its per-image predictions.

Shape legend: N images, B batch, Hp x Wp patch grid, D hidden size, K classes (or outputs), R resolution (crop side),
Hm x Wm label (mask or depth) map.
"""

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from transformers.utils import logging

from ..arguments import canonical_dtype
from ..model.modeling_veca_dense import masked_depth_mse
from .datasets import IGNORE_INDEX, ImageSet
from .features import FeatureCache, ProbeModel, check_resolutions
from .knn import knn_classify
from .statistics import wilson_interval


logger = logging.get_logger(__name__)

__all__ = [
    "LinearClassifierProbe",
    "LinearDenseProbe",
    "LinearDepthProbe",
    "LinearSegmentationProbe",
    "ProbeSettings",
    "predict_classes",
    "predict_depth",
    "predict_segmentation",
    "run_linear_probes",
    "train_linear_classifier",
    "train_linear_depth_estimator",
    "train_linear_segmenter",
]


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


class LinearDenseProbe(nn.Module):
    """`Linear([patch / patch_scale; global / global_scale])` per patch: `(B, Hp, Wp, D), (B, D) -> (B, K, Hp, Wp)`.
    The paper's dense probe, shared by segmentation (K class logits) and depth (K = 1)."""

    def __init__(self, hidden_size: int, num_outputs: int):
        super().__init__()
        self.register_buffer("patch_scale", torch.tensor(1.0))
        self.register_buffer("global_scale", torch.tensor(1.0))
        self.linear = nn.Linear(2 * hidden_size, num_outputs)

    def forward(self, patches: torch.Tensor, global_features: torch.Tensor) -> torch.Tensor:
        global_map = global_features[:, None, None, :].expand(*patches.shape[:3], -1)  # (B, Hp, Wp, D)
        features = torch.cat((patches.float() / self.patch_scale, global_map.float() / self.global_scale), dim=-1)
        return self.linear(features).permute(0, 3, 1, 2)  # (B, K, Hp, Wp)


class LinearSegmentationProbe(LinearDenseProbe):
    """The dense probe with one logit per class: `(B, Hp, Wp, D), (B, D) -> (B, K, Hp, Wp)`."""

    def __init__(self, hidden_size: int, num_classes: int):
        super().__init__(hidden_size, num_classes)


class LinearDepthProbe(LinearDenseProbe):
    """The dense probe with one output, the depth: `(B, Hp, Wp, D), (B, D) -> (B, 1, Hp, Wp)`."""

    def __init__(self, hidden_size: int):
        super().__init__(hidden_size, 1)


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
    The paper's classification probe: a linear layer on the frozen global feature, SGD with momentum and a cosine
    learning rate, deterministic for a given `seed`.

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


def _upsampled(
    probe: LinearDenseProbe, patches: torch.Tensor, global_features: torch.Tensor, size: tuple[int, int]
) -> torch.Tensor:
    """The probe's outputs bilinearly upsampled to the label map: `(B, Hp, Wp, D), (B, D) -> (B, K, *size)`."""
    outputs = probe(patches, global_features)  # (B, K, Hp, Wp)
    return F.interpolate(outputs, size=size, mode="bilinear", align_corners=False)


def _train_dense_probe(
    probe: LinearDenseProbe,
    patches: torch.Tensor,
    global_features: torch.Tensor,
    targets: torch.Tensor,
    loss_function: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    steps: int,
    batch_size: int,
    learning_rate: float,
    weight_decay: float,
    poly_power: float,
    rescale: bool,
    generator: torch.Generator,
    device: str | torch.device,
) -> LinearDenseProbe:
    """The dense probes' training: AdamW with a poly learning rate `lr * (1 - t / steps) ** poly_power`, outputs
    upsampled to the targets `(N, Hm, Wm)`, `loss_function(outputs (B, K, Hm, Wm), targets (B, Hm, Wm))`."""
    if rescale:
        probe.patch_scale, probe.global_scale = _rms(patches), _rms(global_features)
    probe.to(device)
    optimizer = torch.optim.AdamW(probe.parameters(), lr=learning_rate, weight_decay=weight_decay)
    for step, indices in enumerate(_batches(len(patches), batch_size, steps, generator)):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate * (1 - step / steps) ** poly_power
        target = targets[indices].to(device)  # (B, Hm, Wm)
        outputs = _upsampled(
            probe, patches[indices].to(device), global_features[indices].to(device), target.shape[-2:]
        )
        loss = loss_function(outputs, target)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    return probe.eval()


@torch.no_grad()
def _predict_dense(
    probe: LinearDenseProbe,
    patches: torch.Tensor,
    global_features: torch.Tensor,
    size: tuple[int, int],
    batch_size: int,
) -> Iterator[torch.Tensor]:
    """The upsampled outputs `(b, K, *size)`, batch after batch, on the probe's device."""
    device = probe.linear.weight.device
    for start in range(0, len(patches), batch_size):
        batch = slice(start, start + batch_size)
        yield _upsampled(probe, patches[batch].to(device), global_features[batch].to(device), size)


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
    The paper's dense probe: a linear layer on each patch feature concatenated with the global feature, whose
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
        steps (`int`, *optional*, defaults to 4000): optimisation steps (the paper gives none).
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

    def loss_function(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:  # (B, K, Hm, Wm), (B, Hm, Wm)
        return F.cross_entropy(logits, target.long(), ignore_index=ignore_index)

    return _train_dense_probe(
        probe, patches, global_features, masks, loss_function, steps, batch_size, learning_rate, weight_decay,
        poly_power, rescale, generator, device,
    )  # fmt: skip


def predict_segmentation(
    probe: LinearSegmentationProbe,
    patches: torch.Tensor,
    global_features: torch.Tensor,
    size: tuple[int, int],
    batch_size: int = 16,
) -> torch.Tensor:
    """Per-pixel arg-max class at `size`: `(N, Hp, Wp, D), (N, D) -> (N, *size)` `uint8` on the CPU."""
    logits = _predict_dense(probe, patches, global_features, size, batch_size)  # (b, K, *size) each
    return torch.cat([batch.argmax(1).to("cpu", torch.uint8) for batch in logits])


def _valid_depth(depths: torch.Tensor) -> torch.Tensor:
    """Pixels with ground truth: finite and positive depth (0 and NaN mark the others)."""
    return torch.isfinite(depths) & (depths > 0)


def _masked_squared_error(outputs: torch.Tensor, depths: torch.Tensor) -> torch.Tensor:
    """The probe's depth loss: `(B, 1, Hm, Wm), (B, Hm, Wm) -> ()`, the fine-tuning heads' [`masked_depth_mse`]."""
    return masked_depth_mse(outputs[:, 0], depths)


def train_linear_depth_estimator(
    patches: torch.Tensor,
    global_features: torch.Tensor,
    depths: torch.Tensor,
    steps: int = 4000,
    batch_size: int = 8,
    learning_rate: float = 0.01,
    weight_decay: float = 1e-4,
    poly_power: float = 0.9,
    rescale: bool = True,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> LinearDepthProbe:
    r"""
    The paper's dense probe for depth: the segmentation probe's linear layer on each patch feature concatenated with
    the global feature, with one output (the depth) bilinearly upsampled to the depth map's resolution; AdamW and a
    poly learning rate, as `train_linear_segmenter`. The loss is the squared error over the pixels with ground truth
    (depth 0 or NaN is ignored), the square of the RMSE it is scored with. Deterministic for a given `seed`.

    NOTE: the bias starts at the training set's mean depth (the weights at N(0, 0.01)), so the probe starts as the
    mean predictor and learns how depth varies around it; from a zero bias AdamW at lr 0.01 would spend hundreds of
    steps only reaching the scene's scale (2-3 m on NYUv2).

    Args:
        patches (`torch.Tensor` of shape `(N, Hp, Wp, D)`): training patch features.
        global_features (`torch.Tensor` of shape `(N, D)`): training global features.
        depths (`torch.Tensor` of shape `(N, Hm, Wm)`): depth maps (0 or NaN = no ground truth).
        steps (`int`, *optional*, defaults to 4000): optimisation steps (the paper gives none).
        batch_size (`int`, *optional*, defaults to 8), learning_rate (0.01), weight_decay (1e-4): the paper's.
        poly_power (`float`, *optional*, defaults to 0.9): the poly schedule's exponent.
        rescale (`bool`, *optional*, defaults to `True`): as in `train_linear_segmenter`.
        seed (`int`), device: as in `train_linear_classifier`.

    Returns:
        `LinearDepthProbe` on `device`, in eval mode.

    Raises:
        `ValueError`: if no pixel of `depths` has ground truth.
    """
    valid = _valid_depth(depths)
    if not bool(valid.any()):
        raise ValueError("No training pixel has a depth (all are 0 or NaN): there is nothing to fit.")
    generator = torch.Generator().manual_seed(seed)
    probe = LinearDepthProbe(patches.shape[-1])
    _init_linear(probe.linear, generator)
    with torch.no_grad():
        probe.linear.bias.fill_(float(depths[valid].double().mean()))
    return _train_dense_probe(
        probe, patches, global_features, depths, _masked_squared_error, steps, batch_size, learning_rate,
        weight_decay, poly_power, rescale, generator, device,
    )  # fmt: skip


def predict_depth(
    probe: LinearDepthProbe,
    patches: torch.Tensor,
    global_features: torch.Tensor,
    size: tuple[int, int],
    batch_size: int = 16,
) -> torch.Tensor:
    """Per-pixel depth at `size`: `(N, Hp, Wp, D), (N, D) -> (N, *size)` float32 on the CPU."""
    outputs = _predict_dense(probe, patches, global_features, size, batch_size)  # (b, 1, *size) each
    return torch.cat([batch[:, 0].to("cpu", torch.float32) for batch in outputs])


@dataclass
class ProbeSettings:
    r"""
    How the probes are trained and the features extracted (defaults: the paper's where it gives them).

    Args:
        classification_steps (`int`, defaults to 12500), classification_batch_size (128),
        classification_learning_rate (0.05): the SGD probe's (momentum 0.9, cosine schedule).
        segmentation_steps (`int`, defaults to 4000), segmentation_batch_size (8), segmentation_learning_rate (0.01),
        segmentation_weight_decay (1e-4): the AdamW dense probe's (poly schedule).
        depth_steps (`int`, defaults to 4000), depth_batch_size (8), depth_learning_rate (0.01), depth_weight_decay
        (1e-4): the same for depth.
        standardize (`bool`, defaults to `True`): standardise global features per dimension for the SGD classifier.
        rescale (`bool`, defaults to `True`): divide dense features by their training-set RMS for the AdamW probe.
        per_device_eval_batch_size (`int`, defaults to 64), dataloader_num_workers (0): the feature extraction
            `DataLoader`'s batch size and workers.
        feature_dtype (`str`, defaults to `"float32"`): how cached features are stored (`"float16"` halves the disk;
            `"fp32"` / `"fp16"` are read as these).
        knn_k (`int`, defaults to 0), knn_temperature (0.07): with `knn_k > 0`, classification also reports a
            cosine k-NN on the same global features (`knn_classify`; task `"knn"`).
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
    depth_steps: int = field(default=4000, metadata={"help": "AdamW steps of the depth probe."})
    depth_batch_size: int = field(default=8, metadata={"help": "Its batch size (images)."})
    depth_learning_rate: float = field(default=0.01, metadata={"help": "Its peak lr (poly schedule)."})
    depth_weight_decay: float = field(default=1e-4, metadata={"help": "Its weight decay."})
    standardize: bool = field(default=True, metadata={"help": "Standardise global features per dimension (SGD)."})
    rescale: bool = field(default=True, metadata={"help": "Divide dense features by their training RMS (AdamW)."})
    per_device_eval_batch_size: int = field(
        default=64, metadata={"help": "Images per backbone forward.", "aliases": ["--extraction_batch_size"]}
    )
    dataloader_num_workers: int = field(
        default=0,
        metadata={"help": "DataLoader workers decoding images for extraction.", "aliases": ["--num_workers"]},
    )
    feature_dtype: str = field(
        default="float32", metadata={"help": "Cached feature dtype: float32 | float16 (or fp32 | fp16)."}
    )
    knn_k: int = field(default=0, metadata={"help": "Also a weighted k-NN classifier with this k (0: none)."})
    knn_temperature: float = field(default=0.07, metadata={"help": "Its vote temperature (DINO's 0.07)."})
    seed: int = field(default=0, metadata={"help": "Seeds the probes' initialisation and batch order."})
    device: str | None = field(default=None, metadata={"help": "Where the probes train (default: cuda if any)."})

    def __post_init__(self):
        self.feature_dtype = canonical_dtype("--feature_dtype", self.feature_dtype, ("float32", "float16"))


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
    depth: tuple[ImageSet, ImageSet] | None = None,
) -> list[dict[str, Any]]:
    r"""
    Linear probes of every model at every resolution and budget: classification on the global feature, dense
    segmentation and / or depth on `[patch; global]`, features from `cache`.

    Args:
        models (`Sequence[ProbeModel]`): backbones; VECA models are probed at each budget, others once.
        resolutions (`Sequence[int]`): crop sides; multiples of every model's patch size (checked first).
        budgets (`Sequence[int]`, *optional*): VECA budgets (checked first); all of each model's when `None`.
        classification (`(train, eval)`, *optional*): `ImageSet`s with `labels`.
        segmentation (`(train, eval)`, *optional*): `ImageSet`s with `masks`.
        num_segmentation_labels (`int`, *optional*): `K` for segmentation; the largest label seen + 1 by default.
        cache (`FeatureCache`, *optional*): defaults to an in-memory-only cache (`FeatureCache(None)`).
        settings (`ProbeSettings`, *optional*): training and extraction settings.
        depth (`(train, eval)`, *optional*): `ImageSet`s with `depths` (read and checked first, per resolution).

    Returns:
        One `dict` per (task, model, resolution, budget): `task`, `metric`, `value` (a fraction), `model`,
        `model_name`, `model_type`, `budget` (`None` for non-VECA models), `resolution`, `num_train`, `num_eval`;
        for classification (and k-NN) `interval_low` / `interval_high` (95% Wilson interval) and `predictions` (per
        evaluation image, for paired comparisons); for segmentation `overall_accuracy`, `mean_accuracy`,
        `per_category_iou`; for depth `value` is the RMSE (in the depth maps' unit, lower is better), with
        `abs_rel`, `delta1` and `mean_depth_rmse` (the RMSE of predicting the training set's mean depth everywhere).
    """
    if classification is None and segmentation is None and depth is None:
        raise ValueError("Nothing to probe: give classification, segmentation and / or depth data.")
    try:
        from ..metrics import compute_metric
    except ImportError as error:
        raise ImportError(
            "The probes are scored with veca_hf.metrics, which needs `evaluate` (the `train` extra): "
            "`pip install evaluate` or `pip install veca_hf[train]`."
        ) from error
    settings = settings or ProbeSettings()
    cache = cache or FeatureCache(None)
    check_resolutions(models, resolutions)
    model_budgets = {model.name_or_path: model.budgets(budgets) for model in models}  # checks the budgets first
    short_names = [model.name for model in models]
    names = {m.name_or_path: m.name if short_names.count(m.name) == 1 else m.name_or_path for m in models}
    device = settings.device or ("cuda" if torch.cuda.is_available() else "cpu")
    feature_dtype = getattr(torch, settings.feature_dtype)
    extraction = dict(
        batch_size=settings.per_device_eval_batch_size,
        num_workers=settings.dataloader_num_workers,
        dtype=feature_dtype,
    )
    if classification is not None:
        if classification[0].labels is None or classification[1].labels is None:
            raise ValueError("Classification sets need labels.")
        num_classes = int(max(classification[0].labels.max(), classification[1].labels.max())) + 1
        num_classes = max(num_classes, len(classification[0].class_names or []))
    if depth is not None and (depth[0].depths is None or depth[1].depths is None):
        raise ValueError("Depth sets need depth maps (`ImageSet.depths`; see `depth_dataset`).")

    results = []
    for resolution in resolutions:
        masks = None
        if segmentation is not None:
            masks = (segmentation[0].masks_at(resolution), segmentation[1].masks_at(resolution))  # (N, R, R) each
            num_labels = num_segmentation_labels or _num_labels(masks)
            if _num_labels(masks) > num_labels:
                raise ValueError(f"Masks hold labels >= num_segmentation_labels={num_labels} (other than 255).")
        if depth is not None:
            depth_maps = (depth[0].depths_at(resolution), depth[1].depths_at(resolution))  # (N, R, R) each
            valid = _valid_depth(depth_maps[0])
            if not bool(valid.any()):
                raise ValueError(f"No training depth map has a valid pixel in its {resolution} px centre crop.")
            train_mean = float(depth_maps[0][valid].double().mean())
            mean_depth_rmse = compute_metric(
                "depth", np.full(depth_maps[1].shape, train_mean, np.float32), depth_maps[1].numpy()
            )["rmse"]
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
                    predictions = {"classification": predict_classes(probe, evaluation["global"]).numpy()}
                    if settings.knn_k > 0:
                        predictions["knn"] = knn_classify(
                            train["global"], classification[0].labels, evaluation["global"], num_classes,
                            k=settings.knn_k, temperature=settings.knn_temperature,
                        ).numpy()  # fmt: skip
                    for task, predicted in predictions.items():
                        value = compute_metric("accuracy", predicted, classification[1].labels)["accuracy"]
                        low, high = wilson_interval(round(value * len(predicted)), len(predicted))
                        results.append(dict(
                            task=task, metric="accuracy", value=value, **common, num_train=len(classification[0]),
                            num_eval=len(classification[1]), interval_low=low, interval_high=high,
                            predictions=predicted.tolist(),
                        ))  # fmt: skip
                        logger.info(f"{task} {model.name} C={budget} {resolution}px: accuracy {value:.4f}")
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
                    scores = compute_metric(
                        "mean_iou", predictions.numpy(), masks[1].numpy(), num_labels=num_labels,
                        ignore_index=IGNORE_INDEX,
                    )  # fmt: skip
                    results.append(dict(
                        task="segmentation", metric="mean_iou", value=scores["mean_iou"], **common,
                        num_train=len(segmentation[0]), num_eval=len(segmentation[1]),
                        overall_accuracy=scores["overall_accuracy"], mean_accuracy=scores["mean_accuracy"],
                        per_category_iou=[None if math.isnan(v) else float(v) for v in scores["per_category_iou"]],
                    ))  # fmt: skip
                    logger.info(f"segmentation {model.name} C={budget} {resolution}px: mIoU {scores['mean_iou']:.4f}")
                if depth is not None:
                    train, evaluation = (
                        cache.get(model, budget, resolution, s, dense=True, **extraction) for s in depth
                    )
                    probe = train_linear_depth_estimator(
                        train["patches"], train["global"], depth_maps[0], steps=settings.depth_steps,
                        batch_size=settings.depth_batch_size, learning_rate=settings.depth_learning_rate,
                        weight_decay=settings.depth_weight_decay, rescale=settings.rescale, seed=settings.seed,
                        device=device,
                    )  # fmt: skip
                    predictions = predict_depth(
                        probe, evaluation["patches"], evaluation["global"], depth_maps[1].shape[-2:]
                    )  # (N, R, R)
                    scores = compute_metric("depth", predictions.numpy(), depth_maps[1].numpy())
                    results.append(dict(
                        task="depth", metric="rmse", value=scores["rmse"], **common, num_train=len(depth[0]),
                        num_eval=len(depth[1]), abs_rel=scores["abs_rel"], delta1=scores["delta1"],
                        mean_depth_rmse=mean_depth_rmse,
                    ))  # fmt: skip
                    logger.info(
                        f"depth {model.name} C={budget} {resolution}px: RMSE {scores['rmse']:.4f} (mean depth "
                        f"{mean_depth_rmse:.4f}), AbsRel {scores['abs_rel']:.4f}, delta1 {scores['delta1']:.4f}"
                    )
    return results
