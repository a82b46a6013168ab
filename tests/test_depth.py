"""Tests for the depth probe: the `depth` metric module, the depth readers (`veca_hf.evaluation.depth_dataset` and
friends), the dense probe with one output, and `examples/linear_probe.py --task depth`.

Everything is generated: a tiny VECA and scenes whose depth is a function of position (a floor receding towards the
top of the image, brighter where it is near) and of a drawn shape (a yellow rectangle standing nearer than the floor),
with holes without ground truth (0 and NaN) as a Kinect leaves them.
"""

import importlib.util
import json
import math
from pathlib import Path

import datasets
import numpy as np
import pytest
import torch
import transformers
from conftest import tiny_config
from PIL import Image

from veca_hf import VecaModel, evaluation
from veca_hf.metrics import compute_metric, load_metric


EXAMPLES = Path(__file__).parents[1] / "examples"
RESOLUTION = 64  # 4 x 4 patches of the tiny VECA


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny probes: on a busy 2-core machine intra-op threads cost more than they save. Also undoes the probe script's
    process-wide `disable_progress_bar` for the test modules that follow."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    transformers.utils.logging.enable_progress_bar()


def scene(rng: np.random.Generator, size: int = 64) -> tuple[np.ndarray, np.ndarray]:
    """An `(H, W, 3)` uint8 image and its `(H, W)` float32 depth in metres: a floor from 4 m (top row) to 1 m (bottom
    row), lighter where nearer, and a yellow rectangle at 0.8 m in a random place; 10% of the pixels are holes (half
    0, half NaN)."""
    rows = np.arange(size, dtype=np.float32)[:, None].repeat(size, 1) / (size - 1)  # 0 at the top, 1 at the bottom
    depth = 4.0 - 3.0 * rows
    image = np.repeat((40 + 160 * rows)[..., None], 3, axis=-1)
    height, width = rng.integers(16, 33, size=2)
    top, left = rng.integers(0, size - height + 1), rng.integers(0, size - width + 1)
    depth[top : top + height, left : left + width] = 0.8
    image[top : top + height, left : left + width] = (240, 200, 40)
    image = np.clip(image + rng.normal(0, 8, image.shape), 0, 255).astype(np.uint8)
    holes = rng.random(depth.shape) < 0.1
    depth[holes] = np.where(rng.random(int(holes.sum())) < 0.5, 0.0, np.nan)
    return image, depth


def scenes(count: int, seed: int) -> evaluation.ImageSet:
    images, depths = zip(*(scene(np.random.default_rng([seed, index])) for index in range(count)), strict=True)
    return evaluation.ImageSet(list(images), depths=list(depths))


# ----------------------------------------------------------------------------------------------------------------
# The metric
# ----------------------------------------------------------------------------------------------------------------


def test_depth_metric_matches_hand_computation():
    """Pooled over the valid pixels of both images; reference 0 or NaN is ignored, whatever the prediction there."""
    predictions = [np.array([[1.0, 2.0], [3.0, np.nan]]), np.array([[2.0, 6.0, -1.0]])]
    references = [np.array([[1.0, 2.5], [0.0, 0.0]]), np.array([[4.0, np.nan, 0.0]])]
    # valid pixels (pred, gt): (1, 1), (2, 2.5), (2, 4) -> errors 0, -0.5, -2; ratios 1, 1.25 (not < 1.25), 2
    expected = {"rmse": math.sqrt((0 + 0.25 + 4) / 3), "abs_rel": (0 + 0.5 / 2.5 + 2 / 4) / 3, "delta1": 1 / 3}
    scores = compute_metric("depth", predictions, references)
    assert scores == pytest.approx(expected)
    # per image first would give mean(sqrt(0.25 / 2), 2) for the RMSE: the pooled value is the documented one
    assert scores["rmse"] != pytest.approx((math.sqrt(0.125) + 2) / 2)
    assert load_metric("depth").compute(predictions=predictions, references=references) == pytest.approx(expected)
    # arrays of any shape; a prediction <= 0 at a valid pixel is a miss for delta1
    assert compute_metric("depth", np.array([[[-1.0, 2.0]]]), np.array([[[1.0, 2.0]]]))["delta1"] == 0.5


def test_depth_metric_rejects_bad_input():
    with pytest.raises(ValueError, match=r"shape \(2, 3\) was given for a reference of shape \(2, 2\)"):
        compute_metric("depth", np.ones((2, 3)), np.ones((2, 2)))
    with pytest.raises(ValueError, match="No valid pixel"):
        compute_metric("depth", [np.ones((2, 2))], [np.array([[0.0, np.nan], [0.0, 0.0]])])
    with pytest.raises(ValueError, match="non-finite values .* at pixels with ground truth"):
        compute_metric("depth", np.array([1.0, np.nan]), np.array([1.0, 2.0]))
    with pytest.raises(ValueError, match="negative depths"):
        compute_metric("depth", np.ones(2), np.array([1.0, -2.0]))
    with pytest.raises(ValueError, match="2 predictions for 1 references"):
        compute_metric("depth", [np.ones(2), np.ones(2)], [np.ones(2)])


