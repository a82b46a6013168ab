# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Embedding a dataset end to end: images per second of `examples/extract_features.py` over an image folder, against
the model alone and the data side alone, VECA at chosen budgets next to DINOv3 of the same size and DINOv2-S.

- `end to end`: the script as a user runs it (`python` for 1 process, `accelerate launch --multi_gpu` with
  `ACCELERATE_USE_CPU=true` for 2), JPEG files -> Parquet files, timed by the script itself from its first batch to
  its last file (start-up excluded), with `--threads` split between the processes;
- `model`: the model alone on preprocessed batches of the same size, in this process with `--threads` threads;
- `data`: the script's data side alone (`PartBatches` in a DataLoader with the same workers: listing, decoding,
  the processor), no model.

`1 - model seconds / end-to-end seconds` is the share of the end-to-end time that the model does not explain (data,
writing, the processes' coordination). The folders hold random weights (`VecaModel` of `--size`; transformers'
`DINOv3ViTModel` of the same width, depth and heads with 4 registers, as in `scaling.py`; with `--dinov2_dir`, a
DINOv2 folder such as the offline DINOv2-S/14 teacher), all saved with the same `VecaImageProcessor`, so every model
sees the same pixels (patch-14 models at the nearest multiple of 14: 518 px for 512).

    python benchmarks/dataset_embedding.py --size veca-b16 --budgets 8,64 --resolutions 224,512 --dtypes fp32,bf16 \
        --processes 1,2 --num_images 32 --threads 2 [--images_dir PHOTOS] [--dinov2_dir DINOV2_FOLDER]

Outputs in `--output_dir` (default `benchmarks/results/<size>_dataset_embedding_cpu`): `results.json` (machine,
command, every cell) and `results.md` (the table).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import feature_extraction
import scaling
import scaling_measure
import torch
from transformers import AutoImageProcessor, AutoModel, DINOv3ViTModel

from veca_hf import VecaImageProcessor, VecaModel
from veca_hf.arguments import redact_secrets
from veca_hf.data import dataset_root, load_image_dataset
from veca_hf.embedding import PartBatches, Preprocess


ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "extract_features.py"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
RATE = re.compile(r"This run: (\d+) images in ([\d.]+) s")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[224, 512])
    parser.add_argument("--budgets", type=common.int_list, default=[8, 64], help="VECA budgets C.")
    parser.add_argument("--dtypes", default="fp32,bf16", help="Comma-separated: fp32, bf16.")
    parser.add_argument("--processes", type=common.int_list, default=[1, 2], help="Process counts end to end.")
    parser.add_argument("--num_images", type=int, default=32, help="Images embedded per run.")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--workers", type=int, default=1, help="DataLoader workers per process.")
    parser.add_argument("--images_dir", default=None, help="A folder of photos (default: synthetic 1280x960 JPEGs).")
    parser.add_argument("--dinov2_dir", default=None, help="Also a DINOv2 folder (e.g. the offline teacher).")
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args(argv)
    args.dtypes = [d for d in args.dtypes.split(",") if d]
    if not set(args.dtypes) <= set(DTYPES):
        parser.error(f"--dtypes takes fp32 and / or bf16, got {args.dtypes}")
    args.threads = args.threads or torch.get_num_threads()
    if any(args.threads % processes for processes in args.processes):
        parser.error(f"--threads {args.threads} must split evenly between --processes {args.processes}")
    if args.output_dir is None:
        name = f"{args.size}_dataset_embedding_cpu" + ("_tiny" if args.tiny else "")
        args.output_dir = str(Path(__file__).resolve().parent / "results" / name)
    return args


