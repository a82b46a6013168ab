# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""PyTorch VECA (Visual Elastic Core Attention) model.

Patches never attend to each other: in every block the active cores attend to all tokens and every patch attends
to the cores only, so attention costs `2NC + C^2` query-key pairs instead of `(N + C)^2`.

    sequence   [ core_1 ... core_C | patch_(0,0) patch_(0,1) ... patch_(Hp-1,Wp-1) ]   cores first, patches row-major

                 keys:  cores   patches
    queries: cores    [  full     full  ]    call 1: cores over all C + N tokens
             patches  [  full     ----  ]    call 2: patches over the C cores only

Shape legend: B batch, C active cores (the budget), M core bank, N patches (Hp * Wp), T = C + N tokens,
H heads, Hd head size, D hidden size, I SwiGLU hidden size.

NOTE: this file imports only torch, transformers and the sibling config, so that a saved folder loads with
`trust_remote_code=True` where `veca_hf` is not installed.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.backbone_utils import BackboneMixin
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BackboneOutput, BaseModelOutputWithPooling, ImageClassifierOutput
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.pytorch_utils import compile_compatible_method_lru_cache
from transformers.utils import logging

from .configuration_veca import VecaConfig


logger = logging.get_logger(__name__)

# Written into every saved config so the folder loads with `trust_remote_code=True` where veca_hf is not installed
# (transformers itself records only the class that was saved).
VECA_AUTO_MAP = {
    "AutoConfig": "configuration_veca.VecaConfig",
    "AutoModel": "modeling_veca.VecaModel",
    "AutoModelForImageClassification": "modeling_veca.VecaForImageClassification",
    "AutoBackbone": "modeling_veca.VecaBackbone",
}


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
        core_coordinates (`torch.FloatTensor` of shape `(batch_size, num_core_tokens, 2)`):
            Where the active cores sat in the last block, as `(x, y)` in `[-1, 1]^2`.
    """

    core_coordinates: torch.FloatTensor | None = None


@compile_compatible_method_lru_cache(maxsize=32)
def get_patch_coordinates(
    num_patches_h: int, num_patches_w: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Centres of an `Hp x Wp` patch grid as `(x, y)` in `[-1, 1]^2`, row-major: `(N, 2)`."""
    y = (torch.arange(num_patches_h, dtype=dtype, device=device) + 0.5) / num_patches_h * 2 - 1
    x = (torch.arange(num_patches_w, dtype=dtype, device=device) + 0.5) / num_patches_w * 2 - 1
    grid_y, grid_x = torch.meshgrid(y, x, indexing="ij")  # (Hp, Wp) each
    return torch.stack([grid_x, grid_y], dim=-1).flatten(0, 1)  # (N, 2)


def augment_patch_coordinates(
    coords: torch.Tensor, shift: float | None, jitter: float | None, rescale: float | None
) -> torch.Tensor:
    """DINOv3's train-time RoPE augmentation, one draw per call shared by the whole batch: `(N, 2) -> (N, 2)`."""
    if shift is not None:
        coords = coords + torch.empty(2, dtype=coords.dtype, device=coords.device).uniform_(-shift, shift)
    if jitter is not None:
        log_jitter = math.log(jitter)
        coords = coords * torch.empty(2, dtype=coords.dtype, device=coords.device).uniform_(-log_jitter, log_jitter).exp()
    if rescale is not None:
        log_rescale = math.log(rescale)
        coords = coords * torch.empty(1, dtype=coords.dtype, device=coords.device).uniform_(-log_rescale, log_rescale).exp()
    return coords


