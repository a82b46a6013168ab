#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Where VECA's cores look and where they go: per block, the core-to-patch attention of the first k cores over the
image, and every core's position from block 1 to the last, at one budget.

    python examples/visualize_cores.py --model_name_or_path outputs/veca-b16 --image photo.jpg \
        --num_core_tokens 16 --num_cores_shown 4 --resolution 256 --output cores.png

The image goes through the probes' evaluation transform (VECA's image processor at that crop). The maps
are the model's own `output_attentions` maps averaged over heads; positions are the model's own
`output_core_coordinates` (`veca_hf.evaluation.trace_cores`).
"""

import argparse
from pathlib import Path

import PIL.Image
import torch

from veca_hf.evaluation import (
    CoreAttentionMaps,
    ProbeModel,
    center_crop_resized,
    core_attention_maps,
    draw_core_attention,
    preprocess_image,
)


def main(argv: list[str] | None = None) -> CoreAttentionMaps:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="A VECA folder or Hub id.")
    parser.add_argument("--image", required=True, help="An image file.")
    parser.add_argument("--num_core_tokens", type=int, default=None, help="The budget C (default: the model's).")
    parser.add_argument("--num_cores_shown", type=int, default=4, help="Draw the attention maps of cores 1..k.")
    parser.add_argument("--resolution", type=int, default=256, help="Crop side; a multiple of the patch size.")
    parser.add_argument("--output", default="cores.png", help="The PNG to write.")
    args = parser.parse_args(argv)

    backbone = ProbeModel(args.model_name_or_path)  # refuses checkpoints whose weights do not all load
    if not backbone.is_veca:
        parser.error(f"{args.model_name_or_path} is a {backbone.config.model_type} model; this script needs VECA.")
    model = backbone.model
    if args.resolution % model.config.patch_size:
        parser.error(f"--resolution {args.resolution} is not a multiple of the patch size {model.config.patch_size}.")
    budget = model.resolve_num_core_tokens(args.num_core_tokens)
    if not 1 <= args.num_cores_shown <= budget:
        parser.error(f"--num_cores_shown must be between 1 and the budget {budget}.")

    with PIL.Image.open(args.image) as image:
        image = image.convert("RGB")
    crop = center_crop_resized(image, args.resolution)
    pixel_values = preprocess_image(image, args.resolution)[None].to(backbone.device)  # (1, 3, R, R)
    with torch.no_grad():
        maps = core_attention_maps(model, pixel_values, budget, cores=range(args.num_cores_shown))
    title = f"{Path(args.model_name_or_path.rstrip('/')).name}, C = {budget}, {args.resolution} px"
    path = draw_core_attention(crop, maps, args.output, title=title)
    print(f"Wrote {path}")
    return maps


if __name__ == "__main__":
    main()
