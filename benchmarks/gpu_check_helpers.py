#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Helpers of `benchmarks/gpu_check.sh` (no Hub needed):

python benchmarks/gpu_check_helpers.py workspace DIR       # tiny random DINOv3 teacher, student config, images
python benchmarks/gpu_check_helpers.py compare RUN_A RUN_B # max |difference| of two saved students' weights
python benchmarks/gpu_check_helpers.py kernels OUT [--dry_run]  # each attention kernel: forward and training step
python benchmarks/gpu_check_helpers.py report OUT          # the compact table, and OUT/gpu_check.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
from common import fmt


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


def available_kernels(dry_run: bool) -> dict[str, str | None]:
    """Attention kernels to time, each with the reason it is skipped (`None`: it runs)."""
    import importlib.util

    import torch

    if dry_run:  # the CPU path: flex compiles for minutes on CPU, and is tested against sdpa in the suite
        return {"sdpa": None, "eager": None}
    kernels = {"sdpa": None}
    for name, package in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")):
        kernels[name] = None if importlib.util.find_spec(package) else f"the {package} package is not installed"
        if not torch.cuda.is_available():
            kernels[name] = "needs CUDA"
    kernels["flex_attention"] = None  # last: it compiles for every new shape, and the stage has a time limit
    return kernels


