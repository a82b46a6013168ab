# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Feature extraction end to end: images per second through `pipeline("image-feature-extraction")` against a plain
loop and the model alone, VECA at chosen budgets against DINOv3 of the same width and depth.

What a user runs to embed a folder of images, three ways, each from JPEG files on disk to the last hidden states:

- `pipeline`: `pipeline("image-feature-extraction", model=folder)(paths, batch_size=B, return_tensors=True)`;
- `loop`: per batch of `B` paths, open the images, `processor(images, return_tensors="pt")`, `model(**inputs)`;
- `model`: the model alone on the batches already preprocessed (the ceiling of the other two).

The folders are saved by this script (random weights; `VecaModel` with `default_num_core_tokens` = the budget, and
transformers' `DINOv3ViTModel` of the same width, depth and heads with 4 registers, as in `scaling.py`); both
processors resize every image to one square side (`--resolutions`), so both models see the same pixels. The images
are synthetic photos-like JPEGs (`--image_size`, seeded). Rounds are interleaved (every round runs each model and
path once per resolution and batch size); a cell is the median over rounds. The loop's features are checked against
the pipeline's (max abs difference in the JSON): the paths compute the same thing.

    python benchmarks/feature_extraction.py --size veca-b16 --resolutions 512,1024 --batch_sizes 8 \
        --budgets 8,64 --num_images 16 --rounds 2 --threads 2

Outputs in `--output_dir` (default `benchmarks/results/<size>_feature_extraction_<device>_<dtype>`):
`results.json` (machine, command, every timing) and `results.md` (the table).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import numpy as np
import scaling
import scaling_measure
import torch
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, DINOv3ViTImageProcessor, DINOv3ViTModel, pipeline

from veca_hf import VecaImageProcessor, VecaModel
from veca_hf.cpu.hardware import warn_if_slow_bf16


PATHS = ("pipeline", "loop", "model")
DINOV3 = "DINOv3"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[512])
    parser.add_argument("--budgets", type=common.int_list, default=[8, 64], help="VECA budgets C.")
    parser.add_argument("--batch_sizes", type=common.int_list, default=[8])
    parser.add_argument("--num_images", type=int, default=16, help="Images per timed pass (a multiple of each batch).")
    parser.add_argument("--rounds", type=int, default=2, help="Interleaved timed rounds (after one warm-up pass).")
    parser.add_argument("--image_size", default="1280x960", help="Width x height of the synthetic JPEGs.")
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"], help="Weights and inputs.")
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.num_images < 1:
        parser.error("--rounds and --num_images must be >= 1")
    for batch in args.batch_sizes:
        if args.num_images % batch:
            parser.error(f"--num_images {args.num_images} is not a multiple of batch size {batch}")
    try:
        width, height = (int(side) for side in args.image_size.lower().split("x"))
    except ValueError:
        parser.error(f"--image_size takes WIDTHxHEIGHT, e.g. 1280x960; got {args.image_size!r}")
    args.image_wh = (width, height)
    if args.output_dir is None:
        name = f"{args.size}_feature_extraction_{args.device}_{args.dtype}" + ("_tiny" if args.tiny else "")
        args.output_dir = str(Path(__file__).resolve().parent / "results" / name)
    return args


