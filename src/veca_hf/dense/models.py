# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Dense models from one VECA folder: the linear heads, transformers' UperNet, DPT and Depth Anything on a VECA
backbone, the processor they share, and freezing the backbone."""

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoImageProcessor,
    AutoModelForDepthEstimation,
    AutoModelForSemanticSegmentation,
    DepthAnythingConfig,
    DepthAnythingForDepthEstimation,
    DPTConfig,
    DPTForDepthEstimation,
    PreTrainedModel,
    UperNetConfig,
    UperNetForSemanticSegmentation,
)
from transformers.utils import is_torchvision_available, logging

from ..model.configuration_veca import VecaConfig
from ..model.image_processing_pil_veca import VecaImageProcessorPil
from ..model.image_processing_veca import VecaImageProcessor
from ..model.modeling_veca import VecaBackbone, VecaModel


logger = logging.get_logger(__name__)

SEGMENTATION_HEADS = ("linear", "upernet")
DEPTH_HEADS = ("linear", "dpt", "depth_anything")


@dataclass
class DenseModelArguments:
    """The model flags both dense scripts take (each names its heads): which model, which head, which stages."""

    model_name_or_path: str = field(metadata={"help": "A VECA folder or Hub id (VecaModel, or a saved head)."})
    head: str = field(default="linear", metadata={"help": "The head on the backbone."})
    freeze_backbone: bool = field(default=False, metadata={"help": "Train the head only."})
    backbone_out_indices: str | None = field(
        default=None, metadata={"help": "The neck's VECA stages, e.g. '3,6,9,12' (default: four, evenly spread)."}
    )
    head_hidden_size: int | None = field(default=None, metadata={"help": "The neck's width (default: transformers')."})
    cache_dir: str | None = field(default=None, metadata={"help": "Where to cache Hub downloads."})
    model_revision: str = field(default="main", metadata={"help": "Branch, tag or commit of a Hub model."})


def default_out_indices(num_hidden_layers: int, count: int = 4) -> list[int]:
    """`count` stages spread evenly up to the last block, as DPT reads a ViT (`[3, 6, 9, 12]` for 12 blocks); fewer
    for shallow models (`[0, 1, 2]` for 2 blocks: the patch embedding and both blocks)."""
    return sorted({round(num_hidden_layers * (index + 1) / count) for index in range(count)})


def build_dense_processor(model_name_or_path: str, shortest_edge: int, longest_edge: int | None = None, **kwargs):
    """The folder's image processor (its mean and std; the defaults where it has none) in any-size mode:
    `for_any_size(shortest_edge)`, each image resized to multiples of the patch size and batches padded with a
    `pixel_mask` (docs/usage.md, "Images of different sizes in one batch")."""
    config = AutoConfig.from_pretrained(model_name_or_path, **kwargs)
    veca = config if isinstance(config, VecaConfig) else config.backbone_config
    try:
        loaded = AutoImageProcessor.from_pretrained(model_name_or_path, **kwargs)
        cls = type(loaded) if isinstance(loaded, (VecaImageProcessor, VecaImageProcessorPil)) else None
        options = {"image_mean": loaded.image_mean, "image_std": loaded.image_std}
    except OSError:  # a folder without a processor
        cls, options = None, {}
    cls = cls or (VecaImageProcessor if is_torchvision_available() else VecaImageProcessorPil)
    if longest_edge is not None:
        options["size"] = {"shortest_edge": shortest_edge, "longest_edge": longest_edge}
    return cls.for_any_size(shortest_edge, patch_size=veca.patch_size, **options)


def _veca_backbone_config(
    model_name_or_path: str, out_indices, reshape_hidden_states: bool, num_core_tokens, **kwargs
):
    config = VecaConfig.from_pretrained(model_name_or_path, **kwargs)
    indices = list(out_indices) if out_indices else default_out_indices(config.num_hidden_layers)
    config = VecaConfig.from_pretrained(
        model_name_or_path, out_indices=indices, reshape_hidden_states=reshape_hidden_states, **kwargs
    )
    config.architectures = None
    if hasattr(config, "auto_map"):  # the head's folder holds no VECA code
        del config.auto_map
    if num_core_tokens is not None:
        config.default_num_core_tokens = config.check_budget(num_core_tokens, name="--num_core_tokens")
    return config


def _for_trainer(model: PreTrainedModel) -> PreTrainedModel:
    """A transformers head, marked as computing a mean loss that takes no loss arguments.

    NOTE: UperNet, DPT and Depth Anything take `**kwargs`, from which `Trainer` concludes that they normalise their
    loss by `num_items_in_batch`: it would then pass it (DPT hands it to the backbone, which rejects it) and skip
    the division by the gradient accumulation steps. Their losses are per-batch means.
    """
    model.accepts_loss_kwargs = False
    return model


def _load_veca_weights(model: PreTrainedModel, model_name_or_path: str, **kwargs) -> PreTrainedModel:
    """The folder's VECA weights into the head's backbone (a `VecaModel`, classifier, dense head or backbone
    folder)."""
    model.backbone.load_state_dict(VecaBackbone.from_pretrained(model_name_or_path, **kwargs).state_dict())
    return _for_trainer(model)


def _neck_sizes(count: int, hidden_size: int | None, defaults: Sequence[int]) -> list[int]:
    return [hidden_size] * count if hidden_size else list(defaults)[:count]


def _continue_saved_head(
    model: PreTrainedModel, model_name_or_path: str, head: str, expected: type | None, num_core_tokens: int | None
) -> PreTrainedModel:
    """A saved transformers head on a VECA backbone, to train further: it must be the `--head` asked for
    (`expected`); `num_core_tokens` becomes its backbone's default budget."""
    if expected is None or not isinstance(model, expected):
        raise ValueError(f"{model_name_or_path} holds a {type(model).__name__}, not a VECA for --head {head}.")
    if num_core_tokens is not None:
        model.backbone.config.default_num_core_tokens = num_core_tokens
        model.config.backbone_config.default_num_core_tokens = num_core_tokens
    return _for_trainer(model)