def _kernel_call(model, kwargs: dict, pixel_values, optimizer) -> None:
    """One timed call: a bf16 forward without an optimizer, else a training step under bf16 autocast."""
    import torch

    if optimizer is None:
        with torch.inference_mode():
            model(pixel_values.to(torch.bfloat16), **kwargs)
        return
    with torch.autocast(pixel_values.device.type, dtype=torch.bfloat16):
        loss = model(pixel_values, **kwargs).last_hidden_state.float().pow(2).mean()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def kernels(out: Path, dry_run: bool) -> None:
    """VECA-B (C = 8 and 64) and DINOv3-B under each attention kernel at 224/512/1024 px, batch 8 (tiny models at
    64 px, batch 2, on CPU for `--dry_run`): a bf16 forward (weights in bf16) and a training step (fp32 weights under
    bf16 autocast: forward, backward, AdamW), timed in interleaved rounds after one warm-up round (flex compiles
    there). Rows go to `out/kernels.json` as they are measured, so a stage cut by its time limit keeps what it
    measured; a kernel or case that cannot run is a row saying why."""
    import copy
    import statistics

    import torch
    from transformers import DINOv3ViTModel

    from veca_hf import VecaModel

    device = torch.device("cpu" if dry_run else "cuda")
    resolutions, batch, repeats = ([64], 2, 2) if dry_run else ([224, 512, 1024], 8, 5)
    veca_config, dinov3_config = common.model_configs("veca-b16", dry_run, [8, 64])
    rows: list[dict] = []

    def add(new_rows: list[dict]) -> None:
        rows.extend(new_rows)
        (out / "kernels.json").write_text(json.dumps(rows, indent=2) + "\n")
        print(new_rows, flush=True)

    for kernel, skip in available_kernels(dry_run).items():
        if skip:
            add([{"kernel": kernel, "skipped": skip}])
            continue
        torch.manual_seed(0)
        trained = {"DINOv3": DINOv3ViTModel(dinov3_config), "VECA": VecaModel(veca_config)}
        for model in trained.values():
            model.set_attn_implementation(kernel)
            model.to(device).train()
        inference = {name: copy.deepcopy(model).to(torch.bfloat16).eval() for name, model in trained.items()}
        optimizers = {name: torch.optim.AdamW(model.parameters(), lr=1e-6) for name, model in trained.items()}
        cases = {"DINOv3": ("DINOv3", {}), "VECA C=8": ("VECA", {"num_core_tokens": 8})}
        cases["VECA C=64"] = ("VECA", {"num_core_tokens": 64})
        for resolution in resolutions:
            pixel_values = torch.randn(batch, 3, resolution, resolution, device=device)
            for mode in ("forward", "train"):
                errors: dict[str, str] = {}

                def guarded(name: str, model, kwargs: dict, optimizer, pixel_values=pixel_values, errors=errors):
                    def call() -> None:
                        try:
                            if name not in errors:
                                _kernel_call(model, kwargs, pixel_values, optimizer)
                        except Exception as error:  # recorded in the table; the other cases go on
                            errors[name] = f"{type(error).__name__}: {str(error)[:200]}"

                    return call

                # round 0 warms up (flex compiles there)
                calls = {}
                for name, (model_name, kwargs) in cases.items():
                    model = (inference if mode == "forward" else trained)[model_name]
                    calls[name] = guarded(name, model, kwargs, None if mode == "forward" else optimizers[model_name])
                times = common.interleaved(calls, repeats, device, warmup=1)
                new_rows = []
                for name in cases:
                    row = {"kernel": kernel, "resolution": resolution, "batch": batch, "mode": mode, "model": name}
                    if name in errors:
                        row["error"] = errors[name]
                    else:
                        row["ms"] = 1e3 * statistics.median(times[name])
                        if name != "DINOv3" and "DINOv3" not in errors:
                            row["ratio_vs_dinov3"] = common.paired_median(times[name], times["DINOv3"])
                    new_rows.append(row)
                add(new_rows)


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
    kernel_rows = out / "kernels.json"
    result["kernels"] = json.loads(kernel_rows.read_text()) if kernel_rows.exists() else []
    precision = out / "precision" / "results.json"
    if precision.exists():
        result["precision"] = json.loads(precision.read_text())["rows"]
    result["all_ok"] = all(s["status"] in ("ok", "skipped") for s in result["stages"])
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2) + "\n")

    def table(columns: str, rows: list[list]) -> None:
        print("\n" + "\n".join(common.table(columns.split(" | "), rows)))

    table(
        "stage | status | seconds | detail",
        [[s["stage"], s["status"], fmt(s.get("seconds"), ".0f"), s.get("detail", "")] for s in result["stages"]],
    )
    if result["scaling"]:
        table("res | batch | model | latency ms | img/s | peak MB | time / DINOv3 (paired) | FLOPs / DINOv3 | error",
              [[r["resolution"], r["batch"], r["model"], fmt(r["latency_ms"], ".1f"), fmt(r["images_per_s"], ".2f"),
                fmt(r["peak_memory_mb"], ".0f"), fmt(r["paired_ratio"] if "VECA" in r["model"] else None, ".3f"),
                fmt(r["flop_ratio"] if "VECA" in r["model"] else None, ".3f"), r["error"] or ""]
               for r in result["scaling"]])  # fmt: skip
    if result["kernels"]:
        table("kernel | res | batch | mode | model | ms | time / DINOv3 (paired) | note",
              [[r["kernel"], r.get("resolution", "-"), r.get("batch", "-"), r.get("mode", "-"), r.get("model", "-"),
                fmt(r.get("ms"), ".1f"), fmt(r.get("ratio_vs_dinov3"), ".3f"),
                r.get("skipped") or r.get("error") or ""]
               for r in result["kernels"]])  # fmt: skip
    if result["precision"]:
        table("model | check | res | min cos tokens | min cos pooler | rel err | ok",
              [[r["model"], r["check"], r["resolution"], f"{r['last_hidden_state_cosine_min']:.5f}",
                f"{r['pooler_output_cosine_min']:.5f}", f"{r['relative_error']:.1e}", r["passed"]]
               for r in result["precision"]])  # fmt: skip
    print(f"\nall stages ok or skipped: {result['all_ok']}; wrote {out / 'gpu_check.json'}")


if __name__ == "__main__":
    command, *paths = sys.argv[1:]
    {"workspace": lambda: workspace(Path(paths[0])), "compare": lambda: compare(Path(paths[0]), Path(paths[1])),
     "kernels": lambda: kernels(Path(paths[0]), dry_run="--dry_run" in paths),
     "report": lambda: report(Path(paths[0]))}[command]()  # fmt: skip
