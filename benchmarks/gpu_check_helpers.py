#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Helpers of `benchmarks/gpu_check.sh` (no Hub needed):

python benchmarks/gpu_check_helpers.py workspace DIR       # tiny random DINOv3 teacher, student config, images
python benchmarks/gpu_check_helpers.py compare RUN_A RUN_B # max |difference| of two saved students' weights
python benchmarks/gpu_check_helpers.py report OUT          # the compact table, and OUT/gpu_check.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def workspace(root: Path) -> None:
    """A tiny random DINOv3 teacher saved from a config, a tiny VECA student config, and 48 generated images."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import DINOv3ViTConfig, DINOv3ViTModel

    from veca_hf import VecaConfig

    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    teacher = DINOv3ViTConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              patch_size=16, num_register_tokens=4, image_size=64)  # fmt: skip
    DINOv3ViTModel(teacher).save_pretrained(root / "teacher")
    VecaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170, core_bank_size=16,
               core_chunk_size=8, image_size=64).save_pretrained(root / "student")  # fmt: skip
    images = root / "images"
    images.mkdir(exist_ok=True)
    rng = np.random.default_rng(0)
    for index in range(48):
        Image.fromarray(rng.integers(0, 256, (80, 80, 3), dtype=np.uint8)).save(images / f"img_{index:02d}.png")
    print(f"workspace in {root}")


def compare(run_a: Path, run_b: Path) -> None:
    """Prints a JSON line: the max absolute difference between the two runs' saved student weights."""
    from safetensors.torch import load_file

    a, b = load_file(str(run_a / "model.safetensors")), load_file(str(run_b / "model.safetensors"))
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a) if a.keys() == b.keys() else None
    steps = [json.loads((run / "distill_results.json").read_text())["step"] for run in (run_a, run_b)]
    print(json.dumps({"max_abs_weight_diff": diff, "same_keys": a.keys() == b.keys(), "steps": steps}))


def report(out: Path) -> None:
    """Reads what the stages wrote under `out`, prints one table, writes `out/gpu_check.json`."""
    result: dict = {"stages": [], "scaling": [], "precision": [], "distill": []}
    stages = out / "stages.jsonl"
    if stages.exists():
        result["stages"] = [json.loads(line) for line in stages.read_text().splitlines() if line.strip()]
    scaling = out / "scaling" / "results.json"
    if scaling.exists():
        data = json.loads(scaling.read_text())
        result["device"] = data["machine"].get("device_name")
        for p in data["points"]:
            lat = p.get("latency_ms") or {}
            result["scaling"].append({
                "resolution": p["resolution"], "batch": p["batch_size"], "model": p["label"],
                "latency_ms": lat.get("median"), "images_per_s": p.get("images_per_s"),
                "peak_memory_mb": p.get("peak_memory_mb"), "paired_ratio": p.get("paired_latency_ratio_vs_dinov3"),
                "flop_ratio": p.get("flop_ratio_vs_dinov3"), "error": p.get("error"),
            })  # fmt: skip
    precision = out / "precision.json"
    if precision.exists():
        result["precision"] = json.loads(precision.read_text())["rows"]
    result["all_ok"] = all(s["status"] in ("ok", "skipped") for s in result["stages"])
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")

    def cell(value, spec):
        return "-" if value is None else format(value, spec)

    print("\n| stage | status | seconds | detail |\n|---|---|---|---|")
    for s in result["stages"]:
        print(f"| {s['stage']} | {s['status']} | {cell(s.get('seconds'), '.0f')} | {s.get('detail', '')} |")
    if result["scaling"]:
        print("\n| res | batch | model | latency ms | img/s | peak MB | time / DINOv3 (paired) | FLOPs / DINOv3 |")
        print("|---|---|---|---|---|---|---|---|")
        for r in result["scaling"]:
            print(f"| {r['resolution']} | {r['batch']} | {r['model']} | {cell(r['latency_ms'], '.1f')} | "
                  f"{cell(r['images_per_s'], '.2f')} | {cell(r['peak_memory_mb'], '.0f')} | "
                  f"{cell(r['paired_ratio'] if 'VECA' in r['model'] else None, '.3f')} | "
                  f"{cell(r['flop_ratio'] if 'VECA' in r['model'] else None, '.3f')} |"
                  + (f" {r['error']}" if r["error"] else ""))  # fmt: skip
    if result["precision"]:
        print(
            "\n| model | check | res | min cos tokens | min cos pooler | rel err | ok |\n|---|---|---|---|---|---|---|"
        )
        for r in result["precision"]:
            print(f"| {r['model']} | {r['check']} | {r['resolution']} | {r['last_hidden_state_cosine_min']:.5f} | "
                  f"{r['pooler_output_cosine_min']:.5f} | {r['relative_error']:.1e} | {r['passed']} |")  # fmt: skip
    print(f"\nall stages ok or skipped: {result['all_ok']}; wrote {out / 'gpu_check.json'}")


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"workspace": lambda: workspace(Path(paths[0])), "compare": lambda: compare(Path(paths[0]), Path(paths[1])),
     "report": lambda: report(Path(paths[0]))}[command]()  # fmt: skip
