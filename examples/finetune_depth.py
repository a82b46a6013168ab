#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tune a VECA model for monocular depth estimation with `Trainer`, and evaluate its RMSE at several budgets.

The shape of transformers' example scripts (`run_semantic_segmentation.py`), for depth:

```bash
python examples/finetune_depth.py \
    --model_name_or_path path/to/veca-b16 --head depth_anything --max_depth 10 \
    --dataset_name <a Hub copy of NYUv2 with image and depth columns> --depth_column depth --depth_scale 1000 \
    --output_dir outputs/veca-b16-nyu --do_train --do_eval \
    --sample_budgets --eval_budgets 8,16,32,64 --shortest_edge 480 \
    --learning_rate 5e-5 --weight_decay 0.01 --num_train_epochs 25 --per_device_train_batch_size 8
```

Heads: `--head linear` ([`VecaForDepthEstimation`]: a linear layer on every patch token and the global core, loaded
with `AutoModelForDepthEstimation`; a new head starts at the mean training depth), `--head dpt`
(`DPTForDepthEstimation`) or `--head depth_anything` (`DepthAnythingForDepthEstimation`, metric depth up to
`--max_depth`), the last two transformers' own with the VECA as their backbone. All train on the squared error over
the pixels with a depth (`modeling_veca_dense.VecaForDepthEstimation` says why not SiLog). `--freeze_backbone` trains
the head alone.

Data: `--dataset_name` is a Hub id, a local folder `datasets.load_dataset` reads (Parquet files named by split) or one
Parquet file (or `--train_file` and `--validation_file` name Parquet files per split: paths, globs or fsspec URLs such
as `hf://datasets/org/name@revision/dir/*.parquet`), with an image column (`--image_column_name`) and a depth column
(`--depth_column`): float maps (arrays or mode `F` images) or 16-bit PNGs, each of its image's size; stored values are
divided by `--depth_scale` (1000 for millimetres, 256 for KITTI), and 0 or NaN marks pixels without ground truth.
Images keep their aspect ratio (short side `--shortest_edge`) and batches are padded with a `pixel_mask`; padded pixels
count neither in the loss nor in the metrics.

Budget flags as in `finetune_classification.py`; `all_results.json` holds `eval_C{C}_rmse`, `eval_C{C}_abs_rel`,
`eval_C{C}_delta1` and `eval_C{C}_loss` per budget of `--eval_budgets`. See docs/dense_tasks.md.
"""

import logging
from dataclasses import dataclass, field

import veca_hf  # noqa: F401 (registers VECA with the Auto classes)
from veca_hf.budgets import parse_number_list
from veca_hf.dense import (
    DEPTH_HEADS,
    DenseDataArguments,
    DenseModelArguments,
    DepthMetrics,
    build_depth_model,
    finetune_dense,
    mean_depth,
)
from veca_hf.training.scripts import parse_finetuning_args


logger = logging.getLogger(__name__)


@dataclass
class ModelArguments(DenseModelArguments):
    """Which model to fine-tune for depth estimation, and its head (`veca_hf.dense.DenseModelArguments`' flags)."""

    head: str = field(default="linear", metadata={"help": "linear, dpt or depth_anything.", "choices": DEPTH_HEADS})
    max_depth: int = field(default=10, metadata={"help": "Depth Anything's largest depth (10 NYUv2, 80 KITTI)."})


@dataclass
class DataTrainingArguments(DenseDataArguments):
    """Which data to train and evaluate on (the shared flags of `veca_hf.dense.DenseDataArguments`, and the depths)."""

    shortest_edge: int = field(default=480, metadata={"help": "Images are resized to about this short side."})
    depth_column: str = field(default="depth", metadata={"help": "The column holding the depth maps."})
    depth_scale: float = field(
        default=1.0, metadata={"help": "Stored depth / depth_scale = depth: 1000 for 16-bit PNGs in millimetres."}
    )


def main():
    arguments = parse_finetuning_args((ModelArguments, DataTrainingArguments), logger, batch_eval_metrics=True)
    model_args, data_args, budget_args, training_args = arguments

    target = ("--depth_column", data_args.depth_column)
    train, validation = data_args.load_splits(training_args, target, model_args.cache_dir)
    initial_depth = None
    if train is not None and model_args.head == "linear":  # a new linear head starts at the mean training depth
        initial_depth = mean_depth(train, data_args.depth_column, data_args.depth_scale)

    model = build_depth_model(
        model_args.model_name_or_path,
        model_args.head,
        num_core_tokens=budget_args.num_core_tokens,
        out_indices=parse_number_list(model_args.backbone_out_indices),
        head_hidden_size=model_args.head_hidden_size,
        max_depth=model_args.max_depth,
        initial_depth=initial_depth,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
    )
    finetune_dense(
        "depth",
        model,
        arguments,
        (train, validation),
        DepthMetrics(),
        target_column=data_args.depth_column,
        label_pad_value=0.0,  # 0: no ground truth
        metrics_description="RMSE, absolute relative error and delta < 1.25 over the validation pixels with a depth "
        f"(at the training resolution, short side {data_args.shortest_edge}), and the squared-error loss",
        depth_scale=data_args.depth_scale,
    )


if __name__ == "__main__":
    main()
