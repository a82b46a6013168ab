#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Is int8 worth offering for VECA on a CPU? Speed against fp32 and bf16, and what int8 does to the features.

Candidates (`--candidates`), each a way to run VECA's Linear layers (about 95% of its FLOPs) in int8:

- `torch_int8_x86` / `torch_int8_onednn`: `torch.ao.quantization.quantize_dynamic(model, {nn.Linear}, torch.qint8)`
  (weights int8 per tensor, activations quantized per call) with the `x86` (fbgemm) or `onednn` quantized engine;
- `onnxruntime_int8`: our ONNX export through ONNX Runtime's `quantize_dynamic` (int8 weights, dynamic
  activations; `veca_hf.hub.export_onnx.quantize_onnx_int8`, the CLI's `--int8`), run by ONNX Runtime's CPU provider.

Three measurements:

1. Speed (`--speed_resolutions`): a random-weight `--size` model at batch 1, every candidate beside fp32 and bf16
   weights, timed in interleaved rounds (the median per candidate and its ratio to fp32 and bf16 per round).
2. Fidelity (`--veca_model`, `--images_dir`): a trained VECA on real photos at `--resolutions`: per image, the cosine
   of the global feature (`pooler_output`) and the mean per-patch cosine to the same model in fp32.
3. Probe (`--fashion_mnist_dir`): the 20-NN accuracy on Fashion-MNIST at `--probe_resolution` of the trained model in
   fp32 and under each candidate, with a paired bootstrap interval of the difference.

A candidate is *fit to offer* when every photo's global and patch cosine is at least `--min_cosine` and the 20-NN
interval of its difference to fp32 contains 0.

    python benchmarks/int8_check.py --veca_model STUDENT_DIR --images_dir PHOTOS --fashion_mnist_dir FMNIST \
        --output_dir benchmarks/results/int8_cpu
    python benchmarks/int8_check.py --tiny --speed_resolutions 64 --resolutions 64 --candidates torch_int8_x86
