# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""VECA with linear dense heads: semantic segmentation and depth estimation.

Both heads are the paper's dense probe trained end to end: every patch token after the final norm, concatenated
with the global token (core 1, `pooler_output`), goes through one linear layer, and the `(B, K, Hp, Wp)` map is
bilinearly upsampled to the input size.

    patches (B, N, D) ─┐
                       ├─ cat (B, N, 2D) ─ Linear ─ (B, K, Hp, Wp) ─ bilinear x p ─ (B, K, H, W)
    global  (B, 1, D) ─┘   (global repeated for every patch)

Shape legend as in `modeling_veca.py`: B batch, N patches (Hp * Wp), D hidden size, K outputs (classes, or 1 for
depth), p patch size.

With `pixel_mask` (a padded batch of images of different sizes) each image's own patch grid is upsampled alone, so
its logits equal those of a forward of that image alone (bilinear interpolation near the border would otherwise
blend in the padding), and padded pixels are left out of the loss.

NOTE: this file imports only torch, transformers and its siblings, relatively, so that a saved folder loads with
`trust_remote_code=True` where veca_hf is not installed (`VecaPreTrainedModel.save_pretrained` copies it into every
saved VECA folder).
"""

import torch
from torch import nn
from transformers.modeling_outputs import DepthEstimatorOutput, SemanticSegmenterOutput
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs
from transformers.utils.generic import can_return_tuple

from .configuration_veca import VecaConfig
from .image_budgets_veca import NumCoreTokens
from .modeling_veca import VecaModel, VecaModelOutput, VecaPreTrainedModel, veca_docstring


def upsample_patch_logits(logits: torch.Tensor, patch_size: int, patch_mask: torch.Tensor | None) -> torch.Tensor:
    """Bilinear `(B, K, Hp, Wp) -> (B, K, Hp p, Wp p)`; with padding, each image's own patch rectangle alone (zeros
    elsewhere).

    NOTE: the scale factor is exactly `p` either way, so an image upsampled inside its own rectangle gets the values
    of its single-image forward (the interpolation's edge clamping falls on its own border, not on the padding).
    """
    batch_size, channels, rows, cols = logits.shape
    size = (rows * patch_size, cols * patch_size)
    if patch_mask is None or bool(patch_mask.all()):
        return nn.functional.interpolate(logits, size=size, mode="bilinear", align_corners=False)
    grid_mask = patch_mask.reshape(batch_size, rows, cols)
    upsampled = logits.new_zeros(batch_size, channels, *size)
    for index in range(batch_size):
        row_ids = grid_mask[index].any(1).nonzero()[:, 0]
        col_ids = grid_mask[index].any(0).nonzero()[:, 0]
        top, bottom = int(row_ids[0]), int(row_ids[-1]) + 1
        left, right = int(col_ids[0]), int(col_ids[-1]) + 1
        own = nn.functional.interpolate(
            logits[index : index + 1, :, top:bottom, left:right],
            size=((bottom - top) * patch_size, (right - left) * patch_size),
            mode="bilinear",
            align_corners=False,
        )  # (1, K, h, w)
        upsampled[index, :, top * patch_size : bottom * patch_size, left * patch_size : right * patch_size] = own[0]
    return upsampled


def _check_target_size(labels: torch.Tensor, pixel_values: torch.Tensor, name: str) -> None:
    if labels.shape != (pixel_values.shape[0], *pixel_values.shape[-2:]):
        raise ValueError(
            f"{name} has shape {tuple(labels.shape)} but pixel_values {tuple(pixel_values.shape)} needs "
            f"(batch, height, width) = {(pixel_values.shape[0], *pixel_values.shape[-2:])}: resize the maps with the "
            "images (nearest-neighbour for labels), and pad them with the images."
        )


def masked_depth_mse(
    predicted_depth: torch.Tensor, depth: torch.Tensor, pixel_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """
    The depth loss: mean squared error over the pixels with ground truth, `(B, H, W), (B, H, W) -> ()`.

    A pixel counts where its depth is finite and positive (0 or NaN marks pixels without one) and, with `pixel_mask`,
    where the mask is non-zero (padding). A batch without any such pixel gives 0 with a graph of zeros, so a step on
    it changes nothing but still runs under DDP.
    """
    depth = depth.to(predicted_depth.device, predicted_depth.dtype)
    valid = torch.isfinite(depth) & (depth > 0)
    if pixel_mask is not None:
        valid &= pixel_mask.to(valid.device) != 0
    if not bool(valid.any()):
        return predicted_depth.sum() * 0.0
    return nn.functional.mse_loss(predicted_depth[valid], depth[valid])


class VecaDensePreTrainedModel(VecaPreTrainedModel):
    """A `VecaModel` and one linear layer on `[patch; global]`, upsampled to the input: the trunk of both heads."""

    def _dense_forward(
        self,
        head: nn.Linear,
        pixel_values: torch.Tensor,
        num_core_tokens: NumCoreTokens,
        pixel_mask: torch.Tensor | None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, VecaModelOutput]:
        """`(B, K, H, W)` outputs of `head` at every pixel, and the backbone's outputs."""
        outputs = self.veca(pixel_values, num_core_tokens=num_core_tokens, pixel_mask=pixel_mask, **kwargs)
        num_cores = outputs.core_positions.shape[1]
        batch_size, _, height, width = pixel_values.shape
        patch_size = self.config.patch_size
        patches = outputs.last_hidden_state[:, num_cores:]  # (B, N, D)
        global_tokens = outputs.pooler_output[:, None].expand_as(patches)  # (B, N, D)
        logits = head(torch.cat((patches, global_tokens), dim=-1))  # (B, N, K)
        logits = logits.transpose(1, 2).reshape(batch_size, -1, height // patch_size, width // patch_size)
        return upsample_patch_logits(logits, patch_size, outputs.patch_mask), outputs  # (B, K, H, W)


class VecaForSemanticSegmentation(VecaDensePreTrainedModel):
    """VECA with a linear segmentation head on every patch token concatenated with the global token, its logits
    bilinearly upsampled to the input size; cross-entropy that ignores `config.semantic_loss_ignore_index`."""

    # NOTE: the loss is a mean over labelled pixels; `Trainer` then divides by the accumulation steps itself.
    accepts_loss_kwargs = False

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.num_labels = config.num_labels
        self.veca = VecaModel(config)
        self.classifier = nn.Linear(2 * config.hidden_size, config.num_labels)
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
    ) -> SemanticSegmenterOutput:
        r"""
        labels (`torch.LongTensor` of shape `(batch_size, height, width)`, *optional*):
            A class index per pixel, `config.semantic_loss_ignore_index` (255 by default) for unlabelled pixels and
            for padding. The loss is the mean cross-entropy over labelled pixels (0, with a gradient of zeros, if
            none is labelled); `logits` are `(batch_size, num_labels, height, width)`.
        """
        logits, outputs = self._dense_forward(
            self.classifier, pixel_values, num_core_tokens, pixel_mask, **kwargs
        )  # (B, K, H, W)
        loss = None
        if labels is not None:
            _check_target_size(labels, pixel_values, "labels")
            ignore_index = self.config.semantic_loss_ignore_index
            labels = labels.to(logits.device, torch.long)
            if pixel_mask is not None:
                labels = labels.masked_fill(pixel_mask.to(labels.device) == 0, ignore_index)
            if bool((labels != ignore_index).any()):
                loss = nn.functional.cross_entropy(logits, labels, ignore_index=ignore_index)
            else:  # nothing labelled: a mean over no pixel would be NaN
                loss = logits.sum() * 0.0
        return SemanticSegmenterOutput(
            loss=loss, logits=logits, hidden_states=outputs.hidden_states, attentions=outputs.attentions
        )


class VecaForDepthEstimation(VecaDensePreTrainedModel):
    """VECA with a linear depth head (one output) on every patch token concatenated with the global token,
    bilinearly upsampled to the input size; squared error over the pixels with a depth.

    NOTE: the loss is the mean squared error over valid pixels (depth finite and > 0), not the scale-invariant
    log loss (SiLog) of GLPN and the NYUv2 / KITTI literature: (1) it is the square of the RMSE the task is scored
    with, and the loss of `veca_hf.evaluation`'s linear depth probe, so the two agree; (2) it needs no positive
    prediction (SiLog takes the log of the prediction, which a linear output, or DPT's ReLU output at 0, does not
    have); (3) it is a mean over pixels, so a padded batch of images of different sizes has exactly the
    pixel-weighted mean of its images' own losses (SiLog's square root over the whole batch has no such split).
    """

    accepts_loss_kwargs = False

    def __init__(self, config: VecaConfig):
        super().__init__(config)
        self.veca = VecaModel(config)
        self.head = nn.Linear(2 * config.hidden_size, 1)
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
    ) -> DepthEstimatorOutput:
        r"""
        labels (`torch.FloatTensor` of shape `(batch_size, height, width)`, *optional*):
            Ground-truth depth; 0 or NaN marks pixels without one, and padding is left out too. The loss is the mean
            squared error over valid pixels (0, with a gradient of zeros, if none is valid); `predicted_depth` is
            `(batch_size, height, width)`.
        """
        predicted_depth, outputs = self._dense_forward(self.head, pixel_values, num_core_tokens, pixel_mask, **kwargs)
        predicted_depth = predicted_depth[:, 0]  # (B, H, W)
        loss = None
        if labels is not None:
            _check_target_size(labels, pixel_values, "labels")
            loss = masked_depth_mse(predicted_depth, labels, pixel_mask)
        return DepthEstimatorOutput(
            loss=loss,
            predicted_depth=predicted_depth,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )


__all__ = ["VecaForDepthEstimation", "VecaForSemanticSegmentation", "masked_depth_mse", "upsample_patch_logits"]
