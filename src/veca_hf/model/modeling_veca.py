# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""PyTorch VECA (Visual Elastic Core Attention) model.

Patches never attend to each other: in every block the active cores attend to all tokens and every patch attends
to the cores only, so attention costs `2NC + C^2` query-key pairs instead of `(N + C)^2`.

    sequence   [ core_1 ... core_C | patch_(0,0) patch_(0,1) ... patch_(Hp-1,Wp-1) ]   cores first, patches row-major

                 keys:  cores   patches
    queries: cores    [  full     full  ]    call 1: cores over all C + N tokens
             patches  [  full     ----  ]    call 2: patches over the C cores only

Since patches never attend to each other, images of different sizes share a batch exactly: padded to one grid, with
the padded patches masked out of the cores' call and each image's patches at its own grid's RoPE positions
(`pixel_mask`; docs/usage.md, "Images of different sizes in one batch"). For the same reason every image can have a
budget of its own (`num_core_tokens` a list): the cores an image does not use are hidden from all its tokens, or the
batch runs as one sub-batch per budget (`config.group_image_budgets`; `image_budgets_veca.py`).

Shape legend: B batch, C active cores (the budget), M core bank, N patches (Hp * Wp), T = C + N tokens,
H heads, Hd head size, D hidden size, I SwiGLU hidden size.

Where the tokens are (patch and core coordinates, the padding mask, 2D RoPE) lives in `positions_veca.py`.

