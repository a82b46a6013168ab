# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Did a change to the model code cost speed or change the outputs? The model of a git revision against the working
tree's, same weights, timed in the same interleaved rounds (DINOv3 of the same size alongside, as the reference).

    python benchmarks/model_revisions.py --before 6ed9887 --resolutions 512,1024 --budgets 8,64 --repeats 7

The revision's `src/veca_hf/model/` is copied out of git into a temporary package and imported next to the working
tree's: the model folder imports only torch, transformers and its siblings, so both load in one process. Prints one
table (latency per side, the paired after/before ratio: the median over rounds of the ratio within a round) and the
largest output difference, and writes `results.json` and `results.md` to `--output_dir`.
"""

from __future__ import annotations

import importlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import common  # noqa: F401  (offline Hub, veca_hf from the checkout)
import numpy as np
import torch
from scaling import preset_configs
from scaling_measure import machine_info, paired_median, time_call

from veca_hf.evaluation.statistics import paired_bootstrap_interval


MODEL_FOLDER = "src/veca_hf/model"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_args(argv: list[str] | None = None):
    parser = common.argument_parser(__doc__.split("\n")[0], resolutions=[512, 1024])
    parser.add_argument("--before", required=True, help="A git revision (commit, tag, branch) to compare against.")
    parser.add_argument("--budgets", type=common.int_list, default=[8, 64])
    parser.add_argument("--dtype", default="fp32", choices=sorted(DTYPES), help="Weights and inputs cast to it.")
    parser.add_argument("--no_dinov3", action="store_true", help="Leave out the DINOv3 reference.")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7, help="Interleaved timed rounds.")
    parser.set_defaults(bf16_probe_size=0)  # `machine_info` reads it: no bf16 GEMM probe
    parser.add_argument("--output_dir", type=Path, required=True)
    return parser.parse_args(argv)


def import_revision(revision: str, into: Path):
    """`modeling_veca` of `revision`, imported as the package `veca_model_<sha>` from a copy in `into`."""
    root = Path(subprocess.check_output(["git", "rev-parse", "--show-toplevel"], text=True).strip())
    sha = subprocess.check_output(["git", "rev-parse", "--short", revision], cwd=root, text=True).strip()
    package = into / f"veca_model_{sha}"
    package.mkdir()
    names = subprocess.check_output(["git", "ls-tree", "--name-only", f"{sha}:{MODEL_FOLDER}"], cwd=root, text=True)
    for name in names.split():
        if name.endswith(".py"):
            source = subprocess.check_output(["git", "show", f"{sha}:{MODEL_FOLDER}/{name}"], cwd=root)
            (package / name).write_bytes(source)
    sys.path.insert(0, str(into))
    return importlib.import_module(f"{package.name}.modeling_veca"), sha


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    allocator = common.apply_cpu_allocator(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    veca_config, dinov3_config = preset_configs(args.size, args.tiny, args.budgets)
    from transformers import DINOv3ViTModel

    from veca_hf.model import modeling_veca as after_module

    with tempfile.TemporaryDirectory() as folder:
        before_module, before_sha = import_revision(args.before, Path(folder))
        torch.manual_seed(args.seed)
        after = after_module.VecaModel(after_module.VecaConfig(**veca_config.to_dict()))
        before = before_module.VecaModel(before_module.VecaConfig(**veca_config.to_dict()))
        before.load_state_dict(after.state_dict())  # strict: the weights' layout must not have changed
        models = {"before": before, "after": after}
        if not args.no_dinov3:
            models["dinov3"] = DINOv3ViTModel(dinov3_config)
        for model in models.values():
            model.to(device, dtype).eval()

        points = []
        for resolution in args.resolutions:
            generator = torch.Generator().manual_seed(args.seed)
            pixel_values = torch.randn(1, 3, resolution, resolution, generator=generator).to(device, dtype)
            calls = {}
            for budget in args.budgets:
                for side in ("before", "after"):
                    calls[(side, budget)] = lambda m=models[side], b=budget, x=pixel_values: m(x, num_core_tokens=b)
            if "dinov3" in models:
                calls[("dinov3", None)] = lambda m=models["dinov3"], x=pixel_values: m(x)
            times = {key: [] for key in calls}
            with torch.inference_mode():
                differences = {
                    budget: (
                        calls[("after", budget)]().last_hidden_state - calls[("before", budget)]().last_hidden_state
                    )
                    .abs()
                    .max()
                    .item()
                    for budget in args.budgets
                }
                order = list(calls)
                for round_index in range(args.warmup + args.repeats):
                    rotated = order[round_index % len(order) :] + order[: round_index % len(order)]
                    for key in rotated:
                        seconds = time_call(calls[key], device)
                        if round_index >= args.warmup:
                            times[key].append(seconds)
            for budget in args.budgets:
                before_ms, after_ms = (times[(side, budget)] for side in ("before", "after"))
                point = {
                    "resolution": resolution,
                    "budget": budget,
                    "before_ms": 1e3 * statistics.median(before_ms),
                    "after_ms": 1e3 * statistics.median(after_ms),
                    "after_over_before_paired": paired_median(after_ms, before_ms),
                    "after_over_before_rounds": [a / b for a, b in zip(after_ms, before_ms, strict=True)],
                    # the geometric mean of the rounds' ratios and its 95% bootstrap interval (rounds resampled)
                    "after_over_before_geometric_mean": float(np.exp(np.mean(np.log(after_ms) - np.log(before_ms)))),
                    "after_over_before_interval": paired_bootstrap_interval(
                        np.exp, np.log(after_ms) - np.log(before_ms)
                    ),
                    "max_abs_output_difference": differences[budget],
                }
                if "dinov3" in models:
                    dinov3 = times[("dinov3", None)]
                    point["dinov3_ms"] = 1e3 * statistics.median(dinov3)
                    point["before_over_dinov3_paired"] = paired_median(before_ms, dinov3)
                    point["after_over_dinov3_paired"] = paired_median(after_ms, dinov3)
                points.append(point)
                print(point, flush=True)

    machine = machine_info(args)
    machine["cpu_allocator"] = allocator
    result = {
        "command": common.command_line(argv),
        "before": before_sha,
        "after": "working tree",
        "dtype": args.dtype,
        "machine": machine,
        "points": points,
    }
    args.output_dir.mkdir(parents=True, exist_ok=True)
    common.write_results(args.output_dir, result, render(result))
    print(render(result))
    return result


def render(result: dict) -> str:
    machine = result["machine"]
    lines = [
        f"# Model code: {result['before']} vs the working tree, {machine['cpu_model']}, {result['dtype']}",
        "",
        f"- command: `{result['command']}`",
        f"- torch {machine['torch_version']}, transformers {machine['transformers_version']}, "
        f"{machine['torch_num_threads']} threads; batch 1; latency = median of the timed rounds",
        "",
        "| res | C | rounds | before ms | after ms | after / before: paired median | geometric mean [95% interval] | "
        "max abs output diff | before / DINOv3 | after / DINOv3 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:
        low, high = p["after_over_before_interval"]
        dinov3 = (
            f"{p['before_over_dinov3_paired']:.3f} | {p['after_over_dinov3_paired']:.3f}"
            if "dinov3_ms" in p
            else "- | -"
        )
        lines.append(
            f"| {p['resolution']} | {p['budget']} | {len(p['after_over_before_rounds'])} | {p['before_ms']:.1f} | "
            f"{p['after_ms']:.1f} | {p['after_over_before_paired']:.3f} | "
            f"{p['after_over_before_geometric_mean']:.3f} [{low:.3f}, {high:.3f}] | "
            f"{p['max_abs_output_difference']:.2e} | {dinov3} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
