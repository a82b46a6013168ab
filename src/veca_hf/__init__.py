# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""VECA (Visual Elastic Core Attention) for Hugging Face transformers.

Importing this package registers VECA with the Auto classes (`AutoConfig`, `AutoModel`,
`AutoModelForImageClassification`, `AutoModelForSemanticSegmentation`, `AutoModelForDepthEstimation`, `AutoBackbone`,
`AutoImageProcessor`), so Auto loading and pipelines work on saved VECA folders. The image processors follow
transformers 5: `VecaImageProcessor` (torchvision backend, chosen by `AutoImageProcessor` when torchvision is
installed) and `VecaImageProcessorPil` (PIL, the base install).
"""

from transformers import (
    AutoBackbone,
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForDepthEstimation,
    AutoModelForImageClassification,
    AutoModelForSemanticSegmentation,
)
from transformers.utils import is_torchvision_available

from .budget_policy import AdaptiveBudget
from .model.configuration_veca import VECA_PRESET_TEACHERS, VECA_PRESETS, VecaConfig
from .model.image_processing_pil_veca import VecaImageProcessorPil
from .model.image_processing_veca import VecaImageProcessor
from .model.modeling_veca import (
    VecaBackbone,
    VecaForImageClassification,
    VecaModel,
    VecaModelOutput,
    VecaPreTrainedModel,
)
from .model.modeling_veca_dense import VecaForDepthEstimation, VecaForSemanticSegmentation


def _register_auto_classes() -> None:
    AutoConfig.register(VecaConfig.model_type, VecaConfig, exist_ok=True)
    AutoModel.register(VecaConfig, VecaModel, exist_ok=True)
    AutoModelForImageClassification.register(VecaConfig, VecaForImageClassification, exist_ok=True)
    AutoBackbone.register(VecaConfig, VecaBackbone, exist_ok=True)
    AutoModelForSemanticSegmentation.register(VecaConfig, VecaForSemanticSegmentation, exist_ok=True)
    AutoModelForDepthEstimation.register(VecaConfig, VecaForDepthEstimation, exist_ok=True)
    # NOTE: without torchvision only the PIL processor is registered, so that `backend="torchvision"` falls back to
    # it with a warning, as for transformers' own models (their torchvision classes are then dummies).
    processors = {"pil": VecaImageProcessorPil}
    if is_torchvision_available():
        processors["torchvision"] = VecaImageProcessor
    AutoImageProcessor.register(VecaConfig, image_processor_classes=processors, exist_ok=True)
    # Saved model folders carry the code and an auto_map (`VecaPreTrainedModel.save_pretrained`), so they also load
    # with trust_remote_code=True; the processors' `save_pretrained` does the same once registered here.
    VecaImageProcessor.register_for_auto_class("AutoImageProcessor")
    VecaImageProcessorPil.register_for_auto_class("AutoImageProcessor")


_register_auto_classes()

__version__ = "0.1.0"


__all__ = [
    "AdaptiveBudget",
    "VECA_PRESETS",
    "VECA_PRESET_TEACHERS",
    "VecaBackbone",
    "VecaConfig",
    "VecaForDepthEstimation",
    "VecaForImageClassification",
    "VecaForSemanticSegmentation",
    "VecaImageProcessor",
    "VecaImageProcessorPil",
    "VecaModel",
    "VecaModelOutput",
    "VecaPreTrainedModel",
]
