# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""VECA (Visual Elastic Core Attention) model configuration."""

import math
import numbers
from dataclasses import MISSING, fields
from types import NoneType
from typing import get_args

from huggingface_hub.dataclasses import strict
from huggingface_hub.errors import StrictDataclassFieldValidationError
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneConfigMixin
from transformers.configuration_utils import PreTrainedConfig


# The four released sizes (the paper's model sizes, arXiv 2605.12491). Everything else keeps the class defaults.
VECA_PRESETS: dict[str, dict] = {
    "veca-s16": {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6, "intermediate_size": 1024},
    "veca-splus16": {"hidden_size": 384, "num_hidden_layers": 12, "num_attention_heads": 6, "intermediate_size": 1536},
    "veca-b16": {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 2048},
    "veca-l16": {"hidden_size": 1024, "num_hidden_layers": 24, "num_attention_heads": 16, "intermediate_size": 2730},
}

# The DINOv3 teacher of the same width that each released size was distilled from.
VECA_PRESET_TEACHERS: dict[str, str] = {
    "veca-s16": "facebook/dinov3-vits16-pretrain-lvd1689m",
    "veca-splus16": "facebook/dinov3-vits16plus-pretrain-lvd1689m",
    "veca-b16": "facebook/dinov3-vitb16-pretrain-lvd1689m",
    "veca-l16": "facebook/dinov3-vitl16-pretrain-lvd1689m",
}


# Farthest-point sampling makes one pass over all candidates per core at every initialisation. Its result is only as
# fine as the candidates: 100,000 uniform points lie about 0.006 r apart, far closer than the cores of any practical
# bank (0.25 r apart for 64 cores), so more only cost time and memory (100,000 x 64 cores: ~0.1 s on one CPU core).
MAX_CORE_COORDINATE_INIT_CANDIDATES = 100_000


def type_errors_as_value_errors(cls):
    """Makes the type check that `@strict` runs on every field assignment (`__init__` included) raise a `ValueError`
    naming the field, the value and the type to pass, like every other check of the config."""
    strict_setattr = cls.__setattr__

    def __setattr__(self, name, value):
        try:
            strict_setattr(self, name, value)
        except StrictDataclassFieldValidationError as error:
            field = cls.__dataclass_fields__[name]
            expected = field.type.__name__ if isinstance(field.type, type) else str(field.type)
            example = f"{name}={field.default!r}" if field.default not in (MISSING, None) else f"a {expected} value"
            raise ValueError(
                f"{name}={value!r} has type {type(value).__name__}, but {name} takes {expected}: pass e.g. {example}."
            ) from error

    cls.__setattr__ = __setattr__
    return cls


