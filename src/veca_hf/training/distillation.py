# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Distillation pieces: resolution sampling, teacher targets, the loss, the full-attention control student (the
budgets are in `veca_hf.budgets`).

They follow the elastic training and the distillation recipe of the paper (arXiv 2605.12491; docs/training.md
lists the recipe as flags). Everything here is pure and testable; `veca_hf.training.distillation_run` holds a run's
state with Accelerate, and `examples/distill.py` is the glue that runs it.

Shape legend: B batch, N patches, C active cores, D student width, Dt teacher width.
"""

import difflib
import json
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from transformers import AutoConfig, AutoModel, DINOv3ViTConfig, DINOv3ViTModel
from transformers.utils import cached_file, logging

from ..arguments import canonical_dtype
from ..budgets import WeightedChoice
from ..model.configuration_veca import VecaConfig
from ..model.modeling_utils_veca import gathered_for_init
from ..model.modeling_veca import VecaModel


logger = logging.get_logger(__name__)

# The paper's training recipe, stage 2: one resolution per step, the mix changing at step 7k.
PAPER_STAGE2_RESOLUTION_SCHEDULE = "0:256,384,512@0.35,0.35,0.30;7000:256,384,512,768@0.15,0.25,0.30,0.30"


class ResolutionSchedule:
    """One training resolution per optimiser step, from a piecewise schedule of weighted choices.

    The text format is `"start:res,res,...@p,p,...;start:..."`, e.g. the paper's stage 2
    (`PAPER_STAGE2_RESOLUTION_SCHEDULE`); a plain `"256"` means a single resolution throughout.

    Args:
        schedule (`str` or `int`): the schedule text, or one fixed resolution.
        seed (`int`): the run's seed.
    """

    def __init__(self, schedule: str | int, seed: int = 0):
        self.stages: list[tuple[int, WeightedChoice]] = []
        for part in str(schedule).replace(" ", "").split(";"):
            start, _, choice = part.rpartition(":")
            resolutions, _, weights = choice.partition("@")
            try:
                values = [int(r) for r in resolutions.split(",")]
                probabilities = [float(w) for w in weights.split(",")] if weights else None
                start_step = int(start) if start else 0
            except ValueError as error:
                raise ValueError(
                    f"Cannot parse resolution schedule {schedule!r} ({error}); expected e.g. '256' or "
                    f"'{PAPER_STAGE2_RESOLUTION_SCHEDULE}'."
                ) from None
            if any(v <= 0 for v in values):
                raise ValueError(f"Resolutions must be positive, got {values} in {schedule!r}.")
            self.stages.append((start_step, WeightedChoice(values, probabilities, seed=seed, stream=2)))
        self.stages.sort(key=lambda stage: stage[0])
        if self.stages[0][0] != 0:
            raise ValueError(f"The resolution schedule {schedule!r} must start at step 0.")

    @property
    def max_resolution(self) -> int:
        return max(max(choice.values) for _, choice in self.stages)

    @property
    def resolutions(self) -> list[int]:
        return sorted({v for _, choice in self.stages for v in choice.values})

    def __call__(self, step: int) -> int:
        choice = next(choice for start, choice in reversed(self.stages) if step >= start)
        return choice(step)


@dataclass
class TeacherTargets:
    """The teacher's final-norm outputs: `cls (B, Dt)` and `patches (B, N, Dt)` (registers dropped)."""

    cls: torch.Tensor
    patches: torch.Tensor


def teacher_image_size(height: int, width: int, student_patch_size: int, teacher_patch_size: int) -> tuple[int, int]:
    """The size at which the teacher sees the image so that its patch grid equals the student's."""
    if height % student_patch_size or width % student_patch_size:
        raise ValueError(
            f"Image size {height}x{width} is not a multiple of the student's patch size {student_patch_size}."
        )
    return height // student_patch_size * teacher_patch_size, width // student_patch_size * teacher_patch_size


def _patch_size(config) -> int:
    patch_size = config.patch_size
    return patch_size[0] if isinstance(patch_size, (tuple, list)) else int(patch_size)


