# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""A distillation run with Accelerate: the frozen teacher, the budgets the student trains and validates at, the
held-out images, the progress every checkpoint saves, and what the run does at a checkpoint and at its end.

`examples/distill.py` builds a `DistillationRun` from its flags and runs the optimiser steps over it; the pieces
distillation is made of (the loss, the teacher targets, the student) are in `veca_hf.training.distillation`.

Shape legend: B batch, r resolution, N patches, Dt teacher width.
"""

import json
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import datasets
import torch
import transformers
from accelerate import Accelerator
from accelerate.logging import get_logger
from safetensors.torch import save_file
from transformers import AutoModel

from ..budgets import BudgetSampler, training_budgets
from ..cpu.hardware import warn_if_slow_bf16
from ..data import collate_images, resize_batch
from ..model.image_processing_veca import VecaImageProcessor
from .checkpointing import checkpoint_steps, load_checkpoint, save_checkpoint
from .distillation import (
    PROJECTION_FILE,
    TeacherTargets,
    before_after_table,
    compute_teacher_targets,
    teacher_autocast_dtype,
    validation_losses,
)
from .faults import StepGuard, replicas_agree


logger = get_logger(__name__)  # NOTE: Accelerate's: INFO on the main process only

RESULTS_FILE = "distill_results.json"


def uses_zero3(accelerator: Accelerator) -> bool:
    """Whether DeepSpeed ZeRO stage 3 partitions the parameters over the processes (no process holds a whole model)."""
    plugin = accelerator.state.deepspeed_plugin
    return plugin is not None and plugin.zero_stage == 3


def setup_accelerator_logging(accelerator: Accelerator) -> None:
    """The logging of a script that drives an `Accelerator` itself (the `Trainer` scripts use
    `veca_hf.training.scripts.setup_logging`): timestamps on stderr, the run's progress at INFO, the libraries' from
    WARNING on the main process and from ERROR on the others; a warning where bf16 autocast is slow on this CPU."""
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", level=logging.INFO
    )
    # The libraries' config dumps and load reports would drown the run's progress.
    if accelerator.is_main_process:
        transformers.utils.logging.set_verbosity_warning()
    else:
        transformers.utils.logging.set_verbosity_error()
    datasets.utils.logging.set_verbosity_warning()
    if accelerator.is_main_process and accelerator.mixed_precision == "bf16":
        warn_if_slow_bf16(accelerator.device, "mixed precision bf16")


def enable_activation_checkpointing(model: torch.nn.Module) -> None:
    """transformers 5's `activation_checkpointing_enable` where the model has it (its `gradient_` name is deprecated),
    else `gradient_checkpointing_enable` (transformers 4)."""
    enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
    enable()


def budget_label(budget: int | None) -> str:
    """How a budget is named in results and logs: its number, or `"dense"` for the full-attention control."""
    return "dense" if budget is None else str(budget)


@dataclass
class Teacher:
    """The frozen teacher and how it runs."""

    model: torch.nn.Module
    path: str
    dtype: torch.dtype | None  # autocast dtype, None: fp32
    micro_batch_size: int | None

    def targets(self, pixel_values: torch.Tensor, student_patch_size: int) -> TeacherTargets:
        """`cls (B, Dt)` and `patches (B, N, Dt)` for `pixel_values (B, 3, r, r)`."""
        return compute_teacher_targets(self.model, pixel_values, student_patch_size, self.micro_batch_size, self.dtype)


def load_teacher(
    accelerator: Accelerator, teacher_path: str | Path, dtype: str = "auto", micro_batch_size: int | None = None
) -> Teacher:
    """The teacher at `teacher_path`, frozen, in eval mode, on the accelerator's device and outside any optimiser;
    `dtype` as `--teacher_dtype` takes it (`teacher_autocast_dtype`)."""
    if uses_zero3(accelerator):
        # NOTE: under ZeRO-3 from_pretrained would partition the teacher; it is not an engine, so keep it whole.
        with accelerator.state.deepspeed_plugin.zero3_init_context_manager(enable=False):
            model = AutoModel.from_pretrained(teacher_path)
    else:
        model = AutoModel.from_pretrained(teacher_path)
    model.requires_grad_(False).eval().to(accelerator.device)
    autocast_dtype = teacher_autocast_dtype(dtype, accelerator.device)
    if accelerator.is_main_process and autocast_dtype == torch.bfloat16:
        warn_if_slow_bf16(accelerator.device, "--teacher_dtype bfloat16")
    return Teacher(model, str(teacher_path), autocast_dtype, micro_batch_size)


@dataclass
class StudentBudgets:
    """The budgets a student trains at (one drawn per step) and is validated at (all of them). The full-attention
    control has no budget dial: one "budget", `None`, validated and reported as "dense"."""

    values: list
    weights: list | None = None
    sampler: BudgetSampler | None = None

    @classmethod
    def for_student(
        cls, student: torch.nn.Module, budgets: str | None = None, budget_weights: str | None = None, seed: int = 0
    ) -> "StudentBudgets":
        """From `--budgets` / `--budget_weights` (`veca_hf.budgets.training_budgets`) for a VECA student."""
        if student.config.model_type != "veca":
            return cls([None])
        values, weights = training_budgets(student.config, budgets, budget_weights)
        return cls(values, weights, BudgetSampler(values, weights, seed=seed))

    def at(self, step: int) -> int | None:
        return None if self.sampler is None else self.sampler(step)


@dataclass
class HeldOut:
    """The held-out images and their teacher targets, computed once (the teacher is frozen)."""

    batches: list  # (pixel_values (B, 3, r, r), teacher cls (B, Dt), teacher patches (B, N, Dt)) on the device
    resolution: int
    num_images: int  # over all processes
    skipped: int

    @classmethod
    def from_stream(
        cls, accelerator: Accelerator, stream, teacher: Teacher, patch_size: int, batch_size: int, resolution: int
    ) -> "HeldOut":
        """Read this process's held-out images (an `ImageStream` at `resolution`) and compute their targets."""
        batches, skipped = [], 0
        for batch in torch.utils.data.DataLoader(stream, batch_size=batch_size, collate_fn=collate_images):
            skipped += batch["num_skipped"]
            if batch["pixel_values"] is None:
                continue
            pixel_values = batch["pixel_values"].to(accelerator.device)
            targets = teacher.targets(pixel_values, patch_size)
            batches.append((pixel_values, targets.cls, targets.patches))
        count = torch.tensor(sum(len(b[0]) for b in batches), device=accelerator.device)
        return cls(batches, resolution, int(accelerator.reduce(count, reduction="sum")), skipped)


