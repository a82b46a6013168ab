#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""How close reduced precision and the attention backends stay to the fp32 reference: VECA and DINOv3 side by side.

Checks (`--checks`), each against the same model in fp32 with SDPA on the same input:

- `bf16_autocast`: fp32 weights under `torch.autocast(device, torch.bfloat16)`;
- `bf16_weights`: the model and the input cast to bfloat16 (`model.to(torch.bfloat16)`);
- `eager_sdpa`: `attn_implementation="eager"` against `"sdpa"`, both in `--eager_sdpa_dtype` (the same weights).

Per check and resolution: the cosine similarity to the reference of every token of `last_hidden_state` (mean and min
over tokens) and of `pooler_output` (min over the batch), the relative error `||x - ref|| / ||ref||` of the whole
`last_hidden_state`, and the max absolute difference; a check passes when every min cosine is at least
`--min_cosine`. Random weights unless `--veca_model` / `--dinov3_model` name folders (any `AutoModel` for the
latter, e.g. a real DINOv2 teacher): random weights say how the kernels round, not how a trained model's features
move. Inputs are Gaussian noise unless `--images_dir` names a folder of images: then the first `--batch_size` of
them (sorted by name), resized and centre-cropped to each resolution by `VecaImageProcessorPil.for_resolution`
(ImageNet normalisation, as both models expect). On CPU the script first reports whether this CPU has fast bf16
(`veca_hf.cpu.hardware.cpu_bf16_support`).

    python benchmarks/precision_check.py --size veca-b16 --resolutions 224,512,1024 --threads 2
    python benchmarks/precision_check.py --device cuda --checks eager_sdpa --eager_sdpa_dtype bf16
    python benchmarks/precision_check.py --tiny --resolutions 64,96          # seconds
    python benchmarks/precision_check.py --veca_model STUDENT_DIR --dinov3_model TEACHER_DIR --images_dir PHOTOS \
        --resolutions 112,224 --batch_size 16 --budget 8                         # a trained pair on real photos
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import scaling
import torch
import torch.nn.functional as F

from veca_hf import VecaImageProcessorPil, VecaModel
from veca_hf.cpu.hardware import cpu_bf16_support


CHECKS = ("bf16_autocast", "bf16_weights", "eager_sdpa")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[224, 512])
    parser.add_argument("--budget", type=int, default=64)
    parser.add_argument("--batch_size", type=int, default=2)
    parser.add_argument("--checks", default=",".join(CHECKS), help=f"Comma-separated, among {', '.join(CHECKS)}.")
    parser.add_argument("--eager_sdpa_dtype", default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--min_cosine", type=float, default=0.999, help="Pass threshold for every min cosine.")
    parser.add_argument("--veca_model", default=None, help="A VecaModel folder (default: random weights).")
    parser.add_argument("--dinov3_model", default=None, help="An AutoModel folder (default: random DINOv3).")
    parser.add_argument("--images_dir", default=None, help="A folder of images to use as inputs (default: noise).")
    parser.add_argument("--bf16_probe_size", type=int, default=2048, help="CPU: torch.mm side timed (0: flags only).")
    parser.add_argument("--output", default=None, help="JSON file to write.")
    args = parser.parse_args(argv)
    args.checks = [c for c in args.checks.split(",") if c]
    unknown = set(args.checks) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}")
    return args


def build_models(args) -> dict[str, torch.nn.Module]:
    """VECA and DINOv3, fp32, eval, SDPA (from folders, or random weights of the same width and depth)."""
    from transformers import AutoModel, DINOv3ViTModel

    veca_config, dinov3_config = scaling.preset_configs(args.size, args.tiny, [args.budget])
    torch.manual_seed(args.seed)
    veca = (VecaModel.from_pretrained(args.veca_model, attn_implementation="sdpa") if args.veca_model
            else VecaModel(veca_config))  # fmt: skip
    dinov3 = (AutoModel.from_pretrained(args.dinov3_model, attn_implementation="sdpa") if args.dinov3_model
              else DINOv3ViTModel(dinov3_config))  # fmt: skip
    return {"VECA": veca.float().eval().to(args.device), "DINOv3": dinov3.float().eval().to(args.device)}


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
        processor = VecaImageProcessorPil.for_resolution(resolution)
        return processor(images, return_tensors="pt")["pixel_values"]
    generator = torch.Generator().manual_seed(args.seed)
    return torch.randn(args.batch_size, 3, resolution, resolution, generator=generator)


def with_attention(model: torch.nn.Module, implementation: str) -> torch.nn.Module:
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


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    machine: dict[str, Any] = {"torch_version": torch.__version__, "device": args.device,
                               "threads": torch.get_num_threads(),
                               "cpu_allocator": common.apply_cpu_allocator(args)}  # fmt: skip
    if args.device == "cpu":
        machine["bf16"] = cpu_bf16_support(args.bf16_probe_size or None)
        b = machine["bf16"]
        timing = f", torch.mm {b['mm_size']}^2 bf16/fp32 x{b['bf16_speedup']:.2f}" if b.get("mm_size") else ""
        print(f"CPU {b['cpu_model']}: bf16 flags {b['flags']}{timing}; fast bf16: {b['fast_bf16']}", flush=True)
    else:
        machine["device_name"] = torch.cuda.get_device_name()
    rows = []
    device = torch.device(args.device)
    models = build_models(args)
    images = load_images(args.images_dir, args.batch_size) if args.images_dir else None
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
                    else:
                        reference = model(x, **kwargs)
                        if check == "bf16_autocast":
                            context = torch.autocast(device.type, dtype=torch.bfloat16)
                            runner, inputs = model, x
                        else:
                            context = contextlib.nullcontext()
                            runner, inputs = copy.deepcopy(model).to(torch.bfloat16), x.to(torch.bfloat16)
                        with context:
                            output = runner(inputs, **kwargs)
                metrics = compare(output, reference)
                worst = min(metrics["last_hidden_state_cosine_min"], metrics["pooler_output_cosine_min"])
                row = {"model": name, "check": check, "resolution": resolution, **metrics,
                       "passed": worst >= args.min_cosine}  # fmt: skip
                rows.append(row)
                print(
                    f"{name:6s} {check:13s} {resolution:5d} px  cos tokens mean "
                    f"{row['last_hidden_state_cosine_mean']:.6f}"
                    f" min {row['last_hidden_state_cosine_min']:.6f}  pooler min {row['pooler_output_cosine_min']:.6f}"
                    f"  rel err {row['relative_error']:.2e}  "
                    f"{'ok' if row['passed'] else 'BELOW ' + str(args.min_cosine)}",
                    flush=True,
                )
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "weights": {"VECA": args.veca_model or "random", "DINOv3": args.dinov3_model or "random"},
        "inputs": args.images_dir or "gaussian noise",
        "rows": rows,
        "all_passed": all(r["passed"] for r in rows),
    }
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
    print(f"all checks at or above cosine {args.min_cosine}: {result['all_passed']}")
    return result


if __name__ == "__main__":
    main()