def teacher_normalization(teacher_name_or_path: str) -> tuple[list[float], list[float]] | None:
    """The `(image_mean, image_std)` of a teacher's `preprocessor_config.json` (folder or cached Hub id), or `None`."""
    try:
        path = cached_file(
            teacher_name_or_path,
            "preprocessor_config.json",
            _raise_exceptions_for_missing_entries=False,
            _raise_exceptions_for_connection_errors=False,
        )
    except (OSError, ValueError):
        return None
    if path is None:
        return None
    config = json.loads(open(path).read())
    if config.get("image_mean") is None or config.get("image_std") is None:
        return None
    return [float(v) for v in config["image_mean"]], [float(v) for v in config["image_std"]]


def transform_normalization(transform) -> tuple[list[float], list[float]] | None:
    """The mean and std of the first `Normalize` in a torchvision `Compose` (or the transform itself), or `None`."""
    for step in getattr(transform, "transforms", [transform]):
        if hasattr(step, "mean") and hasattr(step, "std"):
            return [float(v) for v in step.mean], [float(v) for v in step.std]
    return None


def check_teacher_student(
    teacher_config,
    student_config,
    resolutions: Sequence[int],
    teacher_mean_std: tuple[Sequence[float], Sequence[float]] | None = None,
    student_mean_std: tuple[Sequence[float], Sequence[float]] | None = None,
    tolerance: float = 1e-3,
) -> None:
    """
    Check, before the first step, that a teacher and a student can be distilled together at these resolutions.

    - every resolution is a multiple of the student's patch size (the teacher then sees the image resized to its own
      patch size times the student's grid, so any teacher patch size works: `teacher_image_size`);
    - both take the same number of channels;
    - the teacher's normalisation (its `preprocessor_config.json`) equals the student's data pipeline's: the teacher
      sees exactly the student's input tensors, so a different mean or std would shift every target.

    Args:
        teacher_config: the teacher's `config` (DINOv3 / DINOv2).
        student_config: the student's config (`VecaConfig` or the full-attention control's `DINOv3ViTConfig`).
        resolutions (`Sequence[int]`): every training and validation resolution.
        teacher_mean_std (`tuple`, *optional*): the teacher's `(mean, std)` (see `teacher_normalization`);
            `None` when unknown (not checked).
        student_mean_std (`tuple`, *optional*): the student pipeline's `(mean, std)` (see
            `transform_normalization`); `None` when unknown (not checked).
        tolerance (`float`, *optional*, defaults to 1e-3): largest accepted difference per channel.

    Raises:
        `ValueError`: naming what disagrees and how to fix it.
    """
    student_patch, teacher_patch = _patch_size(student_config), _patch_size(teacher_config)
    if teacher_patch <= 0:
        raise ValueError(f"The teacher's patch size {teacher_patch} is not a positive integer.")
    bad = [r for r in resolutions if r % student_patch]
    if bad:
        raise ValueError(
            f"Resolution(s) {bad} are not multiples of the student's patch size {student_patch}: pick --resolution "
            f"(and --validation_resolution) among multiples of {student_patch} (the teacher, patch size "
            f"{teacher_patch}, sees each image resized to {teacher_patch} x the student's patch grid)."
        )
    teacher_channels = getattr(teacher_config, "num_channels", 3)
    student_channels = getattr(student_config, "num_channels", 3)
    if teacher_channels != student_channels:
        raise ValueError(
            f"The teacher takes {teacher_channels}-channel images and the student {student_channels}-channel ones: "
            "distil from a teacher with the student's num_channels."
        )
    if teacher_mean_std is None or student_mean_std is None:
        return
    (teacher_mean, teacher_std), (student_mean, student_std) = teacher_mean_std, student_mean_std
    if len(teacher_mean) != len(student_mean) or any(
        abs(a - b) > tolerance
        for a, b in zip([*teacher_mean, *teacher_std], [*student_mean, *student_std], strict=False)
    ):
        raise ValueError(
            f"The teacher expects images normalised with mean {list(teacher_mean)} and std {list(teacher_std)} (its "
            f"preprocessor_config.json), but the student's data pipeline normalises with mean {list(student_mean)} "
            f"and std {list(student_std)}; the teacher sees the student's tensors, so every target would be shifted. "
            "Distil from a teacher that uses the student's normalisation (the LVD-1689M DINOv3 and the DINOv2 "
            "checkpoints use ImageNet's), or correct image_mean / image_std in the teacher's preprocessor_config.json "
            "if they are wrong."
        )


