# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What `examples/finetune_segmentation.py` and `examples/finetune_depth.py` do once their model is built."""

from transformers import TrainingArguments

from ..arguments import BudgetArguments
from ..training.scripts import finetuning_trainer, train_evaluate_and_publish
from .data import DenseCollator, DenseDataArguments, DenseTransform
from .metrics import DepthMetrics, SegmentationMetrics, depth_loss_from_outputs
from .models import DenseModelArguments, build_dense_processor, freeze_backbone


# the model card's pipeline tag of each task
PIPELINE_TASKS = {"segmentation": "image-segmentation", "depth": "depth-estimation"}


def finetune_dense(
    task: str,
    model,
    arguments: tuple[DenseModelArguments, DenseDataArguments, BudgetArguments, TrainingArguments],
    splits: tuple,
    metrics: SegmentationMetrics | DepthMetrics,
    target_column: str,
    label_pad_value: float,
    metrics_description: str,
    **transform_options,
) -> None:
    """
    Fine-tune `model` on `splits` for `task` (`"segmentation"` or `"depth"`), then evaluate it at every budget of
    `--eval_budgets` and publish it: `--freeze_backbone`; the folder's image processor in any-size mode (short side
    `--shortest_edge`); the splits through [`DenseTransform`] (`transform_options` are its task options); batches
    padded with a `pixel_mask` (targets padded with `label_pad_value`); the task's metrics; and, for transformers'
    depth heads, which raise on `labels`, [`depth_loss_from_outputs`].

    Args:
        arguments: the script's parsed `(model_args, data_args, budget_args, training_args)`.
        splits: `(train, validation)`, either `None` when not used.
        target_column (`str`): the label-map or depth column.
        metrics_description (`str`): what the model card says the metrics are.
    """
    model_args, data_args, budget_args, training_args = arguments
    if model_args.freeze_backbone:
        freeze_backbone(model)
    hub = {"cache_dir": model_args.cache_dir, "revision": model_args.model_revision}
    processor = build_dense_processor(
        model_args.model_name_or_path, data_args.shortest_edge, data_args.longest_edge, **hub
    )

    def transformed(split, name: str):
        if split is None:
            return None
        column = data_args.image_column_name
        transform = DenseTransform(
            processor, task, column, target_column, train=name == "train", split=name, **transform_options
        )
        return split.with_transform(transform)

    loss_from_outputs = task == "depth" and model_args.head != "linear"
    trainer = finetuning_trainer(
        model,
        training_args,
        budget_args,
        train_dataset=transformed(splits[0], "train"),
        eval_dataset=transformed(splits[1], "validation"),
        compute_metrics=metrics,
        preprocess_logits_for_metrics=metrics.preprocess_logits,
        processing_class=processor,
        data_collator=DenseCollator(label_pad_value=label_pad_value),
        compute_loss_func=depth_loss_from_outputs if loss_from_outputs else None,
    )
    if loss_from_outputs:
        trainer.loss_is_scaled_for_ga = False  # a per-batch mean: Trainer divides it by the accumulation steps
    title = {"segmentation": "semantic segmentation", "depth": "depth estimation"}[task]
    train_evaluate_and_publish(
        trainer,
        budget_args,
        base_model=model_args.model_name_or_path,
        datasets=data_args.source,
        hub_dataset=data_args.source,
        task=PIPELINE_TASKS[task],
        metrics_description=metrics_description,
        description=f"Fine-tuned for {title} ({model_args.head} head) from its base model (below) with "
        f"`examples/finetune_{task}.py`.",
    )


__all__ = ["finetune_dense"]