# ----------------------------------------------------------------------------------------------------------------
# The probe
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def depth_features():
    """Features of 32 training and 16 held-out scenes from a tiny random VECA at budget 8, with their depth maps."""
    torch.manual_seed(0)
    model = VecaModel(tiny_config()).eval()
    sets = scenes(32, seed=0), scenes(16, seed=1)
    features = [evaluation.compute_features(model, s, RESOLUTION, 8, with_patches=True) for s in sets]
    return features, [s.depths_at(RESOLUTION) for s in sets]


def test_depth_probe_beats_the_mean_predictor(depth_features):
    (train, held_out), (train_depths, held_out_depths) = depth_features
    mean_depth = float(train_depths[train_depths > 0].mean())
    baseline = compute_metric("depth", np.full(held_out_depths.shape, mean_depth), held_out_depths.numpy())["rmse"]

    def held_out_rmse(steps: int) -> float:
        probe = evaluation.train_linear_depth_estimator(train["patches"], train["global"], train_depths, steps=steps)
        predicted = evaluation.predict_depth(probe, held_out["patches"], held_out["global"], (RESOLUTION, RESOLUTION))
        assert predicted.shape == held_out_depths.shape and predicted.dtype == torch.float32
        return compute_metric("depth", predicted.numpy(), held_out_depths.numpy())["rmse"]

    trained = held_out_rmse(steps=100)
    assert trained < 0.8 * baseline, (trained, baseline)  # measured: 0.44 against 0.98
    assert held_out_rmse(steps=0) > 0.8 * baseline  # the bar is not met by a probe that never trains


def test_depth_probe_ignores_pixels_without_ground_truth(depth_features):
    """Holes as 0 or as NaN train the same probe: the loss never sees them (a NaN reaching it would poison it)."""
    (train, _), (train_depths, _) = depth_features
    as_zero = torch.nan_to_num(train_depths, nan=0.0)
    as_nan = torch.where(as_zero > 0, as_zero, torch.nan)
    first, second = (
        evaluation.train_linear_depth_estimator(train["patches"], train["global"], depths, steps=10)
        for depths in (as_zero, as_nan)
    )
    assert torch.isfinite(second.linear.weight).all()
    assert torch.equal(first.linear.weight, second.linear.weight) and torch.equal(
        first.linear.bias, second.linear.bias
    )
    with pytest.raises(ValueError, match="No training pixel has a depth"):
        evaluation.train_linear_depth_estimator(train["patches"], train["global"], torch.zeros_like(as_zero), steps=1)


# ----------------------------------------------------------------------------------------------------------------
# Readers
# ----------------------------------------------------------------------------------------------------------------


def depth_png(depth: np.ndarray) -> Image.Image:
    """A depth map in metres as a 16-bit PNG image in millimetres (holes: 0), as NYUv2 copies store it."""
    return Image.fromarray(np.round(np.nan_to_num(depth, nan=0.0) * 1000).astype(np.uint16))


def test_hub_style_depth_table_detects_columns_and_scales(tmp_path):
    """A Parquet folder with Hub split names (what `load_dataset` reads from a Hub copy), `img` and `depth_map`
    columns holding 16-bit PNGs in millimetres: columns detected, depth in metres, the images' crop geometry."""
    rng = np.random.default_rng(0)
    pairs = [scene(rng, size=48) for _ in range(3)]
    table = datasets.Dataset.from_dict(
        {"img": [Image.fromarray(image) for image, _ in pairs], "depth_map": [depth_png(d) for _, d in pairs]},
        features=datasets.Features({"img": datasets.Image(), "depth_map": datasets.Image()}),
    )
    (tmp_path / "data").mkdir()
    table.to_parquet(tmp_path / "data" / "train-00000-of-00001.parquet")
    table.select([2]).to_parquet(tmp_path / "data" / "validation-00000-of-00001.parquet")

    train, validation = evaluation.depth_splits(str(tmp_path), depth_scale=1000)
    assert (len(train), len(validation)) == (3, 1)
    np.testing.assert_allclose(validation.depth(0), np.nan_to_num(pairs[2][1], nan=0.0), atol=6e-4)
    # the crop of a depth map is the crop of its image: same geometry as the label maps (nearest neighbour)
    labels = np.arange(48 * 48).reshape(48, 48) % 251 + 1
    aligned = evaluation.ImageSet([pairs[0][0]], masks=[labels.astype(np.uint8)], depths=[labels.astype(np.float32)])
    for resolution in (16, 32):
        assert torch.equal(aligned.depths_at(resolution), aligned.masks_at(resolution).float())


