"""Tests for the linear probes (`veca_hf.evaluation`: data readers, features, probes, scores, reports) and
`examples/linear_probe.py`. Core tracing is in `test_core_tracing.py`.

Everything is generated: a tiny VECA, tiny DINOv2 / DINOv3 models from configs, a three-colour classification set
and a segmentation set whose label map is a left / right split (which colour is on which side varies).
"""

import gzip
import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_config, tiny_dinov3_config
from PIL import Image
from transformers import Dinov2Config, Dinov2Model, DINOv3ViTModel

from veca_hf import VecaModel, evaluation
from veca_hf.metrics import compute_metric, load_metric


EXAMPLES = Path(__file__).parents[1] / "examples"
COLOURS = {"red": (200, 40, 40), "green": (40, 180, 60), "blue": (40, 60, 200)}


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def noisy(colour, size, rng) -> np.ndarray:
    """A solid colour plus Gaussian noise, `(H, W, 3)` uint8."""
    image = np.asarray(colour, np.float32) + rng.normal(0, 25, (*size, 3))
    return np.clip(image, 0, 255).astype(np.uint8)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """The probes here are tiny: on a busy 2-core machine intra-op threads cost ten times more than they save.
    Also undoes the probe script's process-wide `disable_progress_bar` for the test modules that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    transformers.utils.logging.enable_progress_bar()


@pytest.fixture(scope="module")
def dinov2_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "dinov2-tiny"
    config = Dinov2Config(
        hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64, patch_size=8, image_size=32
    )
    Dinov2Model(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def classification_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """Three classes of solid colours plus noise: 8 training and 4 held-out images each, sizes varying."""
    root = tmp_path_factory.mktemp("colours")
    rng = np.random.default_rng(0)
    for split, count in (("train", 8), ("validation", 4)):
        for name, colour in COLOURS.items():
            (root / split / name).mkdir(parents=True)
            for index in range(count):
                size = (int(rng.integers(40, 72)), int(rng.integers(40, 72)))
                Image.fromarray(noisy(colour, size, rng)).save(root / split / name / f"{index}.png")
    return root / "train", root / "validation"


@pytest.fixture(scope="module")
def segmentation_dirs(tmp_path_factory) -> tuple[Path, Path]:
    """Left / right halves of two colours (label 0 = red, 1 = blue, sides drawn at random), a 255 band between."""
    root = tmp_path_factory.mktemp("halves")
    rng = np.random.default_rng(1)
    for split, count in (("train", 12), ("validation", 6)):
        (root / split / "images").mkdir(parents=True)
        (root / split / "masks").mkdir(parents=True)
        for index in range(count):
            order = [0, 1] if rng.random() < 0.5 else [1, 0]
            colours = [COLOURS["red"], COLOURS["blue"]]
            halves = [noisy(colours[order[0]], (64, 32), rng), noisy(colours[order[1]], (64, 32), rng)]
            image = np.concatenate(halves, axis=1)
            mask = np.zeros((64, 64), np.uint8)
            mask[:, :32], mask[:, 32:], mask[:, 30:34] = order[0], order[1], 255
            Image.fromarray(image).save(root / split / "images" / f"{index}.jpg")
            Image.fromarray(mask).save(root / split / "masks" / f"{index}.png")
    return root / "train", root / "validation"


# ----------------------------------------------------------------------------------------------------------------
# Features
# ----------------------------------------------------------------------------------------------------------------


def test_extract_features_matches_each_layout(pixel_values):
    veca = VecaModel(tiny_config()).eval()
    dinov3 = DINOv3ViTModel(tiny_dinov3_config()).eval()  # CLS + 4 registers
    with torch.no_grad():
        global_features, patches = evaluation.extract_features(veca, pixel_values, num_core_tokens=8)
        outputs = veca(pixel_values, num_core_tokens=8)
        assert torch.equal(global_features, outputs.pooler_output)
        assert torch.equal(patches, outputs.last_hidden_state[:, 8:].reshape(2, 4, 3, 64))

        global_features, patches = evaluation.extract_features(dinov3, pixel_values)
        outputs = dinov3(pixel_values)
        assert torch.equal(global_features, outputs.pooler_output)
        assert torch.equal(patches, outputs.last_hidden_state[:, 5:].reshape(2, 4, 3, 64))
    with pytest.raises(ValueError, match="only applies to VECA"):
        evaluation.extract_features(dinov3, pixel_values, num_core_tokens=8)


def test_resolutions_must_be_multiples_of_every_patch_size(veca_dir, dinov2_dir):
    models = [evaluation.ProbeModel(str(path), device="cpu") for path in (veca_dir, dinov2_dir)]
    evaluation.check_resolutions(models, [32, 64])
    with pytest.raises(ValueError, match="40 is not a multiple of veca-tiny's patch size 16"):
        evaluation.check_resolutions(models, [32, 40])
    with pytest.raises(ValueError, match="not a valid budget"):
        models[0].budgets([8, 24])
    assert models[1].budgets([8, 16]) == [None]  # one "budget" for non-VECA models


def test_probe_model_refuses_incomplete_checkpoints(veca_dir, tmp_path):
    """A weight the checkpoint lacks would be random: probing such a model must fail, not report noise."""
    import shutil

    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(veca_dir, broken)
    weights = load_file(broken / "model.safetensors")
    del weights["norm.weight"]
    save_file(weights, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="does not match its model code"):
        _ = evaluation.ProbeModel(str(broken), device="cpu").model


# ----------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------


def test_probe_scores_are_the_shipped_metrics_without_arrow():
    """The probes score with `compute_metric`: the `veca_hf.metrics` modules' own numbers (those `Trainer` fine-tuning
    gets from `.compute`), on arrays, without `evaluate`'s Arrow table."""
    references = np.array([[[0, 0, 1], [1, 255, 2]]], np.uint8)  # (N, H, W), 255 = ignored
    predictions = np.array([[[0, 1, 1], [1, 0, 2]]], np.uint8)  # the prediction under 255 does not count
    scores = compute_metric("mean_iou", predictions, references, num_labels=4, ignore_index=255)
    # class 0: |P & R| = 1, |P | R| = 2; class 1: 2 / 3; class 2: 1 / 1; class 3: never seen (nan, skipped)
    np.testing.assert_allclose(scores["per_category_iou"][:3], [1 / 2, 2 / 3, 1.0])
    assert np.isnan(scores["per_category_iou"][3])
    assert scores["mean_iou"] == pytest.approx((1 / 2 + 2 / 3 + 1) / 3)
    assert scores["overall_accuracy"] == pytest.approx(4 / 5)
    reference = load_metric("mean_iou").compute(
        predictions=list(predictions), references=list(references), num_labels=4, ignore_index=255
    )
    for key in ("mean_iou", "mean_accuracy", "overall_accuracy"):
        assert scores[key] == reference[key], key
    np.testing.assert_array_equal(scores["per_category_iou"], reference["per_category_iou"])

    predicted, labels = np.array([1, 2, 3, 4]), np.array([1, 2, 0, 4])
    assert compute_metric("accuracy", predicted, labels) == {"accuracy": 0.75}
    assert load_metric("accuracy").compute(predictions=predicted, references=labels) == {"accuracy": 0.75}


