# Copyright 2026 The veca_hf Authors. Licensed under the Apache License, Version 2.0.
"""The README's main job around `examples/distill.py`: the images it distils on, and the probe that closes it.

- [`write_distillation_pool`]: Fashion-MNIST training images and random views of real photos, shuffled together into
  parquet shards, with a held-out validation shard (Fashion-MNIST *test* images and views of held-out photos).
- [`probe_against_random`]: is the distilled student worth keeping? A linear probe of its global feature (the first
  core) and of its mean patch feature on labelled Fashion-MNIST test images it never saw, at every budget, against a
  randomly initialised VECA of the same shape and against the teacher, with 95% intervals.

`python -m veca_hf.demo pool DIR` and `python -m veca_hf.demo probe CONFIG` run them (`bash run.sh` does both).
Fashion-MNIST comes from Debian's `dataset-fashion-mnist` package (`run.sh` installs it) or any folder of its four
IDX files.
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import PIL.Image
import torch


# where Debian's `dataset-fashion-mnist` puts the four IDX files
DEBIAN_FASHION_MNIST_DIR = Path("/usr/share/datasets/fashion-mnist")
FASHION_MNIST_ENV = "VECA_HF_FASHION_MNIST"


def find_fashion_mnist(directory: str | os.PathLike | None = None) -> Path:
    """The Fashion-MNIST folder: `directory`, else `$VECA_HF_FASHION_MNIST`, else Debian's.

    Raises:
        ValueError: when none holds the IDX files, naming how to get them.
    """
    candidate = directory or os.environ.get(FASHION_MNIST_ENV) or DEBIAN_FASHION_MNIST_DIR
    path = Path(candidate).expanduser()
    if not any(path.glob("t10k-labels-idx1-ubyte*")):
        raise ValueError(
            f"No Fashion-MNIST IDX files in {path}. Install them with `sudo apt-get install dataset-fashion-mnist` "
            f"(Debian / Ubuntu), or point --fashion_mnist_dir (or ${FASHION_MNIST_ENV}) at a folder holding "
            "train-images-idx3-ubyte.gz, train-labels-idx1-ubyte.gz, t10k-images-idx3-ubyte.gz and "
            "t10k-labels-idx1-ubyte.gz."
        )
    return path


# ------------------------------------------------------------------------------------------------------------------
# The distillation pool
# ------------------------------------------------------------------------------------------------------------------


def _encode(image: PIL.Image.Image, fmt: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buffer.getvalue()


def photo_crops(image: PIL.Image.Image, count: int, rng: np.random.Generator, side: int) -> list[bytes]:
    """`count` JPEG views of a photo: the whole photo, then random crops (15-100% of the area, aspect 3:4 to 4:3),
    each resized so that its short side is `side` (large photos would otherwise give the stream few distinct views
    at a low resolution)."""
    width, height = image.size
    views = []
    for index in range(count):
        box = (0, 0, width, height)
        if index > 0:
            area = width * height * rng.uniform(0.15, 1.0)
            aspect = float(np.exp(rng.uniform(np.log(3 / 4), np.log(4 / 3))))
            w, h = min(width, round((area * aspect) ** 0.5)), min(height, round((area / aspect) ** 0.5))
            x, y = int(rng.integers(0, width - w + 1)), int(rng.integers(0, height - h + 1))
            box = (x, y, x + w, y + h)
        crop = image.crop(box)
        scale = side / min(crop.size)
        crop = crop.resize((max(side, round(crop.width * scale)), max(side, round(crop.height * scale))),
                           PIL.Image.Resampling.BICUBIC)  # fmt: skip
        views.append(_encode(crop, "JPEG"))
    return views


@dataclass
class PoolSettings:
    """What goes into the pool (`write_distillation_pool`)."""

    photo_crops: int = 125  # views of each training photo
    heldout_photos: int = 3  # photos (first by name) held out of training, into the validation shard
    heldout_photo_crops: int = 8  # views of each held-out photo (the first: the whole photo)
    train_fashion_mnist: int | None = None  # Fashion-MNIST training images (None: all 60,000)
    validation_fashion_mnist: int = 256  # Fashion-MNIST test images (the first ones) in the validation shard
    num_shards: int = 8  # training shards, so that several workers each stream whole files
    side: int = 140  # short side of the stored photo views, px
    seed: int = 0


def write_distillation_pool(
    output_dir: str | os.PathLike, photos_dir: str | os.PathLike, fashion_mnist_dir: str | os.PathLike,
    settings: PoolSettings | None = None,
) -> Path:  # fmt: skip
    """The distillation pool as parquet shards (`image` bytes and a `source` string per row), written once.

    `train-*.parquet`: Fashion-MNIST training images (stored at 28 px: distil with `--min_image_size 28`) and
    `settings.photo_crops` views of each training photo, shuffled together and dealt round-robin into
    `settings.num_shards` files. `validation-*.parquet`: the first `settings.validation_fashion_mnist` Fashion-MNIST
    *test* images and `settings.heldout_photo_crops` views of each held-out photo. `manifest.json` is written last:
    a folder that has it is complete and is kept as it is; one without it is written again from scratch.

    Returns:
        `output_dir` as a `Path`.

    Raises:
        ValueError: if `photos_dir` has no more photos than are held out.
    """
    import datasets

    from ..evaluation import fashion_mnist
    from ..evaluation.datasets import IMAGE_EXTENSIONS

    settings = settings or PoolSettings()
    output_dir = Path(output_dir)
    if (output_dir / "manifest.json").exists():
        return output_dir
    rng = np.random.default_rng(settings.seed)
    photos = sorted(p for p in Path(photos_dir).iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS)
    if len(photos) <= settings.heldout_photos:
        raise ValueError(f"{photos_dir} has {len(photos)} photos; {settings.heldout_photos} are held out.")
    records = {"train": [], "validation": []}
    for index, path in enumerate(photos):
        held_out = index < settings.heldout_photos
        count = settings.heldout_photo_crops if held_out else settings.photo_crops
        with PIL.Image.open(path) as image:
            views = photo_crops(image.convert("RGB"), count, rng, settings.side)
        records["validation" if held_out else "train"] += [(v, f"photo/{path.stem}/{k}") for k, v in enumerate(views)]
    for split, name, limit in (
        ("train", "train", settings.train_fashion_mnist),
        ("validation", "test", settings.validation_fashion_mnist),
    ):
        images = fashion_mnist(fashion_mnist_dir, name).images[:limit]  # (N, 28, 28) uint8
        records[split] += [(_encode(PIL.Image.fromarray(a), "PNG"), f"fashion-mnist/{name}/{i}") for i, a in
                           enumerate(images)]  # fmt: skip
    features = datasets.Features({"image": datasets.Image(), "source": datasets.Value("string")})
    shutil.rmtree(output_dir, ignore_errors=True)  # an incomplete earlier write
    output_dir.mkdir(parents=True)
    counts = {}
    for split, num_shards in (("train", settings.num_shards), ("validation", 1)):
        order = rng.permutation(len(records[split])) if split == "train" else np.arange(len(records[split]))
        for shard in range(num_shards):
            part = [records[split][i] for i in order[shard::num_shards]]
            table = {"image": [{"bytes": b, "path": None} for b, _ in part], "source": [s for _, s in part]}
            datasets.Dataset.from_dict(table, features=features).to_parquet(
                str(output_dir / f"{split}-{shard:05d}-of-{num_shards:05d}.parquet")
            )
        counts[split] = {
            "images": len(records[split]),
            "photo_views": sum(s.startswith("photo/") for _, s in records[split]),
            "shards": num_shards,
        }
    manifest = {**counts, "photos": [p.name for p in photos]}
    (output_dir / "manifest.json").write_text(json.dumps(manifest, indent=2))
    return output_dir


# ------------------------------------------------------------------------------------------------------------------
# The probe against a random network
# ------------------------------------------------------------------------------------------------------------------


@dataclass
class ProbeRow:
    """One model (at one budget) and feature: its probe accuracy on the test images, and which it got right."""

    model: str  # "student" | "random" | "teacher"
    budget: int | None
    feature: str  # "global" (first core / CLS) | "patches" (mean of the patch features)
    correct: np.ndarray  # (N,) bool

    @property
    def accuracy(self) -> float:
        return float(self.correct.mean())


def _probe_features(model: torch.nn.Module, pixel_values: torch.Tensor, budget: int | None) -> dict[str, torch.Tensor]:
    """`(N, 3, R, R)` -> the global feature and the mean patch feature, `(N, D)` each."""
    from ..evaluation import extract_features

    batches = [extract_features(model, batch, budget) for batch in pixel_values.split(128)]
    return {
        "global": torch.cat([global_features for global_features, _ in batches]),
        "patches": torch.cat([patches.mean(dim=(1, 2)) for _, patches in batches]),
    }


def probe_against_random(
    student: torch.nn.Module, teacher: torch.nn.Module, images, resolution: int, budgets: list[int] | None = None,
    num_train: int | None = None, probe_steps: int = 1000, seed: int = 0,
) -> list[ProbeRow]:  # fmt: skip
    """Linear probes of a distilled VECA, of a random VECA of the same shape and of its teacher on labelled images.

    A probe is trained on the first `num_train` images (half when `None`) and scored on the rest, on the frozen
    global feature (VECA: the first core; teacher: CLS) and on the mean of the patch features, at every budget of
    `budgets` (the student config's when `None`). The random VECA is `VecaModel(student.config)` initialised under
    `torch.manual_seed(seed)`.

    Args:
        images (`veca_hf.evaluation.ImageSet`): labelled images the student never trained on.

    Returns:
        One [`ProbeRow`] per model, budget and feature.
    """
    from .. import VecaModel
    from ..evaluation import train_linear_classifier
    from ..evaluation.linear_probes import predict_classes

    num_train = len(images) // 2 if num_train is None else num_train
    if not 0 < num_train < len(images):
        raise ValueError(f"num_train must leave test images among the {len(images)}; got {num_train}.")
    labels = torch.as_tensor(images.labels)
    num_classes = int(labels.max()) + 1
    torch.manual_seed(seed)
    random_model = VecaModel(student.config).eval()
    budgets = list(budgets or student.config.budgets)
    models = [("teacher", teacher, None)] + [(name, m, b) for b in budgets for name, m in
                                            (("student", student), ("random", random_model))]  # fmt: skip
    from ..evaluation import preprocess_image

    # NOTE: preprocessed once for every model and budget (the image processor costs more than these small models)
    pixel_values = torch.stack([preprocess_image(images.image(i), resolution) for i in range(len(images))])
    rows = []
    with torch.inference_mode():
        extracted = [(name, budget, _probe_features(model.eval(), pixel_values, budget))
                     for name, model, budget in models]  # fmt: skip
    for name, budget, features in extracted:
        for feature, values in features.items():
            probe = train_linear_classifier(values[:num_train], labels[:num_train], num_classes, steps=probe_steps,
                                            seed=seed)  # fmt: skip
            correct = (predict_classes(probe, values[num_train:]) == labels[num_train:]).numpy()
            rows.append(ProbeRow(name, budget, feature, correct))
    return rows


def fashion_mnist_probe_images(fashion_mnist_dir: str | os.PathLike, num_images: int = 600):
    """The last `num_images` Fashion-MNIST test images (labelled; the pool's validation shard takes the first ones,
    its training shards none)."""
    from ..evaluation import fashion_mnist

    test_split = fashion_mnist(fashion_mnist_dir, "test")
    return test_split.subset(range(len(test_split) - num_images, len(test_split)))


def probe_table(rows: list[ProbeRow]) -> tuple[str, bool]:
    """A Markdown table of `rows` (accuracy, 95% Wilson interval, student minus random with a paired-bootstrap
    interval) and whether the student beats the random network at every budget on both features (the interval of
    the difference above zero)."""
    from ..evaluation.statistics import paired_bootstrap_interval, wilson_interval

    def cell(row: ProbeRow) -> str:
        low, high = wilson_interval(int(row.correct.sum()), row.correct.size)
        return f"{100 * row.accuracy:.1f} [{100 * low:.1f}, {100 * high:.1f}]"

    by_key = {(r.model, r.budget, r.feature): r for r in rows}
    teacher = {f: by_key[("teacher", None, f)] for f in ("global", "patches")}
    lines = [
        "| budget | feature | student | random VECA | student - random | teacher |",
        "|---|---|---|---|---|---|",
    ]
    beats = True
    for budget in sorted({r.budget for r in rows if r.budget is not None}):
        for feature in ("global", "patches"):
            student, random_row = by_key[("student", budget, feature)], by_key[("random", budget, feature)]
            low, high = paired_bootstrap_interval(lambda a, b: a - b, student.correct, random_row.correct)
            beats &= low > 0
            difference = 100 * (student.accuracy - random_row.accuracy)
            lines.append(
                f"| C={budget} | {feature} | {cell(student)} | {cell(random_row)} | {difference:+.1f} "
                f"[{100 * low:+.1f}, {100 * high:+.1f}] | {cell(teacher[feature])} |"
            )
    return "\n".join(lines), beats


def probe_distilled_student(
    config_file: str | os.PathLike, fashion_mnist_dir: str | os.PathLike | None = None, num_images: int = 600,
    probe_steps: int = 1000,
) -> bool:  # fmt: skip
    """Probe the student that `examples/distill.py CONFIG_FILE` saved (`probe_against_random`), print the table and
    the verdict, and write `probe_against_random.json` beside the student.

    The teacher, resolution, seed and output folder are read from the same YAML file, so the probe sees the student
    and the teacher that the run used (the offline stand-in teacher only when the file opts in with
    `allow_teacher_fallback`). The probe takes the last `num_images` Fashion-MNIST test images, half to train it, and
    probes the student's smallest and largest budgets (each budget costs a pass over the images).

    Returns:
        Whether the student beats its random network at every budget, on both features.
    """
    import time

    import yaml
    from transformers import AutoModel

    from .. import VecaModel
    from ..hub.access import DEFAULT_TEACHER_FALLBACK_DIR, resolve_teacher

    config = yaml.safe_load(Path(config_file).read_text())
    student_dir = Path(config["output_dir"])
    if not (student_dir / "config.json").exists():
        raise ValueError(f"{student_dir} holds no saved student: run `examples/distill.py {config_file}` first.")
    teacher_path = resolve_teacher(
        config["teacher_name_or_path"],
        Path(config.get("teacher_fallback_dir", DEFAULT_TEACHER_FALLBACK_DIR)).expanduser(),
        allow_fallback=bool(config.get("allow_teacher_fallback", False)),
        fallback_flag="allow_teacher_fallback: true",
    )
    resolution = int(str(config.get("resolution", 256)).split(",")[0])
    start = time.perf_counter()
    images = fashion_mnist_probe_images(find_fashion_mnist(fashion_mnist_dir), num_images)
    student, teacher = VecaModel.from_pretrained(student_dir), AutoModel.from_pretrained(teacher_path)
    budgets = [min(student.config.budgets), max(student.config.budgets)]
    rows = probe_against_random(student, teacher, images, resolution, budgets, probe_steps=probe_steps,
                                seed=int(config.get("seed", 0)))  # fmt: skip
    table, beats = probe_table(rows)
    num_test = rows[0].correct.size
    print(
        f"\nLinear probe on {num_test} held-out Fashion-MNIST test images (trained on {len(images) - num_test:,} "
        f"others), {resolution} px, "
        f"accuracy % [95% interval], {time.perf_counter() - start:.0f} s:\n{table}"
    )
    if beats:
        print(f"The student beats a random VECA of its shape at C = {budgets[0]} and {budgets[-1]}, on the global and "
              "the patch features.")  # fmt: skip
    else:
        print(
            "The student does NOT beat a random VECA of its shape everywhere (rows whose 'student - random' interval "
            "reaches 0 or below): its features are not yet worth more than a random network's. Train longer or on "
            "more images (docs/training.md)."
        )
    results = {
        "resolution": resolution,
        "num_test_images": num_test,
        "student_beats_random_everywhere": beats,
        "rows": [{"model": r.model, "budget": r.budget, "feature": r.feature, "accuracy": r.accuracy} for r in rows],
    }
    (student_dir / "probe_against_random.json").write_text(json.dumps(results, indent=2))
    return beats