def test_depth_readers_name_the_bad_column_or_sample():
    rng = np.random.default_rng(0)
    images = [Image.fromarray(scene(rng, size=40)[0]) for _ in range(3)]
    depths = [np.full((40, 40), 2.0, np.float32) for _ in range(3)]
    table = datasets.Dataset.from_dict({"image": images, "depth": depths})

    with pytest.raises(ValueError, match="no column 'depth_gt' \\(the depth column asked for\\)"):
        evaluation.depth_dataset(table, depth_column="depth_gt")
    with pytest.raises(ValueError, match="Cannot find the depth column .* among \\['image', 'label'\\]"):
        evaluation.depth_dataset(table.rename_column("depth", "label"))
    with pytest.raises(ValueError, match="Cannot find the image column"):
        evaluation.depth_dataset(table.rename_column("image", "photo"))
    assert evaluation.depth_dataset(table).depths_at(32).shape == (3, 32, 32)  # the good table reads

    empty = list(depths)
    empty[1] = np.where(np.eye(40, dtype=bool), np.nan, 0.0).astype(np.float32)  # no valid pixel
    with pytest.raises(ValueError, match="Depth map of sample 1 is empty"):
        evaluation.ImageSet(images, depths=empty).depths_at(32)
    mismatched = list(depths)
    mismatched[2] = np.full((40, 30), 2.0, np.float32)
    with pytest.raises(ValueError, match="sample 2 is 40x30 \\(height x width\\) but its image is 40x40"):
        evaluation.depth_dataset(datasets.Dataset.from_dict({"image": images, "depth": mismatched})).depths_at(32)
    with pytest.raises(ValueError, match="depth_scale must be a positive number"):
        evaluation.ImageSet(images, depths=depths, depth_scale=0)


# ----------------------------------------------------------------------------------------------------------------
# The probe script
# ----------------------------------------------------------------------------------------------------------------


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_linear_probe_script_depth_task(veca_dir, tmp_path):
    """`--task depth` on a folder of images and 16-bit PNG depth maps in millimetres: a quarter held out, RMSE, AbsRel
    and delta1 per budget in results.json and results.md, and the probe beats the mean predictor there too."""
    folder = tmp_path / "scenes"
    (folder / "images").mkdir(parents=True)
    (folder / "depth").mkdir()
    for index in range(32):
        image, depth = scene(np.random.default_rng([2, index]))
        Image.fromarray(image).save(folder / "images" / f"{index:02d}.jpg", quality=95)
        depth_png(depth).save(folder / "depth" / f"{index:02d}.png")
    script = load_script("linear_probe")
    arguments = [
        "--model_name_or_path", str(veca_dir), "--budgets", "8,16", "--resolutions", str(RESOLUTION),
        "--depth_dataset", str(folder), "--depth_scale", "1000", "--depth_steps", "100", "--device", "cpu",
        "--extraction_device", "cpu", "--feature_cache_dir", str(tmp_path / "cache"),
        "--output_dir", str(tmp_path / "out"),
    ]  # fmt: skip
    results = script.main(["--task", "depth", *arguments])

    stored = json.loads((tmp_path / "out" / "results.json").read_text())
    assert stored["results"] == json.loads(json.dumps(results))
    assert stored["settings"]["task"] == ["depth"] and stored["settings"]["depth_scale"] == 1000
    assert [(r["task"], r["metric"], r["budget"]) for r in results] == [("depth", "rmse", 8), ("depth", "rmse", 16)]
    for result in results:
        assert (result["num_train"], result["num_eval"]) == (24, 8)
        assert 0 < result["value"] < 0.8 * result["mean_depth_rmse"], result  # metres: the scale was applied
        assert 0 < result["abs_rel"] < 1 and 0 <= result["delta1"] <= 1
    table = (tmp_path / "out" / "results.md").read_text()
    assert "### Depth: RMSE, AbsRel (lower is better), δ1 (%)" in table
    assert "| resolution | veca-tiny C=16 | veca-tiny C=8 |" in table
    assert f"| {RESOLUTION} px, RMSE | {results[1]['value']:.4f} | {results[0]['value']:.4f} |" in table
    assert f"| {RESOLUTION} px, δ1 (%) | {100 * results[1]['delta1']:.2f} |" in table
    assert (tmp_path / "out" / "depth_vs_budget.png").stat().st_size > 0

    with pytest.raises(SystemExit):  # --task depth without depth data is a usage error, before any work
        script.main(["--task", "depth", "--model_name_or_path", str(veca_dir), "--output_dir", str(tmp_path)])