def test_classifier_training_is_seeded():
    features, labels = torch.randn(40, 8), torch.arange(40) % 3
    first, second = (evaluation.train_linear_classifier(features, labels, 3, steps=20, seed=3) for _ in range(2))
    assert torch.equal(first.linear.weight, second.linear.weight)


# ----------------------------------------------------------------------------------------------------------------
# Data readers
# ----------------------------------------------------------------------------------------------------------------


def write_idx(path: Path, array: np.ndarray) -> None:
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    with gzip.open(path, "wb") as file:
        file.write(header + array.astype(np.uint8).tobytes())


def test_fashion_mnist_reader(tmp_path):
    rng = np.random.default_rng(0)
    for prefix, count in (("train", 6), ("t10k", 3)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte.gz", rng.integers(0, 256, (count, 28, 28)))
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte.gz", np.arange(count) % 10)
    train, test = evaluation.fashion_mnist(tmp_path, "train"), evaluation.fashion_mnist(tmp_path, "test")
    assert train.images.shape == (6, 28, 28) and list(test.labels) == [0, 1, 2]
    assert train.image(0).mode == "RGB" and train.image(0).size == (28, 28)
    assert train.class_names[9] == "Ankle boot"
    assert len(train.sample(4)) == 4 and train.sample(4).get_fingerprint() != train.get_fingerprint()


def test_hub_style_dataset_reader(classification_dirs):
    """`--dataset_name` goes through `datasets.load_dataset`; a local image folder exercises it offline."""
    train = evaluation.hub_image_classification(str(classification_dirs[0].parent), "train")
    assert len(train) == 24 and sorted(set(train.labels.tolist())) == [0, 1, 2]
    assert train.image(0).mode == "RGB" and train.class_names == ["blue", "green", "red"]


# ----------------------------------------------------------------------------------------------------------------
# The probe script
# ----------------------------------------------------------------------------------------------------------------


def test_linear_probe_script_side_by_side_and_cached(
    veca_dir, dinov2_dir, classification_dirs, segmentation_dirs, tmp_path, monkeypatch
):
    script = load_script("linear_probe")
    calls = []
    extract = evaluation.extract_features

    def counting_extract(*args, **kwargs):
        calls.append(kwargs.get("num_core_tokens", args[2] if len(args) > 2 else None))
        return extract(*args, **kwargs)

    monkeypatch.setattr("veca_hf.evaluation.features.extract_features", counting_extract)  # compute_features's
    cache_dir = tmp_path / "cache"

    def run(output_dir):
        return script.main([
            "--model_name_or_path", str(veca_dir), str(dinov2_dir), "--budgets", "8,16", "--resolutions", "32,64",
            "--train_dir", str(classification_dirs[0]), "--validation_dir", str(classification_dirs[1]),
            "--seg_dir", str(segmentation_dirs[0]), "--seg_validation_dir", str(segmentation_dirs[1]),
            "--classification_steps", "100", "--segmentation_steps", "60", "--per_device_eval_batch_size", "16",
            "--device", "cpu", "--extraction_device", "cpu", "--feature_cache_dir", str(cache_dir),
            "--output_dir", str(output_dir),
        ])  # fmt: skip

    results = run(tmp_path / "first")
    output = tmp_path / "first"
    for name in ("results.json", "results.md", "classification_vs_budget.png", "classification_vs_resolution.png",
                 "segmentation_vs_budget.png", "segmentation_vs_resolution.png"):  # fmt: skip
        assert (output / name).stat().st_size > 0, name
    for name in ("classification_vs_budget.png", "segmentation_vs_resolution.png"):
        with Image.open(output / name) as image:
            assert image.format == "PNG" and image.width > 300

    stored = json.loads((output / "results.json").read_text())
    assert stored["results"] == json.loads(json.dumps(results))
    keys = {(r["task"], r["model_name"], r["budget"], r["resolution"]) for r in results}
    expected = {(task, "veca-tiny", budget, resolution) for task in ("classification", "segmentation")
                for budget in (8, 16) for resolution in (32, 64)}  # fmt: skip
    expected |= {(task, "dinov2-tiny", None, resolution) for task in ("classification", "segmentation")
                 for resolution in (32, 64)}  # fmt: skip
    assert keys == expected and len(results) == len(expected)
    for result in results:
        if result["task"] == "classification":  # three colours: the probe learns them
            assert result["value"] > 0.9, result
            assert (result["num_train"], result["num_eval"]) == (24, 12)
        else:  # colour decides the label, whichever side it is on: the dense probe learns it too
            assert result["value"] > 0.8 and len(result["per_category_iou"]) == 2, result
    table = (output / "results.md").read_text()
    assert "| resolution | veca-tiny C=16 | veca-tiny C=8 | dinov2-tiny |" in table
    assert "| 64 px |" in table and "### Segmentation: mIoU (%)" in table

    # (VECA at 2 budgets + DINOv2) x 2 resolutions x (train, eval) x (global, dense) feature sets, one file each
    cached = sorted(cache_dir.rglob("*.safetensors"))
    assert len(cached) == (2 + 1) * 2 * 2 * 2
    assert len(calls) > 0 and set(calls) == {8, 16, None}
    mtimes = {path: path.stat().st_mtime_ns for path in cached}

    calls.clear()
    again = run(tmp_path / "second")
    assert calls == []  # every feature came from the cache: no forward pass at all
    assert {path: path.stat().st_mtime_ns for path in cache_dir.rglob("*.safetensors")} == mtimes
    assert [r["value"] for r in again] == [r["value"] for r in results]  # seeded probes: identical numbers


def test_linear_probe_script_rejects_bad_resolution(veca_dir, classification_dirs, tmp_path):
    script = load_script("linear_probe")
    with pytest.raises(ValueError, match="not a multiple of veca-tiny's patch size"):
        script.main([
            "--model_name_or_path", str(veca_dir), "--resolutions", "32,40",
            "--train_dir", str(classification_dirs[0]), "--validation_dir", str(classification_dirs[1]),
            "--output_dir", str(tmp_path),
        ])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# k-NN, intervals, teacher-student cosine
# ----------------------------------------------------------------------------------------------------------------


def test_knn_classify_finds_the_cluster_and_k1_is_the_nearest_neighbour():
    generator = torch.Generator().manual_seed(0)
    centres = torch.randn(3, 16, generator=generator) * 5
    labels = torch.arange(3).repeat_interleave(20)  # (60,)
    train = centres[labels] + torch.randn(60, 16, generator=generator)
    queries = centres.repeat(4, 1) + 0.5 * torch.randn(12, 16, generator=generator)
    predicted = evaluation.knn_classify(train, labels, queries, num_classes=3, k=10, batch_size=5)
    assert predicted.tolist() == [0, 1, 2] * 4
    # k = 1: the label of the most cosine-similar training feature, whatever the temperature
    nearest = torch.nn.functional.normalize(queries, dim=-1) @ torch.nn.functional.normalize(train, dim=-1).T
    expected = labels[nearest.argmax(-1)]
    assert torch.equal(evaluation.knn_classify(train, labels, queries, 3, k=1, temperature=5.0), expected)
    # k larger than the training set is clipped, not an error
    assert evaluation.knn_classify(train[:4], labels[:4], queries, 3, k=50).shape == (12,)
    with pytest.raises(ValueError, match="labels"):
        evaluation.knn_classify(train, labels[:5], queries, 3)


def test_knn_classify_votes_are_weighted_by_similarity():
    train = torch.tensor([[1.0, 0.0], [0.0, 1.0], [0.1, 1.0]])  # one close neighbour of class 0, two far of class 1
    labels = torch.tensor([0, 1, 1])
    query = torch.tensor([[1.0, 0.05]])
    assert evaluation.knn_classify(train, labels, query, 2, k=3, temperature=0.07).item() == 0  # sharp: nearest wins
    assert evaluation.knn_classify(train, labels, query, 2, k=3, temperature=100.0).item() == 1  # flat: majority


def test_wilson_interval_matches_known_values():
    low, high = evaluation.wilson_interval(50, 100)
    assert low == pytest.approx(0.4038, abs=1e-4) and high == pytest.approx(0.5962, abs=1e-4)
    low, high = evaluation.wilson_interval(0, 10)
    assert low == 0.0 and high == pytest.approx(0.2775, abs=1e-4)  # never below 0, unlike the normal interval
    low, high = evaluation.wilson_interval(4000, 5000)  # the study's size: about +-1.1 points
    assert 0.788 < low < 0.8 < high < 0.812
    with pytest.raises(ValueError):
        evaluation.wilson_interval(3, 2)


def test_paired_bootstrap_interval_of_a_difference():
    rng = np.random.default_rng(0)
    a = rng.random(2000) < 0.8
    b = a.copy()
    b[:100] = ~b[:100]  # differs from a on 100 images
    low, high = evaluation.paired_bootstrap_interval(lambda x, y: x - y, a, b, num_resamples=500)
    observed = a.mean() - b.mean()
    assert low <= observed <= high and high - low < 0.03  # paired: much narrower than two independent intervals
    assert evaluation.paired_bootstrap_interval(lambda x, y: x - y, a, a, num_resamples=50) == (0.0, 0.0)
    with pytest.raises(ValueError, match="same length"):
        evaluation.paired_bootstrap_interval(lambda x, y: x - y, a, b[:10])


def test_global_feature_cosine_separates_common_direction_from_image_variation():
    generator = torch.Generator().manual_seed(0)
    teacher = torch.randn(64, 32, generator=generator)
    assert evaluation.global_feature_cosine(teacher, teacher)["cosine"] == pytest.approx(1.0)
    offset = torch.zeros(32)
    offset[0] = 50.0
    # A student that outputs only the shared direction: high raw cosine, nothing image-specific.
    constant = offset.expand(64, 32) + 1e-3 * torch.randn(64, 32, generator=generator)
    scores = evaluation.global_feature_cosine(constant, teacher + offset)
    assert scores["cosine"] > 0.9 and abs(scores["centred_cosine"]) < 0.2 and scores["num_images"] == 64
    with pytest.raises(ValueError, match="equal shape"):
        evaluation.global_feature_cosine(teacher, teacher[:, :16])


def test_run_linear_probes_adds_knn_intervals_and_predictions(veca_dir, classification_dirs):
    """With `knn_k`, classification gives a `knn` result beside the linear probe's; both carry a Wilson interval
    around the shipped metric's accuracy and the per-image predictions it was computed from."""
    train = evaluation.image_folder(classification_dirs[0])
    validation = evaluation.image_folder(classification_dirs[1], class_names=train.class_names)
    settings = evaluation.ProbeSettings(classification_steps=50, knn_k=3, per_device_eval_batch_size=16, device="cpu")
    model = evaluation.ProbeModel(str(veca_dir), device="cpu")
    results = evaluation.run_linear_probes([model], [32], [8], classification=(train, validation), settings=settings)
    assert [r["task"] for r in results] == ["classification", "knn"]
    for result in results:
        assert len(result["predictions"]) == len(validation) == result["num_eval"]
        assert result["value"] == compute_metric("accuracy", result["predictions"], validation.labels)["accuracy"]
        assert 0.0 <= result["interval_low"] <= result["value"] <= result["interval_high"] <= 1.0
    knn = evaluation.knn_classify(
        evaluation.compute_features(model.model, train, 32, 8)["global"], train.labels,
        evaluation.compute_features(model.model, validation, 32, 8)["global"], len(train.class_names), k=3,
    )  # fmt: skip
    assert results[1]["predictions"] == knn.tolist()
    assert "### k-NN classification: top-1 accuracy (%)" in evaluation.results_markdown(results)