def farthest_point_core_coordinates(
    num_cores: int, num_candidates: int, init_range: float, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Initial raw core coordinates `rho`: `(M, 2)` (spec section 2).

    Farthest-point sampling over uniform candidates, starting from the one nearest the origin, so every prefix of
    the bank (every budget) covers the image evenly and core 1 starts near the centre.
    """
    candidates = (torch.rand(num_candidates, 2, generator=generator) * 2 - 1) * init_range  # (P, 2)
    chosen = [int(candidates.norm(dim=-1).argmin())]
    distance = (candidates - candidates[chosen[0]]).norm(dim=-1)  # (P,) distance to the chosen set
    for _ in range(num_cores - 1):
        chosen.append(int(distance.argmax()))
        distance = torch.minimum(distance, (candidates - candidates[chosen[-1]]).norm(dim=-1))
    return torch.atanh(candidates[chosen].clamp(-0.999, 0.999))


def rope_inv_freq(config: VecaConfig) -> torch.Tensor:
    """RoPE inverse periods `(Hd / 4,)`: DINOv3's `1 / theta^(4f / Hd)`, the longest periods zeroed (not rotated)."""
    head_dim = config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / config.rope_theta ** torch.arange(0, 1, 4 / head_dim, dtype=torch.float32)  # (Hd/4,)
    num_zeroed = round(config.rope_zero_frequency_ratio * inv_freq.numel())
    if num_zeroed > 0:
        inv_freq[-num_zeroed:] = 0.0
    return inv_freq


class VecaRopePositionEmbedding(nn.Module):
    """2D axial RoPE of any `(x, y)` positions, DINOv3 style.

    Channel layout of the returned `(..., Hd)` cos/sin, for HF's half-split `rotate_half` (channel `i` rotates with
    channel `i + Hd/2`)::

        [ x f_0 .. x f_{Hd/4-1} | y f_0 .. y f_{Hd/4-1} | x f_0 .. x f_{Hd/4-1} | y f_0 .. y f_{Hd/4-1} ]

    The reference code rotates interleaved pairs `(2m, 2m+1)` instead; conversion permutes the q/k projection rows
    so that both give identical attention.
    """

    inv_freq: torch.Tensor

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def forward(self, coords: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # (..., 2) -> (..., 2, Hd/4) -> (..., Hd/2) -> (..., Hd)
        angles = 2 * math.pi * coords.float()[..., None] * self.inv_freq
        angles = angles.flatten(-2).tile(2)
        return angles.cos(), angles.sin()


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x * cos + rotate_half(x) * sin` for `x (..., L, Hd)` and cos/sin that broadcast to it.

    NOTE: computed as one product and two in-place half updates instead of `rotate_half`'s negation and concatenation:
    one allocation instead of four, about twice as fast on CPU at high resolution, and autograd-safe.
    """
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    half = x.shape[-1] // 2
    rotated = x * cos
    rotated[..., :half].addcmul_(x[..., half:], sin[..., :half], value=-1)
    rotated[..., half:].addcmul_(x[..., :half], sin[..., half:])
    return rotated


# glibc's largest mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX): larger blocks are mapped fresh on every call.
FRESH_MMAP_BYTES = 32 * 2**20


def linear_into_workspace(
    linear: nn.Module, hidden_states: torch.Tensor, workspace: dict[str, torch.Tensor] | None, name: str
) -> torch.Tensor:
    """`linear(hidden_states)`, written into `workspace[name]`: allocated by the first block, reused by the others.

    NOTE: glibc serves every CPU tensor above 32 MiB with a fresh mmap that the kernel maps in 4 KiB pages on first
    touch. At 1024 px the fused qkv (38 MB) and SwiGLU input (68 MB) outputs of VECA-B cost ~200k such faults per
    forward, ~6% of its time, which one buffer shared by the blocks avoids. Smaller outputs come from glibc's free
    lists, which hand back recently freed (cache-warm) memory: a shared buffer was slower there (512 px). Only a
    plain `nn.Linear` without hooks is bypassed: adapters (PEFT) and quantised layers keep their own forward.
    Without autograd only (a reused buffer would overwrite what backward needs).
    """
    shape = (*hidden_states.shape[:-1], linear.out_features)
    bypass = type(linear) is nn.Linear and not (linear._forward_hooks or linear._forward_pre_hooks)
    large = math.prod(shape) * hidden_states.element_size() > FRESH_MMAP_BYTES
    if workspace is None or not (bypass and large) or torch.is_grad_enabled():
        return linear(hidden_states)
    buffer = workspace.get(name)
    if buffer is None or buffer.shape != shape or buffer.dtype != hidden_states.dtype:
        buffer = workspace[name] = hidden_states.new_empty(shape)
    inputs, outputs = hidden_states.reshape(-1, hidden_states.shape[-1]), buffer.view(-1, linear.out_features)
    if linear.bias is None:
        torch.mm(inputs, linear.weight.t(), out=outputs)
    else:
        torch.addmm(linear.bias, inputs, linear.weight.t(), out=outputs)
    return buffer


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
    """Multi-head core-periphery attention: two attention calls, straight to `scaled_dot_product_attention` for
    `"sdpa"` and through transformers' attention interface for every other implementation.

    Call 1 lets the `C` cores attend to all `C + N` tokens, call 2 lets the `N` patches attend to the cores only.
    No `(C + N)^2` score matrix is built, except for `output_attentions=True`, where the output is computed from
    the assembled block-sparse map itself (so gradients can be taken with respect to it).
    """

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        self.is_causal = False  # NOTE: the SDPA integration treats modules without this flag as causal.
        # NOTE: q, k and v in one GEMM (faster than three); the converter concatenates the reference's q/k/v rows.
        self.qkv_proj = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(
        self,
        hidden_states: torch.Tensor,
        core_position_embeddings: tuple[torch.Tensor, torch.Tensor],
        patch_position_embeddings: tuple[torch.Tensor, torch.Tensor],
        output_attentions: bool = False,
        workspace: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        batch_size, num_tokens, _ = hidden_states.shape  # (B, T, D)
        num_cores = core_position_embeddings[0].shape[-2]

        qkv = linear_into_workspace(self.qkv_proj, hidden_states, workspace, "qkv")  # (B, T, 3 D)
        qkv = qkv.view(batch_size, num_tokens, 3, self.num_heads, self.head_dim)
        qkv = qkv.permute(2, 0, 3, 1, 4)  # (3, B, H, T, Hd)

        # RoPE on q and k at once: cores rotate by their own (per-image, per-layer) positions, patches by the grid.
        (core_cos, core_sin), (patch_cos, patch_sin) = core_position_embeddings, patch_position_embeddings
        rows = core_cos.shape[0]  # 1 before the first coordinate update, else B
        cos = torch.cat((core_cos, patch_cos.expand(rows, -1, -1)), dim=1).unsqueeze(1)  # (B or 1, 1, T, Hd)
        sin = torch.cat((core_sin, patch_sin.expand(rows, -1, -1)), dim=1).unsqueeze(1)
        query, key = apply_rotary_pos_emb(qkv[:2], cos, sin).unbind(0)  # (B, H, T, Hd) each
        value = qkv[2]  # (B, H, T, Hd)
        query_cores, query_patches = query[:, :, :num_cores], query[:, :, num_cores:]

        if output_attentions:
            attn_output, attn_weights = self._block_sparse_attention(query_cores, query_patches, key, value)
        elif self.config._attn_implementation == "sdpa":
            attn_output, attn_weights = self._sdpa_attention(query_cores, query_patches, key, value), None
        else:
            attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward
            )
            core_output, _ = attention_interface(
                self, query_cores, key, value, None, scaling=self.scaling, dropout=0.0
            )  # (B, C, H, Hd)
            patch_output, _ = attention_interface(
                self, query_patches, key[:, :, :num_cores], value[:, :, :num_cores], None, scaling=self.scaling,
                dropout=0.0,
            )  # (B, N, H, Hd)
            attn_output = torch.cat((core_output, patch_output), dim=1)  # (B, T, H, Hd)
            attn_weights = None

        attn_output = self.o_proj(attn_output.reshape(batch_size, num_tokens, -1))  # (B, T, D)
        return attn_output, attn_weights

    def _sdpa_attention(
        self, query_cores: torch.Tensor, query_patches: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        """Both calls straight to `scaled_dot_product_attention` (no mask, never causal), written into one
        `(B, T, H, Hd)` buffer.

        NOTE: the generic SDPA integration makes each output contiguous and the two are then concatenated (two
        copies instead of one), and its causal test on the query length fails under `torch.compile(dynamic=True)`.
        """
        num_cores = query_cores.shape[2]
        batch_size, num_heads, num_tokens, head_dim = key.shape
        sdpa = nn.functional.scaled_dot_product_attention
        core_keys, core_values = key[:, :, :num_cores], value[:, :, :num_cores]  # (B, H, C, Hd)
        core_output = sdpa(query_cores, key, value, scale=self.scaling)  # (B, H, C, Hd)
        patch_output = sdpa(query_patches, core_keys, core_values, scale=self.scaling)  # (B, H, N, Hd)
        attn_output = query_cores.new_empty(batch_size, num_tokens, num_heads, head_dim)
        attn_output[:, :num_cores] = core_output.transpose(1, 2)
        attn_output[:, num_cores:] = patch_output.transpose(1, 2)
        return attn_output  # (B, T, H, Hd)

    def _block_sparse_attention(
        self, query_cores: torch.Tensor, query_patches: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The same two softmaxes, assembled into the full `(B, H, T, T)` map that the output is then computed from."""
        num_cores = query_cores.shape[2]
        num_patches = query_patches.shape[2]
        core_scores = torch.matmul(query_cores, key.transpose(2, 3)) * self.scaling  # (B, H, C, T)
        patch_scores = torch.matmul(query_patches, key[:, :, :num_cores].transpose(2, 3)) * self.scaling  # (B, H, N, C)
        core_probs = core_scores.softmax(dim=-1, dtype=torch.float32).to(query_cores.dtype)
        patch_probs = patch_scores.softmax(dim=-1, dtype=torch.float32).to(query_cores.dtype)
        patch_probs = nn.functional.pad(patch_probs, (0, num_patches))  # (B, H, N, T), exact zeros patch -> patch
        attn_weights = torch.cat((core_probs, patch_probs), dim=2)  # (B, H, T, T)
        attn_output = torch.matmul(attn_weights, value).transpose(1, 2)  # (B, T, H, Hd)
        return attn_output, attn_weights


class VecaSwiGLUMLP(nn.Module):
    """SwiGLU: one input projection whose first half is the (activated) gate, as the reference's `fc1`."""

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size)
        self.act_fn = ACT2FN[config.hidden_act]
        self.hidden_act = config.hidden_act

    def forward(self, hidden_states: torch.Tensor, workspace: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        if torch.is_grad_enabled():
            gate, up = self.gate_up_proj(hidden_states).chunk(2, dim=-1)  # (B, T, I) each
            return self.down_proj(self.act_fn(gate) * up)
        gate, up = linear_into_workspace(self.gate_up_proj, hidden_states, workspace, "gate_up").chunk(2, dim=-1)
        # NOTE: without autograd, activate and gate inside the projection's output: no fresh (B, T, I) buffer, whose
        # first touch alone costs ~8k page faults per block at 1024 px on CPU.
        if self.hidden_act == "silu":
            activated = nn.functional.silu(gate, inplace=True)
        else:
            activated = self.act_fn(gate)
        return self.down_proj(activated.mul_(up))


class VecaLayer(GradientCheckpointingLayer):
    """Pre-norm block: core-periphery attention then SwiGLU, no layer scale, no drop path (block l of the reference)."""

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
        output_attentions: bool = False,
        workspace: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        # NOTE: cos/sin travel as separate tensors: re-entrant checkpointing loses gradients through tuples.
        attn_output, attn_weights = self.attention(
            self.norm1(hidden_states), (core_cos, core_sin), (patch_cos, patch_sin), output_attentions, workspace
        )
        # NOTE: residuals added into the fresh branch outputs (an addition needs no saved inputs for backward);
        # the incoming hidden_states are never modified, so returned hidden states stay intact.
        hidden_states = attn_output.add_(hidden_states)
        hidden_states = self.mlp(self.norm2(hidden_states), workspace).add_(hidden_states)
        return hidden_states, attn_weights


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


class VecaCoreTokens(nn.ParameterList):
    """The core embeddings, `M / chunk` parameters of shape `(chunk, D)`."""


class VecaCoreCoordinates(nn.ParameterList):
    """The raw core coordinates `rho` as `(x, y)`, `M / chunk` parameters of shape `(chunk, 2)`."""


class VecaEmbeddings(nn.Module):
    """Patch embedding plus the core bank: `M` core embeddings and raw coordinates `rho`, in chunks.

    NOTE: the bank is stored as one parameter per chunk so that a step at budget `C` leaves the unused chunks
    without gradients, and optimisers (AdamW momentum and weight decay included) skip them, as in the reference.
    """

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.config = config
        num_chunks = config.num_core_tokens // config.core_chunk_size
        self.patch_embeddings = nn.Conv2d(
            config.num_channels, config.hidden_size, kernel_size=config.patch_size, stride=config.patch_size
        )
        self.core_tokens = VecaCoreTokens(
            [nn.Parameter(torch.empty(config.core_chunk_size, config.hidden_size)) for _ in range(num_chunks)]
        )
        self.core_coordinates = VecaCoreCoordinates(
            [nn.Parameter(torch.empty(config.core_chunk_size, 2)) for _ in range(num_chunks)]
        )

    def embed_patches(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """`(B, 3, H, W)` -> `(B, N, D)`, row-major patches: the `patch_embeddings` convolution, run as one GEMM.

        NOTE: a convolution whose stride equals its kernel is a linear map of the flattened patches; as `F.linear`
        it ran ~1.5x faster than oneDNN's convolution on CPU at 1024 px. The weights stay a `Conv2d` (same checkpoints).
        """
        batch_size, num_channels, height, width = pixel_values.shape
        patch_size = self.config.patch_size
        rows, cols = height // patch_size, width // patch_size
        patches = pixel_values.reshape(batch_size, num_channels, rows, patch_size, cols, patch_size)
        patches = patches.permute(0, 2, 4, 1, 3, 5).reshape(batch_size, rows * cols, -1)  # (B, N, 3 p p)
        return nn.functional.linear(patches, self.patch_embeddings.weight.flatten(1), self.patch_embeddings.bias)

    def forward(self, pixel_values: torch.Tensor, num_core_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch_size = pixel_values.shape[0]
        patches = self.embed_patches(pixel_values)  # (B, N, D)
        if torch.is_grad_enabled():
            num_chunks = num_core_tokens // self.config.core_chunk_size
            # Only the active chunks enter the graph: the others get no gradient, so optimisers skip them.
            cores = torch.cat(list(self.core_tokens[:num_chunks]), dim=0)  # (C, D)
            core_coordinates = torch.cat(list(self.core_coordinates[:num_chunks]), dim=0)  # (C, 2)
        else:
            # NOTE: a slice by the budget (not a list of chunks) keeps one torch.compile graph for every budget.
            cores = torch.cat(list(self.core_tokens), dim=0)[:num_core_tokens]  # (C, D)
            core_coordinates = torch.cat(list(self.core_coordinates), dim=0)[:num_core_tokens]  # (C, 2)
        embeddings = torch.cat((cores.expand(batch_size, -1, -1), patches), dim=1)  # (B, T, D)
        return embeddings, core_coordinates.unsqueeze(0)  # (B, T, D), (1, C, 2)


class VecaPreTrainedModel(PreTrainedModel):
    config: VecaConfig
    config_class = VecaConfig
    base_model_prefix = "veca"
    main_input_name = "pixel_values"
    input_modalities = ("image",)
    supports_gradient_checkpointing = True
    _no_split_modules = ["VecaEmbeddings", "VecaLayer"]
    _supports_sdpa = True
    _can_compile_fullgraph = True

    def save_pretrained(self, save_directory, *args, **kwargs):
        """Same as [`PreTrainedModel.save_pretrained`], plus the code and an `auto_map` for `trust_remote_code`."""
        self.config.auto_map = {**VECA_AUTO_MAP, **(getattr(self.config, "auto_map", None) or {})}
        return super().save_pretrained(save_directory, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        """Spec section 2. Every parameter and non-persistent buffer is set here (`from_pretrained` builds on meta)."""
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
                self.config.num_core_tokens,
                self.config.core_coordinate_init_candidates,
                self.config.core_coordinate_init_range,
            )
            for chunk, value in zip(module, core_coordinates.split(self.config.core_chunk_size)):
                init.copy_(chunk, value)
        elif isinstance(module, VecaCoreCoordinateHead):
            init.constant_(module.step, module.config.core_coordinate_step_init)
        elif isinstance(module, VecaRopePositionEmbedding):
            init.copy_(module.inv_freq, rope_inv_freq(module.config))


class VecaEncoder(nn.Module):
    """The blocks, and the coordinate heads that move the cores between them (`L - 1` of them)."""

    def __init__(self, config: VecaConfig):
        super().__init__()
        self.layer = nn.ModuleList([VecaLayer(config) for _ in range(config.num_hidden_layers)])
        self.core_coordinate_heads = nn.ModuleList(
            [VecaCoreCoordinateHead(config) for _ in range(config.num_hidden_layers - 1)]
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        core_coordinates: torch.Tensor,
        patch_position_embeddings: tuple[torch.Tensor, torch.Tensor],
        rope_embeddings: VecaRopePositionEmbedding,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple | None, tuple | None]:
        num_cores = core_coordinates.shape[1]
        all_hidden_states = (hidden_states,) if output_hidden_states else None
        all_attentions = () if output_attentions else None
        # Without autograd on CPU the blocks share their largest projection outputs (see `linear_into_workspace`);
        # autograd keeps them for backward, the CUDA caching allocator already reuses memory, and autocast,
        # torch.compile and torch.export handle the plain `nn.Linear` call better.
        reuse_buffers = (
            not torch.is_grad_enabled()
            and hidden_states.device.type == "cpu"
            and not torch.is_autocast_enabled("cpu")
            and not torch.compiler.is_compiling()
            and not torch.compiler.is_exporting()
        )
        workspace = {} if reuse_buffers else None
        for index, layer in enumerate(self.layer):
            if index > 0:
                core_coordinates = self.core_coordinate_heads[index - 1](hidden_states[:, :num_cores], core_coordinates)
            core_cos, core_sin = rope_embeddings(torch.tanh(core_coordinates))  # (B or 1, C, Hd)
            hidden_states, attn_weights = layer(
                hidden_states,
                core_cos,
                core_sin,
                *patch_position_embeddings,
                output_attentions=output_attentions,
                workspace=workspace,
            )
            if output_hidden_states:
                all_hidden_states += (hidden_states,)
            if output_attentions:
                all_attentions += (attn_weights,)
        return hidden_states, core_coordinates, all_hidden_states, all_attentions


class VecaModel(VecaPreTrainedModel):
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
        if num_core_tokens is None:
            num_core_tokens = self.config.default_num_core_tokens or self.config.num_core_tokens
        if isinstance(num_core_tokens, torch.Tensor) and num_core_tokens.numel() == 1:
            num_core_tokens = int(num_core_tokens)
        return self.config.check_budget(num_core_tokens)

    def _check_pixel_values(self, pixel_values: torch.Tensor) -> None:
        if not isinstance(pixel_values, torch.Tensor) or pixel_values.ndim != 4:
            shape = tuple(pixel_values.shape) if isinstance(pixel_values, torch.Tensor) else type(pixel_values)
            raise ValueError(
                f"pixel_values must be a tensor of shape (batch, {self.config.num_channels}, height, width), got "
                f"{shape}. Use the image processor (AutoImageProcessor) to turn images into pixel_values."
            )
        _, num_channels, height, width = pixel_values.shape
        if num_channels != self.config.num_channels:
            raise ValueError(
                f"pixel_values has {num_channels} channels but the model expects config.num_channels="
                f"{self.config.num_channels}; convert the images (e.g. to RGB) first."
            )
        patch_size = self.config.patch_size
        if height % patch_size or width % patch_size or height == 0 or width == 0:
            raise ValueError(
                f"Image size {height}x{width} is not a positive multiple of patch_size={patch_size}: resize or crop "
                f"to e.g. {max(patch_size, height // patch_size * patch_size)}x"
                f"{max(patch_size, width // patch_size * patch_size)} (VECA never interpolates positions)."
            )

    def forward(
        self,
        pixel_values: torch.Tensor,
        num_core_tokens: int | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> VecaModelOutput | tuple:
        r"""
        Args:
            pixel_values (`torch.FloatTensor` of shape `(batch_size, num_channels, height, width)`):
                Normalised images; height and width any multiples of `config.patch_size`.
            num_core_tokens (`int`, *optional*):
                The budget `C`: how many cores of the bank are active (a prefix). A multiple of
                `config.core_chunk_size` up to `config.num_core_tokens`. Defaults to `config.default_num_core_tokens`,
                else the whole bank.
            output_attentions (`bool`, *optional*):
                Return each block's block-sparse `(B, H, T, T)` attention map. This materialises the dense map
                (whatever the attention implementation) and computes the output from it.
            output_hidden_states (`bool`, *optional*):
                Return the embeddings and every block's output.
            return_dict (`bool`, *optional*):
                Return a [`VecaModelOutput`] instead of a plain tuple.
        """
        output_attentions = output_attentions if output_attentions is not None else self.config.output_attentions
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        self._check_pixel_values(pixel_values)
        num_core_tokens = self.resolve_num_core_tokens(num_core_tokens)

        pixel_values = pixel_values.to(self.embeddings.patch_embeddings.weight.dtype)
        batch_size, _, height, width = pixel_values.shape
        hidden_states, core_coordinates = self.embeddings(pixel_values, num_core_tokens)  # (B, T, D), (1, C, 2)

        patch_size = self.config.patch_size
        patch_coordinates = get_patch_coordinates(
            height // patch_size, width // patch_size, dtype=torch.float32, device=pixel_values.device
        )  # (N, 2)
        if self.training:
            patch_coordinates = augment_patch_coordinates(
                patch_coordinates, self.config.pos_embed_shift, self.config.pos_embed_jitter, self.config.pos_embed_rescale
            )
        patch_position_embeddings = self.rope_embeddings(patch_coordinates)  # (N, Hd) each

        hidden_states, core_coordinates, all_hidden_states, all_attentions = self.encoder(
            hidden_states,
            core_coordinates,
            patch_position_embeddings,
            self.rope_embeddings,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        sequence_output = self.norm(hidden_states)  # (B, T, D)
        output = VecaModelOutput(
            last_hidden_state=sequence_output,
            pooler_output=sequence_output[:, 0],
            hidden_states=all_hidden_states,
            attentions=all_attentions,
            core_coordinates=torch.tanh(core_coordinates).expand(batch_size, -1, -1),
        )
        return output if return_dict else output.to_tuple()


class VecaForImageClassification(VecaPreTrainedModel):
    """VECA with a linear classifier on the global core (the first core after the final norm), the paper's probe."""

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.veca = VecaModel(config)
        self.classifier = nn.Linear(config.hidden_size, config.num_labels) if config.num_labels > 0 else nn.Identity()
        self.post_init()

    def forward(
        self,
        pixel_values: torch.Tensor,
        labels: torch.Tensor | None = None,
        num_core_tokens: int | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> ImageClassifierOutput | tuple:
        r"""
        Args:
            pixel_values (`torch.FloatTensor` of shape `(batch_size, num_channels, height, width)`):
                Normalised images.
            labels (`torch.LongTensor` of shape `(batch_size,)`, *optional*):
                Class indices (or regression targets when `config.num_labels == 1`) for the loss.
            num_core_tokens (`int`, *optional*):
                The budget `C`; see [`VecaModel.forward`].
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        outputs = self.veca(
            pixel_values,
            num_core_tokens=num_core_tokens,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
        )
        logits = self.classifier(outputs.pooler_output)  # (B, num_labels)
        loss = self.loss_function(labels, logits, self.config, **kwargs) if labels is not None else None
        output = ImageClassifierOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )
        return output if return_dict else output.to_tuple()


class VecaBackbone(BackboneMixin, VecaPreTrainedModel):
    """VECA as an `AutoBackbone`: patch feature maps `(B, D, H/p, W/p)` of the stages in `config.out_features`.

    Stage `"stem"` is the patch embedding, `"stage{l}"` the output of block `l`. With `config.apply_layernorm` every
    map goes through the final LayerNorm (the last stage always does, as in [`VecaModel`]).
    """

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.veca = VecaModel(config)
        self.num_features = [config.hidden_size] * (config.num_hidden_layers + 1)
        self.post_init()

    def get_input_embeddings(self) -> nn.Module:
        return self.veca.get_input_embeddings()

    def forward(
        self,
        pixel_values: torch.Tensor,
        num_core_tokens: int | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> BackboneOutput | tuple:
        r"""
        Args:
            pixel_values (`torch.FloatTensor` of shape `(batch_size, num_channels, height, width)`):
                Normalised images; height and width any multiples of `config.patch_size`.
            num_core_tokens (`int`, *optional*):
                The budget `C`; see [`VecaModel.forward`].
        """
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        output_hidden_states = (
            output_hidden_states if output_hidden_states is not None else self.config.output_hidden_states
        )
        outputs = self.veca(
            pixel_values,
            num_core_tokens=num_core_tokens,
            output_attentions=output_attentions,
            output_hidden_states=True,
            return_dict=True,
        )
        num_cores = outputs.core_coordinates.shape[1]
        batch_size, _, height, width = pixel_values.shape
        grid = (height // self.config.patch_size, width // self.config.patch_size)
        last_stage = len(self.stage_names) - 1

        feature_maps = []
        for index, (stage_name, hidden_state) in enumerate(zip(self.stage_names, outputs.hidden_states)):
            if stage_name not in self.out_features:
                continue
            if index == last_stage:
                hidden_state = outputs.last_hidden_state
            elif self.config.apply_layernorm:
                hidden_state = self.veca.norm(hidden_state)
            patches = hidden_state[:, num_cores:]  # (B, N, D)
            if self.config.reshape_hidden_states:
                patches = patches.reshape(batch_size, *grid, -1).permute(0, 3, 1, 2).contiguous()  # (B, D, Hp, Wp)
            feature_maps.append(patches)

        output = BackboneOutput(
            feature_maps=tuple(feature_maps),
            hidden_states=outputs.hidden_states if output_hidden_states else None,
            attentions=outputs.attentions,
        )
        return output if return_dict else output.to_tuple()


__all__ = [
    "VecaBackbone",
    "VecaForImageClassification",
    "VecaModel",
    "VecaModelOutput",
    "VecaPreTrainedModel",
]
