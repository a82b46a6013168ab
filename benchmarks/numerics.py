#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Numerics and precision: how close reduced precision, the attention backends and int8 stay to fp32. Two commands:

- `precision`: VECA and DINOv3 side by side, each check (`--checks`) against the same model in fp32 with SDPA on the
  same input: `bf16_autocast` (fp32 weights under `torch.autocast(device, torch.bfloat16)`), `bf16_weights` (model
  and input cast to bfloat16), `eager_sdpa` (`attn_implementation="eager"` against `"sdpa"`, both in
  `--eager_sdpa_dtype`). Per check and resolution: the cosine to the reference of every token of
  `last_hidden_state` (mean and min) and of `pooler_output` (min over the batch), the relative error of
  `last_hidden_state` and its max abs difference; a check passes when every min cosine is at least `--min_cosine`.
  Random weights unless `--veca_model` / `--dinov3_model` name folders (any `AutoModel` for the latter); Gaussian
  inputs unless `--images_dir` names a folder of images (the first `--batch_size` by name, through
  `VecaImageProcessorPil.for_resolution`).
- `int8`: is int8 worth offering for VECA on a CPU? Candidates (`--candidates`) run VECA's Linear layers in int8:
  `torch_int8_x86` / `torch_int8_onednn` (`torch.ao.quantization.quantize_dynamic` with that quantized engine) and
  `onnxruntime_int8` (our ONNX export through `veca_hf.hub.export_onnx.quantize_onnx_int8`). (1) Speed
  (`--speed_resolutions`): a random `--size` model at batch 1 beside fp32 and bf16 weights, interleaved rounds;
  (2) fidelity (`--veca_model`, `--images_dir`): per photo, the cosine of `pooler_output` and the mean per-patch
  cosine to fp32; (3) probe (`--fashion_mnist_dir`): the 20-NN accuracy at `--probe_resolution` under each candidate,
  with a paired bootstrap interval of the difference to fp32. A candidate is *fit to offer* when every cosine is at
  least `--min_cosine` and that interval contains 0.

    python benchmarks/numerics.py precision --size veca-b16 --resolutions 224,512,1024 --threads 2
    python benchmarks/numerics.py precision --device cuda --checks eager_sdpa --eager_sdpa_dtype bf16
    python benchmarks/numerics.py precision --veca_model STUDENT_DIR --dinov3_model TEACHER_DIR --images_dir PHOTOS \
        --resolutions 112,224 --batch_size 16 --budget 8
    python benchmarks/numerics.py int8 --veca_model STUDENT_DIR --images_dir PHOTOS --fashion_mnist_dir FMNIST \
        --output_dir benchmarks/results/int8_cpu

Outputs: `results.json` in `--output_dir` when given.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from veca_hf import VecaImageProcessorPil, VecaModel


