# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""VECA (Visual Elastic Core Attention) for Hugging Face transformers.

Importing this package registers VECA with the Auto classes (`AutoConfig`, `AutoModel`,
`AutoModelForImageClassification`, `AutoBackbone`, `AutoImageProcessor`), so Auto loading and pipelines work on
saved VECA folders.
"""

from transformers import (
    AutoBackbone,
    AutoConfig,
    AutoImageProcessor,
    AutoModel,
    AutoModelForImageClassification,
)

from .configuration_veca import VECA_PRESET_TEACHERS, VECA_PRESETS, VecaConfig
from .image_processing_veca import VecaImageProcessor
from .modeling_veca import (
    VecaBackbone,
    VecaForImageClassification,
    VecaModel,
    VecaModelOutput,
    VecaPreTrainedModel,
)


try:  # the fast (torchvision) processor is optional
    from .image_processing_veca_fast import VecaImageProcessorFast
except ImportError:  # torchvision missing
    VecaImageProcessorFast = None


def _register_auto_classes() -> None:
    AutoConfig.register(VecaConfig.model_type, VecaConfig, exist_ok=True)
    AutoModel.register(VecaConfig, VecaModel, exist_ok=True)
    AutoModelForImageClassification.register(VecaConfig, VecaForImageClassification, exist_ok=True)
    AutoBackbone.register(VecaConfig, VecaBackbone, exist_ok=True)
    processors = {"pil": VecaImageProcessor}
    if VecaImageProcessorFast is not None:
        processors["torchvision"] = VecaImageProcessorFast
    AutoImageProcessor.register(VecaConfig, image_processor_classes=processors, exist_ok=True)
    # Saved folders carry the code and an auto_map, so they also load with trust_remote_code=True.
    VecaConfig.register_for_auto_class()
    VecaModel.register_for_auto_class("AutoModel")
    VecaForImageClassification.register_for_auto_class("AutoModelForImageClassification")
    VecaBackbone.register_for_auto_class("AutoBackbone")
    VecaImageProcessor.register_for_auto_class("AutoImageProcessor")


_register_auto_classes()

__version__ = "0.1.0"

__all__ = [
    "VECA_PRESETS",
    "VECA_PRESET_TEACHERS",
    "VecaBackbone",
    "VecaConfig",
    "VecaForImageClassification",
    "VecaImageProcessor",
    "VecaImageProcessorFast",
    "VecaModel",
    "VecaModelOutput",
    "VecaPreTrainedModel",
]