@dataclass
class Progress:
    """What a run has done, saved in every checkpoint and restored on resume."""

    step: int = 0
    position: dict = field(default_factory=lambda: {"epoch": 0, "batches": 0})  # in this process's data stream
    images_seen: int = 0
    skipped: int = 0
    validation_history: list = field(default_factory=list)  # {"step": s, "losses": {budget label: terms}}


def resume_progress(accelerator: Accelerator, resume_path: Path | None, scheduler, guard: StepGuard) -> Progress:
    """The progress of the checkpoint at `resume_path` (weights, optimiser and RNG restored in place, the schedule
    and the non-finite step counts too), or a new run's when it is `None`."""
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


def open_sample_sources(output_dir: Path, process_index: int) -> TextIO:
    """`sample_sources/rank{r}.txt` in `output_dir`, appended to (a resumed run continues it), a line at a time."""
    (output_dir / "sample_sources").mkdir(parents=True, exist_ok=True)
    return open(output_dir / "sample_sources" / f"rank{process_index}.txt", "a", buffering=1)


@dataclass
class DistillationRun:
    """Everything a distillation run carries from step to step, and what it does at a checkpoint and at its end.

    `model` is the prepared `StudentWithLoss`; `batches` yields this process's training batches (`infinite_batches`,
    from `progress.position`); `run_arguments` are the run's flags, credentials redacted, saved in every checkpoint.
    """

    accelerator: Accelerator
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object  # stepped by hand, once per optimiser step
    guard: StepGuard
    teacher: Teacher
    budgets: StudentBudgets
    resolutions: object  # `ResolutionSchedule`: the resolution of each step
    held_out: HeldOut
    progress: Progress
    batches: Iterator[dict]
    output_dir: Path
    run_arguments: dict
    checkpoints_total_limit: int | None = None
    sample_sources: TextIO | None = None  # "step<TAB>image source" per training image, when asked for
    validation: dict | None = None  # the latest held-out losses of this process, per budget

    @property
    def checkpoints_dir(self) -> Path:
        return self.output_dir / "checkpoints"

    @property
    def student(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model).student

    def next_images(self, resolution: int) -> torch.Tensor:
        """The next training batch `(B, 3, r, r)` on the device at `resolution`; batches of unreadable images only
        are passed over, and every unreadable image is counted."""
        batch = next(self.batches)
        while batch["pixel_values"] is None:
            self.progress.skipped += batch["num_skipped"]
            batch = next(self.batches)
        self.progress.skipped += batch["num_skipped"]
        if self.sample_sources is not None:
            self.sample_sources.writelines(f"{self.progress.step}\t{source}\n" for source in batch["sources"])
        return resize_batch(batch["pixel_values"].to(self.accelerator.device, non_blocking=True), resolution)

    def validate(self, record: bool = True) -> dict:
        """The held-out losses at every budget; recorded in the progress and the trackers unless `record` is False
        (a resumed run that has no step left to take: its last step's validation is recorded already)."""
        self.validation = validation_losses(self.model, self.held_out.batches, self.budgets.values, self.accelerator)
        if not record:
            return self.validation
        labelled = {budget_label(b): r for b, r in self.validation.items()}
        self.progress.validation_history.append({"step": self.progress.step, "losses": labelled})
        if self.progress.step:
            self.accelerator.log(
                {f"validation/loss_C{label}": r["loss"] for label, r in labelled.items()}, step=self.progress.step
            )
        return self.validation

    def save_checkpoint(self) -> Path:
        """A resumable checkpoint of this step (every process must call it)."""
        progress = self.progress
        return save_checkpoint(
            self.accelerator,
            self.checkpoints_dir,
            progress.step,
            training_state={
                "step": progress.step,
                "num_processes": self.accelerator.num_processes,
                "scheduler": self.scheduler.state_dict(),
                **self.guard.state_dict(),
                "validation_history": progress.validation_history,
                "args": self.run_arguments,
            },
            process_state={
                **progress.position,
                "images_seen": progress.images_seen,
                "skipped_images": progress.skipped,
            },
            total_limit=self.checkpoints_total_limit,
            check_finite=(self.model, self.optimizer),
        )

    def report_stop(self, error: Exception) -> None:
        """Log why the run stopped, its newest checkpoint and how to continue from it."""
        steps = checkpoint_steps(self.checkpoints_dir)
        newest = f"{self.checkpoints_dir / f'checkpoint-{steps[-1]}'}" if steps else "none yet"
        cause = ""
        if "DataLoader worker" in str(error):  # PyTorch's SIGCHLD handler: a worker died (kill -9, the OOM killer)
            cause = " A DataLoader worker was killed from outside (SIGKILL, e.g. the kernel's OOM killer)."
        logger.error(
            f"The run stopped during step {self.progress.step + 1}.{cause} Newest checkpoint: {newest}. Fix the "
            "cause, then rerun with --resume_from_checkpoint latest to continue exactly from there."
        )

    def close(self) -> None:
        """Shut the DataLoader workers down and close the sample sources."""
        self.batches.close()
        if self.sample_sources is not None:
            self.sample_sources.close()

    def save_student(self) -> None:
        """save_pretrained + image processor, loadable with AutoModel.from_pretrained; the loss's projection beside
        it (every process must call it)."""
        accelerator = self.accelerator
        if accelerator.num_processes > 1 and not uses_zero3(accelerator):
            if replicas_agree(accelerator, self.model):
                logger.info(f"The weights agree on all {accelerator.num_processes} processes.")
            else:
                logger.error("The weights differ between processes: data parallelism broke; rank 0's copy is saved.")
        state_dict = accelerator.get_state_dict(self.model)  # gathers ZeRO-3 shards
        if not accelerator.is_main_process:
            return
        student_state = {k[len("student.") :]: v for k, v in state_dict.items() if k.startswith("student.")}
        self.student.save_pretrained(self.output_dir, state_dict=student_state)
        prefix = "criterion.projection."
        projection = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
        if projection:  # widths differ: the trained map into the teacher's space, to compare features with it
            save_file({k: v.contiguous() for k, v in projection.items()}, self.output_dir / PROJECTION_FILE)
        # The settings the validation transform was derived from (`build_transform(validation_resolution, ...)`).
        VecaImageProcessor.for_resolution(self.held_out.resolution).save_pretrained(self.output_dir)

    def write_results(self) -> dict:
        """`distill_results.json`: what the run did and its held-out losses per budget (also returned)."""
        results = {
            "step": self.progress.step,
            "images_seen_main_process": self.progress.images_seen,
            "skipped_images": self.progress.skipped,
            "nonfinite_steps": self.guard.nonfinite_steps,
            "skipped_validation_images": self.held_out.skipped,
            "student_model_type": self.student.config.model_type,
            "validation": {budget_label(b): r for b, r in (self.validation or {}).items()},
            "validation_history": self.progress.validation_history,
        }
        (self.output_dir / RESULTS_FILE).write_text(json.dumps(results, indent=2))
        return results

    def results_table(self) -> str:
        """The held-out losses and cosines per budget, at initialisation (when validated then) and now."""
        history = self.progress.validation_history
        before = history[0]["losses"] if history[0]["step"] == 0 else None
        after = {budget_label(b): r for b, r in self.validation.items()}
        return before_after_table(
            before, after, self.progress.step, self.held_out.resolution, self.held_out.num_images
        )


__all__ = [
    "RESULTS_FILE",
    "DistillationRun",
    "HeldOut",
    "Progress",
    "StudentBudgets",
    "Teacher",
    "budget_label",
    "enable_activation_checkpointing",
    "load_teacher",
    "open_sample_sources",
    "resume_progress",
    "setup_accelerator_logging",
    "uses_zero3",
]
