#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Scaling benchmark: VECA against a transformers `DINOv3ViTModel` of the same width and depth.

Both models have random weights. The DINOv3 config copies VECA's hidden size, depth and heads and takes the MLP of
the matching DINOv3 release (intermediate 1536 for S, 3072 for B, 4096 for L; plain GELU MLP), 4 register tokens,
patch 16. Both use the same attention implementation (`--attn_implementation`, default `sdpa`). Per mode, batch
size, resolution and model (DINOv3, and VECA at every budget) it records latency (median, min, max, and the ratio to
DINOv3 as the ratio of the medians and paired within the interleaved rounds), analytic and counted FLOPs, images/s,
the fraction of the GEMM throughput, the share of time in attention, memory peaks and minor page faults. How each
is measured: "How the scaling benchmark measures" in docs/performance.md.

Modes:
- `model`: the whole forward, `veca(pixel_values, num_core_tokens=C)` vs `dinov3(pixel_values)`.
- `block`: one attention block as in the paper's Table S.14 (q/k/v/o projections + attention, no norm, no MLP):
  `VecaCorePeripheryAttention` on `(B, C + N, D)` hidden states vs transformers' `DINOv3ViTAttention` on
  `(B, 5 + N, D)`.
- `both`: the two, one after the other.
- `train`: one training step of the student alone (forward, backward, AdamW unless `--no_optimizer_step`), VECA at
  each budget vs the dense student of `veca_hf.training.distillation.dense_student_config` (reported as DINOv3),
  with the training targets (MET / NOT MET).

Outputs in `--output_dir`: `results.json` (machine, command line, GEMM reference, every point, summary),
`results.md` (a table per mode and batch size, and the summary), `latency_vs_resolution.png` and
`flops_vs_resolution.png` (log-log; one line per VECA budget plus DINOv3; a row per mode, a column per batch size).
The cases live in `scaling_cases.py`, the measurements in `scaling_measure.py`, the report in `scaling_report.py`.

Examples:

    # CPU, VECA-B, the default grid (run it on a quiet machine)
    python benchmarks/scaling.py --size veca-b16 --threads 8 --output_dir benchmarks/results/b16_cpu_fp32
    # the attention block only, as Table S.14
    python benchmarks/scaling.py --size veca-b16 --mode block --batch_sizes 8 --output_dir benchmarks/results/b16_block
    # GPU, bf16, up to 2048 px
    python benchmarks/scaling.py --size veca-l16 --device cuda --dtype bf16 \
        --resolutions 256,512,1024,1536,2048 --batch_sizes 1,8 --output_dir benchmarks/results/l16_cuda_bf16
    # seconds-long smoke run: tiny widths
    python benchmarks/scaling.py --tiny --resolutions 64,96 --budgets 8,16 --warmup 0 --repeats 1 --gemm_size 128
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout
import torch
from scaling_cases import DINOV3, DTYPES, GEMM_DTYPES, build_cases
from scaling_measure import (
    cpu_has_fast_bf16,
    cuda_forward_peak_bytes,
    loadavg,
    machine_info,
    make_gemm,
    measure_gemm,
    merge_profiles,
    minor_page_faults,
    paired_median,
    param_bytes,
    profile_call,
    time_call,
)
from scaling_report import markdown, one_line, plot, summarize, summary_lines, train_target_lines, train_targets

from veca_hf import VecaConfig
from veca_hf.cpu.hardware import slow_bf16_warning
from veca_hf.flops import num_patches_for
from veca_hf.training.distillation import dense_student_config


# MLP width of the DINOv3 release that each VECA size is distilled from (DINOv3-S/16, -B/16, -L/16: 4 x hidden).
DINOV3_INTERMEDIATE = {"veca-s16": 1536, "veca-b16": 3072, "veca-l16": 4096}
# `--tiny`: the same architecture at width 64, depth 2, 2 heads (smoke tests).
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, intermediate_size=170)
TINY_DINOV3_INTERMEDIATE = 256
MIB = 2**20