CHECKS = ("bf16_autocast", "bf16_weights", "eager_sdpa")
CANDIDATES = ("torch_int8_x86", "torch_int8_onednn", "onnxruntime_int8")
Runner = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # pixels -> (last_hidden_state, pooler)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    subs = {}
    for name, resolutions, budget, cosine in (("precision", [224, 512], 64, 0.999), ("int8", [112, 224], 64, 0.99)):
        sub = subs[name] = commands.add_parser(name, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
        common.add_model_arguments(sub, resolutions)
        sub.add_argument("--budget", type=int, default=budget, help="The budget C every VECA runs at.")
        sub.add_argument("--min_cosine", type=float, default=cosine, help="Pass threshold for every min cosine.")
        sub.add_argument("--veca_model", default=None, help="A VecaModel folder (default: random weights).")
        sub.add_argument("--images_dir", default=None, help="A folder of photos as inputs.")
        sub.add_argument("--bf16_probe_size", type=int, default=2048, help="CPU: torch.mm side timed (0: flags only).")
        sub.add_argument("--output_dir", default=None, help="Folder for results.json.")
    sub = subs["precision"]
    sub.add_argument("--batch_size", type=int, default=2)
    sub.add_argument("--checks", type=common.comma_list(CHECKS), default=list(CHECKS), help="Comma-separated.")
    sub.add_argument("--eager_sdpa_dtype", default="fp32", choices=["fp32", "bf16"])
    sub.add_argument("--dinov3_model", default=None, help="An AutoModel folder (default: random DINOv3).")
    sub = subs["int8"]
    sub.add_argument(
        "--candidates", type=common.comma_list(CANDIDATES), default=list(CANDIDATES), help="Comma-separated."
    )
    sub.add_argument("--speed_resolutions", type=common.int_list_or_empty, default=[512, 1024])
    sub.add_argument("--rounds", type=int, default=5, help="Interleaved timing rounds per resolution.")
    sub.add_argument("--num_images", type=int, default=16)
    sub.add_argument("--fashion_mnist_dir", default=None, help="Fashion-MNIST idx files for the 20-NN probe.")
    sub.add_argument("--probe_resolution", type=int, default=112)
    sub.add_argument("--probe_samples", type=int, default=2000, help="Train and test images of the probe.")
    return parser.parse_args(argv)


def load_images(images_dir: str, count: int) -> list:
    """The first `count` images of `images_dir` (sorted by name), as RGB PIL images."""
    from PIL import Image

    from veca_hf.evaluation.datasets import IMAGE_EXTENSIONS

    paths = sorted(p for p in Path(images_dir).iterdir() if p.is_file() and p.suffix.lower() in IMAGE_EXTENSIONS)
    if len(paths) < count:
        raise ValueError(f"--images_dir {images_dir} holds {len(paths)} images, fewer than --batch_size {count}; "
                         "pass a smaller --batch_size or a folder with more images.")  # fmt: skip
    return [Image.open(path).convert("RGB") for path in paths[:count]]


def make_inputs(args, resolution: int, images: list | None) -> torch.Tensor:
    """`(batch_size, 3, resolution, resolution)`: the images through the processor, or seeded Gaussian noise."""
    if images is not None:
        return VecaImageProcessorPil.for_resolution(resolution)(images, return_tensors="pt")["pixel_values"]
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randn(args.batch_size, 3, resolution, resolution, generator=generator)


def load_veca(args, veca_config) -> VecaModel:
    if args.veca_model:
        return VecaModel.from_pretrained(args.veca_model, attn_implementation="sdpa").float().eval()
    return VecaModel(veca_config).eval()


# --- precision -----------------------------------------------------------------------------------------------------


def with_attention(model: nn.Module, implementation: str) -> nn.Module:
    """A copy of `model` (same weights) whose config asks for another attention implementation."""
    other = copy.deepcopy(model)
    for module in other.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            config._attn_implementation = implementation
    return other


def compare(output, reference) -> dict[str, float]:
    """Cosines and errors of `output` against `reference` (both `BaseModelOutputWithPooling`), in fp32."""
    x, ref = output.last_hidden_state.float(), reference.last_hidden_state.float()
    token_cos = F.cosine_similarity(x, ref, dim=-1)  # (B, T)
    pooled = F.cosine_similarity(output.pooler_output.float(), reference.pooler_output.float(), dim=-1)  # (B,)
    return {
        "last_hidden_state_cosine_mean": token_cos.mean().item(),
        "last_hidden_state_cosine_min": token_cos.min().item(),
        "pooler_output_cosine_min": pooled.min().item(),
        "relative_error": ((x - ref).norm() / ref.norm()).item(),
        "max_abs_diff": (x - ref).abs().max().item(),
    }


def run_precision(args) -> dict[str, Any]:
    from transformers import AutoModel, DINOv3ViTModel

    device = torch.device(args.device)
    veca_config, dinov3_config = common.model_configs(args.size, args.tiny, [args.budget])
    torch.manual_seed(args.seed)
    dinov3 = (AutoModel.from_pretrained(args.dinov3_model, attn_implementation="sdpa") if args.dinov3_model
              else DINOv3ViTModel(dinov3_config))  # fmt: skip
    models = {"VECA": load_veca(args, veca_config).to(device), "DINOv3": dinov3.float().eval().to(device)}
    images = load_images(args.images_dir, args.batch_size) if args.images_dir else None
    rows = []
    for resolution in args.resolutions:
        x = make_inputs(args, resolution, images).to(device)  # (B, 3, r, r)
        for name, model in models.items():
            kwargs = {"num_core_tokens": args.budget} if name == "VECA" else {}
            for check in args.checks:
                with torch.inference_mode():
                    if check == "eager_sdpa":
                        dtype = torch.bfloat16 if args.eager_sdpa_dtype == "bf16" else torch.float32
                        sdpa = copy.deepcopy(model).to(dtype)
                        reference = sdpa(x.to(dtype), **kwargs)
                        output = with_attention(sdpa, "eager")(x.to(dtype), **kwargs)
                        del sdpa
                    elif check == "bf16_autocast":
                        reference = model(x, **kwargs)
                        with common.autocast(device, True):
                            output = model(x, **kwargs)
                    else:
                        reference = model(x, **kwargs)
                        output = copy.deepcopy(model).to(torch.bfloat16)(x.to(torch.bfloat16), **kwargs)
                metrics = compare(output, reference)
                worst = min(metrics["last_hidden_state_cosine_min"], metrics["pooler_output_cosine_min"])
                row = {"model": name, "check": check, "resolution": resolution, **metrics,
                       "passed": worst >= args.min_cosine}  # fmt: skip
                rows.append(row)
                print(f"{name:6s} {check:13s} {resolution:5d} px  cos tokens mean "
                      f"{row['last_hidden_state_cosine_mean']:.6f} min {row['last_hidden_state_cosine_min']:.6f}  "
                      f"pooler min {row['pooler_output_cosine_min']:.6f}  rel err {row['relative_error']:.2e}  "
                      f"{'ok' if row['passed'] else 'BELOW ' + str(args.min_cosine)}", flush=True)  # fmt: skip
    print(f"all checks at or above cosine {args.min_cosine}: {all(r['passed'] for r in rows)}")
    return {
        "weights": {"VECA": args.veca_model or "random", "DINOv3": args.dinov3_model or "random"},
        "inputs": args.images_dir or "gaussian noise",
        "rows": rows,
        "all_passed": all(r["passed"] for r in rows),
    }


# --- int8 ----------------------------------------------------------------------------------------------------------


def _torch_runner(model: nn.Module, budget: int, dtype: torch.dtype = torch.float32, engine: str | None = None):
    def run(pixel_values: torch.Tensor):
        if engine:  # read when the layers run; two engines run in one process
            torch.backends.quantized.engine = engine
        with torch.inference_mode():
            output = model(pixel_values.to(dtype), num_core_tokens=budget)
        return output.last_hidden_state.float(), output.pooler_output.float()

    return run


def _onnxruntime_int8(model: VecaModel, budget: int, folder: Path) -> Runner:
    import onnxruntime

    from veca_hf.hub.export_onnx import export_onnx, quantize_onnx_int8

    int8_path = quantize_onnx_int8(export_onnx(model, budget, folder / "model.onnx"), folder / "model-int8.onnx")
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    session = onnxruntime.InferenceSession(str(int8_path), options, providers=["CPUExecutionProvider"])

    def run(pixel_values: torch.Tensor):
        hidden, pooled = session.run(["last_hidden_state", "pooler_output"], {"pixel_values": pixel_values.numpy()})
        return torch.from_numpy(hidden), torch.from_numpy(pooled)

    return run


def build_runners(model: VecaModel, args, folder: Path, with_references: bool) -> dict[str, Runner]:
    """fp32 (and bf16 weights, for the timings) and every candidate, each on its own copy of `model`'s weights."""
    from torch.ao.quantization import quantize_dynamic

    runners = {"fp32": _torch_runner(model, args.budget)}
    if with_references:
        runners["bf16"] = _torch_runner(copy.deepcopy(model).to(torch.bfloat16), args.budget, torch.bfloat16)
    for name in args.candidates:
        if name.startswith("torch_int8_"):
            engine = torch.backends.quantized.engine = name.removeprefix("torch_int8_")  # packs the weights for it
            quantized = quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
            runners[name] = _torch_runner(quantized, args.budget, engine=engine)
        else:
            runners[name] = _onnxruntime_int8(model, args.budget, folder)
    return runners


def measure_speed(args, folder: Path) -> list[dict[str, Any]]:
    veca_config, _ = common.model_configs(args.size, args.tiny, [args.budget])
    torch.manual_seed(args.seed)
    runners = build_runners(VecaModel(veca_config).eval(), args, folder / "speed", with_references=True)
    rows = []
    for resolution in args.speed_resolutions:
        pixels = torch.randn(1, 3, resolution, resolution, generator=torch.Generator().manual_seed(args.seed))
        calls = {name: lambda run=run, pixels=pixels: run(pixels) for name, run in runners.items()}
        # a warm-up round: packed weights, oneDNN primitives, ONNX Runtime's arenas
        seconds = common.interleaved(calls, args.rounds, "cpu", warmup=1)
        for name, values in seconds.items():
            row = {"resolution": resolution, "runner": name, "seconds_median": statistics.median(values),
                   "over_fp32": common.paired_median(values, seconds["fp32"]),
                   "over_bf16": common.paired_median(values, seconds["bf16"]), "seconds": values}  # fmt: skip
            rows.append(row)
            print(f"speed {resolution:5d} px {name:18s} {row['seconds_median']:.3f} s  "
                  f"x{row['over_fp32']:.2f} of fp32, x{row['over_bf16']:.2f} of bf16", flush=True)  # fmt: skip
    return rows


def measure_fidelity(runners: dict[str, Runner], args) -> list[dict[str, Any]]:
    images = load_images(args.images_dir, args.num_images)
    rows = []
    for resolution in args.resolutions:
        pixels = VecaImageProcessorPil.for_resolution(resolution)(images, return_tensors="pt")["pixel_values"]
        ref_hidden, ref_pooled = runners["fp32"](pixels)
        for name, run in runners.items():
            if name == "fp32":
                continue
            hidden, pooled = run(pixels)
            cores = args.budget
            global_cos = F.cosine_similarity(pooled, ref_pooled, dim=-1)  # (B,)
            patch_cos = F.cosine_similarity(hidden[:, cores:], ref_hidden[:, cores:], dim=-1).mean(1)  # (B,)
            row = {"resolution": resolution, "runner": name}
            for feature, cosine in (("global", global_cos), ("patch", patch_cos)):
                row[f"{feature}_cosine_min"], row[f"{feature}_cosine_mean"] = cosine.min().item(), cosine.mean().item()
            rows.append(row)
            print(f"fidelity {resolution:4d} px {name:18s} global min {row['global_cosine_min']:.4f} "
                  f"patch min {row['patch_cosine_min']:.4f}", flush=True)  # fmt: skip
    return rows


def measure_probe(runners: dict[str, Runner], args) -> list[dict[str, Any]]:
    from veca_hf import evaluation
    from veca_hf.evaluation.features import _PreprocessedImages

    train = evaluation.fashion_mnist(args.fashion_mnist_dir, "train").sample(args.probe_samples, seed=0)
    test = evaluation.fashion_mnist(args.fashion_mnist_dir, "test").sample(args.probe_samples, seed=1)

    def batches(images) -> list[torch.Tensor]:  # preprocessed once, shared by every runner
        dataset = _PreprocessedImages(images, args.probe_resolution)
        return [torch.stack([dataset[i] for i in range(s, min(s + 64, len(dataset)))])
                for s in range(0, len(dataset), 64)]  # fmt: skip

    train_batches, test_batches = batches(train), batches(test)
    correct = {}
    for name, run in runners.items():
        reference, queries = (torch.cat([run(batch)[1] for batch in b]) for b in (train_batches, test_batches))
        predicted = evaluation.knn_classify(reference, train.labels, queries, num_classes=10)
        correct[name] = predicted.numpy() == np.asarray(test.labels)
    rows = []
    for name, right in correct.items():
        low, high = evaluation.paired_bootstrap_interval(lambda a, b: a - b, right, correct["fp32"], seed=args.seed)
        difference = float(right.mean() - correct["fp32"].mean())
        rows.append({"runner": name, "knn20": float(right.mean()), "minus_fp32": difference,
                     "minus_fp32_interval": [low, high]})  # fmt: skip
        print(f"20-NN {name:18s} {100 * right.mean():.2f}%  {100 * difference:+.2f} "
              f"[{100 * low:+.2f}, {100 * high:+.2f}]", flush=True)  # fmt: skip
    return rows


def run_int8(args) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        result = {"speed": measure_speed(args, Path(tmp)) if args.speed_resolutions else []}
        fidelity, probe = [], []
        if args.veca_model:
            runners = build_runners(load_veca(args, None), args, Path(tmp) / "trained", with_references=False)
            fidelity = measure_fidelity(runners, args) if args.images_dir else []
            probe = measure_probe(runners, args) if args.fashion_mnist_dir else []
    verdicts = {}
    for name in args.candidates:
        cosines = [min(r["global_cosine_min"], r["patch_cosine_min"]) for r in fidelity if r["runner"] == name]
        interval = next((r["minus_fp32_interval"] for r in probe if r["runner"] == name), None)
        keeps_probe = interval is not None and interval[0] <= 0 <= interval[1]
        worst = min(cosines) if cosines else None
        verdicts[name] = {"worst_cosine": worst, "knn20_interval_contains_0": keeps_probe,
                          "fit_to_offer": worst is not None and worst >= args.min_cosine and keeps_probe}  # fmt: skip
        print(f"{name}: worst cosine {verdicts[name]['worst_cosine']}, 20-NN unchanged {keeps_probe} -> fit to "
              f"offer: {verdicts[name]['fit_to_offer']}")  # fmt: skip
    return {**result, "fidelity": fidelity, "probe": probe, "verdicts": verdicts}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    machine = common.start(args, args.bf16_probe_size if args.device == "cpu" else 0)
    if "bf16" in machine:
        b = machine["bf16"]
        timing = f", torch.mm {b['mm_size']}^2 bf16/fp32 x{b['bf16_speedup']:.2f}" if b.get("mm_size") else ""
        print(f"CPU {b['cpu_model']}: bf16 flags {b['flags']}{timing}; fast bf16: {b['fast_bf16']}", flush=True)
    measured = run_precision(args) if args.command == "precision" else run_int8(args)
    result = {"command": common.command_line(argv), "args": vars(args), "machine": machine, **measured}
    if args.output_dir:
        common.write_results(args.output_dir, result)
    return result


if __name__ == "__main__":
    main()