def prepare_images(args: argparse.Namespace, folder: Path) -> None:
    folder.mkdir()
    if args.images_dir is None:
        feature_extraction.write_images(folder, args.num_images, (1280, 960), args.seed)
        return
    photos = sorted(p for p in Path(args.images_dir).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    if len(photos) < args.num_images:
        raise ValueError(f"--images_dir {args.images_dir} has {len(photos)} photos, fewer than --num_images.")
    for index, photo in enumerate(photos[: args.num_images]):
        shutil.copy(photo, folder / f"{index:04d}{photo.suffix.lower()}")


def save_folders(args: argparse.Namespace, root: Path) -> dict[str, tuple[Path, int | None]]:
    """`{name: (folder, budget)}`: VECA per budget (one folder), DINOv3 of the same size, and DINOv2 if given."""
    veca_config, dinov3_config = scaling.preset_configs(args.size, args.tiny, args.budgets)
    torch.manual_seed(args.seed)
    processor = VecaImageProcessor()
    VecaModel(veca_config).save_pretrained(root / "veca")
    DINOv3ViTModel(dinov3_config).save_pretrained(root / "dinov3")
    folders = {f"VECA C={budget}": (root / "veca", budget) for budget in args.budgets}
    folders["DINOv3"] = (root / "dinov3", None)
    if args.dinov2_dir:
        shutil.copytree(args.dinov2_dir, root / "dinov2")
        folders["DINOv2"] = (root / "dinov2", None)
    for folder in {folder for folder, _ in folders.values()}:
        processor.save_pretrained(folder)
    return folders


def side_for(resolution: int, patch_size: int) -> int:
    return round(resolution / patch_size) * patch_size


def end_to_end(args, folder: Path, budget, resolution: int, dtype: str, processes: int, images: Path, out: Path):
    command = [sys.executable, str(SCRIPT)]
    if processes > 1:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", "29561", str(SCRIPT)]  # fmt: skip
    command += ["--model_name_or_path", str(folder), "--dataset_name", str(images), "--output_dir", str(out),
                "--resolution", str(resolution), "--dtype", dtype,
                "--per_device_eval_batch_size", str(args.batch_size), "--dataloader_num_workers", str(args.workers),
                "--rows_per_file", str(args.batch_size)]  # fmt: skip
    if budget is not None:
        command += ["--num_core_tokens", str(budget)]
    threads = str(args.threads // processes)
    env = {**os.environ, "ACCELERATE_USE_CPU": "true", "OMP_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1"}
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=ROOT)
    match = RATE.search(result.stderr)
    if result.returncode != 0 or match is None:
        raise RuntimeError(f"{shlex.join(command)} failed:\n{result.stderr[-4000:]}")
    count, seconds = int(match[1]), float(match[2])
    return {"images": count, "seconds": seconds, "images_per_s": count / seconds}


@torch.inference_mode()
def model_only(args, folder: Path, budget, resolution: int, dtype: str) -> dict:
    torch.set_num_threads(args.threads)
    model = AutoModel.from_pretrained(folder, dtype=DTYPES[dtype]).eval()
    pixel_values = torch.randn(args.batch_size, 3, resolution, resolution, dtype=DTYPES[dtype])
    kwargs = {"num_core_tokens": budget} if budget is not None else {}
    batches = max(1, args.num_images // args.batch_size)
    model(pixel_values=pixel_values, **kwargs)  # warm-up
    rounds = []
    for _ in range(2):
        start = time.perf_counter()
        for _ in range(batches):
            model(pixel_values=pixel_values, **kwargs)
        rounds.append(time.perf_counter() - start)
    seconds = statistics.median(rounds)
    return {"seconds": seconds, "images_per_s": batches * args.batch_size / seconds}


def data_only(args, folder: Path, resolution: int, images: Path, out: Path) -> dict:
    processor = AutoImageProcessor.from_pretrained(folder)
    dataset = load_image_dataset(str(images))
    batches = PartBatches(
        dataset, "image", Preprocess(processor, resolution, False, 16), output_dir=out,
        rows_per_file=args.batch_size, batch_size=args.batch_size, root=str(images),
        image_root=dataset_root(str(images)),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=args.workers)
    start = time.perf_counter()
    count = sum(len(batch["ids"]) for batch in loader)
    seconds = time.perf_counter() - start
    return {"images": count, "seconds": seconds, "images_per_s": count / seconds}


def measure(args: argparse.Namespace) -> tuple[list[dict], dict]:
    machine = scaling_measure.machine_info(argparse.Namespace(device="cpu", bf16_probe_size=0))
    machine["cpu_allocator"] = common.apply_cpu_allocator(args)
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare_images(args, root / "images")
        folders = save_folders(args, root)
        runs = 0
        for dtype in args.dtypes:
            for resolution in args.resolutions:
                data = None
                for name, (folder, budget) in folders.items():
                    side = side_for(resolution, AutoModel.from_pretrained(folder).config.patch_size)
                    if data is None:
                        data = data_only(args, folder, resolution, root / "images", root / f"data-{runs}")
                    model = model_only(args, folder, budget, side, dtype)
                    for processes in args.processes:
                        runs += 1
                        run = end_to_end(args, folder, budget, side, dtype, processes, root / "images",
                                         root / f"run-{runs}")  # fmt: skip
                        cell = {
                            "model": name, "dtype": dtype, "resolution": side, "processes": processes,
                            "threads_per_process": args.threads // processes, "end_to_end": run, "model_only": model,
                            "data_only": data, "share_not_model": 1 - run["images_per_s"] / model["images_per_s"],
                        }  # fmt: skip
                        cells.append(cell)
                        print(
                            f"{dtype} {side} px {name}, {processes} process(es): end to end "
                            f"{run['images_per_s']:.2f} img/s, model {model['images_per_s']:.2f}, data "
                            f"{data['images_per_s']:.1f}",
                            flush=True,
                        )
    machine["loadavg_end"] = scaling_measure.loadavg()
    return cells, machine


def markdown(result: dict) -> str:
    args, machine = result["args"], result["machine"]
    out = [
        f"# Embedding a dataset end to end: {args['size']}{' (tiny)' if args['tiny'] else ''}, CPU",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {machine['cpu_model']}; torch {machine['torch_version']}; {args['threads']} threads in all; "
        f"load average start {machine['loadavg_start']}, end {machine.get('loadavg_end')}",
        f"- {args['num_images']} {'photos' if args['images_dir'] else 'synthetic 1280x960 JPEGs'} from disk, batch "
        f"{args['batch_size']}, {args['workers']} DataLoader worker(s) per process; end to end = "
        "`examples/extract_features.py` from its first batch to its last file; model = the model alone on "
        "preprocessed batches with all threads; data = decoding and preprocessing alone",
        "- not model = 1 - (end-to-end img/s / model img/s): the share of the time the model does not explain; "
        f"{args['num_images']} images per cell, so cells differ by about 10% from run to run (a negative share is "
        "that noise); vs DINOv3: VECA's end-to-end rate over DINOv3-B's, same dtype, resolution and processes",
        "",
        "| dtype | px | model | processes | end to end img/s | model img/s | data img/s | not model | vs DINOv3 |",
        "|" + "---|" * 9,
    ]
    index = {(c["dtype"], c["resolution"], c["model"], c["processes"]): c for c in result["cells"]}
    for cell in result["cells"]:
        dinov3 = index.get((cell["dtype"], cell["resolution"], "DINOv3", cell["processes"]))
        versus = cell["end_to_end"]["images_per_s"] / dinov3["end_to_end"]["images_per_s"] if dinov3 else None
        out.append(
            f"| {cell['dtype']} | {cell['resolution']} | {cell['model']} | {cell['processes']} | "
            f"{cell['end_to_end']['images_per_s']:.2f} | {cell['model_only']['images_per_s']:.2f} | "
            f"{cell['data_only']['images_per_s']:.1f} | {cell['share_not_model']:.0%} | "
            + (f"{versus:.2f}x |" if versus is not None and cell["model"].startswith("VECA") else "- |")
        )
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    cells, machine = measure(args)
    # committed results name this machine's folders by what they are
    places = {args.images_dir: "PHOTOS_DIR", args.dinov2_dir: "DINOV2_DIR", args.output_dir: "OUTPUT_DIR"}
    recorded = [places.get(value, value) for value in (argv if argv is not None else sys.argv[1:])]
    command = "python benchmarks/dataset_embedding.py " + shlex.join(redact_secrets(recorded))
    settings = {
        key: places.get(value, value) if isinstance(value, str) else value for key, value in vars(args).items()
    }
    result = {"args": settings, "command": command, "machine": machine, "cells": cells}
    common.write_results(output_dir, result, markdown(result))
    print(markdown(result))
    return result


if __name__ == "__main__":
    main()
