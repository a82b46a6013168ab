#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tune a VECA model for semantic segmentation with `Trainer`, and evaluate its mean IoU at several budgets.

The shape of transformers' `examples/pytorch/semantic-segmentation/run_semantic_segmentation.py`, plus the budget
and images of any size:

```bash
python examples/finetune_segmentation.py \
    --model_name_or_path path/to/veca-b16 --head linear \
    --dataset_name scene_parse_150 --label_column_name annotation --reduce_labels \
    --output_dir outputs/veca-b16-ade20k --do_train --do_eval \
    --sample_budgets --eval_budgets 8,16,32,64 --shortest_edge 512 \
    --learning_rate 1e-4 --weight_decay 0.05 --num_train_epochs 20 --per_device_train_batch_size 16
```

Heads: `--head linear` ([`VecaForSemanticSegmentation`]: a linear layer on every patch token and the global core,
saved so that `AutoModelForSemanticSegmentation` loads it) or `--head upernet` (transformers'
`UperNetForSemanticSegmentation` with the VECA as its backbone). `--freeze_backbone` trains the head alone.

Data: `--dataset_name` is a Hub id, a local folder `datasets.load_dataset` reads (Parquet files named by split) or one
Parquet file (or `--train_file` and `--validation_file` name Parquet files per split: paths, globs or fsspec URLs such
as `hf://datasets/org/name@revision/dir/*.parquet`), with an image column (`--image_column_name`) and a label-map
column (`--label_column_name`: single-channel images or arrays of class indices, each of its image's size;
`--ignore_index`, 255, marks unlabelled pixels). `--reduce_labels` makes label 0 the ignored background (ADE20K).
Class names come from `--id2label_file`, else `id2label.json` in the dataset, else the labels found in the training
maps. Every image keeps its aspect ratio (short side `--shortest_edge`, sides multiples of the patch size) and
batches are padded with a `pixel_mask`, so padded pixels count neither in the loss nor in the metric.

Budget: `--num_core_tokens C` trains at C and saves it as the default budget; `--sample_budgets` draws one budget per
optimiser step from `--budgets` with `--budget_weights`. Each of `--eval_budgets` is evaluated after training:
`all_results.json` holds `eval_C{C}_mean_iou`, `eval_C{C}_mean_accuracy`, `eval_C{C}_overall_accuracy` and
`eval_C{C}_loss` per budget. Any `TrainingArguments` flag works, and arguments can come from a JSON / YAML file.
See docs/dense_tasks.md.
"""

import logging
from dataclasses import dataclass, field

import veca_hf  # noqa: F401 (registers VECA with the Auto classes)
from veca_hf.budgets import parse_number_list
from veca_hf.dense import (
    SEGMENTATION_HEADS,
    DenseDataArguments,
    DenseModelArguments,
    SegmentationMetrics,
    build_segmentation_model,
    finetune_dense,
    resolve_id2label,
)
from veca_hf.training.scripts import parse_finetuning_args


logger = logging.getLogger(__name__)


@dataclass
class ModelArguments(DenseModelArguments):
    """Which model to fine-tune for semantic segmentation, and its head (`DenseModelArguments`' flags)."""

    head: str = field(default="linear", metadata={"help": "linear or upernet.", "choices": SEGMENTATION_HEADS})


@dataclass
class DataTrainingArguments(DenseDataArguments):
    """Which data to train and evaluate on (the shared flags of `veca_hf.dense.DenseDataArguments`, and the labels)."""

    label_column_name: str = field(
        default="label", metadata={"help": "The column holding the label maps.", "aliases": ["--label_column"]}
    )
    id2label_file: str | None = field(default=None, metadata={"help": "A JSON file {'0': 'wall', ...}."})
    reduce_labels: bool = field(default=False, metadata={"help": "Label 0 is background (ignored); k -> k - 1."})
    ignore_index: int = field(default=255, metadata={"help": "The label of unlabelled pixels."})


def main():
    arguments = parse_finetuning_args((ModelArguments, DataTrainingArguments), logger, batch_eval_metrics=True)
    model_args, data_args, budget_args, training_args = arguments

    target = ("--label_column_name", data_args.label_column_name)
    train, validation = data_args.load_splits(training_args, target, model_args.cache_dir)
    label_options = {"reduce_labels": data_args.reduce_labels, "ignore_index": data_args.ignore_index}
    id2label = resolve_id2label(
        data_args.id2label_file, data_args.dataset_name, train, data_args.label_column_name, **label_options
    )
    logger.info(f"{len(id2label)} classes: {id2label}")

    model = build_segmentation_model(
        model_args.model_name_or_path,
        model_args.head,
        id2label,
        ignore_index=data_args.ignore_index,
        num_core_tokens=budget_args.num_core_tokens,
        out_indices=parse_number_list(model_args.backbone_out_indices),
        head_hidden_size=model_args.head_hidden_size,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
    )
    finetune_dense(
        "segmentation",
        model,
        arguments,
        (train, validation),
        SegmentationMetrics(len(id2label), data_args.ignore_index),
        target_column=data_args.label_column_name,
        label_pad_value=data_args.ignore_index,
        metrics_description="mean IoU, mean class accuracy and pixel accuracy on the validation split (labelled "
        f"pixels at the training resolution, short side {data_args.shortest_edge}), and the cross-entropy loss",
        num_labels=len(id2label),
        **label_options,
    )


if __name__ == "__main__":
    main()
