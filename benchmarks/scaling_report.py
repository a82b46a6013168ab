# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""What `scaling.py` reports: the log line of a point, the summary and the training targets, `results.md` and the
plots."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import common  # noqa: F401 - first: the offline Hub defaults, and veca_hf from a source checkout
from scaling_cases import DINOV3, VECA
from scaling_measure import paired_median, rounds_within


MODE_ORDER = ["model", "block", "train"]
# Training targets: at these resolutions VECA's step time over the dense student's is at most their
# training FLOP ratio plus this margin (paired ratios of one run).
TRAIN_TARGET_RESOLUTIONS = (512, 768)
TRAIN_TARGET_MARGIN = 0.03


def one_line(p: dict) -> str:
    lat = p["latency_ms"]
    text = f"{p['label']:<12} {p['flops_analytic'] / 1e9:9.3f} GFLOPs"
    text += f"  {lat['median']:9.2f} ms [{lat['min']:.2f}-{lat['max']:.2f}]" if lat else "  (failed)"
    if p.get("gemm_fraction") is not None:
        text += f"  {100 * p['gemm_fraction']:5.1f}% GEMM"
    if p.get("minor_page_faults_per_call") is not None:
        text += f"  {p['minor_page_faults_per_call'] / 1e3:.1f}k faults"
    if p.get("attention_core_share") is not None:
        text += f"  attn {100 * p['attention_module_share']:4.1f}%/{100 * p['attention_core_share']:4.1f}%"
    if p["model"] == VECA and p.get("latency_ratio_vs_dinov3") is not None:
        text += (
            f"  x{p['latency_ratio_vs_dinov3']:.3f} time (paired x{_fmt(p.get('paired_latency_ratio_vs_dinov3'))}),"
            f" x{p['flop_ratio_vs_dinov3']:.3f} FLOPs vs DINOv3"
        )
    if not p["flops_match"]:
        text += f"  COUNTED {p['flops_counted']} != ANALYTIC {p['flops_analytic']}"
    return text


def _find(points, mode, batch, resolution, model, budget=None):
    for p in points:
        if (p["mode"], p["batch_size"], p["resolution"], p["model"]) == (mode, batch, resolution, model) and (
            model == DINOV3 or p["budget"] == budget
        ):
            return p
    return None


def _median(p):
    return p["latency_ms"]["median"] if p and p.get("latency_ms") else None


def summarize(points: list[dict], args) -> list[dict]:
    """The speed targets per mode and batch size, for the largest budget (C = 64 by default).

    - at the largest resolution and at 512 px (or the smallest, if 512 was not run or is the largest): latency
      ratio VECA/DINOv3 vs FLOP ratio;
    - VECA's latency per token (latency / (B (N + C))) at the largest resolution over that at 512 px: 1 means
      linear scaling in tokens;
    - each latency ratio also paired: the median over the interleaved rounds of the ratio within one round;
    - VECA's (and DINOv3's) achieved fraction of the GEMM throughput at the largest resolution.
    """
    budget = max(args.budgets)
    largest = max(args.resolutions)
    reference = 512 if 512 in args.resolutions and 512 < largest else min(args.resolutions)
    summaries = []
    modes = sorted({p["mode"] for p in points}, key=MODE_ORDER.index)
    for mode in modes:
        for batch in args.batch_sizes:
            entry: dict[str, Any] = {
                "mode": mode,
                "batch_size": batch,
                "budget": budget,
                "largest_resolution": largest,
                "reference_resolution": reference,
                "ratios": {},
            }
            for resolution in sorted({largest, reference}):
                veca = _find(points, mode, batch, resolution, VECA, budget)
                entry["ratios"][str(resolution)] = {
                    "latency_ratio": veca.get("latency_ratio_vs_dinov3") if veca else None,
                    "paired_latency_ratio": veca.get("paired_latency_ratio_vs_dinov3") if veca else None,
                    "flop_ratio": veca.get("flop_ratio_vs_dinov3") if veca else None,
                }
            veca_large = _find(points, mode, batch, largest, VECA, budget)
            veca_ref = _find(points, mode, batch, reference, VECA, budget)
            dense_large = _find(points, mode, batch, largest, DINOV3)
            dense_ref = _find(points, mode, batch, reference, DINOV3)

            def per_token_ratio(a, b):
                if a is not b and a and b and a.get("latency_per_token_us") and b.get("latency_per_token_us"):
                    return a["latency_per_token_us"] / b["latency_per_token_us"]
                return None

            def paired_per_token_ratio(a, b):
                if a is b or not (a and b and a.get("latency_ms") and b.get("latency_ms")):
                    return None
                ratio = paired_median(a["latency_ms"]["samples"], b["latency_ms"]["samples"])
                return None if ratio is None else ratio * b["num_tokens"] / a["num_tokens"]

            entry["veca_per_token_latency_ratio"] = per_token_ratio(veca_large, veca_ref)
            entry["dinov3_per_token_latency_ratio"] = per_token_ratio(dense_large, dense_ref)
            entry["veca_paired_per_token_latency_ratio"] = paired_per_token_ratio(veca_large, veca_ref)
            entry["dinov3_paired_per_token_latency_ratio"] = paired_per_token_ratio(dense_large, dense_ref)
            entry["veca_gemm_fraction_at_largest"] = veca_large.get("gemm_fraction") if veca_large else None
            entry["dinov3_gemm_fraction_at_largest"] = dense_large.get("gemm_fraction") if dense_large else None
            summaries.append(entry)
    return summaries


