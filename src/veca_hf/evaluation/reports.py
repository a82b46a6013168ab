# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Reports of `run_linear_probes`' results: markdown tables in the paper's layout, metric plots, and the files.

`results_markdown` gives one table per task (a column per model and budget, a row per resolution and, for depth, per
metric);
`plot_metric_vs_budget` and `plot_metric_vs_resolution` draw the metric against either axis; `write_reports` writes
`results.json`, `results.md` and the plots. Plots need `matplotlib` (the `dev` extra).
"""

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np


__all__ = ["plot_metric_vs_budget", "plot_metric_vs_resolution", "results_markdown", "write_reports"]

# task -> the `veca_hf.metrics` module of its `value`
TASK_METRICS = {"classification": "accuracy", "knn": "accuracy", "segmentation": "mean_iou", "depth": "rmse"}
TASK_TITLES = {
    "classification": "Classification",
    "knn": "k-NN classification",
    "segmentation": "Segmentation",
    "depth": "Depth",
}
METRIC_LABELS = {"accuracy": "top-1 accuracy (%)", "mean_iou": "mIoU (%)", "rmse": "RMSE (lower is better)"}
METRIC_SCALES = {"rmse": 1.0}  # shown as is; fractions (the default) are shown in %
# the table rows of each resolution: (result key, label, scale, format); one unlabelled row of `value` by default
TASK_ROWS = {
    "depth": (
        ("value", "RMSE", 1.0, ".4f"),
        ("abs_rel", "AbsRel", 1.0, ".4f"),
        ("delta1", "δ1 (%)", 100.0, ".2f"),
    )
}


def _scale(task: str) -> float:
    return METRIC_SCALES.get(TASK_METRICS[task], 100.0)


def _column_name(result: Mapping[str, Any]) -> str:
    return f"{result['model_name']} C={result['budget']}" if result["budget"] is not None else result["model_name"]


def results_markdown(results: Sequence[Mapping[str, Any]]) -> str:
    """One table per task in the paper's layout: a column per model and budget (VECA models first, each from its
    largest budget down, as the paper's `VECA C=64 | VECA C=8 | teacher`), a row per resolution, metric in %."""
    lines = []
    for task, metric in TASK_METRICS.items():
        rows = [r for r in results if r["task"] == task]
        if not rows:
            continue
        order = list(dict.fromkeys(r["model"] for r in rows))
        columns = []
        for r in sorted(rows, key=lambda r: (r["model_type"] != "veca", order.index(r["model"]), -(r["budget"] or 0))):
            if _column_name(r) not in columns:
                columns.append(_column_name(r))
        resolutions = sorted({r["resolution"] for r in rows})
        sizes = sorted({(r["num_train"], r["num_eval"]) for r in rows})
        title = f"{TASK_TITLES[task]}: " + (
            "RMSE, AbsRel (lower is better), δ1 (%)" if task in TASK_ROWS else METRIC_LABELS[metric]
        )
        lines += [f"### {title}", ""]
        lines += [
            f"{'k-NN' if task == 'knn' else 'Linear probe'} on frozen features; "
            f"{', '.join(f'{a} train / {b} eval images' for a, b in sizes)}. "
            "`C` = VECA budget; other models have one.",
            "",
        ]
        lines.append("| resolution | " + " | ".join(columns) + " |")
        lines.append("|---|" + "---|" * len(columns))
        row_specs = TASK_ROWS.get(task, (("value", None, _scale(task), ".2f"),))
        for resolution in resolutions:
            for key, label, scale, number_format in row_specs:
                values = {_column_name(r): r[key] for r in rows if r["resolution"] == resolution}
                cells = [format(scale * values[c], number_format) if c in values else "–" for c in columns]
                name = f"{resolution} px" if label is None else f"{resolution} px, {label}"
                lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def _save_metric_plot(figure, axis, task: str, against: str, xlabel: str, path: str | os.PathLike) -> Path:
    """Labels, title, grid and legend shared by the metric plots; writes the PNG."""
    axis.set_xlabel(xlabel)
    axis.set_ylabel(METRIC_LABELS[TASK_METRICS[task]])
    axis.set_title(f"{TASK_TITLES[task]}: {'k-NN' if task == 'knn' else 'linear probe'} vs {against}")
    axis.grid(alpha=0.3)
    axis.legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    return Path(path)


