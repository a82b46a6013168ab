# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The depth loss for transformers' depth heads, and the segmentation and depth metrics (`evaluate` modules)."""

import numpy as np
import torch
from torch import nn
from transformers import EvalPrediction

from ..metrics import compute_metric
from ..model.modeling_veca_dense import masked_depth_mse


def _resized_like(prediction: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """`(B, h, w)` bilinearly to the labels' `(B, H, W)` where they differ (DPT on an odd patch grid)."""
    if prediction.shape[-2:] == labels.shape[-2:]:
        return prediction
    resized = nn.functional.interpolate(prediction[:, None], size=labels.shape[-2:], mode="bilinear")
    return resized[:, 0]


def depth_loss_from_outputs(outputs, labels: torch.Tensor, num_items_in_batch=None) -> torch.Tensor:
    """
    `compute_loss_func` for transformers' depth heads (DPT, Depth Anything raise on `labels`): the mean squared
    error over pixels with a depth (finite, > 0; padding is 0), as [`VecaForDepthEstimation`] (its NOTE says why).

    NOTE: `Trainer` takes a `compute_loss_func` loss as already scaled for gradient accumulation; this one is a
    per-batch mean, so set `trainer.loss_is_scaled_for_ga = False` (the depth script does).
    """
    return masked_depth_mse(_resized_like(outputs["predicted_depth"], labels), labels)


class _PixelMetric:
    """Collects the scored pixels of each call and scores them together when `compute_result` is true, so it works
    with and without `TrainingArguments(batch_eval_metrics=True)` (per batch, keeping only the scored pixels)."""

    def __init__(self):
        self.predictions, self.references = [], []

    def preprocess_logits(self, logits, labels):  # `preprocess_logits_for_metrics`
        raise NotImplementedError

    def _keep(self, predictions: np.ndarray, references: np.ndarray) -> None:
        raise NotImplementedError

    def _score(self, predictions: np.ndarray, references: np.ndarray) -> dict[str, float]:
        raise NotImplementedError

    def __call__(self, prediction: EvalPrediction, compute_result: bool = True) -> dict[str, float]:
        predictions, references = prediction.predictions, prediction.label_ids
        if isinstance(predictions, (tuple, list)):
            predictions = predictions[0]
        if isinstance(predictions, torch.Tensor):
            predictions = predictions.detach().float().cpu().numpy()
        if isinstance(references, torch.Tensor):
            references = references.detach().float().cpu().numpy()
        self._keep(np.asarray(predictions), np.asarray(references))
        if not compute_result:
            return {}
        predictions, references = np.concatenate(self.predictions), np.concatenate(self.references)
        self.predictions, self.references = [], []
        return self._score(predictions, references)


class SegmentationMetrics(_PixelMetric):
    """
    Mean IoU, mean accuracy and pixel accuracy (the `mean_iou` metric module, pooled over all pixels) of arg-max
    predictions; `compute_metrics` for `Trainer`, with `preprocess_logits` as `preprocess_logits_for_metrics`.

    Labels equal to `ignore_index` (unlabelled and padded pixels) or negative (`Trainer`'s -100 padding between
    batches) are not scored.

    Args:
        num_labels (`int`): the number of classes.
        ignore_index (`int`, *optional*, defaults to 255): the label of pixels not scored.
    """

    def __init__(self, num_labels: int, ignore_index: int = 255):
        super().__init__()
        self.num_labels, self.ignore_index = num_labels, ignore_index
        self.dtype = np.uint8 if num_labels <= 255 else np.int32

    def preprocess_logits(self, logits, labels):
        """`(B, K, H, W)` logits -> `(B, H, W)` classes, resized to the labels if they differ."""
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        if logits.shape[-2:] != labels.shape[-2:]:
            logits = nn.functional.interpolate(logits, size=labels.shape[-2:], mode="bilinear")
        return logits.argmax(1)

    def _keep(self, predictions, references):
        scored = (references != self.ignore_index) & (references >= 0)
        self.predictions.append(predictions[scored].astype(self.dtype))
        self.references.append(references[scored].astype(self.dtype))

    def _score(self, predictions, references):
        results = compute_metric(
            "mean_iou",
            predictions=[predictions],
            references=[references],
            num_labels=self.num_labels,
            ignore_index=self.ignore_index,
        )
        return {name: float(results[name]) for name in ("mean_iou", "mean_accuracy", "overall_accuracy")}


class DepthMetrics(_PixelMetric):
    """
    RMSE, AbsRel and delta1 (the `depth` metric module, pooled over all pixels with a depth): `compute_metrics` for
    `Trainer`, with `preprocess_logits` as `preprocess_logits_for_metrics`. Pixels with depth 0, NaN or negative
    (padding, `Trainer`'s -100 between batches) are not scored.
    """

    def preprocess_logits(self, logits, labels):
        """`predicted_depth` `(B, h, w)`, resized to the labels' size if it differs."""
        if isinstance(logits, (tuple, list)):
            logits = logits[0]
        return _resized_like(logits, labels)

    def _keep(self, predictions, references):
        scored = np.isfinite(references) & (references > 0)
        self.predictions.append(predictions[scored].astype(np.float32))
        self.references.append(references[scored].astype(np.float32))

    def _score(self, predictions, references):
        return compute_metric("depth", predictions=predictions, references=references)