def train_targets(points: list[dict], args) -> list[dict]:
    """The training targets, from the paired rounds of one run, per batch size and resolution:

    - per budget: VECA's step time over the dense student's (paired) is at most their training FLOP ratio + 0.03
      (targets at 512 and 768 px: `target_resolution`);
    - the step at the smallest budget (C = 8) takes at most as long as at the largest (C = 64): paired ratio <= 1.
    """
    out = []
    small, large = min(args.budgets), max(args.budgets)
    for batch in args.batch_sizes:
        for resolution in args.resolutions:
            dense = _find(points, "train", batch, resolution, DINOV3)
            if dense is None:
                continue
            at_target = resolution in TRAIN_TARGET_RESOLUTIONS
            for budget in args.budgets:
                veca = _find(points, "train", batch, resolution, VECA, budget)
                paired, flop_ratio = veca.get("paired_latency_ratio_vs_dinov3"), veca["flop_ratio_vs_dinov3"]
                limit = flop_ratio + TRAIN_TARGET_MARGIN
                rounds = None
                if veca.get("latency_ms") and dense.get("latency_ms"):
                    rounds = rounds_within(veca["latency_ms"]["samples"], dense["latency_ms"]["samples"], limit)
                out.append({
                    "target": "step time VECA / dense <= training FLOP ratio + 0.03",
                    "batch_size": batch, "resolution": resolution, "budget": budget, "target_resolution": at_target,
                    "paired_ratio": paired, "ratio_of_medians": veca.get("latency_ratio_vs_dinov3"),
                    "flop_ratio": flop_ratio, "limit": limit, "met": None if paired is None else paired <= limit,
                    "rounds_within_limit": rounds,
                })  # fmt: skip
            if small != large:
                a, b = (
                    _find(points, "train", batch, resolution, VECA, small),
                    _find(points, "train", batch, resolution, VECA, large),
                )
                paired = rounds = None
                if a.get("latency_ms") and b.get("latency_ms"):
                    paired = paired_median(a["latency_ms"]["samples"], b["latency_ms"]["samples"])
                    rounds = rounds_within(a["latency_ms"]["samples"], b["latency_ms"]["samples"], 1.0)
                out.append({
                    "target": f"step time C={small} <= C={large}",
                    "batch_size": batch, "resolution": resolution, "budget": [small, large], "target_resolution": True,
                    "paired_ratio": paired, "ratio_of_medians": _safe_ratio(_median(a), _median(b)),
                    "flop_ratio": a["flops_analytic"] / b["flops_analytic"], "limit": 1.0,
                    "met": None if paired is None else paired <= 1.0, "rounds_within_limit": rounds,
                })  # fmt: skip
    return out


def _safe_ratio(a, b):
    return None if a is None or b is None else a / b


def train_target_lines(targets: list[dict]) -> list[str]:
    lines = []
    for t in targets:
        verdict = {True: "MET", False: "NOT MET", None: "n/a"}[t["met"]]
        where = "" if t["target_resolution"] else " (not a target resolution)"
        budget = t["budget"] if isinstance(t["budget"], list) else f"C={t['budget']}"
        lines.append(
            f"  - train, batch {t['batch_size']}, {t['resolution']} px, {budget}: {t['target']}: paired "
            f"{_fmt(t['paired_ratio'])} (medians {_fmt(t['ratio_of_medians'])}) vs limit {t['limit']:.3f} "
            f"(FLOP ratio {t['flop_ratio']:.3f}; rounds within it: {t['rounds_within_limit']}): {verdict}{where}"
        )
    return lines


