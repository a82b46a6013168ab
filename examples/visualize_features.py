#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Pictures of dense features, as the VECA paper draws them: one image at several resolutions through a VECA folder
(at chosen budgets) and any DINOv2 / DINOv3 folder, each row's patch features coloured by one joint 3-D projection
to RGB across its resolutions, the same colours over the image, and the global-to-patch cosine map.

    python examples/visualize_features.py --image photo.jpg --budgets 8,64 --resolutions 256,384,512,768,1024 \
        --model_name_or_path outputs/veca-b16 facebook/dinov3-vitb16-pretrain-lvd1689m --output features.png

Each resolution is the short side of the whole image (aspect kept, both sides multiples of every model's patch size:
16 for VECA-B/16 and DINOv3, 14 for DINOv2); `--max_side` bounds the long side. The projection is UMAP
(`pip install umap-learn`, the `viz` extra) as in the paper, or PCA (`--projection pca`, or `auto` without
umap-learn). Writes the PNG and, beside it, a JSON with the shapes, the projection and the mean cosines. The logic
is `veca_hf.evaluation.feature_pictures` (see docs/pictures.md).
"""

import argparse
import logging

import torch
import transformers

from veca_hf.evaluation import FeaturePictures, ProbeModel, feature_pictures, load_image, write_feature_pictures


def int_list(text: str | None) -> list[int] | None:
    return None if text is None else [int(item) for item in text.replace(" ", "").split(",") if item]


def main(argv: list[str] | None = None) -> FeaturePictures:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model_name_or_path", nargs="+", required=True, help="VECA / DINOv2 / DINOv3 folders or ids."
    )
    parser.add_argument("--image", required=True, help="An image file.")
    parser.add_argument("--resolutions", default="256,384,512,768,1024", help="Comma-separated short sides.")
    parser.add_argument("--budgets", default=None, help="VECA budgets, e.g. 8,64 (default: smallest and largest).")
    parser.add_argument("--projection", choices=("auto", "umap", "pca"), default="auto", help="UMAP, PCA, or auto.")
    parser.add_argument("--max_side", type=int, default=None, help="Bound on the long side in pixels (memory).")
    parser.add_argument("--seed", type=int, default=0, help="UMAP's seed.")
    parser.add_argument("--device", default=None, help="Where the models run (default: cuda if any).")
    parser.add_argument("--dpi", type=int, default=100, help="The PNG's resolution.")
    parser.add_argument("--title", default=None, help="A figure title (default: the image and the projection).")
    parser.add_argument("--output", default="features.png", help="The PNG to write; the JSON goes beside it.")
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S",
                        level=logging.INFO)  # fmt: skip
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()

    image = load_image(args.image)  # a ValueError naming a missing file
    models = [ProbeModel(name, device=args.device, dtype=torch.float32) for name in args.model_name_or_path]
    pictures = feature_pictures(
        models, image, int_list(args.resolutions), int_list(args.budgets), args.projection, args.max_side, args.seed
    )
    title = args.title or f"{args.image.rsplit('/', 1)[-1]}: patch features ({pictures.projection.upper()})"
    png, summary = write_feature_pictures(pictures, args.output, title=title, dpi=args.dpi)
    print(f"Wrote {png} and {summary}")
    return pictures


if __name__ == "__main__":
    main()