# --- command line --------------------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(
        "VECA vs DINOv3 (same width and depth): latency, FLOPs, memory and attention share.",
        resolutions=[256, 384, 512, 768, 1024],
    )
    parser.add_argument("--budgets", type=common.int_list, default=[8, 16, 32, 64], help="VECA budgets C.")
    parser.add_argument("--batch_sizes", type=common.int_list, default=[1])
    parser.add_argument(
        "--num_hidden_layers", type=int, default=None, help="Depth of both models (default: the preset's)."
    )
    parser.add_argument(
        "--dtype",
        default="fp32",
        choices=sorted(DTYPES),
        help="fp32; bf16: weights and inputs cast to bfloat16 (inference only); bf16_autocast: fp32 weights under "
        "torch.autocast(device, torch.bfloat16) (inference and training).",
    )
    parser.add_argument(
        "--mode",
        default="model",
        choices=["model", "block", "both", "train"],
        help="model: whole forward; block: one attention block; both: model then block; train: one training step "
        "of the student alone (forward, backward, optimiser) vs the same-size dense student.",
    )
    parser.add_argument(
        "--no_optimizer_step",
        action="store_true",
        help="Train mode: time forward + backward only (no AdamW step).",
    )
    parser.add_argument("--learning_rate", type=float, default=1e-5, help="Train mode: AdamW learning rate.")
    parser.add_argument(
        "--bf16_probe_size",
        type=int,
        default=2048,
        help="CPU: side of the fp32 and bf16 torch.mm timed to tell whether this CPU has fast bf16 (0: flags only).",
    )
    parser.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"], help="For both models.")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed calls per model and point.")
    parser.add_argument("--repeats", type=int, default=5, help="Timed calls per model and point (interleaved).")
    parser.add_argument("--gemm_size", type=int, default=4096, help="Side of the square torch.mm GEMM reference.")
    parser.add_argument("--gemm_repeats", type=int, default=5, help="Timed GEMMs at the start and again at the end.")
    parser.add_argument(
        "--profile_repeats", type=int, default=3, help="Profiled calls per point (attention share: their median)."
    )
    parser.add_argument("--no_profile", action="store_true", help="Skip profiling (attention share, CPU memory).")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="Model mode: time torch.compile(model, dynamic=True) of both models (inductor; the warm-up compiles). "
        "Implies --no_profile (the profiler's module hooks do not fire inside compiled graphs).",
    )
    parser.add_argument("--compile_backend", default="inductor", help="torch.compile backend for --compile.")
    parser.add_argument(
        "--compile_mode",
        default=None,
        choices=["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"],
        help="torch.compile mode for --compile (max-autotune: inductor's tuned GEMM templates; compiles longer).",
    )
    parser.add_argument(
        "--cpu_inference_buffers",
        action="store_true",
        help="Model mode: run VECA inside veca_hf.cpu.buffers.cpu_inference_buffers (blocks share their large "
        "projection outputs; docs/performance.md).",
    )
    parser.add_argument("--no_plots", action="store_true")
    parser.add_argument(
        "--output_dir", default=None, help="Default: benchmarks/results/<size>_<mode>_<device>_<dtype>[_tiny]."
    )
    args = parser.parse_args(argv)
    if args.warmup < 0 or args.repeats < 1 or args.profile_repeats < 1:
        parser.error("--warmup must be >= 0, --repeats and --profile_repeats >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda but torch.cuda.is_available() is False")
    for resolution in args.resolutions:
        if resolution % 16:
            parser.error(f"resolution {resolution} is not a multiple of the patch size 16")
    if args.mode == "train" and args.dtype == "bf16":
        parser.error("--mode train takes --dtype fp32 or bf16_autocast (bf16 weights have no fp32 master copy)")
    if args.compile:
        if args.mode != "model":
            parser.error("--compile applies to --mode model only")
        args.no_profile = True
    if args.output_dir is None:
        name = f"{args.size}_{args.mode}_{args.device}_{args.dtype}" + ("_compiled" if args.compile else "")
        name += "_tiny" if args.tiny else ""
        args.output_dir = str(Path(__file__).resolve().parent / "results" / name)
    return args


# --- configs -------------------------------------------------------------------------------------------------------


def build_configs(args: argparse.Namespace):
    """VECA config of the preset (or `--tiny`) and a DINOv3 config of the same width, depth and heads."""
    from transformers import DINOv3ViTConfig

    overrides = dict(TINY) if args.tiny else {}
    if args.num_hidden_layers is not None:
        overrides["num_hidden_layers"] = args.num_hidden_layers
    veca_config = VecaConfig.from_preset(args.size, **overrides)
    for budget in args.budgets:
        veca_config.check_budget(budget, name="--budgets")
    dinov3_config = DINOv3ViTConfig(
        hidden_size=veca_config.hidden_size,
        num_hidden_layers=veca_config.num_hidden_layers,
        num_attention_heads=veca_config.num_attention_heads,
        intermediate_size=TINY_DINOV3_INTERMEDIATE if args.tiny else DINOV3_INTERMEDIATE[args.size],
        patch_size=veca_config.patch_size,
        num_register_tokens=4,
        image_size=224,
    )
    for config in (veca_config, dinov3_config):
        config._attn_implementation = args.attn_implementation
    return veca_config, dinov3_config