@torch.no_grad()
def compute_teacher_targets(
    teacher: nn.Module,
    pixel_values: torch.Tensor,
    student_patch_size: int,
    micro_batch_size: int | None = None,
    autocast_dtype: torch.dtype | None = None,
) -> TeacherTargets:
    """Runs the frozen teacher on the student's normalised images and returns its distillation targets.

    As in the paper's distillation objective, the CLS token is token 0 of `last_hidden_state` (already after the
    teacher's final norm); the patch targets are the tokens after `1 + num_register_tokens`. A teacher with another
    patch size (DINOv2 uses 14) sees the image resized so that both patch grids are equal.

    Args:
        teacher (`nn.Module`): a DINOv3 / DINOv2 `AutoModel`; it is kept in eval mode (DINOv3's train mode
            randomly rescales its RoPE).
        pixel_values (`torch.Tensor` of shape `(B, 3, H, W)`): the student's input batch.
        student_patch_size (`int`): the student's patch size.
        micro_batch_size (`int`, *optional*): run the teacher on this many images at a time (all at once if `None`).
        autocast_dtype (`torch.dtype`, *optional*): e.g. `torch.bfloat16` to run the teacher in reduced precision.
    """
    if teacher.training:
        teacher.eval()
    config = teacher.config
    teacher_patch_size = _patch_size(config)
    num_prefix_tokens = 1 + int(getattr(config, "num_register_tokens", 0) or 0)
    height, width = pixel_values.shape[-2:]
    teacher_size = teacher_image_size(height, width, student_patch_size, teacher_patch_size)
    if teacher_size != (height, width):
        pixel_values = F.interpolate(
            pixel_values, size=teacher_size, mode="bicubic", antialias=True, align_corners=False
        )
    num_patches = (height // student_patch_size) * (width // student_patch_size)

    micro_batch_size = micro_batch_size or pixel_values.shape[0]
    cls_parts, patch_parts = [], []
    for chunk in pixel_values.split(micro_batch_size):
        with torch.autocast(chunk.device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            hidden = teacher(pixel_values=chunk).last_hidden_state  # (b, prefix + N, Dt)
        if hidden.shape[1] - num_prefix_tokens != num_patches:
            raise ValueError(
                f"The teacher returned {hidden.shape[1]} tokens for a {teacher_size[0]}x{teacher_size[1]} image; "
                f"after {num_prefix_tokens} CLS/register tokens that is {hidden.shape[1] - num_prefix_tokens} "
                f"patches, but the student has {num_patches}. Check the teacher's patch size and registers."
            )
        cls_parts.append(hidden[:, 0].float())
        patch_parts.append(hidden[:, num_prefix_tokens:].float())
    return TeacherTargets(cls=torch.cat(cls_parts), patches=torch.cat(patch_parts))


# Where `examples/distill.py` saves the loss's projection (student width -> teacher width) beside the student.
PROJECTION_FILE = "distillation_projection.safetensors"


class DistillationLoss(nn.Module):
    """`L = L_global + dense_weight * (L_dense_cos + mse_weight * L_dense_mse)` in fp32: the paper's objective. Its
    "dense" terms are those on the patch tokens (the paper's name, kept in the flag `--dense_weight` and in the logged
    `dense_cosine_loss` / `dense_mse_loss`); they have nothing to do with dense tasks or the full-attention control.

    - `L_global = mean_b (1 - cos(student global core, teacher CLS))`
    - `L_dense_cos = mean_{b,n} (1 - cos(student patch, teacher patch))`
    - `L_dense_mse = mean over all elements of (student patch - teacher patch)^2`

    With different widths a trainable linear projection maps the student to the teacher's width (none when equal,
    as for every released pair).

    Args:
        student_hidden_size (`int`): the student's width `D`.
        teacher_hidden_size (`int`): the teacher's width `Dt`.
        dense_weight (`float`, *optional*, defaults to 1.0): `lambda_dense`.
        mse_weight (`float`, *optional*, defaults to 1.0): `beta`.
    """

    def __init__(
        self, student_hidden_size: int, teacher_hidden_size: int, dense_weight: float = 1.0, mse_weight: float = 1.0
    ):
        super().__init__()
        self.projection = (
            nn.Linear(student_hidden_size, teacher_hidden_size) if student_hidden_size != teacher_hidden_size else None
        )
        self.dense_weight = dense_weight
        self.mse_weight = mse_weight

    def forward(
        self, student_global: torch.Tensor, student_patches: torch.Tensor, targets: TeacherTargets
    ) -> dict[str, torch.Tensor]:
        # (B, D), (B, N, D) -> the teacher's width, fp32
        if self.projection is not None:
            student_global, student_patches = self.projection(student_global), self.projection(student_patches)
        student_global, student_patches = student_global.float(), student_patches.float()
        if student_patches.shape != targets.patches.shape:
            raise ValueError(
                f"Student patches {tuple(student_patches.shape)} and teacher patches {tuple(targets.patches.shape)} "
                "differ: the patch grids must match."
            )
        global_loss = (1 - F.cosine_similarity(student_global, targets.cls, dim=-1, eps=1e-6)).mean()
        dense_cosine_loss = (1 - F.cosine_similarity(student_patches, targets.patches, dim=-1, eps=1e-6)).mean()
        dense_mse_loss = F.mse_loss(student_patches, targets.patches)
        loss = global_loss + self.dense_weight * (dense_cosine_loss + self.mse_weight * dense_mse_loss)
        return {
            "loss": loss,
            "global_loss": global_loss.detach(),
            "dense_cosine_loss": dense_cosine_loss.detach(),
            "dense_mse_loss": dense_mse_loss.detach(),
        }


PATCH_EMBEDDING_INIT_MODES = ("auto", "yes", "no")
TEACHER_DTYPES = ("auto", "bfloat16", "float16", "float32")


def patch_embedding_conv(model: nn.Module) -> nn.Conv2d:
    """The patch convolution of a VECA, DINOv3 or DINOv2 model: the first `nn.Conv2d` under `model.embeddings`."""
    embeddings = getattr(model, "embeddings", None)
    for module in embeddings.modules() if embeddings is not None else ():
        if isinstance(module, nn.Conv2d):
            return module
    raise ValueError(f"{type(model).__name__} has no patch convolution (an nn.Conv2d) under `embeddings`.")


def init_patch_embeddings_from_teacher(student: nn.Module, teacher: nn.Module, mode: str = "auto") -> bool:
    """
    Copy the teacher's patch convolution (weight and bias) into the student before training, as the research code
    does: the student then starts from the teacher's view of a patch.

    Args:
        student (`VecaModel` or `DINOv3ViTModel`): the student (its parameters may be ZeRO-3 partitions).
        teacher (`nn.Module`): a DINOv3 / DINOv2 model.
        mode (`str`): `"auto"` copies when the shapes match and says what it did either way; `"yes"` copies or
            raises; `"no"` leaves the student as it is.

    Returns:
        `bool`: whether the weights were copied.

    Raises:
        `ValueError`: for an unknown `mode`, or `"yes"` with shapes that differ (naming both).
    """
    if mode not in PATCH_EMBEDDING_INIT_MODES:
        raise ValueError(
            f"--init_patch_embeddings_from_teacher {mode!r} is not one of {', '.join(PATCH_EMBEDDING_INIT_MODES)}."
        )
    if mode == "no":
        return False
    source, target = patch_embedding_conv(teacher), patch_embedding_conv(student)
    with gathered_for_init(target), torch.no_grad():  # ZeRO-3: the whole weight, written on rank 0 and broadcast
        shapes = {"teacher": tuple(source.weight.shape), "student": tuple(target.weight.shape)}
        same = shapes["teacher"] == shapes["student"] and (source.bias is None) == (target.bias is None)
        if not same:
            message = (
                f"the teacher's patch convolution has weight shape {shapes['teacher']} (bias: "
                f"{source.bias is not None}) "
                f"and the student's {shapes['student']} (bias: {target.bias is not None})"
            )
            if mode == "yes":
                raise ValueError(
                    f"--init_patch_embeddings_from_teacher yes: {message}; they must be equal (same width, patch size "
                    "and channels). Use 'auto' to copy only when they match, or 'no'."
                )
            logger.info(f"Patch embedding not copied from the teacher: {message}.")
            return False
        target.weight.copy_(source.weight)
        if target.bias is not None:
            target.bias.copy_(source.bias)
    logger.info(f"Patch embedding copied from the teacher: weight {shapes['student']} and bias.")
    return True


# fields that `VecaConfig` and `DINOv3ViTConfig` name and mean alike
_DENSE_STUDENT_COPIED_FIELDS = (
    "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "hidden_act", "layer_norm_eps",
    "initializer_range", "image_size", "patch_size", "num_channels", "rope_theta", "pos_embed_shift",
    "pos_embed_jitter", "pos_embed_rescale",
)  # fmt: skip


def full_attention_student_config(config: VecaConfig, num_register_tokens: int = 0) -> DINOv3ViTConfig:
    """A `DINOv3ViTConfig` of the same size as a VECA config: the control student whose only difference is dense
    patch-to-patch attention (and a CLS token in place of the core bank).

    Width, depth, heads, SwiGLU MLP, biases, patch size, RoPE base and the training-time RoPE augmentations are
    copied. What DINOv3's block has and VECA's has not: a learnable LayerScale per branch (initialised to 1, i.e.
    the identity at start) and RoPE without zeroed low frequencies.
    """
    copied = {name: getattr(config, name) for name in _DENSE_STUDENT_COPIED_FIELDS}
    biases = dict(query_bias=True, key_bias=True, value_bias=True, proj_bias=True, mlp_bias=True)
    return DINOv3ViTConfig(
        **copied, **biases, use_gated_mlp=True, layerscale_value=1.0, num_register_tokens=num_register_tokens
    )


class StudentWithLoss(nn.Module):
    """The trainable part of distillation in one module (student + optional projection), so DDP / DeepSpeed wrap
    one model and unused-parameter handling covers both.

    The student is a `VecaModel` (global feature: core 1; patches: the tokens after the `C` active cores) or a dense
    `DINOv3ViTModel` control (global feature: CLS; patches: the tokens after CLS and registers; the budget is
    ignored).

    Args:
        student (`VecaModel` or `DINOv3ViTModel`): the student.
        criterion (`DistillationLoss`): the loss, possibly holding a trainable projection.
    """

    def __init__(self, student: nn.Module, criterion: DistillationLoss):
        super().__init__()
        self.student = student
        self.criterion = criterion
        self.is_veca = student.config.model_type == "veca"
        self.num_prefix_tokens = 0 if self.is_veca else 1 + int(getattr(student.config, "num_register_tokens", 0) or 0)

    def forward(
        self,
        pixel_values: torch.Tensor,
        num_core_tokens: int | None,
        teacher_cls: torch.Tensor,
        teacher_patches: torch.Tensor,
    ) -> dict[str, torch.Tensor]:
        if self.is_veca:
            num_prefix_tokens = self.student.resolve_num_core_tokens(num_core_tokens)  # the C active cores
            outputs = self.student(pixel_values, num_core_tokens=num_prefix_tokens)
        else:
            outputs = self.student(pixel_values)
            num_prefix_tokens = self.num_prefix_tokens
        student_patches = outputs.last_hidden_state[:, num_prefix_tokens:]  # (B, N, D)
        return self.criterion(outputs.pooler_output, student_patches, TeacherTargets(teacher_cls, teacher_patches))


def parse_config_overrides(overrides: str | dict | None, name: str = "--student_overrides") -> dict:
    """`VecaConfig` field overrides from a dict or its JSON; an unknown field or anything but a JSON object is a
    `ValueError` naming it (a typo would otherwise be ignored and the default built)."""
    if isinstance(overrides, str):
        try:
            overrides = json.loads(overrides)
        except json.JSONDecodeError as error:
            raise ValueError(f"{name} {overrides!r} is not valid JSON ({error}).") from None
    overrides = {} if overrides is None else overrides
    if not isinstance(overrides, dict):
        raise ValueError(
            f"{name} must be a JSON object of VecaConfig fields, e.g. '{{\"num_hidden_layers\": 6}}', got a "
            f"{type(overrides).__name__}: {overrides!r}."
        )
    fields = set(VecaConfig.__dataclass_fields__) | {"out_features", "out_indices", "num_labels"}
    unknown = sorted(key for key in overrides if key not in fields or key.startswith("_"))
    if unknown:
        close = {key: difflib.get_close_matches(key, sorted(fields), n=1) for key in unknown}
        hints = ", ".join(f"{key!r}" + (f" (did you mean {match[0]!r}?)" if match else "")
                          for key, match in close.items())  # fmt: skip
        raise ValueError(f"{name}: unknown VecaConfig field(s) {hints}.")
    return dict(overrides)


def build_student_config(
    student_config: str | None = None, student_preset: str | None = None, student_overrides: str | dict | None = None
) -> VecaConfig:
    """The student's `VecaConfig`: a saved config (folder or Hub id) or a preset (default `"veca-b16"`), with
    `student_overrides` (a dict or its JSON) applied on top. Backbone stages are recomputed from the new depth."""
    overrides = parse_config_overrides(student_overrides)
    if not student_config:
        return VecaConfig.from_preset(student_preset or "veca-b16", **overrides)
    config = VecaConfig.from_pretrained(student_config)
    if not overrides:
        return config
    values = config.to_dict()
    for key in ("out_features", "out_indices", "stage_names"):  # backbone stages follow num_hidden_layers
        values.pop(key, None)
    return VecaConfig(**{**values, **overrides})


def build_student(
    student_name_or_path: str | None = None,
    student_config: str | None = None,
    student_preset: str | None = None,
    student_overrides: str | dict | None = None,
) -> nn.Module:
    """The student to distil: the saved model at `student_name_or_path`, or random weights from a config.

    The config decides the model: a VECA config (a preset, a saved `VecaConfig`, with `student_overrides`) gives a
    `VecaModel`; a saved `DINOv3ViTConfig` (e.g. `full_attention_student_config`'s, the control) gives a
    `DINOv3ViTModel`, trained without budgets. Anything else is a `ValueError`: the loss reads VECA's or DINOv3's
    token layout.
    """
    if student_name_or_path:
        given = {"--student_config": student_config, "--student_preset": student_preset,
                 "--student_overrides": student_overrides}  # fmt: skip
        if any(given.values()):
            raise ValueError(
                f"--student_name_or_path {student_name_or_path} brings its own config; drop "
                f"{', '.join(flag for flag, value in given.items() if value)} (or train from a config without "
                "--student_name_or_path)."
            )
        model_type = AutoConfig.from_pretrained(student_name_or_path).model_type
        _check_student_model_type(model_type, student_name_or_path)
        return AutoModel.from_pretrained(student_name_or_path)
    if student_config:
        config = AutoConfig.from_pretrained(student_config)
        _check_student_model_type(config.model_type, student_config)
        if config.model_type != "veca":
            if student_preset or student_overrides:
                raise ValueError(
                    f"--student_config {student_config} is a {config.model_type} config: --student_preset and "
                    "--student_overrides apply to VECA configs only; edit the config file instead."
                )
            return DINOv3ViTModel(config)
    return VecaModel(build_student_config(student_config, student_preset, student_overrides))


def _check_student_model_type(model_type: str, source: str) -> None:
    if model_type not in ("veca", "dinov3_vit"):
        raise ValueError(
            f"The student {source} is a {model_type!r} model; distillation trains a VECA student ('veca') or its "
            "full-attention control ('dinov3_vit', see veca_hf.training.distillation.full_attention_student_config)."
        )


def teacher_autocast_dtype(name: str, device: torch.device) -> torch.dtype | None:
    """The teacher's autocast dtype for `name`: `"auto"` (bfloat16 on GPU, none (float32) elsewhere), `"bfloat16"`,
    `"float16"` or `"float32"` (none), or their short spellings `"bf16"`, `"fp16"`, `"fp32"`."""
    name = canonical_dtype("--teacher_dtype", name, TEACHER_DTYPES)
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else None
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": None}[name]


@torch.no_grad()
def validation_losses(
    model: nn.Module, validation_batches: Sequence[tuple], budgets: Sequence[int | None], accelerator
) -> dict[int | None, dict[str, float]]:
    """The mean loss terms on held-out images for every budget (the elastic curve), averaged over all processes.

    Args:
        model (`StudentWithLoss`, possibly wrapped by `accelerator.prepare`): put back in train mode afterwards.
        validation_batches: `(pixel_values, teacher_cls, teacher_patches)` per batch, on `accelerator.device`.
        budgets: the budgets to evaluate (`[None]` for a dense student).
        accelerator (`accelerate.Accelerator`): for autocast and the reduction over processes.

    Returns:
        Per budget, `loss`, `global_loss`, `dense_cosine_loss` and `dense_mse_loss`, each a mean over all held-out
        images.
    """
    model.eval()
    totals = {budget: torch.zeros(5, device=accelerator.device) for budget in budgets}  # 4 loss terms + count
    for pixel_values, teacher_cls, teacher_patches in validation_batches:
        count = pixel_values.shape[0]
        for budget in budgets:
            with accelerator.autocast():
                terms = model(pixel_values, budget, teacher_cls, teacher_patches)
            totals[budget] += torch.stack([
                terms["loss"].float() * count, terms["global_loss"] * count, terms["dense_cosine_loss"] * count,
                terms["dense_mse_loss"] * count, torch.tensor(float(count), device=accelerator.device),
            ])  # fmt: skip
    model.train()
    results = {}
    for budget, total in totals.items():
        total = accelerator.reduce(total, reduction="sum")
        count = max(float(total[4]), 1.0)
        results[budget] = {
            "loss": float(total[0]) / count,
            "global_loss": float(total[1]) / count,
            "dense_cosine_loss": float(total[2]) / count,
            "dense_mse_loss": float(total[3]) / count,
        }
    return results


def before_after_table(before: dict | None, after: dict, step: int, resolution: int, num_images: int) -> str:
    """What a run did, per budget, on held-out images: the loss and the cosine of the global and patch features to
    the teacher's, at initialisation (`before`, `None` if unknown) and after `step` steps (`after`). Both are
    `{budget label: terms}` from `validation_losses`; a cosine is `1 - ` its loss term."""

    def cell(name: str, label: str, cosine: bool) -> str:
        values = [terms[label][name] for terms in (before, after) if terms is not None and label in terms]
        values = [1 - v if cosine else v for v in values]
        return " -> ".join(f"{v:.4f}" for v in values)

    lines = [
        f"Held-out images ({num_images} at {resolution} px), "
        + ("before the first step -> " if before else "")
        + f"after step {step}:",
        "| budget C | loss (lower is better) | global cosine to the teacher | patch cosine to the teacher |",
        "|---|---|---|---|",
    ]
    for label in after:
        lines.append(f"| {label} | {cell('loss', label, False)} | {cell('global_loss', label, True)} | "
                     f"{cell('dense_cosine_loss', label, True)} |")  # fmt: skip
    return "\n".join(lines)


__all__ = [
    "PAPER_STAGE2_RESOLUTION_SCHEDULE",
    "PATCH_EMBEDDING_INIT_MODES",
    "PROJECTION_FILE",
    "DistillationLoss",
    "ResolutionSchedule",
    "StudentWithLoss",
    "TeacherTargets",
    "before_after_table",
    "build_student",
    "build_student_config",
    "check_teacher_student",
    "compute_teacher_targets",
    "full_attention_student_config",
    "init_patch_embeddings_from_teacher",
    "patch_embedding_conv",
    "TEACHER_DTYPES",
    "teacher_autocast_dtype",
    "teacher_image_size",
    "teacher_normalization",
    "transform_normalization",
    "validation_losses",
]
