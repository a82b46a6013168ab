"""Tests for the linear probes and core visualisation (`veca_hf.probing`, `examples/linear_probe.py`,
`examples/visualize_cores.py`).

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

from veca_hf import VecaImageProcessor, VecaModel, probing


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
def veca_dir(tmp_path_factory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "veca-tiny"
    VecaModel(tiny_config()).save_pretrained(path)
    VecaImageProcessor().save_pretrained(path)
    return path


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
        global_features, patches = probing.extract_features(veca, pixel_values, num_core_tokens=8)
        outputs = veca(pixel_values, num_core_tokens=8)
        assert torch.equal(global_features, outputs.pooler_output)
        assert torch.equal(patches, outputs.last_hidden_state[:, 8:].reshape(2, 4, 3, 64))

        global_features, patches = probing.extract_features(dinov3, pixel_values)
        outputs = dinov3(pixel_values)
        assert torch.equal(global_features, outputs.pooler_output)
        assert torch.equal(patches, outputs.last_hidden_state[:, 5:].reshape(2, 4, 3, 64))
    with pytest.raises(ValueError, match="only applies to VECA"):
        probing.extract_features(dinov3, pixel_values, num_core_tokens=8)


def test_resolutions_must_be_multiples_of_every_patch_size(veca_dir, dinov2_dir):
    models = [probing.ProbeModel(str(veca_dir), device="cpu"), probing.ProbeModel(str(dinov2_dir), device="cpu")]
    probing.check_resolutions(models, [32, 64])
    with pytest.raises(ValueError, match="40 is not a multiple of veca-tiny's patch size 16"):
        probing.check_resolutions(models, [32, 40])
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
        probing.ProbeModel(str(broken), device="cpu").model


# ----------------------------------------------------------------------------------------------------------------
# Metrics
# ----------------------------------------------------------------------------------------------------------------


def test_mean_iou_matches_hand_computation_with_ignored_pixels():
    references = np.array([[0, 0, 1], [1, 255, 2]])
    predictions = np.array([[0, 1, 1], [1, 0, 2]])  # the prediction under 255 does not count
    scores = probing.mean_iou(predictions, references, num_labels=4)
    # class 0: |P & R| = 1, |P | R| = 2; class 1: 2 / 3; class 2: 1 / 1; class 3: never seen (nan, skipped)
    np.testing.assert_allclose(scores["per_category_iou"][:3], [1 / 2, 2 / 3, 1.0])
    assert np.isnan(scores["per_category_iou"][3])
    assert scores["mean_iou"] == pytest.approx((1 / 2 + 2 / 3 + 1) / 3)
    assert scores["overall_accuracy"] == pytest.approx(4 / 5)
    assert probing.accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75
    from veca_hf import metrics  # the `evaluate` module: same numbers
    reference = metrics.load_metric("mean_iou").compute(
        predictions=[predictions], references=[references], num_labels=4, ignore_index=255
    )
    assert reference["mean_iou"] == pytest.approx(scores["mean_iou"])
    assert reference["overall_accuracy"] == pytest.approx(scores["overall_accuracy"])
    assert probing.classification_accuracy([1, 2, 3, 4], [1, 2, 0, 4]) == 0.75  # through load_metric("accuracy")


def test_classifier_training_is_seeded():
    features, labels = torch.randn(40, 8), torch.arange(40) % 3
    first, second = (probing.train_linear_classifier(features, labels, 3, steps=20, seed=3) for _ in range(2))
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
    train, test = probing.fashion_mnist(tmp_path, "train"), probing.fashion_mnist(tmp_path, "test")
    assert train.images.shape == (6, 28, 28) and list(test.labels) == [0, 1, 2]
    assert train.image(0).mode == "RGB" and train.image(0).size == (28, 28)
    assert train.class_names[9] == "Ankle boot"
    assert len(train.sample(4)) == 4 and train.sample(4).get_fingerprint() != train.get_fingerprint()


def test_hub_style_dataset_reader(classification_dirs):
    """`--dataset_name` goes through `datasets.load_dataset`; a local image folder exercises it offline."""
    train = probing.hub_image_classification(str(classification_dirs[0].parent), "train")
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
    extract = probing.extract_features

    def counting_extract(*args, **kwargs):
        calls.append(kwargs.get("num_core_tokens", args[2] if len(args) > 2 else None))
        return extract(*args, **kwargs)

    monkeypatch.setattr(probing, "extract_features", counting_extract)
    cache_dir = tmp_path / "cache"

    def run(output_dir):
        return script.main([
            "--model_name_or_path", str(veca_dir), str(dinov2_dir), "--budgets", "8,16", "--resolutions", "32,64",
            "--train_dir", str(classification_dirs[0]), "--validation_dir", str(classification_dirs[1]),
            "--seg_dir", str(segmentation_dirs[0]), "--seg_validation_dir", str(segmentation_dirs[1]),
            "--classification_steps", "100", "--segmentation_steps", "60", "--extraction_batch_size", "16",
            "--device", "cpu", "--extraction_device", "cpu", "--cache_dir", str(cache_dir),
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
            "--model_name_or_path", str(veca_dir), "--resolutions", "32,40", "--train_dir", str(classification_dirs[0]),
            "--validation_dir", str(classification_dirs[1]), "--output_dir", str(tmp_path),
        ])  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Cores
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moving_veca() -> VecaModel:
    """Three blocks and a large coordinate step, so that cores visibly move between blocks."""
    torch.manual_seed(0)
    return VecaModel(tiny_config(num_hidden_layers=3, core_coordinate_step_init=0.5)).eval()


def test_core_attention_maps_are_the_model_attentions_and_sum_to_one(moving_veca, pixel_values):
    image = pixel_values[:1]  # (1, 3, 64, 48): 4 x 3 patches
    maps = probing.core_attention_maps(moving_veca, image, num_core_tokens=16, cores=range(3))
    assert maps.patch_maps.shape == (3, 3, 4, 3) and maps.core_weights.shape == (3, 3, 16)
    with torch.no_grad():
        attentions = moving_veca(image, num_core_tokens=16, output_attentions=True).attentions
    for layer, attention in enumerate(attentions):  # (1, H, T, T)
        rows = attention[0, :, :3].mean(0)  # cores 1..3 over all 16 + 12 tokens, averaged over heads
        torch.testing.assert_close(maps.patch_maps[layer], rows[:, 16:].reshape(3, 4, 3), rtol=0, atol=0)
        torch.testing.assert_close(maps.core_weights[layer], rows[:, :16], rtol=0, atol=0)
    patch_part, core_part = maps.patch_maps.sum((-2, -1)), maps.core_weights.sum(-1)  # (L, k) each
    torch.testing.assert_close(patch_part + core_part, torch.ones_like(patch_part))
    torch.testing.assert_close(patch_part, 1 - core_part)
    assert bool((patch_part <= 1 + 1e-6).all()) and bool((maps.patch_maps >= 0).all())


def test_core_positions_per_layer(moving_veca, pixel_values):
    image = pixel_values[1:]
    positions = probing.core_positions_per_layer(moving_veca, image, num_core_tokens=16)
    assert positions.shape == (3, 16, 2)
    with torch.no_grad():
        outputs = moving_veca(image, num_core_tokens=16, output_hidden_states=True)
    torch.testing.assert_close(positions[-1], outputs.core_coordinates[0], rtol=0, atol=0)
    # independent recomputation: block 1 uses the bank, block l + 1 moves by the head applied to block l's cores
    embeddings, encoder = moving_veca.embeddings, moving_veca.encoder
    raw = torch.cat(list(embeddings.core_coordinates[:2]))[None]  # (1, 16, 2)
    torch.testing.assert_close(positions[0], torch.tanh(raw[0]))
    with torch.no_grad():
        for layer in (1, 2):
            raw = encoder.core_coordinate_heads[layer - 1](outputs.hidden_states[layer][:, :16], raw)
            torch.testing.assert_close(positions[layer], torch.tanh(raw[0]))
    assert not torch.allclose(positions[0], positions[1])  # the cores moved


def test_visualize_cores_script_writes_png(veca_dir, tmp_path):
    image_path, output = tmp_path / "image.png", tmp_path / "cores.png"
    Image.fromarray(noisy(COLOURS["green"], (80, 96), np.random.default_rng(0))).save(image_path)
    maps = load_script("visualize_cores").main([
        "--model_name_or_path", str(veca_dir), "--image", str(image_path), "--num_core_tokens", "16",
        "--num_cores_shown", "3", "--resolution", "64", "--output", str(output),
    ])  # fmt: skip
    with Image.open(output) as drawn:
        assert drawn.format == "PNG" and drawn.width > 400 and drawn.height > 300
    assert maps.patch_maps.shape == (2, 3, 4, 4) and maps.core_positions.shape == (2, 16, 2)
    torch.testing.assert_close(maps.patch_maps.sum((-2, -1)) + maps.core_weights.sum(-1), torch.ones(2, 3))