def preset_configs(size: str, tiny: bool, budgets: list[int], num_hidden_layers: int | None = None):
    """`build_configs` for the other benchmark scripts: the preset `size` (or `--tiny`), default settings otherwise."""
    argv = ["--size", size, "--budgets", ",".join(map(str, budgets)), "--output_dir", "unused"]
    argv += ["--tiny"] if tiny else []
    argv += ["--num_hidden_layers", str(num_hidden_layers)] if num_hidden_layers is not None else []
    return build_configs(parse_args(argv))


# --- the benchmark -------------------------------------------------------------------------------------------------


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error).lower()


def _release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_mode(mode, args, veca_config, dinov3_config, device, dtype, log) -> list[dict]:
    cases = build_cases(mode, args, veca_config, dinov3_config, device, dtype)
    # NOTE: the GEMM reference is timed inside the interleaved rounds too: on a shared machine the throughput drifts
    # (82 and 129 GFLOP/s at the start and end of one run here), and the points are compared with their own rounds.
    gemm, gemm_flops = make_gemm(args.gemm_size, GEMM_DTYPES[args.dtype], device)
    points: list[dict] = []
    for batch in args.batch_sizes:
        # NOTE: every resolution runs in the same rounds, so that ratios across resolutions (latency per token) are
        # paired in time as the VECA/DINOv3 ratios are.
        keys = [(resolution, case) for resolution in args.resolutions for case in cases]
        log(f"[{mode}] batch {batch}, resolutions {', '.join(map(str, args.resolutions))} px, interleaved")
        calls: dict[tuple, Callable | None] = {}
        errors: dict[tuple, str] = {}

        def attempt(key, action, errors=errors, calls=calls):
            try:
                return action()
            except Exception as error:  # noqa: BLE001 - record OOM (or anything) and go on
                if not _is_oom(error) and not isinstance(error, RuntimeError):
                    raise
                errors[key] = f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
                calls[key] = None
                _release(device)
                return None

        # NOTE: train mode needs autograd; the others run without it.
        with torch.inference_mode() if mode != "train" else contextlib.nullcontext():
            for resolution, case in keys:
                key = (resolution, case.label)
                calls[key] = attempt(key, lambda r=resolution, case=case, batch=batch: case.make_call(r, batch))
            first_call: dict[tuple, float] = {}  # the first warm-up call's seconds: with --compile, the compile too
            for _ in range(args.warmup):
                for key, call in calls.items():
                    if call is not None:
                        start = time.perf_counter()
                        attempt(key, call)
                        first_call.setdefault(key, time.perf_counter() - start)
            # One round: the GEMM, then per resolution DINOv3 and each budget (rotated). Lists are indexed by round;
            # None where a call failed.
            samples: dict[tuple, list[float | None]] = {key: [] for key in calls}
            faults: dict[tuple, list[int]] = {key: [] for key in calls}
            gemm_samples = []
            order = list(calls)
            for round_index in range(args.repeats):
                gemm_samples.append(gemm_flops / time_call(gemm, device))
                shift = round_index % len(order)
                for key in order[shift:] + order[:shift]:  # rotated: no point always follows the same one
                    call = calls[key]
                    seconds = None
                    if call is not None:
                        faults_before = minor_page_faults()
                        seconds = attempt(key, lambda call=call: time_call(call, device))
                        if seconds is not None and faults_before is not None:
                            faults[key].append(minor_page_faults() - faults_before)
                    samples[key].append(seconds)
            extra: dict[tuple, dict] = {key: {"first_call_s": first_call.get(key)} for key in calls}
            for resolution, case in keys:
                key = (resolution, case.label)
                call = calls[key]
                if call is None:
                    continue
                if device.type == "cuda":
                    peak = attempt(key, lambda call=call: cuda_forward_peak_bytes(call, device))
                    extra[key]["forward_peak_bytes"] = peak
                if not args.no_profile:
                    runs = [
                        attempt(key, lambda call=call, case=case: profile_call(call, case.module, device))
                        for _ in range(args.profile_repeats)
                    ]
                    if all(runs):
                        extra[key].update(merge_profiles(runs, device))

        gemm_reference = statistics.median(gemm_samples)
        for resolution in args.resolutions:
            num_patches = num_patches_for(resolution, resolution, veca_config.patch_size)
            log(f"    {resolution} px (N = {num_patches})")
            mode_points = []
            for case in cases:
                key = (resolution, case.label)
                if mode == "model":
                    input_bytes = batch * 3 * resolution**2 * dtype.itemsize
                else:
                    input_bytes = batch * case.num_tokens(resolution) * veca_config.hidden_size * dtype.itemsize
                analytic = case.analytic_flops(resolution, batch)
                counted = case.counted_flops(resolution, batch)
                rounds = samples[key]
                times = [t for t in rounds if t is not None]
                point: dict[str, Any] = {
                    "mode": mode,
                    "batch_size": batch,
                    "resolution": resolution,
                    "num_patches": num_patches,
                    "model": case.model,
                    "budget": case.budget,
                    "label": case.label,
                    "num_tokens": case.num_tokens(resolution),
                    "flops_analytic": analytic,
                    "flops_counted": counted,
                    "flops_match": analytic == counted,
                    "error": errors.get(key),
                }
                if times:
                    median = statistics.median(times)
                    achieved = analytic / median
                    point.update(
                        latency_ms={
                            "median": 1e3 * median,
                            "min": 1e3 * min(times),
                            "max": 1e3 * max(times),
                            "samples": [None if t is None else 1e3 * t for t in rounds],  # one per round
                        },
                        images_per_s=batch / median,
                        achieved_gflops_per_s=achieved / 1e9,
                        gemm_reference_gflops_per_s=gemm_reference / 1e9,
                        gemm_fraction=achieved / gemm_reference,
                        latency_per_token_us=1e6 * median / (batch * case.num_tokens(resolution)),
                        minor_page_faults_per_call=statistics.median(faults[key]) if faults[key] else None,
                    )
                else:
                    point["latency_ms"] = None
                peak = extra[key].get("forward_peak_bytes")
                weights = param_bytes(case.module)
                point.update(
                    first_call_s=extra[key]["first_call_s"],  # with --compile: compile + one call
                    attention_module_share=extra[key].get("attention_module_share"),
                    attention_core_share=extra[key].get("attention_core_share"),
                    forward_peak_mb=None if peak is None else peak / MIB,
                    weights_mb=weights / MIB,
                    peak_memory_mb=None if peak is None else (peak + weights + input_bytes) / MIB,
                    memory_method=(
                        "torch.cuda.max_memory_allocated - allocated before the call"
                        if device.type == "cuda"
                        else ("torch.profiler allocation events (running max)" if peak is not None else None)
                    ),
                )
                mode_points.append(point)

            dense = next(p for p in mode_points if p["model"] == DINOV3)
            dense_rounds = samples[(resolution, DINOV3)]
            for point in mode_points:
                point["flop_ratio_vs_dinov3"] = point["flops_analytic"] / dense["flops_analytic"]
                both = point["latency_ms"] and dense["latency_ms"]
                point["latency_ratio_vs_dinov3"] = (
                    point["latency_ms"]["median"] / dense["latency_ms"]["median"] if both else None
                )
                point["paired_latency_ratio_vs_dinov3"] = paired_median(
                    samples[(resolution, point["label"])], dense_rounds
                )
                log("    " + one_line(point))
            points.extend(mode_points)
        calls.clear()
        _release(device)
    return points