def _fmt(value, spec=".3f", none="-"):
    return none if value is None else format(value, spec)


def summary_lines(summaries: list[dict]) -> list[str]:
    lines = []
    for s in summaries:
        c, big, ref = s["budget"], s["largest_resolution"], s["reference_resolution"]
        lines.append(f"{s['mode']} mode, batch {s['batch_size']}, VECA C={c}:")
        for resolution, r in s["ratios"].items():
            lines.append(
                f"  - {resolution} px: VECA/DINOv3 latency ratio {_fmt(r['latency_ratio'])} "
                f"(paired {_fmt(r.get('paired_latency_ratio'))}) vs FLOP ratio {_fmt(r['flop_ratio'])}"
            )
        lines.append(
            f"  - latency per token (latency / (B (N + C))), {big} px over {ref} px: VECA "
            f"{_fmt(s['veca_per_token_latency_ratio'])} (paired {_fmt(s.get('veca_paired_per_token_latency_ratio'))};"
            f" 1 = linear in tokens), DINOv3 {_fmt(s['dinov3_per_token_latency_ratio'])} "
            f"(paired {_fmt(s.get('dinov3_paired_per_token_latency_ratio'))})"
        )
        fraction = s["veca_gemm_fraction_at_largest"]
        dense = s["dinov3_gemm_fraction_at_largest"]
        lines.append(
            f"  - fraction of GEMM throughput at {big} px: VECA {_fmt(fraction and 100 * fraction, '.1f')}%, "
            f"DINOv3 {_fmt(dense and 100 * dense, '.1f')}%"
        )
    return lines


def _ratio_cell(p: dict) -> str:
    paired = p.get("paired_latency_ratio_vs_dinov3")
    return _fmt(p["latency_ratio_vs_dinov3"]) + ("" if paired is None else f" ({paired:.3f})")


def markdown(result: dict) -> str:
    args, machine, gemm, models = result["args"], result["machine"], result["gemm"], result["models"]
    out = [
        f"# VECA vs DINOv3 scaling: {args['size']}{' (tiny)' if args['tiny'] else ''}, {args['device']}, "
        f"{args['dtype']}, {args['attn_implementation']}",
        "",
        f"- command: `{result['command']}`",
        f"- device: {args['device']} ({machine['device_name']}); CPU: {machine['cpu_model']}; "
        f"torch {machine['torch_version']}, transformers {machine['transformers_version']}; "
        f"threads {machine['torch_num_threads']}; "
        f"load average start {machine['loadavg_start']}, end {machine.get('loadavg_end')}; "
        f"THP_MEM_ALLOC_ENABLE={machine.get('thp_mem_alloc_enable')}, kernel THP mode "
        f"{machine.get('transparent_hugepage')}",
        f"- models: VECA {models['veca']}; DINOv3 {models['dinov3']}"
        + (f"; train mode's dense student {models['dense_student']}" if "dense_student" in models else ""),
        f"- GEMM reference: `torch.mm` {gemm['size']}x{gemm['size']} {args['dtype']}, timed in every interleaved "
        f"round (column `GEMM GFLOP/s`: the median of the rounds); alone at the start "
        f"{gemm['start_median_gflops_per_s']:.1f} and the end {gemm['end_median_gflops_per_s']:.1f} GFLOP/s",
        f"- timing: {args['warmup']} warm-up + {args['repeats']} timed calls per model and resolution, in "
        f"{args['repeats']} interleaved rounds (the GEMM, then per resolution DINOv3 and each budget, the order "
        "rotated by one every round); latency = median [min-max]; ratio = ratio of the medians, and in brackets "
        "the paired ratio: the median over the rounds of the ratio within each round",
        "- GFLOPs: analytic (`veca_hf.flops`) and counted (`torch.utils.flop_counter` on meta, SDPA as MATH); "
        "% GEMM = analytic FLOPs / median latency / the point's GEMM reference",
        "- attention share: time inside the attention modules / whole forward, and in brackets the attention "
        f"kernels alone (SDPA or eager matmul+softmax), median of {args['profile_repeats']} `torch.profiler` runs",
        "- forward peak: bytes allocated during the call above the level before it (activations + outputs); "
        + ("CUDA max_memory_allocated" if args["device"] == "cuda" else "CPU: torch.profiler allocation events"),
        "",
    ]
    header = (
        "| res | N | model | C | GFLOPs analytic | GFLOPs counted | latency ms median [min-max] | img/s | "
        "GEMM GFLOP/s | % GEMM | attention share (kernel) | fwd peak MB | page faults / call | "
        "latency ratio vs DINOv3 (paired) | FLOP ratio vs DINOv3 |"
    )
    points = result["points"]
    for mode in sorted({p["mode"] for p in points}, key=MODE_ORDER.index):
        title = {
            "model": "whole model",
            "block": "one attention block (q/k/v/o + attention, Table S.14)",
            "train": "training step of the student (forward, backward, optimiser); DINOv3 = the dense student",
        }[mode]
        for batch in args["batch_sizes"]:
            out += [f"## {mode} mode: {title}, batch {batch}", "", header, "|" + "---|" * 15]
            for p in points:
                if p["mode"] != mode or p["batch_size"] != batch:
                    continue
                lat = p["latency_ms"]
                latency = f"{lat['median']:.2f} [{lat['min']:.2f}-{lat['max']:.2f}]" if lat else (p["error"] or "-")
                share = "-"
                if p.get("attention_module_share") is not None:
                    share = f"{100 * p['attention_module_share']:.1f}% ({100 * p['attention_core_share']:.1f}%)"
                counted = f"{p['flops_counted'] / 1e9:.3f}" + ("" if p["flops_match"] else " (!= analytic)")
                out.append(
                    f"| {p['resolution']} | {p['num_patches']} | {p['model']} | {p['budget'] or '-'} | "
                    f"{p['flops_analytic'] / 1e9:.3f} | {counted} | {latency} | "
                    f"{_fmt(p.get('images_per_s'), '.2f')} | "
                    f"{_fmt(p.get('gemm_reference_gflops_per_s'), '.1f')} | "
                    f"{_fmt(p.get('gemm_fraction') and 100 * p['gemm_fraction'], '.1f')} | {share} | "
                    f"{_fmt(p.get('forward_peak_mb'), '.1f')} | "
                    f"{_fmt(p.get('minor_page_faults_per_call'), '.0f')} | "
                    f"{_ratio_cell(p) if p['model'] == VECA else '-'} | "
                    f"{_fmt(p['flop_ratio_vs_dinov3']) if p['model'] == VECA else '-'} |"
                )
            out.append("")
    out += ["## Summary", ""] + summary_lines(result["summary"]) + [""]
    if result.get("train_targets"):
        out += ["## Training targets", ""] + train_target_lines(result["train_targets"]) + [""]
    if result["notes"]:
        out += ["## Notes", ""] + [f"- {note}" for note in result["notes"]] + [""]
    return "\n".join(out)


