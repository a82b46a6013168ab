#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""A whole distillation step in images/s, with its breakdown: teacher forward, student forward + backward, optimiser.

The step is `examples/distill.py`'s, without data loading: `compute_teacher_targets` (the frozen teacher, optionally
under bf16 autocast), `StudentWithLoss` (the student and `DistillationLoss`), `backward`, AdamW `step` and
`zero_grad`. Students: VECA at each `--budgets` value and the dense control (`dense_student_config`, a
`DINOv3ViTModel` of the same size), timed interleaved as in `benchmarks/scaling.py`: after the warm-up, each of the
`--repeats` rounds runs, per resolution, every student's step back to back (the order rotated by one every round);
every ratio to the dense student is also reported paired (median over the rounds of the ratio within one round).

The teacher: a random DINOv3 of the student's width (the release the preset is distilled from: 4 registers, plain
MLP, patch 16), or `--teacher` (any `AutoModel` folder, e.g. a real DINOv2; a patch size of 14 makes it see the
image resized to the same grid). Before timing, per resolution, the targets of the teacher in bf16 autocast are
compared with fp32 (`cosine` of the CLS target, min over the batch, and of the patch targets, mean and min over
tokens): `--teacher_dtype bf16` is accepted as is only when every min cosine is at least `--teacher_min_cosine`;
the script says so either way.

    python benchmarks/distill_step.py --size veca-b16 --resolutions 224,512 --batch_size 8 --threads 2
    python benchmarks/distill_step.py --tiny --resolutions 64,96 --batch_size 2 --warmup 0 --repeats 2   # seconds
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import scaling
import scaling_measure
import torch
import torch.nn.functional as F

from veca_hf import VecaModel
from veca_hf.cpu.hardware import warn_if_slow_bf16
from veca_hf.training.distillation import (
    DistillationLoss,
    StudentWithLoss,
    compute_teacher_targets,
    dense_student_config,
)
from veca_hf.training.optimization import get_parameter_groups


DENSE = "dense"
PARTS = ("teacher", "student_forward_backward", "optimizer")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(__doc__.split("\n\n")[0], resolutions=[224, 512])
    parser.add_argument("--budgets", type=common.int_list, default=[8, 64])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16_autocast"], help="The student's precision.")
    parser.add_argument("--teacher", default=None, help="AutoModel folder (default: a random DINOv3 of this width).")
    parser.add_argument("--teacher_dtype", default="fp32", choices=["fp32", "bf16"], help="bf16: autocast.")
    parser.add_argument("--teacher_min_cosine", type=float, default=0.999)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--learning_rate", type=float, default=1e-5)
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args(argv)
    if args.output_dir is None:
        name = f"{args.size}_distill_step_{args.device}_{args.dtype}_teacher_{args.teacher_dtype}"
        args.output_dir = str(Path(__file__).resolve().parent / "results" / (name + ("_tiny" if args.tiny else "")))
    return args


def build(args, device):
    """Teacher (eval, fp32), and per student `(label, StudentWithLoss, optimizer, budget)`."""
    from transformers import AutoModel, DINOv3ViTModel

    veca_config, dinov3_config = scaling.preset_configs(args.size, args.tiny, args.budgets)
    torch.manual_seed(args.seed)
    teacher = AutoModel.from_pretrained(args.teacher) if args.teacher else DINOv3ViTModel(dinov3_config)
    teacher = teacher.float().eval().to(device).requires_grad_(False)
    width, teacher_width = veca_config.hidden_size, teacher.config.hidden_size
    dense_config = dense_student_config(veca_config)
    students = []
    for label, student, budget in [(DENSE, DINOv3ViTModel(dense_config), None)] + [
        (f"VECA C={c}", None, c) for c in args.budgets
    ]:
        if student is None:
            student = VecaModel(veca_config)
        module = StudentWithLoss(student, DistillationLoss(width, teacher_width)).to(device).train()
        optimizer = torch.optim.AdamW(get_parameter_groups(module, 0.05), lr=args.learning_rate)
        students.append((label, module, optimizer, budget))
    return teacher, students, veca_config.patch_size