def plot_metric_vs_budget(results: Sequence[Mapping[str, Any]], task: str, path: str | os.PathLike) -> Path:
    """`task`'s metric (% for fractions) against the VECA budget, one line per model and resolution; models without
    budgets are dashed horizontal lines (the teacher column of the paper's tables)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure state

    rows = [r for r in results if r["task"] == task]
    resolutions = sorted({r["resolution"] for r in rows})
    colours = dict(
        zip(resolutions, colormaps["viridis"](np.linspace(0, 0.85, max(1, len(resolutions)))), strict=False)
    )
    markers = iter("osD^vP*X" * 4)
    figure = Figure(figsize=(6, 4))
    axis = figure.subplots()
    budgets = sorted({r["budget"] for r in rows if r["budget"] is not None})
    for model in dict.fromkeys(r["model"] for r in rows):
        model_rows = [r for r in rows if r["model"] == model]
        marker = next(markers)
        for resolution in resolutions:
            here = [r for r in model_rows if r["resolution"] == resolution]
            points = sorted((r["budget"], _scale(task) * r["value"]) for r in here if r["budget"] is not None)
            label = f"{model_rows[0]['model_name']}, {resolution} px"
            if points:
                axis.plot(*zip(*points, strict=True), marker=marker, color=colours[resolution], label=label)
            for r in (r for r in here if r["budget"] is None):
                axis.axhline(
                    _scale(task) * r["value"], linestyle="--", color=colours[resolution], label=f"{label} (no budget)"
                )
    axis.set_xscale("log", base=2)
    if budgets:
        axis.set_xticks(budgets, [str(b) for b in budgets])
    return _save_metric_plot(figure, axis, task, "budget", "budget C (active cores)", path)


def plot_metric_vs_resolution(results: Sequence[Mapping[str, Any]], task: str, path: str | os.PathLike) -> Path:
    """`task`'s metric (% for fractions) against the resolution, one line per model and budget (dashed for models
    without)."""
    from matplotlib import colormaps
    from matplotlib.figure import Figure  # not pyplot: no global backend or figure state

    rows = [r for r in results if r["task"] == task]
    lines = list(dict.fromkeys((r["model"], r["budget"]) for r in rows))
    budgets = sorted({b for _, b in lines if b is not None})
    colours = dict(zip(budgets, colormaps["plasma"](np.linspace(0, 0.85, max(1, len(budgets)))), strict=False))
    markers = {
        model: marker for model, marker in zip(dict.fromkeys(m for m, _ in lines), "osD^vP*X" * 4, strict=False)
    }
    figure = Figure(figsize=(6, 4))
    axis = figure.subplots()
    for model, budget in lines:
        here = [r for r in rows if r["model"] == model and r["budget"] == budget]
        points = sorted((r["resolution"], _scale(task) * r["value"]) for r in here)
        name = next(r["model_name"] for r in rows if r["model"] == model)
        style = dict(color=colours[budget]) if budget is not None else dict(color="black", linestyle="--")
        axis.plot(
            *zip(*points, strict=True), marker=markers[model], label=f"{name} C={budget}" if budget else name, **style
        )
    resolutions = sorted({r["resolution"] for r in rows})
    axis.set_xticks(resolutions, [str(r) for r in resolutions])
    return _save_metric_plot(figure, axis, task, "resolution", "resolution (px)", path)


def write_reports(
    results: Sequence[Mapping[str, Any]], output_dir: str | os.PathLike, metadata: Mapping[str, Any] | None = None
) -> list[Path]:
    """Writes `results.json` (metadata + every result), `results.md` (`results_markdown`) and, per task present,
    `<task>_vs_budget.png` and `<task>_vs_resolution.png` into `output_dir`; returns the paths."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    paths = [output_dir / "results.json", output_dir / "results.md"]
    paths[0].write_text(json.dumps({"settings": dict(metadata or {}), "results": list(results)}, indent=2) + "\n")
    paths[1].write_text(results_markdown(results))
    for task in TASK_METRICS:
        if any(r["task"] == task for r in results):
            paths.append(plot_metric_vs_budget(results, task, output_dir / f"{task}_vs_budget.png"))
            paths.append(plot_metric_vs_resolution(results, task, output_dir / f"{task}_vs_resolution.png"))
    return paths