@type_errors_as_value_errors
@strict
class VecaConfig(BackboneConfigMixin, PreTrainedConfig):
    r"""
    Configuration of a [`VecaModel`]. The defaults describe VECA-B/16; `VecaConfig.from_preset(name)` builds any of
    the released sizes (`"veca-s16"`, `"veca-splus16"`, `"veca-b16"`, `"veca-l16"`).

    VECA is a ViT whose patches never attend to each other: every block runs core-periphery attention, in which a
    small ordered bank of learned *core* tokens attends to all tokens and each patch attends to the cores only. The
    first `C` cores of the bank are active (the budget, a multiple of `core_chunk_size`); `C` can be changed per call.

    A config is checked when it is built: a value of the wrong type (also when assigned later) or out of its range
    (every float must be finite) raises a `ValueError` that names the field, the value and what is allowed.

    Args:
        hidden_size (`int`, *optional*, defaults to 768):
            Width `D` of the residual stream.
        num_hidden_layers (`int`, *optional*, defaults to 12):
            Number of transformer blocks `L`.
        num_attention_heads (`int`, *optional*, defaults to 12):
            Number of attention heads; the head size `hidden_size / num_attention_heads` must be a multiple of 4
            (2D RoPE splits it into x and y halves of channel pairs).
        intermediate_size (`int`, *optional*, defaults to 2048):
            Hidden width of the SwiGLU MLP (`int(hidden_size * mlp_ratio)` in the reference code).
        hidden_act (`str`, *optional*, defaults to `"silu"`):
            Activation applied to the gate half of the SwiGLU MLP.
        layer_norm_eps (`float`, *optional*, defaults to 1e-5):
            Epsilon of every LayerNorm.
        initializer_range (`float`, *optional*, defaults to 0.02):
            Standard deviation of the truncated normal used for linear and patch-embedding weights.
        image_size (`int`, *optional*, defaults to 256):
            Training resolution. Informative only: any height and width that are multiples of `patch_size` work.
        patch_size (`int`, *optional*, defaults to 16):
            Side of the square patches.
        num_channels (`int`, *optional*, defaults to 3):
            Number of input channels.
        core_bank_size (`int`, *optional*, defaults to 64):
            Size `M` of the core bank, the largest budget. A multiple of `core_chunk_size`. (`num_core_tokens` is
            the budget `C` that `forward` takes; configs that used it for the bank still load.)
        core_chunk_size (`int`, *optional*, defaults to 8):
            Cores are stored, and budgets chosen, in chunks of this many. The smallest budget is one chunk.
        default_num_core_tokens (`int`, *optional*):
            Budget used when `forward` is called without `num_core_tokens` (pipelines, `Trainer`). `None` means
            the whole bank (`core_bank_size`); `"auto"`, a budget per image picked by `adaptive_budget`.
        adaptive_budget (`dict`, *optional*):
            A fitted budget policy (written by `veca_hf.AdaptiveBudget`): with `num_core_tokens="auto"` (or
            `default_num_core_tokens="auto"`), every image runs first at the policy's smallest budget and then, if
            the policy predicts more cores would change its global feature by more than its threshold, at a larger
            one (docs/budget_picker.md, "A budget per image, picked by the model").
        group_image_budgets (`bool`, *optional*, defaults to `True`):
            How a batch whose images have different budgets (`num_core_tokens` a list) runs: `True`, one forward per
            budget on the images of that budget, so each image costs only its own cores; `False`, one forward at the
            largest budget with the cores an image does not use masked out of its attention (one graph, as
            `torch.compile` and ONNX export need; traced and compiled calls always run this way). Outputs are the
            same either way.
        rope_theta (`float`, *optional*, defaults to 100.0):
            Base of the RoPE periods, as in DINOv3.
        rope_zero_frequency_ratio (`float`, *optional*, defaults to 0.125):
            Fraction of the RoPE frequencies (the lowest ones) set to zero, leaving those channels unrotated.
        pos_embed_shift (`float`, *optional*, defaults to 0.08):
            Training only: patch coordinates are shifted per axis by `U(-shift, shift)`. `None` disables.
        pos_embed_jitter (`float`, *optional*):
            Training only: patch coordinates are scaled per axis by a log-uniform factor in `[1/jitter, jitter]`.
            `None` (the default) disables.
        pos_embed_rescale (`float`, *optional*, defaults to 2.0):
            Training only: patch coordinates are scaled (both axes together) by a log-uniform factor in
            `[1/rescale, rescale]`. `None` disables.
        core_coordinate_init_range (`float`, *optional*, defaults to 0.95):
            Initial core positions are farthest-point samples of points drawn uniformly in `[-r, r]^2`.
        core_coordinate_init_candidates (`int`, *optional*, defaults to 1000):
            Number of uniform candidate points the farthest-point sampling picks the initial core positions from
            (from `core_bank_size` to 100,000).
        core_coordinate_step_init (`float`, *optional*, defaults to 0.01):
            Initial value of each layer's learned coordinate step scale `alpha_l`.
        apply_layernorm (`bool`, *optional*, defaults to `True`):
            [`VecaBackbone`] only: apply the final LayerNorm to every returned feature map.
        reshape_hidden_states (`bool`, *optional*, defaults to `True`):
            [`VecaBackbone`] only: return feature maps as `(batch, hidden_size, height / patch, width / patch)` (for
            UperNet and other convolutional heads). `False` returns token sequences `(batch, 1 + num_patches,
            hidden_size)`: the global core (core 1) as the single prefix token, then the patches in row-major order,
            the ViT layout that Depth Anything and DPT expect.
        out_features (`list[str]`, *optional*):
            [`VecaBackbone`] only: stages to return, among `"stem"`, `"stage1"`, ..., `"stage{L}"`.
        out_indices (`list[int]`, *optional*):
            [`VecaBackbone`] only: indices of the stages to return (alternative to `out_features`).
        semantic_loss_ignore_index (`int`, *optional*, defaults to 255):
            [`VecaForSemanticSegmentation`] only: the label that the loss ignores (unlabelled and padded pixels), as
            in SegFormer's and BEiT's configs.

    Example:

    ```python
    >>> from veca_hf import VecaConfig, VecaModel

    >>> # VECA-S/16 with random weights
    >>> config = VecaConfig.from_preset("veca-s16")
    >>> model = VecaModel(config)

    >>> # a budget of 16 cores for calls that cannot pass `num_core_tokens` (pipelines, Trainer)
    >>> config = VecaConfig.from_preset("veca-s16", default_num_core_tokens=16)
    ```"""

    model_type = "veca"

    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 2048
    hidden_act: str = "silu"
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    image_size: int = 256
    patch_size: int = 16
    num_channels: int = 3
    core_bank_size: int = 64
    core_chunk_size: int = 8
    default_num_core_tokens: int | str | None = None
    group_image_budgets: bool = True
    adaptive_budget: dict | None = None
    rope_theta: float = 100.0
    rope_zero_frequency_ratio: float = 0.125
    pos_embed_shift: float | None = 0.08
    pos_embed_jitter: float | None = None
    pos_embed_rescale: float | None = 2.0
    core_coordinate_init_range: float = 0.95
    core_coordinate_init_candidates: int = 1000
    core_coordinate_step_init: float = 0.01
    apply_layernorm: bool = True
    reshape_hidden_states: bool = True
    semantic_loss_ignore_index: int = 255
    _out_features: list[str] | None = None
    _out_indices: list[int] | None = None

    def __post_init__(self, **kwargs):
        if "num_core_tokens" in kwargs:  # the bank's name in configs saved before `core_bank_size`
            self.core_bank_size = kwargs.pop("num_core_tokens")
        self.stage_names = ["stem"] + [f"stage{i}" for i in range(1, self.num_hidden_layers + 1)]
        self.set_output_features_output_indices(
            out_indices=kwargs.pop("out_indices", None), out_features=kwargs.pop("out_features", None)
        )
        # NOTE: checked here rather than in a `validate_*` hook, which would wrap the ValueError in a
        # huggingface_hub StrictDataclass error that users cannot catch as a ValueError.
        self._check_values()
        super().__post_init__(**kwargs)

    def _check_values(self):
        """Raises a `ValueError` naming the offending field, its value and what is allowed (`@strict` checked the
        types already)."""
        for field in fields(self):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):
                optional = " (or None)" if NoneType in get_args(field.type) else ""
                raise ValueError(f"{field.name}={value!r} must be a finite number{optional}.")
        for name in ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size", "image_size",
                     "patch_size", "num_channels", "core_bank_size", "core_chunk_size"):  # fmt: skip
            value = getattr(self, name)
            if value < 1:
                raise ValueError(f"{name}={value!r} must be a positive integer.")
        for name in ("layer_norm_eps", "rope_theta"):
            value = getattr(self, name)
            if not value > 0:
                raise ValueError(f"{name}={value!r} must be positive.")
        if not self.initializer_range >= 0:
            raise ValueError(f"initializer_range={self.initializer_range!r} must be >= 0.")
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"hidden_act={self.hidden_act!r} is not an activation of transformers' ACT2FN.")
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})."
            )
        head_dim = self.hidden_size // self.num_attention_heads
        if head_dim % 4 != 0:
            raise ValueError(
                f"The head size hidden_size / num_attention_heads = {head_dim} must be a multiple of 4 for 2D RoPE."
            )
        if self.core_bank_size % self.core_chunk_size != 0:
            raise ValueError(
                f"core_bank_size ({self.core_bank_size}) must be a multiple of core_chunk_size "
                f"({self.core_chunk_size})."
            )
        if self.core_coordinate_init_candidates < self.core_bank_size:
            raise ValueError(
                f"core_coordinate_init_candidates={self.core_coordinate_init_candidates!r} must be at least "
                f"core_bank_size ({self.core_bank_size}): the initial core positions are picked among them, and "
                "fewer would place cores on top of each other."
            )
        if self.core_coordinate_init_candidates > MAX_CORE_COORDINATE_INIT_CANDIDATES:
            raise ValueError(
                f"core_coordinate_init_candidates={self.core_coordinate_init_candidates!r} must be at most "
                f"{MAX_CORE_COORDINATE_INIT_CANDIDATES}: more candidates no longer move the initial core positions, "
                "they only slow down every initialisation (the default is 1000)."
            )
        if not 0 < self.core_coordinate_init_range <= 1:
            raise ValueError(
                f"core_coordinate_init_range={self.core_coordinate_init_range!r} must be in (0, 1]: core positions "
                "are tanh of the learned coordinates, inside (-1, 1)."
            )
        for name, low in (("pos_embed_shift", 0.0), ("pos_embed_jitter", 1.0), ("pos_embed_rescale", 1.0)):
            value = getattr(self, name)
            if value is not None and not value >= low:
                raise ValueError(f"{name}={value!r} must be None (off) or >= {low}.")
        if self.default_num_core_tokens == "auto":
            if self.adaptive_budget is None:
                raise ValueError(
                    "default_num_core_tokens='auto' needs a budget policy in adaptive_budget: fit one with "
                    "veca_hf.AdaptiveBudget.fit(model, pixel_values, target_mean_cost=...)."
                )
        elif self.default_num_core_tokens is not None:
            self.check_budget(self.default_num_core_tokens, name="default_num_core_tokens")
        if self.adaptive_budget is not None:
            self._check_adaptive_budget(self.adaptive_budget)
        if not 0.0 <= self.rope_zero_frequency_ratio <= 1.0:
            raise ValueError(f"rope_zero_frequency_ratio ({self.rope_zero_frequency_ratio}) must be in [0, 1].")

    def _check_adaptive_budget(self, policy: dict) -> None:
        """A `ValueError` unless `policy` is a budget policy this model can run (what `AdaptiveBudget` writes)."""
        missing = {"budgets", "threshold", "feature_mean", "weight", "bias"} - set(policy)
        if missing:
            raise ValueError(f"adaptive_budget lacks {sorted(missing)}: write it with veca_hf.AdaptiveBudget.")
        ladder = [self.check_budget(budget, name="adaptive_budget['budgets'][...]") for budget in policy["budgets"]]
        if len(ladder) < 2 or ladder != sorted(set(ladder)):
            raise ValueError(f"adaptive_budget['budgets']={ladder!r} must be two or more increasing budgets.")
        width = 2 * self.hidden_size  # `budget_policy_features`: the global feature and the mean patch token
        shapes = {"feature_mean": len(policy["feature_mean"]), "bias": len(policy["bias"]),
                  "weight": (len(policy["weight"]), {len(row) for row in policy["weight"]})}  # fmt: skip
        if shapes != {"feature_mean": width, "bias": len(ladder) - 1, "weight": (len(ladder) - 1, {width})}:
            raise ValueError(
                f"adaptive_budget's sizes {shapes} do not fit this model: it needs feature_mean of {width}, bias of "
                f"{len(ladder) - 1} and weight of {len(ladder) - 1} rows of {width} (fit it on this model)."
            )
        if not math.isfinite(policy["threshold"]):
            raise ValueError(f"adaptive_budget['threshold']={policy['threshold']!r} must be a finite number.")

    @property
    def budgets(self) -> list[int]:
        """Every valid budget: `core_chunk_size, 2 * core_chunk_size, ..., core_bank_size`."""
        return list(range(self.core_chunk_size, self.core_bank_size + 1, self.core_chunk_size))

    def check_budget(self, num_core_tokens, name: str = "num_core_tokens") -> int:
        """Returns `num_core_tokens` as an int, or raises a `ValueError` that lists the valid budgets."""
        # NOTE: any Python or NumPy integer (not a bool, not a float such as 8.0) counts.
        valid = isinstance(num_core_tokens, numbers.Integral) and not isinstance(num_core_tokens, bool)
        if not valid or int(num_core_tokens) not in self.budgets:
            raise ValueError(
                f"{name}={num_core_tokens!r} is not a valid budget: use a multiple of core_chunk_size="
                f"{self.core_chunk_size} between {self.core_chunk_size} and core_bank_size={self.core_bank_size}, "
                f"i.e. one of {self.budgets}."
            )
        return int(num_core_tokens)

    @classmethod
    def from_preset(cls, name: str, **kwargs) -> "VecaConfig":
        """Builds the configuration of a released size; keyword arguments override any field.

        Args:
            name (`str`): one of `"veca-s16"`, `"veca-splus16"`, `"veca-b16"`, `"veca-l16"`.
        """
        if name not in VECA_PRESETS:
            raise ValueError(f"Unknown VECA preset {name!r}: choose one of {sorted(VECA_PRESETS)}.")
        return cls(**{**VECA_PRESETS[name], **kwargs})


__all__ = ["VecaConfig", "VECA_PRESETS", "VECA_PRESET_TEACHERS"]
