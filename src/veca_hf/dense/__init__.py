# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tuning VECA for dense tasks (semantic segmentation, depth) with `Trainer`: everything the example scripts
`examples/finetune_segmentation.py` and `examples/finetune_depth.py` share, so that they stay thin.

- Data: `load_dense_dataset` (a Hub id, a local folder, a Parquet file, or Parquet files per split),
  `check_columns`, `prepare_splits`, `resolve_id2label`, `mean_depth`; `DenseTransform` turns an image and its label
  map (or depth map) into tensors of one size, checked sample by sample; `DenseCollator` pads a batch of different
  sizes and returns `pixel_mask`, the label maps padded with the ignore index (segmentation) or 0 (depth, "no
  ground truth").
- Models: `build_segmentation_model` (`"linear"`: [`VecaForSemanticSegmentation`]; `"upernet"`: transformers'
  `UperNetForSemanticSegmentation` with a VECA backbone) and `build_depth_model` (`"linear"`:
  [`VecaForDepthEstimation`]; `"dpt"`, `"depth_anything"`: transformers' heads), all from one VECA folder;
  `freeze_backbone`.
- Losses and metrics: `depth_loss_from_outputs` (for transformers' depth heads, which raise on `labels`),
  `SegmentationMetrics` (the `mean_iou` module) and `DepthMetrics` (the `depth` module), both through
  `veca_hf.metrics.compute_metric`, per batch or all at once.

Tensors: pixel values `(B, 3, H, W)`, `pixel_mask` `(B, H, W)` (1 = image, 0 = padding), label maps `(B, H, W)`
(int64 class indices, or float32 depths with 0 = no ground truth).

The parts: `data` (splits, transforms, collator), `models` (heads and backbone), `metrics` (depth loss, metrics),
`finetuning` (`finetune_dense`: what both scripts do once their model is built).
"""

from .data import (
    SAMPLE_INDEX_COLUMN,
    DenseCollator,
    DenseDataArguments,
    DenseTransform,
    check_columns,
    load_dense_dataset,
    mean_depth,
    prepare_splits,
    resolve_id2label,
    with_sample_index,
)
from .finetuning import finetune_dense
from .metrics import (
    DepthMetrics,
    SegmentationMetrics,
    depth_loss_from_outputs,
)
from .models import (
    DEPTH_HEADS,
    SEGMENTATION_HEADS,
    DenseModelArguments,
    build_dense_processor,
    build_depth_model,
    build_segmentation_model,
    default_out_indices,
    freeze_backbone,
)


__all__ = [
    "DEPTH_HEADS",
    "SAMPLE_INDEX_COLUMN",
    "SEGMENTATION_HEADS",
    "DenseCollator",
    "DenseDataArguments",
    "DenseModelArguments",
    "DenseTransform",
    "DepthMetrics",
    "SegmentationMetrics",
    "build_dense_processor",
    "build_depth_model",
    "build_segmentation_model",
    "check_columns",
    "default_out_indices",
    "depth_loss_from_outputs",
    "finetune_dense",
    "freeze_backbone",
    "load_dense_dataset",
    "mean_depth",
    "prepare_splits",
    "resolve_id2label",
    "with_sample_index",
]
