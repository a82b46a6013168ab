#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Embed a whole image dataset into Parquet files: one process or many machines, resumable, any size.

    accelerate launch examples/extract_features.py --model_name_or_path outputs/veca-b16 \
        --dataset_name "https://host/shard-{00000..01023}.tar" --output_dir embeddings/ --num_core_tokens 64 \
        --resolution 512 --per_device_eval_batch_size 32 --patch_features mean --dtype bfloat16

Each row holds `id` (the image's path within a local folder, its webdataset key, or `shard-<s>#<row>`), `embedding`
(the model's `pooler_output`: VECA's first core after the final norm, a DINO model's CLS) and, with
`--patch_features`, the mean patch feature or every patch with its grid. Killed at any point, the same command
finishes the job with every image exactly once; undecodable images are skipped, counted and listed in
`metadata.json`. Load the result with `datasets.load_dataset("parquet", data_files="embeddings/part-*.parquet")`.
See docs/usage.md, "Embedding a dataset".
"""

import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import transformers
from accelerate import Accelerator
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoImageProcessor, AutoModel, HfArgumentParser

import veca_hf  # noqa: F401 (registers VECA with the Auto classes)
from veca_hf.arguments import canonical_dtype, parse_args_with_file, redact_urls
from veca_hf.cpu.hardware import warn_if_slow_bf16
from veca_hf.data import (
    StreamRetries,
    dataset_root,
    detect_image_column,
    is_remote,
    load_image_dataset,
    parse_storage_options,
)
from veca_hf.embedding import (
    METADATA_FILE,
    PATCH_FEATURES,
    PROGRESS_DIR,
    EmbeddingSettings,
    PartBatches,
    PartWriter,
    Preprocess,
    embed,
    remove_partial_files,
    summarize,
)
from veca_hf.hub.access import take_credentials
from veca_hf.model.image_budgets_veca import AUTO_BUDGET
from veca_hf.training.faults import end_training_together


logger = logging.getLogger("veca_hf.extract_features")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class ExtractionArguments:
    model_name_or_path: str = field(metadata={"help": "A VECA (or DINOv2 / DINOv3) folder or Hub id."})
    dataset_name: str = field(
        metadata={"help": "An image folder, parquet / webdataset shards (local or remote URLs, globs) or a Hub id."}
    )
    output_dir: str = field(metadata={"help": "Where the Parquet files and metadata.json go."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The Hub dataset's configuration."})
    train_split: str = field(
        default="train",
        metadata={"help": "The split to embed (any split: train, validation, ...).", "aliases": ["--split"]},
    )
    image_column_name: str | None = field(
        default=None, metadata={"help": "The image column (default: detected).", "aliases": ["--image_column"]}
    )
    storage_options: str | None = field(
        default=None, metadata={"help": "fsspec options of remote shards, as JSON. Never written anywhere."}
    )
    image_processor_name: str | None = field(
        default=None,
        metadata={
            "help": "The image processor's folder or Hub id (default: the model's).",
            "aliases": ["--image_processor_name_or_path"],
        },
    )
    num_core_tokens: str | None = field(
        default=None,
        metadata={
            "help": "VECA's budget C (default: the model's default budget), or `auto`: each image's budget picked by "
            "the model's fitted policy (`config.adaptive_budget`, see veca_hf.AdaptiveBudget), written per row."
        },
    )
    resolution: int | None = field(
        default=None, metadata={"help": "Resize and centre-crop every image to this side (default: as saved)."}
    )
    keep_size: bool = field(
        default=False, metadata={"help": "VECA: embed each image at its own size (rounded to patch multiples)."}
    )
    max_image_side: int | None = field(default=None, metadata={"help": "With --keep_size: bound the long side."})
    per_device_eval_batch_size: int = field(
        default=32, metadata={"help": "Images per forward and process.", "aliases": ["--per_device_batch_size"]}
    )
    patch_features: str = field(default="none", metadata={"help": "none | mean | all (every patch, with its grid)."})
    dtype: str = field(
        default="float32", metadata={"help": "float32 | bfloat16 (or fp32 | bf16): the model's weights and compute."}
    )
    rows_per_file: int = field(default=10000, metadata={"help": "Rows of a data source per Parquet file."})
    dataloader_num_workers: int = field(default=2, metadata={"help": "Decoding and preprocessing processes."})
    min_image_size: int = field(default=1, metadata={"help": "Images with a shorter side are skipped."})
    stream_retries: int = field(default=20, metadata={"help": "Attempts per remote read or open before failing."})
    stream_retry_wait: float = field(default=5.0, metadata={"help": "Seconds between attempts."})

    def __post_init__(self):
        for name in ("per_device_eval_batch_size", "rows_per_file"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.patch_features not in PATCH_FEATURES:
            raise ValueError(f"--patch_features {self.patch_features!r} is not one of {PATCH_FEATURES}.")
        self.dtype = canonical_dtype("--dtype", self.dtype, tuple(DTYPES))
        if self.keep_size and self.resolution is not None:
            raise ValueError("--keep_size embeds each image at its own size: do not pass --resolution with it.")
        if self.resolution is not None and self.resolution < 1:
            raise ValueError(f"--resolution must be a positive number of pixels, got {self.resolution}.")
        if self.dataloader_num_workers < 0:
            raise ValueError(f"--dataloader_num_workers must be >= 0, got {self.dataloader_num_workers}.")
        if self.num_core_tokens is not None and self.num_core_tokens != AUTO_BUDGET:
            if not str(self.num_core_tokens).isdigit():
                raise ValueError(f"--num_core_tokens must be a budget or 'auto', got {self.num_core_tokens!r}.")
            self.num_core_tokens = int(self.num_core_tokens)


def load_model_and_processor(args: ExtractionArguments, device: torch.device):
    if args.dtype == "bfloat16":
        warn_if_slow_bf16(device, "--dtype bfloat16")
    model = AutoModel.from_pretrained(args.model_name_or_path, dtype=DTYPES[args.dtype]).to(device).eval()
    config = model.config
    if config.model_type == "veca":
        # "auto", or a folder saved with default_num_core_tokens="auto": each image's budget picked by the policy
        picks = model.picks_budgets(args.num_core_tokens)
        budget = AUTO_BUDGET if picks else model.resolve_num_core_tokens(args.num_core_tokens)
    elif args.num_core_tokens is not None:
        raise ValueError(f"--num_core_tokens applies to VECA models only, not to model_type={config.model_type!r}.")
    else:
        budget = None
    if args.keep_size and config.model_type != "veca":
        raise ValueError(
            f"--keep_size needs a VECA model (its pixel_mask batches mixed sizes), got {config.model_type!r}."
        )
    source = args.image_processor_name or args.model_name_or_path
    try:
        processor = AutoImageProcessor.from_pretrained(source)
    except OSError as error:
        raise ValueError(
            f"No image processor in {source!r} ({error}). Save one next to the model, or pass --image_processor_name."
        ) from None
    if args.resolution is not None and args.resolution % config.patch_size:
        raise ValueError(f"--resolution {args.resolution} is not a multiple of the patch size {config.patch_size}.")
    return model, processor, budget


def main(argv=None):
    (args,) = parse_args_with_file(HfArgumentParser(ExtractionArguments), argv)
    take_credentials(args)
    accelerator = Accelerator()
    logging.basicConfig(format="%(asctime)s - %(levelname)s - %(name)s - %(message)s", level=logging.INFO)
    if accelerator.is_main_process:
        transformers.utils.logging.set_verbosity_info()

    model, processor, budget = load_model_and_processor(args, accelerator.device)
    retries = StreamRetries(args.stream_retries, args.stream_retry_wait)
    retries.configure()
    dataset = load_image_dataset(
        args.dataset_name, args.dataset_config_name, split=args.train_split,
        storage_options=parse_storage_options(args.storage_options), retries=retries,
    )  # fmt: skip
    image_column = detect_image_column(dataset, args.image_column_name)
    output_dir = Path(args.output_dir)
    settings = EmbeddingSettings(
        model=redact_urls(args.model_name_or_path), model_type=model.config.model_type, num_core_tokens=budget,
        resolution=args.resolution, keep_size=args.keep_size, max_image_side=args.max_image_side,
        patch_features=args.patch_features, dtype=args.dtype, rows_per_file=args.rows_per_file,
        image_column=image_column, dataset=redact_urls(args.dataset_name), min_image_size=args.min_image_size,
        budget_policy=model.config.adaptive_budget if budget == AUTO_BUDGET else None,
    )  # fmt: skip
    if accelerator.is_main_process:
        (output_dir / PROGRESS_DIR).mkdir(parents=True, exist_ok=True)
        settings.check_against(output_dir)
        leftovers = remove_partial_files(output_dir)
        if leftovers:
            logger.info(f"Removed {len(leftovers)} partly written file(s) of an interrupted run; redoing them.")
    accelerator.wait_for_everyone()
    settings.check_against(output_dir)  # every rank raises the same error for another run's folder

    local_root = None if is_remote(args.dataset_name) or not os.path.isdir(args.dataset_name) else args.dataset_name
    batches = PartBatches(
        dataset, image_column,
        Preprocess(processor, args.resolution, args.keep_size, model.config.patch_size, args.max_image_side),
        output_dir=output_dir, rows_per_file=args.rows_per_file, batch_size=args.per_device_eval_batch_size,
        rank=accelerator.process_index, world_size=accelerator.num_processes, min_image_size=args.min_image_size,
        root=local_root, image_root=dataset_root(args.dataset_name),
    )  # fmt: skip
    # NOTE: not through accelerator.prepare: the lanes already split the work between processes.
    loader = DataLoader(batches, batch_size=None, num_workers=args.dataloader_num_workers)
    writer = PartWriter(output_dir, args.patch_features, model.config.hidden_size)
    progress = tqdm(desc=f"process {accelerator.process_index}", unit="img", position=accelerator.process_index)
    start = time.perf_counter()
    for batch in loader:
        features = None
        if batch["pixel_values"] is not None:
            features = embed(model, batch, budget, args.patch_features, DTYPES[args.dtype])
        writer.add(batch, features)
        progress.update(len(batch["ids"]) + len(batch["skipped"]))
    progress.close()
    accelerator.wait_for_everyone()
    seconds = time.perf_counter() - start
    images = accelerator.reduce(torch.tensor(writer.images, device=accelerator.device), reduction="sum").item()
    end_training_together(accelerator)
    if accelerator.is_main_process:
        metadata = summarize(output_dir, settings, processor.to_dict(), batches.num_sources)
        logger.info(
            f"Embedded {metadata['num_images']} images ({metadata['num_skipped']} skipped, listed in "
            f"{output_dir / METADATA_FILE}) into {metadata['num_files']} files: "
            f"datasets.load_dataset('parquet', data_files='{output_dir}/part-*.parquet'). This run: {images} images "
            f"in {seconds:.1f} s ({images / seconds:.2f} images/s over {accelerator.num_processes} process(es))."
        )


if __name__ == "__main__":
    main()