This file imports only torch, transformers and its siblings (relatively, so `save_pretrained` copies them too), so
that a saved folder loads with `trust_remote_code=True` where `veca_hf` is not installed.
"""

import inspect
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneMixin, filter_output_hidden_states
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import (
    BackboneOutput,
    BaseModelOutput,
    BaseModelOutputWithPooling,
    ImageClassifierOutput,
)
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, logging
from transformers.utils.generic import can_return_tuple
from transformers.utils.output_capturing import capture_outputs

from .configuration_veca import VecaConfig
from .image_budgets_veca import NumCoreTokens, VecaImageBudgetsMixin, is_integer_dtype
from .modeling_utils_veca import check_model_kwargs, check_pixel_values, gathered_for_init, save_code_and_auto_map
from .positions_veca import (
    VecaRopePositionEmbedding,
    apply_rotary_pos_emb,
    augment_patch_coordinates,
    farthest_point_core_coordinates,
    get_padded_patch_coordinates,
    get_patch_coordinates,
    get_patch_mask,
    rope_inv_freq,
)


logger = logging.get_logger(__name__)


@dataclass
class VecaModelOutput(BaseModelOutputWithPooling):
    r"""
    Output of [`VecaModel`].

    Args:
        last_hidden_state (`torch.FloatTensor` of shape `(batch_size, num_core_tokens + num_patches, hidden_size)`):
            Final-norm tokens, the active cores first, then the patches in row-major order.
        pooler_output (`torch.FloatTensor` of shape `(batch_size, hidden_size)`):
            The global feature: the first core after the final norm.
        hidden_states (`tuple(torch.FloatTensor)`, *optional*):
            The embeddings and the output of every block (before the final norm), each
            `(batch_size, num_core_tokens + num_patches, hidden_size)`.
        attentions (`tuple(torch.FloatTensor)`, *optional*):
            Per block, the block-sparse attention map `(batch_size, num_heads, T, T)` with `T = C + N`; the
            patch-to-patch block is exactly zero. It is the map the outputs were computed from.
        core_positions (`torch.FloatTensor` of shape `(batch_size, num_core_tokens, 2)`):
            Where the active cores sat in the last block, as `(x, y)` in `[-1, 1]^2`.
        all_core_positions (`tuple(torch.FloatTensor)`, *optional*):
            With `output_core_positions=True`: per block, the `(batch_size, num_core_tokens, 2)` positions `(x, y)`
            in `[-1, 1]^2` (after `tanh`) that its RoPE rotated the cores by. Block 1's are the bank's (the same for
            every image); the last equals `core_positions`.
        patch_mask (`torch.BoolTensor` of shape `(batch_size, num_patches)`, *optional*):
            Only when `pixel_mask` was passed: `True` for the patches of each image, `False` for padding, in the
            row-major order of the padded grid (the order of `last_hidden_state[:, num_core_tokens:]`). Image `i`'s
            own `hp x wp` patch grid is `last_hidden_state[i, num_core_tokens:][patch_mask[i]].reshape(hp, wp, -1)`.
            The outputs at padded patches are finite but meaningless.
        core_mask (`torch.BoolTensor` of shape `(batch_size, num_core_tokens)`, *optional*):
            Only when `num_core_tokens` gave a budget per image: `True` for the cores image `i` used (its first
            `budget_i`), `False` for the rest of the largest budget. `last_hidden_state` and `core_positions` are
            zero at unused cores; what `hidden_states` and `attentions` hold there has no meaning.
    """

    core_positions: torch.FloatTensor | None = None
    all_core_positions: tuple[torch.FloatTensor, ...] | None = None
    patch_mask: torch.BoolTensor | None = None
    core_mask: torch.BoolTensor | None = None


class VecaPatchEmbeddings(nn.Conv2d):
    """The patch embedding: a `Conv2d` with stride = kernel = `p`, run as one GEMM: `(B, 3, H, W) -> (B, N, D)`.

    Such a convolution is a linear map of the flattened patches, and one GEMM (`F.linear`) computes it faster on
    CPU than oneDNN's convolution. It stays a `Conv2d` (same weights, same state-dict keys) and the GEMM runs in its
    own `forward`, so module hooks (Accelerate offloading, DeepSpeed ZeRO-3) see every use of the weight.
    """

    def __init__(self, config: VecaConfig):
        patch_size = config.patch_size
        super().__init__(config.num_channels, config.hidden_size, kernel_size=patch_size, stride=patch_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        batch_size, num_channels, height, width = pixel_values.shape
        patch_size = self.kernel_size[0]
        rows, cols = height // patch_size, width // patch_size
        patches = pixel_values.reshape(batch_size, num_channels, rows, patch_size, cols, patch_size)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch_size, rows * cols, -1)  # (B, N, 3 p p), row-major
        return nn.functional.linear(patches, self.weight.flatten(1), self.bias)  # (B, N, D)


class VecaCoreBank(nn.ParameterList):
    """Chunks of equal shape `(chunk, width)`; called with a budget `C` (a multiple of `chunk`), returns the first `C`
    rows `(C, width)`."""

    # a ParameterList refuses to be called; a call (rather than reading its items from outside) runs module
    # hooks, which Accelerate's offloading and DeepSpeed ZeRO-3 need to bring the weights in.
    __call__ = nn.Module.__call__

    def forward(self, num_core_tokens: int) -> torch.Tensor:
        if torch.is_grad_enabled():
            # only the active chunks enter the autograd graph, so the others get `grad = None` and no gradient
            # hook: optimisers (AdamW momentum and weight decay included), DDP and DeepSpeed skip them, as in the
            # reference. With one (M, D) parameter sliced to C rows they would get zeros and AdamW would move them.
            chunks = list(self)
            return torch.cat(chunks[: num_core_tokens // chunks[0].shape[0]], dim=0)  # (C, width)
        # without autograd, a slice by the budget keeps one torch.compile graph for every budget.
        return torch.cat(list(self), dim=0)[:num_core_tokens]  # (C, width)


class VecaCoreTokens(VecaCoreBank):
    """The core embeddings, `M / chunk` parameters of shape `(chunk, D)`."""


class VecaCoreCoordinates(VecaCoreBank):
    """The raw core coordinates `rho` as `(x, y)`, `M / chunk` parameters of shape `(chunk, 2)`."""


class VecaEmbeddings(nn.Module):
    """Patch embedding plus the core bank: `M` core embeddings and raw coordinates `rho`, in chunks."""

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        num_chunks = config.core_bank_size // config.core_chunk_size
        self.patch_embeddings = VecaPatchEmbeddings(config)
        self.core_tokens = VecaCoreTokens(
            [nn.Parameter(torch.empty(config.core_chunk_size, config.hidden_size)) for _ in range(num_chunks)]
        )
        self.core_coordinates = VecaCoreCoordinates(
            [nn.Parameter(torch.empty(config.core_chunk_size, 2)) for _ in range(num_chunks)]
        )

    def forward(self, pixel_values: torch.Tensor, num_core_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = pixel_values.shape[0]
        patches = self.patch_embeddings(pixel_values)  # (B, N, D)
        cores = self.core_tokens(num_core_tokens)  # (C, D)
        core_coordinates = self.core_coordinates(num_core_tokens)  # (C, 2)
        embeddings = torch.cat((cores.expand(batch_size, -1, -1), patches), dim=1)  # (B, T, D)
        return embeddings, core_coordinates.unsqueeze(0)  # (B, T, D), (1, C, 2)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same as DINOv3's eager attention; works with unequal query and key lengths. Returns `(B, Lq, H, Hd)`."""
    attn_weights = torch.matmul(query, key.transpose(2, 3)) * scaling  # (B, H, Lq, Lk)
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = nn.functional.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class VecaCorePeripheryAttention(nn.Module):
    """Multi-head core-periphery attention: two calls of the attention kernel that `config._attn_implementation`
    names in transformers' `ALL_ATTENTION_FUNCTIONS` ("sdpa", "eager", "flex_attention", "flash_attention_2", or any
    kernel registered with `AttentionInterface.register`), as transformers' own models call it.

    Call 1 lets the `C` cores attend to all `C + N` tokens, call 2 lets the `N` patches attend to the cores only:
    every kernel sees two ordinary non-causal attentions with unequal query and key lengths. No `(C + N)^2` score
    matrix is built, except for `output_attentions=True`, where the output is computed here from the assembled
    block-sparse map itself (so gradients can be taken with respect to it), whatever the kernel.
    """

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # NOTE: the SDPA integration treats modules without this flag as causal.
        # q, k and v in one GEMM rather than three; the converter concatenates the reference's q/k/v rows.
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        core_position_embeddings: tuple[torch.Tensor, torch.Tensor],
        patch_position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None = None,
        core_key_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Both masks are additive and hide keys: `attention_mask` `(B, 1, 1, T)` in the cores' call (padded patches,
        cores beyond an image's budget), `core_key_mask` `(B, 1, 1, C)` in the patches' call (cores beyond an image's
        budget). Core 1 is never hidden, so no row is ever fully masked. With `output_attentions=True` (from the
        model's kwargs) the second output is the `(B, H, T, T)` map."""
        batch_size, num_tokens, _ = hidden_states.shape  # (B, T, D)
        num_cores = core_position_embeddings[0].shape[-2]

        qkv = self.qkv_proj(hidden_states)  # (B, T, 3 D)
        qkv = qkv.view(batch_size, num_tokens, 3, self.num_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, Hd)

        # RoPE on q and k at once: cores rotate by their own (per-image, per-layer) positions, patches by the grid.
        # cos/sin: the cores' (B or 1, C, Hd) then the patches' (N, Hd) or (B, N, Hd), broadcast over the heads
        (core_cos, core_sin), (patch_cos, patch_sin) = core_position_embeddings, patch_position_embeddings
        cos = (core_cos.unsqueeze(-3), patch_cos.unsqueeze(-3))  # (B or 1, 1, C, Hd), ((B,) 1, N, Hd)
        sin = (core_sin.unsqueeze(-3), patch_sin.unsqueeze(-3))
        query, key = apply_rotary_pos_emb(qkv[:2], cos, sin).unbind(0)  # (B, H, T, Hd) each
        value = qkv[2]  # (B, H, T, Hd)

        # the same rule as `capture_outputs`, which records what this returns
        if kwargs.get("output_attentions", self.config.output_attentions):
            attn_output, attn_weights = self._attention_map_forward(
                query, key, value, num_cores, attention_mask, core_key_mask
            )
        else:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            if attention_mask is not None:
                # one row per query, as every kernel reads it (flex indexes it by query); a view, no copy
                attention_mask = attention_mask.expand(-1, -1, num_cores, -1)  # (B, 1, C, T)
            core_output, _ = attention_interface(
                self, query[:, :, :num_cores], key, value, attention_mask, scaling=self.scaling, is_causal=False
            )  # (B, C, H, Hd)
            core_keys, core_values = key[:, :, :num_cores], value[:, :, :num_cores]  # (B, H, C, Hd)
            if core_key_mask is not None:
                core_key_mask = core_key_mask.expand(-1, -1, num_tokens - num_cores, -1)  # (B, 1, N, C)
            patch_output, _ = attention_interface(
                self,
                query[:, :, num_cores:],
                core_keys,
                core_values,
                core_key_mask,
                scaling=self.scaling,
                is_causal=False,
            )  # (B, N, H, Hd)
            attn_output, attn_weights = torch.cat((core_output, patch_output), dim=1), None  # (B, T, H, Hd)

        attn_output = self.o_proj(attn_output.reshape(batch_size, num_tokens, -1))  # (B, T, D)
        return attn_output, attn_weights

    def _attention_map_forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        num_cores: int,
        attention_mask: torch.Tensor | None,
        core_key_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Both calls' softmaxes assembled into the full block-sparse `(B, H, T, T)` map, and the output computed
        from it: `(B, H, T, Hd)` each -> `(B, T, H, Hd)`, `(B, H, T, T)`. The patch-to-patch block is exactly zero."""
        num_tokens = key.shape[2]
        query_cores, query_patches = query[:, :, :num_cores], query[:, :, num_cores:]  # (B, H, C, Hd), (B, H, N, Hd)
        core_scores = torch.matmul(query_cores, key.transpose(2, 3)) * self.scaling  # (B, H, C, T)
        if attention_mask is not None:
            core_scores = core_scores + attention_mask  # hidden keys: exactly zero probability
        patch_scores = torch.matmul(query_patches, key[:, :, :num_cores].transpose(2, 3)) * self.scaling  # (B,H,N,C)
        if core_key_mask is not None:
            patch_scores = patch_scores + core_key_mask
        core_probs = core_scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        patch_probs = patch_scores.softmax(dim=-1, dtype=torch.float32).to(query.dtype)
        patch_probs = nn.functional.pad(patch_probs, (0, num_tokens - num_cores))  # (B, H, N, T), 0 patch -> patch
        attn_weights = torch.cat((core_probs, patch_probs), dim=2)  # (B, H, T, T)
        return torch.matmul(attn_weights, value).transpose(1, 2), attn_weights


class VecaSwiGLUMLP(nn.Module):
    """SwiGLU: one input projection whose first half is the (activated) gate, as the reference's `fc1`."""

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)  # (B, T, I) each
        return self.down_proj(self.act_fn(gate) * up)  # (B, T, D)


