#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Throughput end to end, in images per second: what a user runs, VECA at chosen budgets against DINOv3 of the same
width and depth (random weights; `common.model_configs`). Three commands:

- `pipeline`: embedding JPEG files three ways, each from the files on disk to the last hidden states:
  `pipeline("image-feature-extraction", model=folder)(paths, batch_size=B, return_tensors=True)`; a `loop` (open,
  `processor(images)`, `model(**inputs)` per batch); the `model` alone on the batches already preprocessed. Both
  processors resize every image to one square side, so both models see the same pixels; the loop's features are
  checked against the pipeline's. Rounds are interleaved; a cell is the median over rounds.
- `dataset`: `examples/extract_features.py` over an image folder (`python` for 1 process, `accelerate launch
  --multi_gpu` with `ACCELERATE_USE_CPU=true` for 2; timed by the script itself from its first batch to its last
  file, `--threads` split between the processes), against the model alone on preprocessed batches and the data side
  alone (`PartBatches` in a DataLoader, no model); `1 - model seconds / end-to-end seconds` is the share of the time
  the model does not explain. `--dinov2_dir` adds a DINOv2 folder (patch-14 models at the nearest multiple of 14).
- `distill`: a whole distillation step (`examples/distill.py`'s, without data loading: the frozen teacher's targets,
  the student's forward and backward, AdamW), timed in its three parts, VECA at each budget and the dense student
  in interleaved rounds; every ratio to the dense student also paired. The teacher is a random DINOv3 of the
  student's width or `--teacher` (any `AutoModel` folder); before timing, its targets under bf16 autocast are
  compared with fp32 (min cosines), and `--teacher_dtype bf16` is judged against `--teacher_min_cosine`.
- `resume`: how long a resumed `examples/distill.py` takes to reach its next batch mid-epoch: parquet shards of
  small generated JPEGs (one epoch holds `--steps` batches), then `veca_hf.data.infinite_batches` (the training
  stream) up to the first batch after `--steps` consumed ones, with what a checkpoint holds (batches per DataLoader
  worker: consumed samples are passed over undecoded) and without it (`replay`: every consumed batch decoded,
  augmented and discarded; timed at `--replay_steps` and scaled linearly to `--steps`).

    python benchmarks/throughput.py pipeline --size veca-b16 --resolutions 512,1024 --batch_sizes 8 --threads 2
    python benchmarks/throughput.py dataset --size veca-b16 --resolutions 224,512 --dtypes fp32,bf16 --threads 2 \
        [--images_dir PHOTOS] [--dinov2_dir DINOV2_FOLDER]
    python benchmarks/throughput.py distill --size veca-b16 --resolutions 224,512 --batch_size 4 --threads 2 \
        --teacher_dtype bf16
    python benchmarks/throughput.py resume --steps 10000 --batch_size 32 --replay_steps 200 --output_dir OUT

Outputs in `--output_dir` (default under `benchmarks/results/`: `<size>_feature_extraction_...`,
`<size>_dataset_embedding_cpu`, `<size>_distill_step_...`): `results.json` (machine, command, every timing) and, for
`pipeline` and `dataset`, `results.md`.
"""

from __future__ import annotations

import argparse
import json
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
import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from transformers import AutoImageProcessor, AutoModel, DINOv3ViTImageProcessor, DINOv3ViTModel, pipeline

from veca_hf import VecaImageProcessor, VecaModel
from veca_hf.cpu.hardware import warn_if_slow_bf16


ROOT = Path(__file__).resolve().parents[1]
EXTRACT_SCRIPT = ROOT / "examples" / "extract_features.py"
PATHS = ("pipeline", "loop", "model")
DINOV3 = "DINOv3"
RATE = re.compile(r"This run: (\d+) images in ([\d.]+) s")
PARTS = ("teacher", "student_forward_backward", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str, resolutions: list[int]) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        common.add_model_arguments(sub, resolutions)
        sub.add_argument("--budgets", type=common.int_list, default=[8, 64], help="VECA budgets C.")
        sub.add_argument("--output_dir", default=None)
        return sub

    sub = command("pipeline", "pipeline vs loop vs the model alone, from JPEG files", [512])
    sub.add_argument("--batch_sizes", type=common.int_list, default=[8])
    sub.add_argument("--num_images", type=int, default=16, help="Images per timed pass (a multiple of each batch).")
    sub.add_argument("--rounds", type=int, default=2, help="Interleaved timed rounds (after one warm-up pass).")
    sub.add_argument("--image_size", default="1280x960", help="Width x height of the synthetic JPEGs.")
    sub.add_argument("--dtype", default="fp32", choices=sorted(common.DTYPES), help="Weights and inputs.")

    sub = command("dataset", "examples/extract_features.py over an image folder", [224, 512])
    sub.add_argument(
        "--dtypes", type=common.comma_list(common.DTYPES), default=list(common.DTYPES), help="Comma-separated."
    )
    sub.add_argument("--processes", type=common.int_list, default=[1, 2], help="Process counts end to end.")
    sub.add_argument("--num_images", type=int, default=32, help="Images embedded per run.")
    sub.add_argument("--batch_size", type=int, default=8)
    sub.add_argument("--workers", type=int, default=1, help="DataLoader workers per process.")
    sub.add_argument("--images_dir", default=None, help="A folder of photos (default: synthetic 1280x960 JPEGs).")
    sub.add_argument("--dinov2_dir", default=None, help="Also a DINOv2 folder (e.g. the offline teacher).")

    sub = command("distill", "a whole distillation step and its parts", [224, 512])
    sub.add_argument("--batch_size", type=int, default=8)
    sub.add_argument("--dtype", default="fp32", choices=["fp32", "bf16_autocast"], help="The student's precision.")
    sub.add_argument("--teacher", default=None, help="AutoModel folder (default: a random DINOv3 of this width).")
    sub.add_argument("--teacher_dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast.")
    sub.add_argument("--teacher_min_cosine", type=float, default=0.999)
    sub.add_argument("--warmup", type=int, default=1)
    sub.add_argument("--repeats", type=int, default=5)
    sub.add_argument("--learning_rate", type=float, default=1e-5)

    sub = commands.add_parser("resume", help="time to the next batch of a resumed stream")
    for name, default, help in (("--steps", 10000, "Consumed batches at the resume point."),
                                ("--replay_steps", 200, "Steps at which the replay is timed (then scaled)."),
                                ("--batch_size", 32, ""), ("--resolution", 224, ""),
                                ("--image_size", 48, "Side of the generated JPEGs."), ("--num_shards", 16, ""),
                                ("--dataloader_num_workers", 2, ""), ("--shuffle_buffer_size", 1000, "")):  # fmt: skip
        sub.add_argument(name, type=int, default=default, help=help)
    sub.add_argument("--output_dir", default="outputs/resume_skip", help="The generated shards and results.")
    args = parser.parse_args(argv)
    if args.command == "resume":
        return args
    if args.command == "pipeline":
        if args.rounds < 1 or args.num_images < 1 or any(args.num_images % batch for batch in args.batch_sizes):
            parser.error("--rounds and --num_images must be >= 1, --num_images a multiple of every batch size")
        try:
            args.image_wh = tuple(int(side) for side in args.image_size.lower().split("x"))
        except ValueError:
            parser.error(f"--image_size takes WIDTHxHEIGHT, e.g. 1280x960; got {args.image_size!r}")
        name = f"{args.size}_feature_extraction_{args.device}_{args.dtype}"
    elif args.command == "dataset":
        args.threads = args.threads or torch.get_num_threads()
        if any(args.threads % processes for processes in args.processes):
            parser.error(f"--threads {args.threads} must split evenly between --processes {args.processes}")
        name = f"{args.size}_dataset_embedding_cpu"
    else:
        name = f"{args.size}_distill_step_{args.device}_{args.dtype}_teacher_{args.teacher_dtype}"
    args.output_dir = args.output_dir or common.default_output_dir(name, args.tiny)
    return args


def write_images(folder: Path, count: int, size: tuple[int, int], seed: int) -> list[str]:
    """`count` JPEGs of smooth colour fields with noise (what a photo costs to decode and resize), seeded."""
    folder.mkdir(parents=True, exist_ok=True)
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


# --- pipeline ------------------------------------------------------------------------------------------------------


def save_folders(args: argparse.Namespace, root: Path, dinov3_processor) -> dict[str, tuple[Path, int | None]]:
    """`{name: (folder, budget)}`, saved: DINOv3 (with `dinov3_processor`), VECA per budget (its
    `default_num_core_tokens`) and DINOv2 if `--dinov2_dir` is given (both with `VecaImageProcessor`)."""
    veca_config, dinov3_config = common.model_configs(args.size, args.tiny, args.budgets)
    torch.manual_seed(args.seed)
    folders = {DINOV3: (root / "dinov3", None)}
    DINOv3ViTModel(dinov3_config).eval().save_pretrained(root / "dinov3")
    dinov3_processor.save_pretrained(root / "dinov3")
    veca = VecaModel(veca_config).eval()
    for budget in args.budgets:
        folders[f"VECA C={budget}"] = (root / f"veca_c{budget}", budget)
        veca.config.default_num_core_tokens = budget
        veca.save_pretrained(root / f"veca_c{budget}")
    if getattr(args, "dinov2_dir", None):
        shutil.copytree(args.dinov2_dir, root / "dinov2")
        folders["DINOv2"] = (root / "dinov2", None)
    for name, (folder, _) in folders.items():
        if name != DINOV3:
            VecaImageProcessor().save_pretrained(folder)
    return folders


def extraction_calls(folder: Path, resolution: int, paths: list[str], batch: int, dtype, device) -> dict:
    """The three ways to embed `paths` with the model of `folder`, each a call returning `(num_images, T, D)`."""
    model = AutoModel.from_pretrained(folder, dtype=dtype).to(device).eval()
    size = {"height": resolution, "width": resolution}
    processor = AutoImageProcessor.from_pretrained(folder, size=size, do_center_crop=False)
    extractor = pipeline("image-feature-extraction", model=model, image_processor=processor, device=device)
    batches = [paths[start : start + batch] for start in range(0, len(paths), batch)]

    def preprocess(chunk: list[str]) -> torch.Tensor:  # (B, 3, r, r)
        images = [Image.open(path).convert("RGB") for path in chunk]
        return processor(images, return_tensors="pt")["pixel_values"].to(device=device, dtype=dtype)

    preprocessed = [preprocess(chunk) for chunk in batches]

    @torch.inference_mode()
    def via(inputs) -> torch.Tensor:
        return torch.cat([model(pixel_values=pixels).last_hidden_state for pixels in inputs])

    return {
        "pipeline": lambda: torch.cat(extractor(paths, batch_size=batch, return_tensors=True)),
        "loop": lambda: via(preprocess(chunk) for chunk in batches),
        "model": lambda: via(preprocessed),
    }


def run_pipeline(args: argparse.Namespace, machine: dict) -> dict:
    dtype, device = common.DTYPES[args.dtype], torch.device(args.device)
    if dtype == torch.bfloat16:
        warn_if_slow_bf16(device, "--dtype bf16")
    cells: dict[tuple, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = write_images(Path(tmp) / "images", args.num_images, args.image_wh, args.seed)
        folders = save_folders(args, Path(tmp), DINOv3ViTImageProcessor())
        for resolution in args.resolutions:
            for batch in args.batch_sizes:
                calls = {name: extraction_calls(folder, resolution, paths, batch, dtype, device)
                         for name, (folder, _) in folders.items()}  # fmt: skip
                for round_index in range(args.rounds + 1):  # round 0 warms up and checks, untimed
                    for name, by_path in calls.items():
                        features = {}
                        for path, call in by_path.items():
                            start = time.perf_counter()
                            features[path] = call()
                            common.synchronize(device)
                            seconds = time.perf_counter() - start
                            cell = cells.setdefault((resolution, batch, name, path), {
                                "resolution": resolution, "batch_size": batch, "model": name, "path": path,
                                "seconds": []})  # fmt: skip
                            if round_index == 0:
                                difference = features[path].float() - features["pipeline"].float()
                                cell["max_abs_difference_to_pipeline"] = difference.abs().max().item()
                            else:
                                cell["seconds"].append(seconds)
                        if round_index:
                            timed = ", ".join(f"{p} {cells[(resolution, batch, name, p)]['seconds'][-1]:.2f} s"
                                              for p in PATHS)  # fmt: skip
                            print(f"round {round_index}: {resolution} px, batch {batch}, {name}: {timed}", flush=True)
    for cell in cells.values():
        cell["median_seconds"] = statistics.median(cell["seconds"])
        cell["images_per_s"] = args.num_images / cell["median_seconds"]
    summary = []  # per (resolution, batch, VECA budget, path): VECA's images/s over DINOv3's
    for (resolution, batch, name, path), cell in cells.items():
        dinov3 = cells.get((resolution, batch, DINOV3, path))
        if name != DINOV3 and dinov3:
            summary.append({"resolution": resolution, "batch_size": batch, "model": name, "path": path,
                            "images_per_s": cell["images_per_s"], "dinov3_images_per_s": dinov3["images_per_s"],
                            "speedup_vs_dinov3": cell["images_per_s"] / dinov3["images_per_s"]})  # fmt: skip
    return {"cells": list(cells.values()), "summary": summary}


def pipeline_markdown(result: dict) -> list[str]:
    args = result["args"]
    index = {(c["resolution"], c["batch_size"], c["model"], c["path"]): c for c in result["cells"]}
    speedups = {(s["resolution"], s["batch_size"], s["model"], s["path"]): s for s in result["summary"]}
    rows = []
    for resolution, batch, name in dict.fromkeys(key[:3] for key in index):
        row = {path: index[(resolution, batch, name, path)] for path in PATHS}
        versus = [speedups.get((resolution, batch, name, path)) for path in ("pipeline", "loop")]
        rows.append([resolution, batch, name, *(f"{row[path]['images_per_s']:.3f}" for path in PATHS),
                     f"{row['pipeline']['images_per_s'] / row['loop']['images_per_s']:.3f}",
                     *(f"{v['speedup_vs_dinov3']:.3f}x" if v else "-" for v in versus),
                     f"{max(c.get('max_abs_difference_to_pipeline', 0.0) for c in row.values()):.1e}"])  # fmt: skip
    return [
        f"- {args['num_images']} JPEGs of {args['image_size']} px from disk, resized to the square side; median "
        f"of {args['rounds']} interleaved rounds after a warm-up; images/s = images / median seconds",
        "- pipeline: `pipeline('image-feature-extraction')(paths, batch_size=B, return_tensors=True)`; loop: "
        "open, `processor(images)`, `model(**inputs)` per batch; model: the model alone on preprocessed batches",
        "",
        *common.table(["res", "batch", "model", "pipeline img/s", "loop img/s", "model img/s", "pipeline / loop",
                       "pipeline vs DINOv3", "loop vs DINOv3", "max abs diff to pipeline"], rows),
    ]  # fmt: skip


# --- dataset -------------------------------------------------------------------------------------------------------


def end_to_end(args, folder: Path, budget, resolution: int, dtype: str, processes: int, images: Path, out: Path):
    command = [sys.executable, str(EXTRACT_SCRIPT)]
    if processes > 1:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes",
                   str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
                   "--main_process_port", "29561", str(EXTRACT_SCRIPT)]  # fmt: skip
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
    model = AutoModel.from_pretrained(folder, dtype=common.DTYPES[dtype]).eval()
    pixel_values = torch.randn(args.batch_size, 3, resolution, resolution, dtype=common.DTYPES[dtype])
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
    from veca_hf.data import dataset_root, load_image_dataset
    from veca_hf.embedding import PartBatches, Preprocess

    batches = PartBatches(
        load_image_dataset(str(images)), "image", Preprocess(AutoImageProcessor.from_pretrained(folder), resolution,
        False, 16), output_dir=out, rows_per_file=args.batch_size, batch_size=args.batch_size, root=str(images),
        image_root=dataset_root(str(images)),
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(batches, batch_size=None, num_workers=args.workers)
    start = time.perf_counter()
    count = sum(len(batch["ids"]) for batch in loader)
    seconds = time.perf_counter() - start
    return {"images": count, "seconds": seconds, "images_per_s": count / seconds}


def run_dataset(args: argparse.Namespace, machine: dict) -> dict:
    cells = []
    with tempfile.TemporaryDirectory() as tmp:
        root, runs = Path(tmp), 0
        images = root / "images"
        if args.images_dir is None:
            write_images(images, args.num_images, (1280, 960), args.seed)
        else:
            photos = sorted(
                p for p in Path(args.images_dir).rglob("*") if p.suffix.lower() in (".jpg", ".jpeg", ".png")
            )
            if len(photos) < args.num_images:
                raise ValueError(f"--images_dir {args.images_dir} has {len(photos)} photos, fewer than --num_images.")
            images.mkdir()
            for index, photo in enumerate(photos[: args.num_images]):
                shutil.copy(photo, images / f"{index:04d}{photo.suffix.lower()}")
        folders = save_folders(args, root, VecaImageProcessor())
        for dtype in args.dtypes:
            for resolution in args.resolutions:
                data = None
                for name, (folder, budget) in folders.items():
                    patch_size = AutoModel.from_pretrained(folder).config.patch_size
                    side = round(resolution / patch_size) * patch_size
                    data = data or data_only(args, folder, resolution, images, root / f"data-{runs}")
                    model = model_only(args, folder, budget, side, dtype)
                    for processes in args.processes:
                        runs += 1
                        run = end_to_end(args, folder, budget, side, dtype, processes, images, root / f"run-{runs}")
                        cells.append({
                            "model": name, "dtype": dtype, "resolution": side, "processes": processes,
                            "threads_per_process": args.threads // processes, "end_to_end": run, "model_only": model,
                            "data_only": data, "share_not_model": 1 - run["images_per_s"] / model["images_per_s"],
                        })  # fmt: skip
                        print(f"{dtype} {side} px {name}, {processes} process(es): end to end "
                              f"{run['images_per_s']:.2f} img/s, model {model['images_per_s']:.2f}, data "
                              f"{data['images_per_s']:.1f}", flush=True)  # fmt: skip
    return {"cells": cells}


def dataset_markdown(result: dict) -> list[str]:
    args = result["args"]
    index = {(c["dtype"], c["resolution"], c["model"], c["processes"]): c for c in result["cells"]}
    rows = []
    for cell in result["cells"]:
        dinov3 = index.get((cell["dtype"], cell["resolution"], DINOV3, cell["processes"]))
        versus = cell["end_to_end"]["images_per_s"] / dinov3["end_to_end"]["images_per_s"] if dinov3 else None
        rows.append([cell["dtype"], cell["resolution"], cell["model"], cell["processes"],
                     f"{cell['end_to_end']['images_per_s']:.2f}", f"{cell['model_only']['images_per_s']:.2f}",
                     f"{cell['data_only']['images_per_s']:.1f}", f"{cell['share_not_model']:.0%}",
                     "-" if versus is None or not cell["model"].startswith("VECA") else f"{versus:.2f}x"])  # fmt: skip
    return [
        f"- {args['num_images']} {'photos' if args['images_dir'] else 'synthetic 1280x960 JPEGs'} from disk, batch "
        f"{args['batch_size']}, {args['workers']} DataLoader worker(s) per process, {args['threads']} threads in "
        "all; end to end = `examples/extract_features.py` from its first batch to its last file; model = the model "
        "alone on preprocessed batches with all threads; data = decoding and preprocessing alone",
        "- not model = 1 - (end-to-end img/s / model img/s): the share of the time the model does not explain (a "
        "few images per cell: cells differ by about 10% from run to run, and a negative share is that noise); vs "
        "DINOv3: VECA's end-to-end rate over DINOv3's, same dtype, resolution and processes",
        "",
        *common.table(["dtype", "px", "model", "processes", "end to end img/s", "model img/s", "data img/s",
                       "not model", "vs DINOv3"], rows),
    ]  # fmt: skip


# --- distill -------------------------------------------------------------------------------------------------------


def run_distill(args: argparse.Namespace, machine: dict) -> dict:
    from veca_hf.training.distillation import compute_teacher_targets

    device = torch.device(args.device)
    veca_config, dinov3_config = common.model_configs(args.size, args.tiny, args.budgets)
    torch.manual_seed(args.seed)
    teacher = AutoModel.from_pretrained(args.teacher) if args.teacher else DINOv3ViTModel(dinov3_config)
    teacher = teacher.float().eval().to(device).requires_grad_(False)
    students = []  # (label, module, optimizer, budget): the dense student first
    for label, budget in [("dense", None)] + [(f"VECA C={c}", c) for c in args.budgets]:
        module = common.student_with_loss(veca_config, budget is None, teacher.config.hidden_size).to(device)
        students.append((label, module, common.adamw(module, args.learning_rate), budget))
    patch_size = veca_config.patch_size
    teacher_autocast = torch.bfloat16 if args.teacher_dtype == "bf16" else None
    for flag, value in (("--dtype", args.dtype), ("--teacher_dtype", args.teacher_dtype)):
        if value.startswith("bf16"):
            warn_if_slow_bf16(device, f"{flag} {value}")

    def part_times(module, optimizer, budget, x) -> dict[str, float]:
        """One distillation step, timed in its three parts (synchronised on CUDA)."""
        start = time.perf_counter()
        targets = compute_teacher_targets(teacher, x, patch_size, autocast_dtype=teacher_autocast)
        common.synchronize(device)
        middle = time.perf_counter()
        with common.autocast(device, args.dtype == "bf16_autocast"):
            loss = module(x, budget, targets.cls, targets.patches)["loss"]
        loss.backward()
        common.synchronize(device)
        end = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        common.synchronize(device)
        return {"teacher": middle - start, "student_forward_backward": end - middle,
                "optimizer": time.perf_counter() - end}  # fmt: skip

    inputs, agreement = {}, {}
    for resolution in args.resolutions:
        generator = torch.Generator().manual_seed(args.seed)
        x = inputs[resolution] = torch.randn(args.batch_size, 3, resolution, resolution, generator=generator).to(
            device
        )
        with torch.inference_mode():  # the targets of the teacher under bf16 autocast against fp32's
            fp32 = compute_teacher_targets(teacher, x, patch_size)
            bf16 = compute_teacher_targets(teacher, x, patch_size, autocast_dtype=torch.bfloat16)
        cls = F.cosine_similarity(bf16.cls, fp32.cls, dim=-1)  # (B,)
        patches = F.cosine_similarity(bf16.patches, fp32.patches, dim=-1)  # (B, N)
        agreement[str(resolution)] = entry = {"cls_cosine_min": cls.min().item(),
                                              "patch_cosine_mean": patches.mean().item(),
                                              "patch_cosine_min": patches.min().item()}  # fmt: skip
        entry["within_tolerance"] = min(entry["cls_cosine_min"], entry["patch_cosine_min"]) >= args.teacher_min_cosine
        print(f"{resolution} px: bf16 vs fp32 teacher targets: {entry}", flush=True)

    samples: dict[tuple, list[dict[str, float]]] = {(r, s[0]): [] for r in args.resolutions for s in students}
    for round_index in range(args.warmup + args.repeats):
        shift = round_index % len(students)
        for resolution in args.resolutions:
            for label, module, optimizer, budget in students[shift:] + students[:shift]:  # rotated every round
                times = part_times(module, optimizer, budget, inputs[resolution])
                if round_index >= args.warmup:
                    samples[(resolution, label)].append(times)
    points = []
    for resolution in args.resolutions:
        dense_totals = [sum(t.values()) for t in samples[(resolution, "dense")]]
        for label, _, _, budget in students:
            rounds = samples[(resolution, label)]
            totals = [sum(t.values()) for t in rounds]
            median = statistics.median(totals)
            breakdown = {part: statistics.median(t[part] for t in rounds) for part in PARTS}
            point = {
                "resolution": resolution, "student": label, "budget": budget, "batch_size": args.batch_size,
                "step_s": {"median": median, "min": min(totals), "max": max(totals), "samples": totals},
                "images_per_s": args.batch_size / median, "breakdown_s": breakdown,
                "breakdown_share": {part: breakdown[part] / sum(breakdown.values()) for part in PARTS},
                "parts_samples": rounds, "ratio_vs_dense": median / statistics.median(dense_totals),
                "paired_ratio_vs_dense": common.paired_median(totals, dense_totals),
            }  # fmt: skip
            points.append(point)
            shares = ", ".join(f"{part} {100 * v:.0f}%" for part, v in point["breakdown_share"].items())
            print(f"{resolution:5d} px {label:10s} {point['images_per_s']:8.2f} img/s  step {median:.3f} s "
                  f"({shares})  x{point['paired_ratio_vs_dense']:.3f} dense (paired)", flush=True)  # fmt: skip
    within = all(a["within_tolerance"] for a in agreement.values())
    print(f"bf16 teacher targets {'within' if within else 'NOT within'} min cosine {args.teacher_min_cosine} of "
          f"fp32" + ("" if args.teacher_dtype == "bf16" or within else " (the run used fp32)"))  # fmt: skip
    return {
        "teacher": {
            "source": args.teacher or "random DINOv3",
            "hidden_size": teacher.config.hidden_size,
            "dtype": args.teacher_dtype,
        },  # fmt: skip
        "teacher_bf16_vs_fp32": agreement,
        "teacher_bf16_within_tolerance": within,
        "points": points,
    }


# --- resume --------------------------------------------------------------------------------------------------------


def run_resume(args: argparse.Namespace) -> dict:
    import io

    import datasets

    from veca_hf.data import ImageStream, build_transform, collate_images, infinite_batches, load_image_dataset

    shards, count = Path(args.output_dir) / "shards", (args.steps + 1) * args.batch_size
    if len(list(shards.glob("*.parquet"))) != args.num_shards:  # distinct noisy JPEGs, kept for the next run
        shards.mkdir(parents=True, exist_ok=True)
        rng, size, per_shard = np.random.default_rng(0), args.image_size, -(-count // args.num_shards)
        base = np.linspace(0, 255, size, dtype=np.float32)[None, :, None] * np.ones((size, 1, 3), np.float32)
        for shard in range(args.num_shards):
            images = []
            for _ in range(min(per_shard, count - shard * per_shard)):
                buffer = io.BytesIO()
                pixels = np.clip(base + rng.normal(0, 20, (size, size, 3)), 0, 255).astype(np.uint8)
                Image.fromarray(pixels).save(buffer, format="JPEG", quality=85)
                images.append({"bytes": buffer.getvalue(), "path": None})
            table = datasets.Dataset.from_dict({"image": images}).cast_column("image", datasets.Image())
            table.to_parquet(str(shards / f"part-{shard:05d}.parquet"))
    stream = ImageStream(load_image_dataset(str(shards)), "image", build_transform(args.resolution, train=True),
                         seed=0, shuffle_buffer_size=args.shuffle_buffer_size)  # fmt: skip
    loader = dict(batch_size=args.batch_size, collate_fn=collate_images, num_workers=args.dataloader_num_workers)
    workers = max(1, args.dataloader_num_workers)

    def seconds_to_next_batch(steps: int, per_worker: bool) -> float:
        position = {"epoch": 0, "batches": steps}
        if per_worker:  # what the training loop records: batches are taken from the workers in turn
            position.update(worker_batches=[len(range(w, steps, workers)) for w in range(workers)],
                            last_worker=(steps - 1) % workers)  # fmt: skip
        start = time.perf_counter()
        assert next(infinite_batches(stream, loader, 0, position, "empty"))["pixel_values"] is not None
        return time.perf_counter() - start

    result = {key: getattr(args, key) for key in ("steps", "batch_size", "resolution", "dataloader_num_workers")}
    result.update(
        first_batch_seconds=seconds_to_next_batch(0, True),
        skip_seconds=seconds_to_next_batch(args.steps, True),
        replay_steps=args.replay_steps,
        replay_seconds_measured=seconds_to_next_batch(args.replay_steps, False),
    )
    # The replay's cost above a fresh start grows linearly with the consumed batches.
    extra = result["replay_seconds_measured"] - result["first_batch_seconds"]
    result["replay_seconds_scaled"] = result["first_batch_seconds"] + extra * args.steps / args.replay_steps
    return result


# --- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.command == "resume":
        result = run_resume(args)
        (Path(args.output_dir) / "resume_skip.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result, indent=2))
        return result
    machine = common.start(args)
    run = {"pipeline": run_pipeline, "dataset": run_dataset, "distill": run_distill}[args.command]
    measured = run(args, machine)
    machine["loadavg_end"] = common.loadavg()
    # committed results name this machine's folders by what they are
    named = [(getattr(args, "images_dir", None), "PHOTOS_DIR"), (getattr(args, "dinov2_dir", None), "DINOV2_DIR")]
    places = {value: name for value, name in [*named, (args.output_dir, "OUTPUT_DIR")] if value}
    command = common.command_line([places.get(word, word) for word in (sys.argv[1:] if argv is None else argv)])
    settings = {key: places.get(value, value) if isinstance(value, str) else value
                for key, value in vars(args).items() if key != "image_wh"}  # fmt: skip
    result = {"command": command, "args": settings, "machine": machine, **measured}
    text = None
    if args.command != "distill":
        title = "Feature extraction" if args.command == "pipeline" else "Embedding a dataset"
        lines = pipeline_markdown(result) if args.command == "pipeline" else dataset_markdown(result)
        text = "\n".join([f"# {title} end to end: {args.size}{' (tiny)' if args.tiny else ''}, {args.device}", "",
                          f"- command: `{command}`", common.machine_line(machine), *lines]) + "\n"  # fmt: skip
        print(text)
    common.write_results(args.output_dir, result, text)
    print(f"wrote {args.output_dir}")
    return result


if __name__ == "__main__":
    main()