def write_images(folder: Path, count: int, size: tuple[int, int], seed: int) -> list[str]:
    """`count` JPEGs of smooth colour fields with noise (what a photo costs to decode and resize), seeded."""
    rng = np.random.default_rng(seed)
    width, height = size
    ys, xs = np.mgrid[0:height, 0:width].astype(np.float32)
    paths = []
    for index in range(count):
        phase = rng.uniform(0, 2 * np.pi, 3)
        scale = rng.uniform(40, 200, 3)
        channels = [127 + 100 * np.sin(xs / scale[c] + ys / (scale[c] * 1.7) + phase[c]) for c in range(3)]
        pixels = np.stack(channels, -1) + rng.normal(0, 12, (height, width, 3))
        path = folder / f"image_{index:03d}.jpg"
        Image.fromarray(pixels.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(str(path))
    return paths


def save_folders(args: argparse.Namespace, root: Path) -> dict[str, Path]:
    """One saved folder per model and resolution-independent setting: DINOv3, and VECA per budget."""
    veca_config, dinov3_config = scaling.preset_configs(args.size, args.tiny, args.budgets)
    torch.manual_seed(args.seed)
    folders = {}
    dinov3 = DINOv3ViTModel(dinov3_config).eval()
    folders[DINOV3] = root / "dinov3"
    dinov3.save_pretrained(folders[DINOV3])
    DINOv3ViTImageProcessor().save_pretrained(folders[DINOV3])
    veca = VecaModel(veca_config).eval()
    for budget in args.budgets:
        veca.config.default_num_core_tokens = budget
        folders[f"VECA C={budget}"] = root / f"veca_c{budget}"
        veca.save_pretrained(folders[f"VECA C={budget}"])
        VecaImageProcessor().save_pretrained(folders[f"VECA C={budget}"])
    return folders


def load(folders: dict[str, Path], resolution: int, dtype: torch.dtype, device: torch.device) -> dict[str, dict]:
    """Per model: the loaded model, its processor resizing to `resolution` x `resolution` (no crop), and a pipeline
    over both, as a user builds them from the folder."""
    loaded = {}
    for name, folder in folders.items():
        model = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
        size = {"height": resolution, "width": resolution}
        processor = AutoImageProcessor.from_pretrained(folder, size=size, do_center_crop=False)
        extractor = pipeline("image-feature-extraction", model=model, image_processor=processor, device=device)
        loaded[name] = {"model": model, "processor": processor, "pipeline": extractor}
    return loaded


def extraction_calls(entry: dict, paths: list[str], batch: int, dtype: torch.dtype, device: torch.device) -> dict:
    """The three ways to embed `paths`, each a call returning `(num_images, T, D)` features."""
    model, processor, extractor = entry["model"], entry["processor"], entry["pipeline"]
    batches = [paths[start : start + batch] for start in range(0, len(paths), batch)]

    def preprocess(chunk: list[str]) -> torch.Tensor:  # (B, 3, r, r)
        images = [Image.open(path).convert("RGB") for path in chunk]
        return processor(images, return_tensors="pt")["pixel_values"].to(device=device, dtype=dtype)

    def via_pipeline() -> torch.Tensor:
        return torch.cat(extractor(paths, batch_size=batch, return_tensors=True))

    def via_loop() -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([model(pixel_values=preprocess(chunk)).last_hidden_state for chunk in batches])

    preprocessed = [preprocess(chunk) for chunk in batches]

    def via_model() -> torch.Tensor:
        with torch.inference_mode():
            return torch.cat([model(pixel_values=pixel_values).last_hidden_state for pixel_values in preprocessed])

    return {"pipeline": via_pipeline, "loop": via_loop, "model": via_model}


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Every (resolution, batch, model, path) cell: seconds per round, images per second; and the machine."""
    if args.threads:
        torch.set_num_threads(args.threads)
    allocator = common.apply_cpu_allocator(args)
    machine = scaling_measure.machine_info(argparse.Namespace(device=args.device, bf16_probe_size=0))
    machine["cpu_allocator"] = allocator
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    if dtype == torch.bfloat16:
        warn_if_slow_bf16(args.device, "--dtype bf16")
    device = torch.device(args.device)
    cells: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        (root / "images").mkdir()
        paths = write_images(root / "images", args.num_images, args.image_wh, args.seed)
        folders = save_folders(args, root)
        for resolution in args.resolutions:
            loaded = load(folders, resolution, dtype, device)
            for batch in args.batch_sizes:
                calls = {name: extraction_calls(entry, paths, batch, dtype, device) for name, entry in loaded.items()}
                for round_index in range(args.rounds + 1):  # round 0 warms up and checks, untimed
                    for name, by_path in calls.items():
                        features = {}
                        for path, call in by_path.items():
                            start = time.perf_counter()
                            features[path] = call()
                            scaling_measure.synchronize(device)
                            seconds = time.perf_counter() - start
                            cell = cells.setdefault(
                                (resolution, batch, name, path),
                                {"resolution": resolution, "batch_size": batch, "model": name, "path": path,
                                 "seconds": []},
                            )  # fmt: skip
                            if round_index == 0:
                                reference = features["pipeline"].float()
                                cell["max_abs_difference_to_pipeline"] = (
                                    (features[path].float() - reference).abs().max().item()
                                )
                            else:
                                cell["seconds"].append(seconds)
                        print(
                            f"{'warm-up' if round_index == 0 else f'round {round_index}'}: {resolution} px, batch "
                            f"{batch}, {name}: "
                            + ", ".join(
                                f"{path} {cells[(resolution, batch, name, path)]['seconds'][-1]:.2f} s"
                                for path in PATHS
                                if round_index > 0
                            ),  # fmt: skip
                            flush=True,
                        )
    for cell in cells.values():
        cell["median_seconds"] = statistics.median(cell["seconds"])
        cell["images_per_s"] = args.num_images / cell["median_seconds"]
    machine["loadavg_end"] = scaling_measure.loadavg()
    return list(cells.values()), machine


def summarize(cells: list[dict]) -> list[dict]:
    """Per (resolution, batch, VECA budget, path): VECA's images/s over DINOv3's (ratio of the medians)."""
    index = {(c["resolution"], c["batch_size"], c["model"], c["path"]): c for c in cells}
    summary = []
    for (resolution, batch, name, path), cell in index.items():
        dinov3 = index.get((resolution, batch, DINOV3, path))
        if name != DINOV3 and dinov3:
            speedup = cell["images_per_s"] / dinov3["images_per_s"]
            summary.append({"resolution": resolution, "batch_size": batch, "model": name, "path": path,
                            "images_per_s": cell["images_per_s"], "dinov3_images_per_s": dinov3["images_per_s"],
                            "speedup_vs_dinov3": speedup})  # fmt: skip
    return summary


def markdown(result: dict) -> str:
    args, machine = result["args"], result["machine"]
    allocator = machine["cpu_allocator"]
    out = [
        f"# Feature extraction end to end: {args['size']}{' (tiny)' if args['tiny'] else ''}, {args['device']}, "
        f"{args['dtype']}",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {machine['cpu_model']}; torch {machine['torch_version']}, transformers "
        f"{machine['transformers_version']}; {machine['torch_num_threads']} threads; load average start "
        f"{machine['loadavg_start']}, end {machine.get('loadavg_end')}; glibc malloc settings "
        f"{'veca_hf' if allocator['tuned'] else 'default'} ({allocator['reason']})",
        f"- {args['num_images']} JPEGs of {args['image_size']} px from disk, resized to the square side; median "
        f"of {args['rounds']} interleaved rounds after a warm-up; images/s = images / median seconds",
        "- pipeline: `pipeline('image-feature-extraction')(paths, batch_size=B, return_tensors=True)`; loop: "
        "open, `processor(images)`, `model(**inputs)` per batch; model: the model alone on preprocessed batches",
        "",
        "| res | batch | model | pipeline img/s | loop img/s | model img/s | pipeline / loop | "
        "pipeline vs DINOv3 | loop vs DINOv3 | max abs diff to pipeline |",
        "|" + "---|" * 10,
    ]
    index = {(c["resolution"], c["batch_size"], c["model"], c["path"]): c for c in result["cells"]}
    speedups = {(s["resolution"], s["batch_size"], s["model"], s["path"]): s for s in result["summary"]}
    for resolution, batch, name in dict.fromkeys(
        (c["resolution"], c["batch_size"], c["model"]) for c in result["cells"]
    ):
        row = {path: index[(resolution, batch, name, path)] for path in PATHS}
        ratio = row["pipeline"]["images_per_s"] / row["loop"]["images_per_s"]
        versus = [speedups.get((resolution, batch, name, path)) for path in ("pipeline", "loop")]
        difference = max(cell.get("max_abs_difference_to_pipeline", 0.0) for cell in row.values())
        out.append(
            f"| {resolution} | {batch} | {name} | "
            + " | ".join(f"{row[path]['images_per_s']:.3f}" for path in PATHS)
            + f" | {ratio:.3f} | "
            + " | ".join(f"{v['speedup_vs_dinov3']:.3f}x" if v else "-" for v in versus)
            + f" | {difference:.1e} |"
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    cells, machine = measure(args)
    args_record = {key: value for key, value in vars(args).items() if key != "image_wh"}
    result = {
        "command": common.command_line(argv),
        "args": args_record,
        "machine": machine,
        "cells": cells,
        "summary": summarize(cells),
    }
    text = markdown(result)
    common.write_results(output_dir, result, text)
    print(text)
    return result


if __name__ == "__main__":
    main()