def target_agreement(teacher, x, patch_size) -> dict[str, float]:
    """Cosine of the bf16-autocast teacher's targets to the fp32 ones."""
    with torch.inference_mode():
        fp32 = compute_teacher_targets(teacher, x, patch_size)
        bf16 = compute_teacher_targets(teacher, x, patch_size, autocast_dtype=torch.bfloat16)
    cls = F.cosine_similarity(bf16.cls, fp32.cls, dim=-1)  # (B,)
    patches = F.cosine_similarity(bf16.patches, fp32.patches, dim=-1)  # (B, N)
    return {"cls_cosine_min": cls.min().item(), "patch_cosine_mean": patches.mean().item(),
            "patch_cosine_min": patches.min().item()}  # fmt: skip


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    allocator = common.apply_cpu_allocator(args)
    machine = scaling_measure.machine_info(argparse.Namespace(device=args.device, bf16_probe_size=0))
    machine["cpu_allocator"] = allocator
    teacher, students, patch_size = build(args, device)
    teacher_autocast = torch.bfloat16 if args.teacher_dtype == "bf16" else None
    for flag, value in (("--dtype", args.dtype), ("--teacher_dtype", args.teacher_dtype)):
        if value.startswith("bf16"):
            warn_if_slow_bf16(device, f"{flag} {value}")

    def student_context():
        if args.dtype == "bf16_autocast":
            return torch.autocast(device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def part_times(module, optimizer, budget, x) -> dict[str, float]:
        """One distillation step, timed in its three parts (synchronised on CUDA)."""
        times = {}
        start = time.perf_counter()
        targets = compute_teacher_targets(teacher, x, patch_size, autocast_dtype=teacher_autocast)
        scaling_measure.synchronize(device)
        times["teacher"] = time.perf_counter() - start
        start = time.perf_counter()
        with student_context():
            loss = module(x, budget, targets.cls, targets.patches)["loss"]
        loss.backward()
        scaling_measure.synchronize(device)
        times["student_forward_backward"] = time.perf_counter() - start
        start = time.perf_counter()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scaling_measure.synchronize(device)
        times["optimizer"] = time.perf_counter() - start
        return times

    inputs, agreement = {}, {}
    for resolution in args.resolutions:
        generator = torch.Generator().manual_seed(args.seed)
        inputs[resolution] = torch.randn(args.batch_size, 3, resolution, resolution, generator=generator).to(device)
        agreement[resolution] = target_agreement(teacher, inputs[resolution], patch_size)
        worst = min(agreement[resolution]["cls_cosine_min"], agreement[resolution]["patch_cosine_min"])
        agreement[resolution]["within_tolerance"] = worst >= args.teacher_min_cosine
        print(f"{resolution} px: bf16 vs fp32 teacher targets: {agreement[resolution]}", flush=True)

    samples: dict[tuple, list[dict[str, float]]] = {(r, s[0]): [] for r in args.resolutions for s in students}
    for round_index in range(args.warmup + args.repeats):
        shift = round_index % len(students)
        for resolution in args.resolutions:
            for label, module, optimizer, budget in students[shift:] + students[:shift]:  # rotated, as scaling.py
                times = part_times(module, optimizer, budget, inputs[resolution])
                if round_index >= args.warmup:
                    samples[(resolution, label)].append(times)

    points = []
    for resolution in args.resolutions:
        dense_totals = [sum(t.values()) for t in samples[(resolution, DENSE)]]
        for label, _, _, budget in students:
            rounds = samples[(resolution, label)]
            totals = [sum(t.values()) for t in rounds]
            median = statistics.median(totals)
            breakdown = {part: statistics.median(t[part] for t in rounds) for part in PARTS}
            point = {
                "resolution": resolution, "student": label, "budget": budget, "batch_size": args.batch_size,
                "step_s": {"median": median, "min": min(totals), "max": max(totals), "samples": totals},
                "images_per_s": args.batch_size / median,
                "breakdown_s": breakdown,
                "breakdown_share": {part: breakdown[part] / sum(breakdown.values()) for part in PARTS},
                "parts_samples": rounds,
                "ratio_vs_dense": median / statistics.median(dense_totals),
                "paired_ratio_vs_dense": scaling_measure.paired_median(totals, dense_totals),
            }  # fmt: skip
            points.append(point)
            shares = ", ".join(f"{part} {100 * v:.0f}%" for part, v in point["breakdown_share"].items())
            print(f"{resolution:5d} px {label:10s} {point['images_per_s']:8.2f} img/s  step {median:.3f} s "
                  f"({shares})  x{point['paired_ratio_vs_dense']:.3f} dense (paired)", flush=True)  # fmt: skip
    bf16_ok = all(a["within_tolerance"] for a in agreement.values())
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "teacher": {
            "source": args.teacher or "random DINOv3",
            "hidden_size": teacher.config.hidden_size,
            "dtype": args.teacher_dtype,
        },  # fmt: skip
        "teacher_bf16_vs_fp32": {str(r): a for r, a in agreement.items()},
        "teacher_bf16_within_tolerance": bf16_ok,
        "points": points,
    }
    common.write_results(output_dir, result)
    verdict = "within" if bf16_ok else "NOT within"
    print(f"bf16 teacher targets {verdict} min cosine {args.teacher_min_cosine} of fp32"
          + ("" if args.teacher_dtype == "bf16" or bf16_ok else " (the run used fp32)"))  # fmt: skip
    print(f"wrote {output_dir}")
    return result


if __name__ == "__main__":
    main()