def plot(points: list[dict], args, output_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    modes = sorted({p["mode"] for p in points}, key=MODE_ORDER.index)
    written = []
    for kind, ylabel, filename in (
        ("latency", "median latency (ms)", "latency_vs_resolution.png"),
        ("flops", "GFLOPs (analytic)", "flops_vs_resolution.png"),
    ):
        rows, cols = len(modes), len(args.batch_sizes)
        fig, axes = plt.subplots(rows, cols, figsize=(5.5 * cols, 4.2 * rows), squeeze=False)
        for i, mode in enumerate(modes):
            for j, batch in enumerate(args.batch_sizes):
                ax = axes[i][j]
                labels = [DINOV3] + [f"VECA C={c}" for c in args.budgets]
                for k, label in enumerate(labels):
                    xs, ys = [], []
                    for p in points:
                        if (p["mode"], p["batch_size"], p["label"]) != (mode, batch, label):
                            continue
                        value = _median(p) if kind == "latency" else p["flops_analytic"] / 1e9
                        if value:
                            xs.append(p["resolution"])
                            ys.append(value)
                    if xs:
                        dense = label == DINOV3
                        ax.plot(
                            xs,
                            ys,
                            marker="s" if dense else "o",
                            linestyle="--" if dense else "-",
                            color="black" if dense else plt.cm.viridis(0.85 * (k - 1) / max(1, len(labels) - 2)),
                            linewidth=2 if dense else 1.5,
                            label=label,
                        )
                ax.set_xscale("log")
                ax.set_yscale("log")
                ax.set_xticks(args.resolutions)
                ax.set_xticklabels([str(r) for r in args.resolutions])
                ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
                ax.set_xlabel("resolution (px, square)")
                ax.set_ylabel(ylabel)
                name = args.size + (" tiny" if args.tiny else "")
                ax.set_title(f"{name} {mode}, batch {batch}, {args.dtype}, {args.device}")
                ax.grid(True, which="both", alpha=0.3)
                ax.legend(fontsize=8)
        fig.tight_layout()
        path = output_dir / filename
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(str(path))
    return written