class VecaLayer(GradientCheckpointingLayer):
    """Pre-norm block: core-periphery attention then SwiGLU; no layer scale, no drop path (the reference's block)."""

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = VecaCorePeripheryAttention(config)
        self.norm2 = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.mlp = VecaSwiGLUMLP(config)

    def forward(
        self,
        hidden_states: torch.Tensor,
        core_cos: torch.Tensor,
        core_sin: torch.Tensor,
        patch_cos: torch.Tensor,
        patch_sin: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        core_key_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        # cos/sin travel as separate tensors: re-entrant checkpointing loses gradients through tuples.
        attn_output, _ = self.attention(
            self.norm1(hidden_states),
            (core_cos, core_sin),
            (patch_cos, patch_sin),
            attention_mask,
            core_key_mask,
            **kwargs,
        )
        hidden_states = hidden_states + attn_output  # (B, T, D)
        return hidden_states + self.mlp(self.norm2(hidden_states))


class VecaCoreCoordinateHead(nn.Module):
    """Moves the active cores before a block: `rho <- rho + alpha * Linear(r)`, `r` the cores' residual stream."""

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        self.proj = nn.Linear(config.hidden_size, 2)
        self.step = nn.Parameter(torch.full((1,), config.core_coordinate_step_init))

    def forward(self, core_hidden_states: torch.Tensor, core_coordinates: torch.Tensor) -> torch.Tensor:
        # (B, C, D), (B or 1, C, 2) -> (B, C, 2); the residual stream is read before any norm.
        return core_coordinates + self.step * self.proj(core_hidden_states)


class VecaCorePositions(nn.Module):
    """Where a block's RoPE places the cores: `tanh(rho)`, `(B or 1, C, 2)` -> `(B, C, 2)` in `[-1, 1]^2`. A module of
    its own so that `output_core_positions=True` records every block's positions as hidden states are recorded."""

    def forward(self, core_coordinates: torch.Tensor, batch_size: int) -> torch.Tensor:
        return torch.tanh(core_coordinates).expand(batch_size, -1, -1)


class VecaPreTrainedModel(PreTrainedModel):
    config: VecaConfig
    config_class = VecaConfig
    base_model_prefix = "veca"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["VecaEmbeddings", "VecaLayer"]
    # every kernel in `ALL_ATTENTION_FUNCTIONS`: VECA's two calls are plain non-causal attentions
    _supports_sdpa = True
    _supports_flash_attn = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_compile_fullgraph = True
    # what `output_hidden_states`, `output_attentions` and `output_core_positions` record per block (capture_outputs)
    _can_record_outputs = {
        "hidden_states": VecaLayer,
        "attentions": VecaCorePeripheryAttention,
        "all_core_positions": VecaCorePositions,
    }

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Same as [`PreTrainedModel.save_pretrained`], plus the code of every VECA class and an `auto_map` naming
        them, so the folder loads with `trust_remote_code=True`."""
        save_code_and_auto_map(self.config, save_directory, kwargs.get("is_main_process", True))
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        """Every parameter and non-persistent buffer is set here (`from_pretrained` builds on meta)."""
        with gathered_for_init(module):
            self._init_module(module)

    def _init_module(self, module: nn.Module) -> None:
        """The initialisation of arXiv 2605.12491 (docs/architecture.md): truncated normal weights, zero biases."""
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            init.trunc_normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                init.zeros_(module.bias)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, VecaCoreTokens):
            for chunk in module:
                init.normal_(chunk, mean=0.0, std=self.config.hidden_size**-0.5)
        elif isinstance(module, VecaCoreCoordinates):
            core_coordinates = farthest_point_core_coordinates(
                self.config.core_bank_size,
                self.config.core_coordinate_init_candidates,
                self.config.core_coordinate_init_range,
            )
            for chunk, value in zip(module, core_coordinates.split(self.config.core_chunk_size), strict=True):
                init.copy_(chunk, value)
        elif isinstance(module, VecaCoreCoordinateHead):
            init.constant_(module.step, module.config.core_coordinate_step_init)
        elif isinstance(module, VecaRopePositionEmbedding):
            init.copy_(module.inv_freq, rope_inv_freq(module.config))


VECA_INPUTS_DOCSTRING = r"""
    pixel_values (`torch.FloatTensor` of shape `(batch_size, num_channels, height, width)`):
        Normalised images (from [`VecaImageProcessor`]); height and width any multiples of `config.patch_size`.
    num_core_tokens (`int`, a list or 1-D tensor of `batch_size` ints, or `"auto"`, *optional*):
        The budget `C`: how many cores of the bank are active (a prefix). A multiple of `config.core_chunk_size` up
        to `config.core_bank_size`. Defaults to `config.default_num_core_tokens`, else the whole bank. One budget per
        image runs every image at its own budget in one call: its outputs equal those of a forward of that image
        alone at that budget (eval mode; up to float rounding), the cores are laid out for the largest budget and
        the output's `core_mask` says which an image used. `"auto"`: every image's budget picked by the policy fitted
        in `config.adaptive_budget` (`veca_hf.AdaptiveBudget`).
    pixel_mask (`torch.LongTensor` of shape `(batch_size, height, width)`, *optional*):
        For a batch of images of different sizes padded to one size (the image processor's `do_pad=True`): 1 for real
        pixels, 0 for padding, padded on patch boundaries. Padded patches are hidden from the cores and each image's
        patches get the RoPE positions of its own grid, so every image's outputs equal those of a forward of that
        image alone (eval mode; up to float rounding). Without it (or with no padding at all) nothing is masked.
    output_attentions (`bool`, *optional*):
        Return each block's block-sparse `(B, H, T, T)` attention map. This builds the dense map, whatever the
        attention implementation, and computes the block's output from it.
"""


def veca_docstring(forward):
    """`auto_docstring` for a VECA forward: transformers' argument docs, VECA's shared ones (`VECA_INPUTS_DOCSTRING`,
    written once) and the forward's own docstring, which holds only the arguments special to it."""
    own = inspect.cleandoc(forward.__doc__ or "")
    forward.__doc__ = None
    return auto_docstring(forward, custom_args=inspect.cleandoc(VECA_INPUTS_DOCSTRING) + "\n" + own)


@dataclass
class VecaEncoderOutput(BaseModelOutput):
    r"""
    core_positions (`torch.FloatTensor` of shape `(batch_size, num_core_tokens, 2)`):
        Where the active cores sat in the last block, `(x, y)` in `[-1, 1]^2`.
    all_core_positions (`tuple(torch.FloatTensor)`, *optional*):
        Per block, the `(batch_size, num_core_tokens, 2)` positions its RoPE rotated the cores by.
    """

    core_positions: torch.FloatTensor | None = None
    all_core_positions: tuple[torch.FloatTensor, ...] | None = None


class VecaEncoder(VecaPreTrainedModel):
    """The blocks and the coordinate heads that move the cores between them (`L - 1` of them). Every block's hidden
    states, attention map and core positions are recorded here, by `capture_outputs` (as DINOv3's encoder does)."""

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.layer = nn.ModuleList([VecaLayer(config) for _ in range(config.num_hidden_layers)])
        self.core_coordinate_heads = nn.ModuleList(
            [VecaCoreCoordinateHead(config) for _ in range(config.num_hidden_layers - 1)]
        )
        self.core_positions = VecaCorePositions()
        self.post_init()

    @capture_outputs(tie_last_hidden_states=False)
    def forward(
        self,
        hidden_states: torch.Tensor,
        core_coordinates: torch.Tensor,
        patch_position_embeddings: tuple[torch.Tensor, torch.Tensor],
        rope_embeddings: VecaRopePositionEmbedding,
        attention_mask: torch.Tensor | None = None,
        core_key_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> VecaEncoderOutput:
        """`(B, T, D)` embeddings and the bank's raw core coordinates `(1, C, 2)` in; the last block's output and core
        positions out. The additive masks hide keys in every block: `attention_mask` `(B, 1, 1, T)` from the cores
        (padded patches, unused cores), `core_key_mask` `(B, 1, 1, C)` from the patches (unused cores)."""
        batch_size, num_cores = hidden_states.shape[0], core_coordinates.shape[1]
        for index, layer in enumerate(self.layer):
            if index > 0:
                core_coordinates = self.core_coordinate_heads[index - 1](
                    hidden_states[:, :num_cores], core_coordinates
                )
            core_positions = self.core_positions(core_coordinates, batch_size)  # (B, C, 2)
            core_cos, core_sin = rope_embeddings(core_positions)  # (B, C, Hd) each
            hidden_states = layer(
                hidden_states, core_cos, core_sin, *patch_position_embeddings, attention_mask, core_key_mask, **kwargs
            )  # (B, T, D)
        return VecaEncoderOutput(last_hidden_state=hidden_states, core_positions=core_positions)


class VecaModel(VecaImageBudgetsMixin, VecaPreTrainedModel):
    """The bare VECA backbone: cores and patches out, after the final LayerNorm."""

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.embeddings = VecaEmbeddings(config)
        self.rope_embeddings = VecaRopePositionEmbedding(config)
        self.encoder = VecaEncoder(config)
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.embeddings.patch_embeddings

    def resolve_num_core_tokens(self, num_core_tokens: int | None) -> int:
        """The budget for this call: the argument, else `config.default_num_core_tokens`, else the whole bank."""
        if isinstance(num_core_tokens, (list, tuple)) and len(num_core_tokens) == 1:
            num_core_tokens = num_core_tokens[0]
        if type(num_core_tokens).__module__ == "numpy" and getattr(num_core_tokens, "size", 0) == 1:
            num_core_tokens = num_core_tokens.item()  # a NumPy scalar or one-element array: its Python number
        if num_core_tokens is None:
            num_core_tokens = self.config.default_num_core_tokens or self.config.core_bank_size
        if isinstance(num_core_tokens, torch.Tensor) and num_core_tokens.numel() == 1:
            if is_integer_dtype(num_core_tokens.dtype):  # others go on to check_budget's error, unconverted
                num_core_tokens = int(num_core_tokens)
        return self.config.check_budget(num_core_tokens)

    @can_return_tuple
    @veca_docstring
    def forward(
        self,
        pixel_values: torch.Tensor,
        num_core_tokens: NumCoreTokens = None,
        pixel_mask: torch.Tensor | None = None,
        output_core_positions: bool = False,
        **kwargs: Unpack[TransformersKwargs],
    ) -> VecaModelOutput:
        r"""
        output_core_positions (`bool`, *optional*, defaults to `False`):
            Return `all_core_positions`: per block, where its RoPE placed the cores.
        """
        check_model_kwargs(kwargs, type(self).__name__)
        check_pixel_values(pixel_values, self.config.num_channels, self.config.patch_size)
        if self.picks_budgets(num_core_tokens):
            return self._forward_picked_budgets(pixel_values, pixel_mask, output_core_positions, **kwargs)
        image_budgets = self.resolve_image_budgets(num_core_tokens, pixel_values.shape[0])
        if image_budgets is not None and len(set(image_budgets)) > 1 and self.groups_image_budgets():
            return self._forward_budget_groups(
                pixel_values, image_budgets, pixel_mask, output_core_positions, **kwargs
            )
        if image_budgets is not None:
            num_core_tokens = max(image_budgets)
        num_core_tokens = self.resolve_num_core_tokens(num_core_tokens)

        pixel_values = pixel_values.to(self.embeddings.patch_embeddings.weight.dtype)
        batch_size, _, height, width = pixel_values.shape
        device = pixel_values.device
        hidden_states, core_coordinates = self.embeddings(pixel_values, num_core_tokens)  # (B, T, D), (1, C, 2)

        patch_size = self.config.patch_size
        patch_mask, core_mask = None, None
        if pixel_mask is not None:
            patch_mask = get_patch_mask(pixel_mask.to(device), pixel_values.shape, patch_size)
        if image_budgets is not None:
            budgets = torch.tensor(image_budgets, device=device)
            core_mask = torch.arange(num_core_tokens, device=device) < budgets[:, None]  # (B, C)
        # a batch without padding (e.g. images of one size) and of one budget takes the unmasked path below, exactly
        # as without `pixel_mask`; only real padding or mixed budgets cost masks.
        padded = patch_mask is not None and not bool(patch_mask.all())
        mixed_budgets = image_budgets is not None and len(set(image_budgets)) > 1  # Python values: one graph
        attention_mask, core_key_mask = None, None
        if padded or mixed_budgets:
            # NOTE: flash kernels take no additive mask, and torch's compiled flex kernel aborts on CPU with one
            if "flash" in self.config._attn_implementation or "flex" in self.config._attn_implementation:
                raise ValueError(
                    f"A padded batch (pixel_mask with padding) needs an attention kernel that takes a mask, not "
                    f"{self.config._attn_implementation!r}: use 'sdpa' or 'eager' "
                    "(model.set_attn_implementation('sdpa')), or batch images of one size."
                )
            num_patches = hidden_states.shape[1] - num_core_tokens
            hidden_cores = ~core_mask if mixed_budgets else torch.zeros(batch_size, num_core_tokens, dtype=torch.bool)
            hidden_patches = (
                ~patch_mask.flatten(1) if padded else torch.zeros(batch_size, num_patches, dtype=torch.bool)
            )
            hidden = torch.cat((hidden_cores.to(device), hidden_patches.to(device)), dim=1)  # (B, T): keys no one sees
            attention_mask = torch.zeros(hidden.shape, dtype=pixel_values.dtype, device=device)
            attention_mask = attention_mask.masked_fill(hidden, torch.finfo(pixel_values.dtype).min)[:, None, None]
            if mixed_budgets:
                core_key_mask = attention_mask[..., :num_core_tokens]  # (B, 1, 1, C): the patches' keys are the cores
        if padded:
            patch_coordinates = get_padded_patch_coordinates(patch_mask, dtype=torch.float32)  # (B, N, 2)
        else:
            patch_coordinates = get_patch_coordinates(
                height // patch_size, width // patch_size, dtype=torch.float32, device=device
            )  # (N, 2)
        if self.training:
            patch_coordinates = augment_patch_coordinates(
                patch_coordinates,
                self.config.pos_embed_shift,
                self.config.pos_embed_jitter,
                self.config.pos_embed_rescale,
            )
        patch_position_embeddings = self.rope_embeddings(patch_coordinates)  # (N, Hd) or (B, N, Hd) each

        encoder_outputs = self.encoder(
            hidden_states,
            core_coordinates,
            patch_position_embeddings,
            self.rope_embeddings,
            attention_mask,  # (B, 1, 1, T): 0, or the dtype's minimum at padded patches and unused cores
            core_key_mask,  # (B, 1, 1, C): 0, or the dtype's minimum at unused cores
            output_all_core_positions=output_core_positions,
            return_dict=True,
            **kwargs,
        )
        sequence_output = self.norm(encoder_outputs.last_hidden_state)  # (B, T, D)
        core_positions = encoder_outputs.core_positions  # (B, C, 2)
        if mixed_budgets:  # unused cores read zero, as where the batch runs by budget groups
            unused = ~core_mask[..., None]  # (B, C, 1)
            cores = sequence_output[:, :num_core_tokens].masked_fill(unused, 0)
            sequence_output = torch.cat((cores, sequence_output[:, num_core_tokens:]), dim=1)
            core_positions = core_positions.masked_fill(unused, 0)
        return VecaModelOutput(
            last_hidden_state=sequence_output,
            pooler_output=sequence_output[:, 0],
            hidden_states=encoder_outputs.hidden_states,
            attentions=encoder_outputs.attentions,
            core_positions=core_positions,
            all_core_positions=encoder_outputs.all_core_positions,
            patch_mask=patch_mask.flatten(1) if patch_mask is not None else None,  # (B, N)
            core_mask=core_mask,  # (B, C)
        )


class VecaForImageClassification(VecaPreTrainedModel):
    """VECA with a linear classifier on the global core (the first core after the final norm), the paper's probe."""

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.veca = VecaModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    @can_return_tuple
    @veca_docstring
    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_core_tokens: NumCoreTokens = None,
        pixel_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> ImageClassifierOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
            Class indices (or regression targets when `config.num_labels == 1`) for the loss; with
            `num_items_in_batch` (`Trainer` passes it) the loss is summed and divided by it.
        """
        outputs = self.veca(pixel_values, num_core_tokens=num_core_tokens, pixel_mask=pixel_mask, **kwargs)
        logits = self.classifier(outputs.pooler_output)  # (B, num_labels)
        loss = None
        if labels is not None:
            loss = self.loss_function(labels, logits, self.config, **kwargs)
        return ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class VecaBackbone(BackboneMixin, VecaPreTrainedModel):
    """VECA as an `AutoBackbone`: one feature map per stage in `config.out_features`.

    Stage `"stem"` is the patch embedding, `"stage{l}"` the output of block `l`. With `config.apply_layernorm` every
    map goes through the final LayerNorm (the last stage always does, as in [`VecaModel`]). Two layouts, as
    `Dinov2Backbone` has them:

    - `config.reshape_hidden_states=True`: patch maps `(B, D, H/p, W/p)`, for convolutional heads such as UperNet.
    - `config.reshape_hidden_states=False`: token sequences `(B, 1 + N, D)`, the global core (core 1, the
      `pooler_output` of [`VecaModel`]) followed by the patches in row-major order. This is the ViT layout with one
      CLS token that the necks of Depth Anything and DPT read (DPT's readout uses the prefix token).

    Heads call the backbone without `num_core_tokens`, so their budget is `config.default_num_core_tokens`. With
    `pixel_mask` the maps keep the padded grid: each image's region equals that image's own maps.
    """

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.veca = VecaModel(config)
        self.num_features = [config.hidden_size] * (config.num_hidden_layers + 1)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.veca.get_input_embeddings()

    @can_return_tuple
    @filter_output_hidden_states
    @veca_docstring
    def forward(
        self,
        pixel_values: torch.Tensor,
        num_core_tokens: NumCoreTokens = None,
        pixel_mask: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BackboneOutput:
        outputs = self.veca(pixel_values, num_core_tokens=num_core_tokens, pixel_mask=pixel_mask, **kwargs)
        num_cores = outputs.core_positions.shape[1]
        batch_size, _, height, width = pixel_values.shape
        grid = (height // self.config.patch_size, width // self.config.patch_size)
        last_stage = len(self.stage_names) - 1

        feature_maps = []
        for index, (stage_name, hidden_state) in enumerate(zip(self.stage_names, outputs.hidden_states, strict=False)):
            if stage_name not in self.out_features:
                continue
            if index == last_stage:
                hidden_state = outputs.last_hidden_state
            elif self.config.apply_layernorm:
                hidden_state = self.veca.norm(hidden_state)
            patches = hidden_state[:, num_cores:]  # (B, N, D)
            if self.config.reshape_hidden_states:
                feature_map = patches.reshape(batch_size, *grid, -1).permute(0, 3, 1, 2).contiguous()  # (B, D, Hp, Wp)
            else:
                # only the global core stays, in the place of a ViT's CLS token: the ViT necks drop exactly one
                # prefix token (Depth Anything) or read it as the readout token (DPT).
                feature_map = torch.cat([hidden_state[:, :1], patches], dim=1)  # (B, 1 + N, D)
            feature_maps.append(feature_map)

        return BackboneOutput(
            feature_maps=tuple(feature_maps), hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


__all__ = [
    "VecaBackbone",
    "VecaForImageClassification",
    "VecaModel",
    "VecaModelOutput",
    "VecaPreTrainedModel",
]