# --- main ----------------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = DTYPES[args.dtype]
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)

    def log(message: str) -> None:
        print(message, flush=True)

    veca_config, dinov3_config = build_configs(args)
    modes = ["model", "block"] if args.mode == "both" else [args.mode]
    allocator = common.apply_cpu_allocator(args)
    machine = machine_info(args)
    machine["cpu_allocator"] = allocator
    log(
        f"device {machine['device_name']}, torch {machine['torch_version']}, {machine['torch_num_threads']} threads, "
        f"glibc malloc settings: {'veca_hf' if allocator['tuned'] else 'default'} ({allocator['reason']})"
    )

    gemm_dtype = GEMM_DTYPES[args.dtype]
    if machine.get("bf16"):
        bf16 = machine["bf16"]
        timing = (
            f"; torch.mm {bf16['mm_size']}^2 fp32 {bf16['fp32_gflops_per_s']:.1f}, {bf16['bf16_mm_size']}^2 bf16 "
            f"{bf16['bf16_gflops_per_s']:.1f} GFLOP/s; F.linear fp32 {bf16['linear_fp32_gflops_per_s']:.1f}, bf16 "
            f"{bf16['linear_bf16_gflops_per_s']:.1f} GFLOP/s"
            if bf16.get("mm_size")
            else ""
        )
        log(f"CPU {bf16['cpu_kind']}: flags {bf16['flags']}{timing}; fast bf16: {bf16['fast_bf16']}")
    gemm_start = measure_gemm(args.gemm_size, gemm_dtype, device, args.gemm_repeats)
    log(f"GEMM {args.gemm_size}^2 {args.dtype}: {statistics.median(gemm_start) / 1e9:.1f} GFLOP/s (start)")

    notes = [
        "Random weights. dtype bf16 = models and inputs cast to bfloat16 (no autocast); bf16_autocast = fp32 "
        "weights under torch.autocast(device, torch.bfloat16) (the GEMM reference then runs in bf16).",
        "FLOPs count matmuls/linears/convs only (multiply-add = 2), as torch.utils.flop_counter does; counted on the "
        "meta device under sdpa_kernel(SDPBackend.MATH) because the counter does not see the CPU flash SDPA kernel.",
        "Attention share comes from a profiled run (profiler overhead included); the timed runs have no hooks.",
    ]
    if "train" in modes:
        notes.append(
            "Train mode: one step of the student alone (StudentWithLoss with DistillationLoss against fixed random "
            "targets, backward, " + ("no optimiser step" if args.no_optimizer_step else "AdamW step") + "), VECA vs "
            "the dense student of veca_hf.training.distillation.dense_student_config (DINOv3ViTModel, same width, "
            "depth and SwiGLU MLP, CLS, no registers), both in train mode. Training FLOPs: analytic 3 x forward - "
            "patch embedding (its input needs no gradient), which is what the counter measures; the optimiser step "
            "and the loss are elementwise and not counted. The attention share is that of the forward's attention "
            "modules in the whole step."
        )
    if device.type == "cpu" and gemm_dtype == torch.bfloat16 and cpu_has_fast_bf16(machine) is False:
        # The F.linear rates are measured now (veca_hf.cpu.hardware); machine["bf16"] holds torch.mm's.
        warning = (
            f"--dtype {args.dtype}: "
            + (slow_bf16_warning(device) or "this CPU's torch.mm ran slower in bf16 than in fp32.")
            + " The bf16 timings below mostly measure those fallback kernels, and the GEMM fraction can exceed 1."
        )
        notes.append(warning)
        log("WARNING: " + warning)
    if device.type == "cpu":
        notes.append(
            "CPU memory: from torch.profiler allocation events (tensor allocations through torch's CPU allocator); "
            "RSS is not used (allocator caching and other processes make it unreliable)."
        )
    points: list[dict] = []
    for mode in modes:
        points += run_mode(mode, args, veca_config, dinov3_config, device, dtype, log)

    gemm_end = measure_gemm(args.gemm_size, gemm_dtype, device, args.gemm_repeats)
    gemm_all = gemm_start + gemm_end
    gemm_reference = statistics.median(gemm_all)
    log(f"GEMM {args.gemm_size}^2 {args.dtype}: {statistics.median(gemm_end) / 1e9:.1f} GFLOP/s (end)")
    machine["loadavg_end"] = loadavg()
    if any(not p["flops_match"] for p in points):
        notes.append("Some counted FLOPs differ from the analytic ones: see flops_match in results.json.")

    summary = summarize(points, args)
    targets = train_targets(points, args) if "train" in modes else []
    shared = ("hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "models": {
            "veca": {k: getattr(veca_config, k) for k in (*shared, "core_bank_size")},
            "dinov3": {k: getattr(dinov3_config, k) for k in (*shared, "num_register_tokens", "use_gated_mlp")},
        },
        "gemm": {
            "size": args.gemm_size,
            "dtype": args.dtype,
            "median_gflops_per_s": gemm_reference / 1e9,
            "start_median_gflops_per_s": statistics.median(gemm_start) / 1e9,
            "end_median_gflops_per_s": statistics.median(gemm_end) / 1e9,
            "samples_gflops_per_s": [g / 1e9 for g in gemm_all],
        },
        "points": points,
        "summary": summary,
        "train_targets": targets,
        "notes": notes,
    }
    if "train" in modes:  # train mode's "DINOv3" is the dense student, not dinov3_config
        dense = dense_student_config(veca_config)
        result["models"]["dense_student"] = {
            k: getattr(dense, k) for k in (*shared, "num_register_tokens", "use_gated_mlp")
        }
    common.write_results(output_dir, result, markdown(result))
    if not args.no_plots:
        plot(points, args, output_dir)
    log("")
    log("Summary")
    for line in summary_lines(summary):
        log(line)
    if targets:
        log("Training targets")
        for line in train_target_lines(targets):
            log(line)
    log(f"wrote {output_dir}")
    return result


if __name__ == "__main__":
    main()
