#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Fine-tune a VECA model for image classification with `Trainer`, and evaluate it at several budgets.

The shape of transformers' `examples/pytorch/image-classification/run_image_classification.py`, plus the budget:

```bash
python examples/finetune_classification.py \
    --model_name_or_path path/to/veca-b16 --train_dir data/train --validation_dir data/validation \
    --output_dir outputs/veca-b16-finetuned --do_train --do_eval \
    --sample_budgets --eval_budgets 8,16,32,64 \
    --learning_rate 5e-5 --weight_decay 0.05 --num_train_epochs 3 --per_device_train_batch_size 32
```

Data: `--dataset_name` (a Hub dataset id, or a local folder `datasets.load_dataset` understands) or
`--train_dir`/`--validation_dir` image folders (one sub-folder per class). The label names go into the config
(`id2label`, `label2id`). Budget: `--num_core_tokens C` trains at C and makes C the saved model's
`default_num_core_tokens`; `--sample_budgets` draws one budget per optimiser step from `--budgets` with
`--budget_weights`. Each budget of `--eval_budgets` is evaluated after training; `all_results.json` in the output
folder holds the train metrics and `eval_C{C}_accuracy`, `eval_C{C}_loss`, ... for each budget.

Any `TrainingArguments` flag works (`--use_cpu`, `--report_to none`, `--eval_strategy epoch`, ...); arguments can also
come from one JSON or YAML file, optionally followed by flags that override it:
`python examples/finetune_classification.py args.yaml --learning_rate 1e-4`. See docs/budget_picker.md.
"""

import logging
import os
from dataclasses import dataclass, field

import datasets
import numpy as np
import torch
import transformers
from datasets import load_dataset
from transformers import AutoImageProcessor, AutoModelForImageClassification

import veca_hf  # noqa: F401 (registers VECA with the Auto classes)
from veca_hf.data import build_transform
from veca_hf.metrics import load_metric
from veca_hf.training.scripts import finetuning_trainer, parse_finetuning_args, train_evaluate_and_publish


logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    """Which model and image processor to fine-tune."""

    model_name_or_path: str = field(metadata={"help": "A VECA folder or Hub id (VecaModel or a classifier)."})
    image_processor_name: str | None = field(
        default=None, metadata={"help": "Image processor folder or Hub id, if not the model's."}
    )
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache Hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a Hub model."})
    ignore_mismatched_sizes: bool = field(
        default=True, metadata={"help": "Replace a classifier head whose number of labels differs (new head)."}
    )


@dataclass
class DataTrainingArguments:
    """Which data to train and evaluate on."""

    dataset_name: str | None = field(default=None, metadata={"help": "A Hub dataset id or a local dataset folder."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration."})
    train_dir: str | None = field(default=None, metadata={"help": "An image folder with one sub-folder per class."})
    validation_dir: str | None = field(default=None, metadata={"help": "The same, for validation."})
    train_val_split: float = field(
        default=0.15, metadata={"help": "Fraction of train held out for validation when there is no validation split."}
    )
    image_column_name: str = field(default="image", metadata={"help": "The column holding the images."})
    label_column_name: str = field(default="label", metadata={"help": "The column holding the labels."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Use at most this many training images."})
    max_eval_samples: int | None = field(default=None, metadata={"help": "Use at most this many validation images."})

    def __post_init__(self):
        if self.dataset_name is None and self.train_dir is None and self.validation_dir is None:
            raise ValueError("Pass --dataset_name, or --train_dir and/or --validation_dir.")


def collate_fn(examples: list[dict]) -> dict[str, torch.Tensor]:
    return {
        "pixel_values": torch.stack([example["pixel_values"] for example in examples]),
        "labels": torch.tensor([example["labels"] for example in examples]),
    }


def main():
    # Flags, or a JSON / YAML file of them first (later flags override it).
    model_args, data_args, budget_args, training_args = parse_finetuning_args(
        (ModelArguments, DataTrainingArguments), logger
    )

    # Data: a Hub / local dataset, or image folders (labels from the sub-folder names).
    if data_args.dataset_name is not None:
        dataset = load_dataset(data_args.dataset_name, data_args.dataset_config_name, cache_dir=model_args.cache_dir)
    else:
        data_files = {}
        if data_args.train_dir is not None:
            data_files["train"] = os.path.join(data_args.train_dir, "**")
        if data_args.validation_dir is not None:
            data_files["validation"] = os.path.join(data_args.validation_dir, "**")
        dataset = load_dataset("imagefolder", data_files=data_files, cache_dir=model_args.cache_dir)
    for column in (data_args.image_column_name, data_args.label_column_name):
        if column not in dataset["train"].column_names:
            raise ValueError(
                f"Column {column!r} not found; the dataset has {dataset['train'].column_names}. Set "
                "--image_column_name / --label_column_name."
            )
    if "validation" not in dataset and data_args.train_val_split > 0:
        split = dataset["train"].train_test_split(data_args.train_val_split, seed=training_args.seed)
        dataset["train"], dataset["validation"] = split["train"], split["test"]
    if not isinstance(dataset["train"].features[data_args.label_column_name], datasets.ClassLabel):
        dataset = dataset.class_encode_column(data_args.label_column_name)  # strings / ints -> ClassLabel, all splits

    labels = dataset["train"].features[data_args.label_column_name].names
    label2id = {label: i for i, label in enumerate(labels)}
    id2label = dict(enumerate(labels))

    model = AutoModelForImageClassification.from_pretrained(
        model_args.model_name_or_path,
        num_labels=len(labels),
        label2id=label2id,
        id2label=id2label,
        ignore_mismatched_sizes=model_args.ignore_mismatched_sizes,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
        **({"default_num_core_tokens": budget_args.num_core_tokens} if budget_args.num_core_tokens else {}),
    )
    image_processor = AutoImageProcessor.from_pretrained(
        model_args.image_processor_name or model_args.model_name_or_path,
        cache_dir=model_args.cache_dir,
        revision=model_args.model_revision,
    )
    # Both derive from the processor's settings (sizes, resampling, mean / std): the saved processor agrees with them.
    train_transform = build_transform(image_processor, train=True, recipe="finetune")
    eval_transform = build_transform(image_processor, train=False)

    def transform_batch(transform):
        def apply(batch):
            batch["pixel_values"] = [transform(image.convert("RGB")) for image in batch[data_args.image_column_name]]
            batch["labels"] = batch[data_args.label_column_name]
            return batch

        return apply

    if training_args.do_train:
        if data_args.max_train_samples is not None:
            dataset["train"] = (
                dataset["train"].shuffle(seed=training_args.seed).select(range(data_args.max_train_samples))
            )
        dataset["train"] = dataset["train"].with_transform(transform_batch(train_transform))
    if training_args.do_eval:
        if "validation" not in dataset:
            raise ValueError("--do_eval needs a validation split: --validation_dir, or --train_val_split > 0.")
        if data_args.max_eval_samples is not None:
            dataset["validation"] = (
                dataset["validation"].shuffle(seed=training_args.seed).select(range(data_args.max_eval_samples))
            )
        dataset["validation"] = dataset["validation"].with_transform(transform_batch(eval_transform))

    accuracy = load_metric("accuracy")

    def compute_metrics(prediction: transformers.EvalPrediction) -> dict[str, float]:
        return accuracy.compute(predictions=np.argmax(prediction.predictions, axis=1), references=prediction.label_ids)

    # Budgets: per-step sampling or one fixed budget for training; a sweep for evaluation.
    trainer = finetuning_trainer(
        model,
        training_args,
        budget_args,
        train_dataset=dataset["train"] if training_args.do_train else None,
        eval_dataset=dataset["validation"] if training_args.do_eval else None,
        compute_metrics=compute_metrics,
        processing_class=image_processor,
        data_collator=collate_fn,
    )
    train_evaluate_and_publish(
        trainer,
        budget_args,
        base_model=model_args.model_name_or_path,
        datasets=data_args.dataset_name or data_args.train_dir,
        hub_dataset=data_args.dataset_name,
        task="image-classification",
        metrics_description="accuracy (top-1) and cross-entropy loss on the validation split",
        description="Fine-tuned for image classification from its base model (below) with "
        "`examples/finetune_classification.py`.",
    )


if __name__ == "__main__":
    main()