def build_segmentation_model(
    model_name_or_path: str,
    head: str,
    id2label: Mapping[int, str],
    ignore_index: int = 255,
    num_core_tokens: int | None = None,
    out_indices: Sequence[int] | None = None,
    head_hidden_size: int | None = None,
    **kwargs,
) -> PreTrainedModel:
    """
    A segmentation model on the VECA of `model_name_or_path`.

    Args:
        model_name_or_path (`str`):
            A VECA folder or Hub id: a `VecaModel` (the head is new), a classifier, or a saved segmentation model
            (`VecaForSemanticSegmentation`, or `UperNetForSemanticSegmentation` with a VECA backbone), whose head is
            kept when its labels match.
        head (`str`):
            `"linear"` ([`VecaForSemanticSegmentation`], loaded with `AutoModelForSemanticSegmentation`) or
            `"upernet"` (transformers' `UperNetForSemanticSegmentation`, the VECA as its backbone, maps of
            `out_indices`).
        id2label (`Mapping[int, str]`): the class names; their number is `num_labels`.
        ignore_index (`int`, *optional*, defaults to 255): the label the loss ignores.
        num_core_tokens (`int`, *optional*): saved as the VECA's `default_num_core_tokens`.
        out_indices (`Sequence[int]`, *optional*): UperNet's stages; defaults to `default_out_indices`.
        head_hidden_size (`int`, *optional*): UperNet's `hidden_size` (512 by default; its auxiliary head half).
        kwargs: passed to `from_pretrained` (`cache_dir`, `revision`).
    """
    id2label = {int(index): name for index, name in id2label.items()}
    labels = {"num_labels": len(id2label), "id2label": id2label, "label2id": {n: i for i, n in id2label.items()}}
    config = AutoConfig.from_pretrained(model_name_or_path, **kwargs)
    if head not in SEGMENTATION_HEADS:
        raise ValueError(f"--head must be one of {SEGMENTATION_HEADS}, got {head!r}.")
    if not isinstance(config, VecaConfig):  # a saved transformers head: continue training it
        model = AutoModelForSemanticSegmentation.from_pretrained(
            model_name_or_path, ignore_mismatched_sizes=True, loss_ignore_index=ignore_index, **labels, **kwargs
        )
        expected = UperNetForSemanticSegmentation if head == "upernet" else None
        return _continue_saved_head(model, model_name_or_path, head, expected, num_core_tokens)
    if head == "linear":
        budget = {"default_num_core_tokens": num_core_tokens} if num_core_tokens is not None else {}
        return AutoModelForSemanticSegmentation.from_pretrained(
            model_name_or_path,
            ignore_mismatched_sizes=True,
            semantic_loss_ignore_index=ignore_index,
            **labels,
            **budget,
            **kwargs,
        )
    backbone_config = _veca_backbone_config(model_name_or_path, out_indices, True, num_core_tokens, **kwargs)
    hidden_size = head_hidden_size or 512
    upernet_config = UperNetConfig(
        backbone_config=backbone_config,
        hidden_size=hidden_size,
        auxiliary_channels=max(hidden_size // 2, 1),
        loss_ignore_index=ignore_index,
        **labels,
    )
    return _load_veca_weights(UperNetForSemanticSegmentation(upernet_config), model_name_or_path, **kwargs)


def build_depth_model(
    model_name_or_path: str,
    head: str,
    num_core_tokens: int | None = None,
    out_indices: Sequence[int] | None = None,
    head_hidden_size: int | None = None,
    max_depth: int = 10,
    initial_depth: float | None = None,
    **kwargs,
) -> PreTrainedModel:
    """
    A depth model on the VECA of `model_name_or_path`.

    Args:
        model_name_or_path (`str`):
            A VECA folder or Hub id (`VecaModel`, classifier, `VecaForDepthEstimation`), or a saved DPT / Depth
            Anything head with a VECA backbone to continue training.
        head (`str`):
            `"linear"` ([`VecaForDepthEstimation`], loaded with `AutoModelForDepthEstimation`), `"dpt"`
            (`DPTForDepthEstimation`, readout `"project"` from the global core) or `"depth_anything"`
            (`DepthAnythingForDepthEstimation`, metric: `sigmoid * max_depth`).
        num_core_tokens (`int`, *optional*): saved as the VECA's `default_num_core_tokens`.
        out_indices (`Sequence[int]`, *optional*): the necks' stages; defaults to `default_out_indices`.
        head_hidden_size (`int`, *optional*): the necks' width (every `neck_hidden_sizes` entry and
            `fusion_hidden_size`); transformers' defaults otherwise.
        max_depth (`int`, *optional*, defaults to 10): Depth Anything's largest depth (10 m for NYUv2, 80 for
            KITTI).
        initial_depth (`float`, *optional*):
            A new linear head starts predicting this depth everywhere (its bias; e.g. `mean_depth` of the training
            set): from 0, the optimiser would spend its first hundreds of steps only reaching the scene's scale.
        kwargs: passed to `from_pretrained` (`cache_dir`, `revision`).
    """
    if head not in DEPTH_HEADS:
        raise ValueError(f"--head must be one of {DEPTH_HEADS}, got {head!r}.")
    config = AutoConfig.from_pretrained(model_name_or_path, **kwargs)
    if not isinstance(config, VecaConfig):  # a saved transformers head: continue training it
        model = AutoModelForDepthEstimation.from_pretrained(model_name_or_path, **kwargs)
        expected = {"dpt": DPTForDepthEstimation, "depth_anything": DepthAnythingForDepthEstimation}.get(head)
        return _continue_saved_head(model, model_name_or_path, head, expected, num_core_tokens)
    if head == "linear":
        budget = {"default_num_core_tokens": num_core_tokens} if num_core_tokens is not None else {}
        model, info = AutoModelForDepthEstimation.from_pretrained(
            model_name_or_path, output_loading_info=True, **budget, **kwargs
        )
        if initial_depth is not None and "head.bias" in info["missing_keys"]:
            with torch.no_grad():
                model.head.bias.fill_(initial_depth)
        return model
    backbone_config = _veca_backbone_config(model_name_or_path, out_indices, False, num_core_tokens, **kwargs)
    count = len(backbone_config.out_indices)
    factors = [4, 2, 1, 0.5][:count]
    if head == "dpt":
        head_config = DPTConfig(
            backbone_config=backbone_config,
            readout_type="project",  # the global core is the readout token
            reassemble_factors=factors,
            neck_hidden_sizes=_neck_sizes(count, head_hidden_size, [96, 192, 384, 768]),
            fusion_hidden_size=head_hidden_size or 256,
        )
        model = DPTForDepthEstimation(head_config)
    else:
        head_config = DepthAnythingConfig(
            backbone_config=backbone_config,
            patch_size=backbone_config.patch_size,  # Depth Anything reads these two from its own config
            reassemble_hidden_size=backbone_config.hidden_size,
            reassemble_factors=factors,
            neck_hidden_sizes=_neck_sizes(count, head_hidden_size, [48, 96, 192, 384]),
            fusion_hidden_size=head_hidden_size or 64,
            depth_estimation_type="metric",
            max_depth=max_depth,
        )
        model = DepthAnythingForDepthEstimation(head_config)
    return _load_veca_weights(model, model_name_or_path, **kwargs)


def freeze_backbone(model: nn.Module) -> int:
    """Stops the gradients of every VECA in `model` (only the head trains); returns the number of frozen tensors."""
    frozen = 0
    for module in model.modules():
        if isinstance(module, VecaModel):
            for parameter in module.parameters():
                parameter.requires_grad_(False)
                frozen += 1
    return frozen
