#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Where VECA's cores look and where they go, in one of two views of one image.

`--view cores` (the default): per block, the core-to-patch attention of the first k cores over the image, and every
core's position from block 1 to the last, at one budget.

    python examples/visualize_cores.py --model_name_or_path outputs/veca-b16 --image photo.jpg \
        --num_core_tokens 16 --num_cores_shown 4 --resolution 256 --output cores.png

`--view attention` (the paper's core-attention view): each patch's attention profile over the active cores (the
patches' call, mean over heads), coloured by one joint UMAP / PCA projection per budget across blocks; rows =
budgets, columns = blocks. Where the colours follow position in early blocks and objects in later ones, the cores
went from isotropic to semantic. Writes the PNG and, beside it, a JSON (shapes, projection, per-block entropy).

    python examples/visualize_cores.py --view attention --model_name_or_path outputs/veca-b16 --image photo.jpg \
        --budgets 8,64 --resolution 256 --output core_attention.png

The image goes through the probes' evaluation transform (VECA's image processor at that crop). The maps
are the model's own `output_attentions` maps averaged over heads; positions are the model's own
`output_core_positions` (`veca_hf.evaluation.trace_cores`). `output_attentions` builds the `(C + N)^2` map of
every block: keep `--resolution` modest.
"""

import argparse
import json
from pathlib import Path

import torch

from veca_hf.evaluation import (
    CoreAttentionMaps,
    PatchCoreAttention,
    ProbeModel,
    center_crop_resized,
    core_attention_maps,
    draw_core_attention,
    draw_patch_core_attention,
    load_image,
    patch_core_attention_pictures,
    patch_core_attention_summary,
    preprocess_image,
)


def main(argv: list[str] | None = None) -> CoreAttentionMaps | PatchCoreAttention:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_name_or_path", required=True, help="A VECA folder or Hub id.")
    parser.add_argument("--image", required=True, help="An image file.")
    parser.add_argument("--view", choices=("cores", "attention"), default="cores", help="Which picture (see above).")
    parser.add_argument("--num_core_tokens", type=int, default=None, help="The budget C (default: the model's).")
    parser.add_argument("--num_cores_shown", type=int, default=4, help="Draw the attention maps of cores 1..k.")
    budgets_help = "--view attention: budgets, e.g. 8,64 (default: --num_core_tokens, or the smallest and largest)."
    parser.add_argument("--budgets", default=None, help=budgets_help)
    parser.add_argument("--projection", choices=("auto", "umap", "pca"), default="auto", help="--view attention.")
    parser.add_argument("--seed", type=int, default=0, help="--view attention: UMAP's seed.")
    parser.add_argument("--resolution", type=int, default=256, help="Crop side; a multiple of the patch size.")
    parser.add_argument("--output", default="cores.png", help="The PNG to write.")
    args = parser.parse_args(argv)

    image = load_image(args.image)  # a ValueError naming a missing file
    backbone = ProbeModel(args.model_name_or_path)  # refuses checkpoints whose weights do not all load
    if not backbone.is_veca:
        parser.error(f"{args.model_name_or_path} is a {backbone.config.model_type} model; this script needs VECA.")
    if args.resolution <= 0 or args.resolution % backbone.patch_size:
        raise ValueError(f"--resolution {args.resolution} is not a multiple of the patch size {backbone.patch_size}.")
    model = backbone.model
    crop = center_crop_resized(image, args.resolution)
    pixel_values = preprocess_image(image, args.resolution)[None].to(backbone.device)  # (1, 3, R, R)
    name = Path(args.model_name_or_path.rstrip("/")).name

    if args.view == "attention":
        if args.budgets is not None:
            budgets = [int(budget) for budget in args.budgets.replace(" ", "").split(",") if budget]
        elif args.num_core_tokens is not None:
            budgets = [args.num_core_tokens]
        else:
            budgets = list(dict.fromkeys([min(model.config.budgets), max(model.config.budgets)]))
        budgets = [model.config.check_budget(budget, name="budget") for budget in budgets]
        pictures = patch_core_attention_pictures(model, pixel_values, budgets, args.projection, args.seed)
        title = f"{name}: patch-to-core attention, {args.resolution} px ({pictures.projection.upper()})"
        path = draw_patch_core_attention(crop, pictures, args.output, title=title)
        summary = Path(path).with_suffix(".json")
        summary.write_text(json.dumps(patch_core_attention_summary(pictures), indent=2) + "\n")
        print(f"Wrote {path} and {summary}")
        return pictures

    budget = model.resolve_num_core_tokens(args.num_core_tokens)
    if not 1 <= args.num_cores_shown <= budget:
        parser.error(f"--num_cores_shown must be between 1 and the budget {budget}.")
    with torch.no_grad():
        maps = core_attention_maps(model, pixel_values, budget, cores=range(args.num_cores_shown))
    title = f"{name}, C = {budget}, {args.resolution} px"
    path = draw_core_attention(crop, maps, args.output, title=title)
    print(f"Wrote {path}")
    return maps


if __name__ == "__main__":
    main()
