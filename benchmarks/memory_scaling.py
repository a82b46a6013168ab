#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Peak memory against resolution: VECA vs DINOv3 (same width and depth), inference and training, in one run.

Every point (model, phase, resolution) runs in a fresh process, so that no allocator cache, no earlier peak and no
other point's tensors are counted. The processes are forked from a `multiprocessing` fork server that has imported
torch, transformers and veca_hf once (importing transformers takes seconds) but has allocated no model. Per point:

- CPU: the process's resident set. Just before the call its high-water mark is reset (`echo 5 >
  /proc/self/clear_refs`, Linux >= 4.0) and read back after it (`VmHWM`); where the reset is not allowed, the
  lifetime peak `ru_maxrss` of the fresh process is used instead (`method` says which). `peak_mb` is that peak:
  what a memory limit sees, the interpreter, torch, the weights and the input included; `call_peak_mb` is the peak
  above the resident set just before the call (activations, outputs, and in training gradients and AdamW's state).
- CUDA: `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`: `peak_mb` is all tensors (weights
  included, not the CUDA context), `call_peak_mb` the part above what was allocated before the call.

Phases: `inference` (no autograd, batch `--batch_size`) at `--resolutions`; `train` (one step of the student alone:
`StudentWithLoss` against random targets, backward, AdamW; VECA vs `dense_student_config`, as
`benchmarks/scaling.py --mode train`) at `--train_resolutions`. VECA runs at `--budget` (default 64).

From the points: the log-log slope of `call_peak_mb` against the number of patches N, fitted by least squares over
the points with N >= `--fit_min_patches` (1 = linear in patches, 2 = quadratic), and the largest square resolution
each model runs within `--memory_limit_gib`: measured where a point at or above the limit was run, otherwise
extrapolated from the fit (`peak(N) = base + a N^slope`, `base` the resident set before the call) and marked so.

Outputs in `--output_dir`: `results.json`, `results.md`, `memory_vs_resolution.png` (log-log, with the limit).

    python benchmarks/memory_scaling.py --size veca-b16 --threads 2 --output_dir benchmarks/results/b16_memory_cpu
    python benchmarks/memory_scaling.py --tiny --resolutions 64,96,128 --train_resolutions 64,96   # seconds
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import sys
import time
from pathlib import Path
from typing import Any

import common  # first: the offline Hub defaults, and veca_hf from a source checkout


MIB = 2**20
GIB = 2**30
MODELS = ("DINOv3", "VECA")
PRELOAD = ["torch", "transformers", "veca_hf", "veca_hf.training.distillation", "transformers.models.dinov3_vit"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = common.argument_parser(
        "Peak memory vs resolution, VECA vs DINOv3, each point in a fresh process.",
        resolutions=[256, 384, 512, 768, 1024, 1536, 2048],
    )
    parser.add_argument(
        "--train_resolutions", type=common.int_list_or_empty, default=[512, 768], help="Empty: no training points."
    )
    parser.add_argument("--budget", type=int, default=64, help="VECA's budget C.")
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "bf16_autocast"])
    parser.add_argument("--attn_implementation", default="sdpa", choices=["sdpa", "eager"])
    parser.add_argument("--memory_limit_gib", type=float, default=24.0)
    parser.add_argument("--fit_min_patches", type=int, default=1024, help="Fit the slope over points with N >= this.")
    parser.add_argument("--point_timeout", type=float, default=3600, help="Seconds per point before it is stopped.")
    parser.add_argument("--no_plots", action="store_true")
    parser.add_argument("--output_dir", default=None)
    args = parser.parse_args(argv)
    if args.dtype == "bf16" and args.train_resolutions:
        parser.error("training points take --dtype fp32 or bf16_autocast (pass --train_resolutions '' to skip)")
    if any(r % 16 for r in args.resolutions + args.train_resolutions):
        parser.error("resolutions must be multiples of the patch size 16")
    if args.output_dir is None:
        name = f"{args.size}_memory_{args.device}_{args.dtype}" + ("_tiny" if args.tiny else "")
        args.output_dir = str(Path(__file__).resolve().parent / "results" / name)
    return args


# --- one point, in a fresh process ---------------------------------------------------------------------------------


def _status_kib(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def _reset_peak_rss() -> bool:
    """Resets this process's resident high-water mark (`VmHWM`); False where the kernel does not allow it."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return _status_kib("VmHWM") is not None


def _ru_maxrss_bytes() -> int:
    import resource

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss if sys.platform == "darwin" else maxrss * 1024  # bytes on macOS, KiB on Linux


def build_point(spec: dict[str, Any]):
    """The module and a zero-argument call of one point (also used by the tests)."""
    import contextlib

    import torch
    from transformers import DINOv3ViTModel

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import scaling

    from veca_hf import VecaModel
    from veca_hf.training.distillation import DistillationLoss, StudentWithLoss, dense_student_config
    from veca_hf.training.optimization import get_parameter_groups

    args = scaling.parse_args(
        ["--size", spec["size"], "--budgets", str(spec["budget"]),
         "--attn_implementation", spec["attn_implementation"], "--output_dir", "unused"]
        + (["--tiny"] if spec["tiny"] else [])
    )  # fmt: skip
    veca_config, dinov3_config = scaling.build_configs(args)
    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if spec["dtype"] == "bf16" else torch.float32
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if spec["dtype"] == "bf16_autocast"
        else contextlib.nullcontext()
    )
    torch.manual_seed(spec["seed"])
    r, b, c = spec["resolution"], spec["batch_size"], spec["budget"]
    generator = torch.Generator().manual_seed(spec["seed"])
    x = torch.randn(b, 3, r, r, generator=generator).to(device, dtype)
    if spec["phase"] == "inference":
        if spec["model"] == "VECA":
            model = VecaModel(veca_config).to(device=device, dtype=dtype).eval()
            kwargs = {"num_core_tokens": c}
        else:
            model = DINOv3ViTModel(dinov3_config).to(device=device, dtype=dtype).eval()
            kwargs = {}

        def call():
            with torch.inference_mode(), autocast:
                model(x, **kwargs)

        return model, call
    dense_config = dense_student_config(veca_config)
    dense_config._attn_implementation = spec["attn_implementation"]
    student = VecaModel(veca_config) if spec["model"] == "VECA" else DINOv3ViTModel(dense_config)
    width = veca_config.hidden_size
    model = StudentWithLoss(student, DistillationLoss(width, width)).to(device).train()
    optimizer = torch.optim.AdamW(get_parameter_groups(model, 0.05), lr=1e-5)
    num_patches = (r // 16) ** 2
    cls = torch.randn(b, width, generator=generator).to(device)
    patches = torch.randn(b, num_patches, width, generator=generator).to(device)
    budget = c if spec["model"] == "VECA" else None

    def call():
        with autocast:
            loss = model(x, budget, cls, patches)["loss"]
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)

    return model, call


def measure_point(spec: dict[str, Any]) -> dict[str, Any]:
    """Builds one point, runs its call once, and returns its peak memory (runs in the fresh process)."""
    import torch

    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    common.apply_cpu_allocator(argparse.Namespace(cpu_allocator=spec["cpu_allocator"]))  # this fresh process's
    model, call = build_point(spec)
    weights = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    out: dict[str, Any] = {"weights_mb": weights / MIB}
    if spec["device"] == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        start = time.perf_counter()
        call()
        torch.cuda.synchronize()
        out["seconds"] = time.perf_counter() - start
        peak = torch.cuda.max_memory_allocated()
        out.update(method="torch.cuda.max_memory_allocated", before_mb=before / MIB, peak_mb=peak / MIB,
                   call_peak_mb=(peak - before) / MIB)  # fmt: skip
        return out
    rss_before = (_status_kib("VmRSS") or 0) * 1024
    reset = _reset_peak_rss()
    start = time.perf_counter()
    call()
    out["seconds"] = time.perf_counter() - start
    if reset:
        peak, method = _status_kib("VmHWM") * 1024, "VmHWM after clear_refs (fresh process)"
    else:
        peak, method = _ru_maxrss_bytes(), "ru_maxrss (fresh process)"
    out.update(method=method, before_mb=rss_before / MIB, peak_mb=peak / MIB,
               call_peak_mb=max(0, peak - rss_before) / MIB)  # fmt: skip
    return out


def _child(spec: dict[str, Any], queue) -> None:
    try:
        queue.put(measure_point(spec))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put({"error": f"{type(error).__name__}: {str(error).splitlines()[0][:300] if str(error) else ''}"})


def run_point(context, spec: dict[str, Any], timeout: float) -> dict[str, Any]:
    queue = context.Queue()
    process = context.Process(target=_child, args=(spec, queue))
    process.start()
    result = None
    try:
        result = queue.get(timeout=timeout)
    except Exception:  # noqa: BLE001 - queue.Empty on timeout, or the child died
        pass
    process.join(timeout=30)
    if process.is_alive():
        process.kill()
        process.join()
    if result is None:
        reason = f"timed out after {timeout:.0f} s" if process.exitcode in (None, -9) else "died"
        result = {"error": f"process {reason} (exit code {process.exitcode}; killed for memory?)"}
    return result


# --- fits, summary, outputs ----------------------------------------------------------------------------------------


def fit_loglog(xs: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares line through `(log x, log y)`: `slope`, `log_intercept` (natural log), `r2`."""
    pairs = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=False) if x > 0 and y > 0]
    if len(pairs) < 2 or len({p[0] for p in pairs}) < 2:
        return None
    mx = sum(p[0] for p in pairs) / len(pairs)
    my = sum(p[1] for p in pairs) / len(pairs)
    sxx = sum((p[0] - mx) ** 2 for p in pairs)
    sxy = sum((p[0] - mx) * (p[1] - my) for p in pairs)
    slope = sxy / sxx
    intercept = my - slope * mx
    ss_tot = sum((p[1] - my) ** 2 for p in pairs)
    ss_res = sum((p[1] - intercept - slope * p[0]) ** 2 for p in pairs)
    return {"slope": slope, "log_intercept": intercept, "r2": 1.0 - ss_res / ss_tot if ss_tot > 0 else 1.0,
            "num_points": len(pairs)}  # fmt: skip


def largest_resolution(points: list[dict], fit: dict | None, limit_mb: float, patch: int = 16) -> dict[str, Any]:
    """Largest square resolution within `limit_mb`: measured if a run point reached the limit, else extrapolated."""
    ok = [p for p in points if p.get("peak_mb") is not None]
    within = [p["resolution"] for p in ok if p["peak_mb"] <= limit_mb]
    over = [p["resolution"] for p in points if (p.get("peak_mb") or 0) > limit_mb or p.get("error")]
    best = max(within) if within else None
    if over and best is not None and min(over) > best:
        return {"resolution": best, "extrapolated": False, "note": f"measured: {min(over)} px did not fit or failed"}
    if fit is None or not ok:
        return {"resolution": best, "extrapolated": False, "note": "no fit"}
    base = sorted(p["before_mb"] for p in ok)[len(ok) // 2]
    if limit_mb <= base:
        return {"resolution": None, "extrapolated": True, "note": "the limit is below the memory before the call"}
    # Through the largest measured point, with the local slope but at least 1: activations grow at least linearly in
    # N, and a smaller slope (fixed costs still visible) would over-reach.
    slope = max(fit["slope"], 1.0)
    last = max(ok, key=lambda p: p["num_patches"])
    scale = last["call_peak_mb"] / last["num_patches"] ** slope
    num_patches = ((limit_mb - base) / scale) ** (1 / slope)
    resolution = int(math.sqrt(num_patches)) * patch
    extrapolated = best is None or resolution > best
    return {"resolution": resolution, "extrapolated": extrapolated, "num_patches": num_patches,
            "slope_used": slope,
            "note": (f"extrapolated: base + a N^{slope:.2f} through the largest point" if extrapolated
                     else "measured")}  # fmt: skip


def summarize(points: list[dict], args) -> dict[str, Any]:
    limit_mb = args.memory_limit_gib * GIB / MIB
    out: dict[str, Any] = {"memory_limit_gib": args.memory_limit_gib, "fits": {}, "largest_resolution": {}}
    for phase in ("inference", "train"):
        for model in MODELS:
            mine = [p for p in points if p["phase"] == phase and p["model"] == model and p.get("call_peak_mb")]
            used = [p for p in mine if p["num_patches"] >= args.fit_min_patches]
            if len(used) < 2:  # too few large points (tiny runs): fit over all of them
                used = mine
            fit = fit_loglog([p["num_patches"] for p in used], [p["call_peak_mb"] for p in used])
            key = f"{phase}/{model}"
            out["fits"][key] = fit and {**fit, "fitted_resolutions": [p["resolution"] for p in used]}
            if phase == "inference":
                # NOTE: extrapolate with the local slope of the two largest points: at small N the fixed part of
                # the call peak (allocator, kernel scratch) flattens the whole-range fit, which then over-reaches.
                last = sorted(mine, key=lambda p: p["num_patches"])[-2:]
                local = fit_loglog([p["num_patches"] for p in last], [p["call_peak_mb"] for p in last])
                out["fits"][f"{key} (two largest, for the limit)"] = local and {
                    **local,
                    "fitted_resolutions": [p["resolution"] for p in last],
                }
                every = [p for p in points if p["phase"] == phase and p["model"] == model]
                out["largest_resolution"][key] = largest_resolution(every, local, limit_mb)
    return out


def markdown(result: dict) -> str:
    args, machine = result["args"], result["machine"]
    out = [
        f"# Peak memory vs resolution: {args['size']}{' (tiny)' if args['tiny'] else ''}, {args['device']}, "
        f"{args['dtype']}, {args['attn_implementation']}, batch {args['batch_size']}, VECA C={args['budget']}",
        "",
        f"- command: `{result['command']}`",
        f"- machine: {machine['cpu_model']} ({machine.get('device_name')}); torch {machine['torch_version']}; "
        f"threads {machine['threads']}",
        "- each point in a fresh process (forked from a server that imported torch only); peak = "
        + ("CUDA max_memory_allocated" if args["device"] == "cuda" else "resident high-water mark (VmHWM / ru_maxrss)")
        + "; call peak = peak - memory just before the call",
        "",
        "| phase | model | res | N | peak MB | call peak MB | before MB | weights MB | s | method / error |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for p in result["points"]:

        def f(key, spec=".1f", point=p):
            return "-" if point.get(key) is None else format(point[key], spec)

        out.append(
            f"| {p['phase']} | {p['model']} | {p['resolution']} | {p['num_patches']} | {f('peak_mb')} | "
            f"{f('call_peak_mb')} | {f('before_mb')} | {f('weights_mb')} | {f('seconds', '.2f')} | "
            f"{p.get('error') or p.get('method')} |"
        )
    out += ["", "## Fits and limits", ""] + summary_lines(result["summary"]) + [""]
    return "\n".join(out)


def summary_lines(summary: dict) -> list[str]:
    lines = []
    for key, fit in summary["fits"].items():
        if fit is None:
            lines.append(f"- {key}: no fit (fewer than 2 points)")
            continue
        lines.append(
            f"- {key}: log-log slope of the call peak vs N {fit['slope']:.3f} (r^2 {fit['r2']:.4f}, "
            f"{fit['num_points']} points: {', '.join(map(str, fit['fitted_resolutions']))} px)"
        )
    for key, entry in summary["largest_resolution"].items():
        lines.append(
            f"- {key}: largest resolution within {summary['memory_limit_gib']:g} GiB: {entry['resolution']} px "
            f"({entry['note']})"
        )
    return lines


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.8))
    for phase, style in (("inference", "-"), ("train", "--")):
        for model, color in (("DINOv3", "black"), ("VECA", "tab:green")):
            mine = [p for p in result["points"] if (p["phase"], p["model"]) == (phase, model) and p.get("peak_mb")]
            if mine:
                ax.plot([p["num_patches"] for p in mine], [p["peak_mb"] for p in mine], style, marker="o",
                        color=color, label=f"{model} {phase}")  # fmt: skip
    ax.axhline(result["summary"]["memory_limit_gib"] * 1024, color="red", linewidth=1, label="limit")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("patches N")
    ax.set_ylabel("peak memory (MB)")
    args = result["args"]
    ax.set_title(f"{args['size']}{' tiny' if args['tiny'] else ''} {args['device']} {args['dtype']}, "
                 f"batch {args['batch_size']}")  # fmt: skip
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    output_dir = Path(args.output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if context.get_start_method() == "forkserver":
        context.set_forkserver_preload(PRELOAD)

    import platform

    import torch

    from veca_hf.cpu.hardware import cpu_kind, cpu_model

    machine = {
        "cpu_model": cpu_model(),
        "cpu_kind": cpu_kind(),
        "platform": platform.platform(),
        "torch_version": torch.__version__,
        "threads": args.threads or torch.get_num_threads(),
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else cpu_model(),
        "start_method": context.get_start_method(),
        "cpu_allocator": args.cpu_allocator,  # applied in each point's process
    }
    plan = [("inference", r) for r in sorted(args.resolutions)] + [
        ("train", r) for r in sorted(args.train_resolutions)
    ]
    points = []
    failed: set = set()
    for phase, resolution in plan:
        for model in MODELS:  # the two models of one resolution back to back
            spec = {"phase": phase, "model": model, "resolution": resolution, "size": args.size, "tiny": args.tiny,
                    "budget": args.budget, "batch_size": args.batch_size, "device": args.device, "dtype": args.dtype,
                    "attn_implementation": args.attn_implementation, "threads": args.threads,
                    "seed": args.seed, "cpu_allocator": args.cpu_allocator}  # fmt: skip
            point = {k: spec[k] for k in ("phase", "model", "resolution")} | {"num_patches": (resolution // 16) ** 2}
            if (phase, model) in failed:
                point["error"] = "skipped: a smaller resolution already failed"
            else:
                point.update(run_point(context, spec, args.point_timeout))
                if point.get("error"):
                    failed.add((phase, model))
            points.append(point)
            shown = (
                "failed: " + point["error"]
                if point.get("error")
                else (
                    f"peak {point['peak_mb']:.1f} MB, call peak {point['call_peak_mb']:.1f} MB, "
                    f"{point['seconds']:.2f} s"
                )
            )
            print(f"{phase:9s} {model:6s} {resolution:5d} px  {shown}", flush=True)
    summary = summarize(points, args)
    result = {
        "command": common.command_line(argv),
        "args": vars(args),
        "machine": machine,
        "points": points,
        "summary": summary,
    }
    common.write_results(output_dir, result, markdown(result))
    if not args.no_plots:
        plot(result, output_dir / "memory_vs_resolution.png")
    for line in summary_lines(summary):
        print(line)
    print(f"wrote {output_dir}")
    return result


if __name__ == "__main__":
    main()