"""

from __future__ import annotations

import argparse
import copy
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import numpy as np
import scaling_measure
import torch
import torch.nn.functional as F
from precision_check import load_images
from scaling import preset_configs
from torch import nn

from veca_hf import VecaImageProcessorPil, VecaModel


CANDIDATES = ("torch_int8_x86", "torch_int8_onednn", "onnxruntime_int8")
Runner = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # pixels -> (last_hidden_state, pooler)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[112, 224])
    parser.add_argument("--candidates", default=",".join(CANDIDATES), help=f"Comma-separated, among {CANDIDATES}.")
    parser.add_argument("--budget", type=int, default=64, help="The budget C every model runs at.")
    parser.add_argument("--speed_resolutions", type=common.int_list_or_empty, default=[512, 1024])
    parser.add_argument("--rounds", type=int, default=5, help="Interleaved timing rounds per resolution.")
    parser.add_argument("--veca_model", default=None, help="A trained VecaModel folder (fidelity and probe).")
    parser.add_argument("--images_dir", default=None, help="Real photos for the fidelity check.")
    parser.add_argument("--num_images", type=int, default=16)
    parser.add_argument("--fashion_mnist_dir", default=None, help="Fashion-MNIST idx files for the 20-NN probe.")
    parser.add_argument("--probe_resolution", type=int, default=112)
    parser.add_argument("--probe_samples", type=int, default=2000, help="Train and test images of the probe.")
    parser.add_argument("--min_cosine", type=float, default=0.99)
    parser.add_argument("--bf16_probe_size", type=int, default=2048, help="torch.mm side timed in fp32 and bf16.")
    parser.add_argument("--output_dir", default=None, help="Folder for results.json.")
    args = parser.parse_args(argv)
    args.candidates = [c for c in args.candidates.split(",") if c]
    unknown = sorted(set(args.candidates) - set(CANDIDATES))
    if unknown:
        parser.error(f"unknown candidates {unknown}; choose among {', '.join(CANDIDATES)}")
    return args


def _torch_runner(model: nn.Module, budget: int, dtype: torch.dtype = torch.float32) -> Runner:
    def run(pixel_values: torch.Tensor):
        with torch.inference_mode():
            output = model(pixel_values.to(dtype), num_core_tokens=budget)
        return output.last_hidden_state.float(), output.pooler_output.float()

    return run


def _torch_int8(model: nn.Module, engine: str) -> nn.Module:
    from torch.ao.quantization import quantize_dynamic

    torch.backends.quantized.engine = engine  # read when the weights are packed and when the layers run
    return quantize_dynamic(model, {nn.Linear}, dtype=torch.qint8)


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
    runners = {"fp32": _torch_runner(model, args.budget)}
    if with_references:
        runners["bf16"] = _torch_runner(copy.deepcopy(model).to(torch.bfloat16), args.budget, torch.bfloat16)
    for name in args.candidates:
        if name.startswith("torch_int8_"):
            engine = name.removeprefix("torch_int8_")
            quantized = _torch_int8(copy.deepcopy(model), engine)
            runners[name] = _engine_bound(_torch_runner(quantized, args.budget), engine)
        else:
            runners[name] = _onnxruntime_int8(model, args.budget, folder)
    return runners


def _engine_bound(run: Runner, engine: str) -> Runner:
    """A torch int8 runner that sets its quantized engine for each call (two engines run in one process)."""

    def bound(pixel_values: torch.Tensor):
        torch.backends.quantized.engine = engine
        return run(pixel_values)

    return bound


def measure_speed(args, folder: Path) -> list[dict[str, Any]]:
    veca_config, _ = preset_configs(args.size, args.tiny, [args.budget])
    torch.manual_seed(args.seed)
    runners = build_runners(VecaModel(veca_config).eval(), args, folder / "speed", with_references=True)
    rows = []
    for resolution in args.speed_resolutions:
        pixels = torch.randn(1, 3, resolution, resolution, generator=torch.Generator().manual_seed(args.seed))
        for run in runners.values():  # warm-up: packed weights, oneDNN primitives, ONNX Runtime's arenas
            run(pixels)
        seconds = {name: [] for name in runners}
        for _ in range(args.rounds):
            for name, run in runners.items():
                start = time.perf_counter()
                run(pixels)
                seconds[name].append(time.perf_counter() - start)
        for name, values in seconds.items():
            row = {"resolution": resolution, "runner": name, "seconds_median": statistics.median(values),
                   "over_fp32": scaling_measure.paired_median(values, seconds["fp32"]),
                   "over_bf16": scaling_measure.paired_median(values, seconds["bf16"]), "seconds": values}  # fmt: skip
            rows.append(row)
            print(f"speed {resolution:5d} px {name:18s} {row['seconds_median']:.3f} s  "
                  f"x{row['over_fp32']:.2f} of fp32, x{row['over_bf16']:.2f} of bf16", flush=True)  # fmt: skip
    return rows


def measure_fidelity(runners: dict[str, Runner], args, num_cores: int) -> list[dict[str, Any]]:
    images = load_images(args.images_dir, args.num_images)
    rows = []
    for resolution in args.resolutions:
        pixels = VecaImageProcessorPil.for_resolution(resolution)(images, return_tensors="pt")["pixel_values"]
        ref_hidden, ref_pooled = runners["fp32"](pixels)
        for name, run in runners.items():
            if name == "fp32":
                continue
            hidden, pooled = run(pixels)
            global_cos = F.cosine_similarity(pooled, ref_pooled, dim=-1)  # (B,)
            patch_cos = F.cosine_similarity(hidden[:, num_cores:], ref_hidden[:, num_cores:], dim=-1).mean(1)  # (B,)
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

    def features(run: Runner, pixel_batches: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat([run(batch)[1] for batch in pixel_batches])  # (N, D) pooler outputs

    correct = {}
    for name, run in runners.items():
        reference, queries = features(run, train_batches), features(run, test_batches)
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


def verdicts(args, fidelity: list[dict], probe: list[dict]) -> dict[str, dict[str, Any]]:
    result = {}
    for name in args.candidates:
        cosines = [min(r["global_cosine_min"], r["patch_cosine_min"]) for r in fidelity if r["runner"] == name]
        interval = next((r["minus_fp32_interval"] for r in probe if r["runner"] == name), None)
        keeps_features = bool(cosines) and min(cosines) >= args.min_cosine
        keeps_probe = interval is not None and interval[0] <= 0 <= interval[1]
        result[name] = {"worst_cosine": min(cosines) if cosines else None, "knn20_interval_contains_0": keeps_probe,
                        "fit_to_offer": keeps_features and keeps_probe}  # fmt: skip
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine = scaling_measure.machine_info(args)
    result: dict[str, Any] = {"args": vars(args), "machine": machine}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        result["speed"] = measure_speed(args, folder) if args.speed_resolutions else []
        fidelity, probe = [], []
        if args.veca_model:
            model = VecaModel.from_pretrained(args.veca_model, attn_implementation="sdpa").float().eval()
            runners = build_runners(model, args, folder / "trained", with_references=False)
            if args.images_dir:
                fidelity = measure_fidelity(runners, args, args.budget)
            if args.fashion_mnist_dir:
                probe = measure_probe(runners, args)
        result.update(fidelity=fidelity, probe=probe, verdicts=verdicts(args, fidelity, probe))
    for name, verdict in result["verdicts"].items():
        print(f"{name}: worst cosine {verdict['worst_cosine']}, 20-NN unchanged {verdict['knn20_interval_contains_0']}"
              f" -> fit to offer: {verdict['fit_to_offer']}")  # fmt: skip
    if args.output_dir:
        output_dir = Path(args.output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        common.write_results(output_dir, result)
    return result


if __name__ == "__main__":
    main()
