"""Tests for the pictures of dense features (`veca_hf.evaluation.feature_maps`, `examples/visualize_features.py`) and
the core-attention view (`patch_core_attention*`, `examples/visualize_cores.py --view attention`), on tiny models."""

import importlib.util
import json
import logging
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config, tiny_dinov3_config
from PIL import Image
from transformers import DINOv3ViTModel

from veca_hf import VecaModel, evaluation
from veca_hf.evaluation import feature_maps


EXAMPLES = Path(__file__).parents[1] / "examples"


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def dinov3_dir(tmp_path_factory) -> Path:
    """A saved tiny random DINOv3 folder (patch 16, 4 registers)."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "dinov3-tiny"
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def photo(tmp_path_factory) -> Path:
    """A 120 x 90 (4:3) generated image with a bright square on a gradient."""
    x = np.linspace(0, 255, 120)[None, :, None]
    array = np.broadcast_to(x, (90, 120, 3)).astype(np.uint8).copy()
    array[30:60, 40:80] = (250, 40, 40)
    path = tmp_path_factory.mktemp("images") / "photo.png"
    Image.fromarray(array).save(path)
    return path


@pytest.fixture(scope="module")
def moving_veca() -> VecaModel:
    """Three blocks and a large coordinate step, so that blocks differ."""
    torch.manual_seed(0)
    return VecaModel(tiny_config(num_hidden_layers=3, core_coordinate_step_init=0.5)).eval()


def test_visualize_features_script_writes_png_and_json(veca_dir, dinov3_dir, photo, tmp_path):
    output = tmp_path / "features.png"
    pictures = load_script("visualize_features").main([
        "--model_name_or_path", str(veca_dir), str(dinov3_dir), "--image", str(photo), "--resolutions", "32,64",
        "--budgets", "8,16", "--projection", "pca", "--output", str(output), "--dpi", "60",
    ])  # fmt: skip
    with Image.open(output) as drawn:
        assert drawn.format == "PNG" and drawn.width > 300 and drawn.height > 150
    summary = json.loads(output.with_suffix(".json").read_text())
    assert summary["projection"] == pictures.projection == "pca" and summary["resolutions"] == [32, 64]
    assert [row["label"] for row in summary["rows"]] == ["veca-tiny C=8", "veca-tiny C=16", "dinov3-tiny"]
    # short side 32 -> 32 x 48 pixels (2 x 3 patches); 64 -> 64 x 80 (4 x 5), both sides multiples of 16
    for row, row_summary in zip(pictures.rows, summary["rows"], strict=True):
        assert [entry["grid"] for entry in row_summary["resolutions"]] == [[2, 3], [4, 5]]
        for picture, entry in zip(row.pictures, row_summary["resolutions"], strict=True):
            assert picture.size == tuple(entry["size"]) and picture.image.size == (entry["size"][1], entry["size"][0])
            assert picture.cosine.shape == picture.grid == tuple(entry["grid"])
            assert picture.colours.shape == (*picture.grid, 3) and entry["patch_features_shape"] == [*picture.grid, 64]
            assert entry["mean_cosine"] == pytest.approx(float(picture.cosine.mean()))
            assert bool((picture.colours >= 0).all() and (picture.colours <= 1).all())


def test_features_and_cosine_maps_are_the_models_own(veca_dir, dinov3_dir, photo):
    image = evaluation.load_image(photo)
    models = [evaluation.ProbeModel(str(veca_dir), device="cpu"), evaluation.ProbeModel(str(dinov3_dir), device="cpu")]
    pictures = evaluation.feature_pictures(models, image, [48], budgets=[8], projection="pca")
    _, pixel_values = evaluation.image_at_resolution(image, 48, 16)
    assert pixel_values.shape == (1, 3, 48, 64)
    with torch.no_grad():
        veca_tokens = models[0].model(pixel_values, num_core_tokens=8).last_hidden_state[0]  # (8 + 12, 64)
        dino_tokens = models[1].model(pixel_values=pixel_values).last_hidden_state[0]  # (1 + 4 + 12, 64)
    expected_tokens = [(veca_tokens[0], veca_tokens[8:]), (dino_tokens[0], dino_tokens[5:])]  # (global, patches)
    for row, (global_feature, patches) in zip(pictures.rows, expected_tokens, strict=True):
        picture = row.pictures[0]
        torch.testing.assert_close(picture.patch_features, patches.reshape(3, 4, 64))
        expected = torch.nn.functional.cosine_similarity(patches, global_feature[None], dim=-1).reshape(3, 4)
        torch.testing.assert_close(picture.cosine, expected)


def test_joint_projection_gives_one_colour_per_vector_across_sets():
    generator = torch.Generator().manual_seed(0)
    small, large = torch.randn(2, 3, 16, generator=generator), torch.randn(4, 5, 16, generator=generator) * 3
    large[1, 2] = small[0, 1]  # the same vector at both "resolutions"
    (small_colours, large_colours), method = evaluation.project_to_rgb([small, large], "pca")
    assert method == "pca" and small_colours.shape == (2, 3, 3) and large_colours.shape == (4, 5, 3)
    torch.testing.assert_close(small_colours[0, 1], large_colours[1, 2], rtol=0, atol=1e-6)
    (alone,), _ = evaluation.project_to_rgb([small], "pca")  # a fit of one set alone colours it differently
    assert not torch.allclose(alone, small_colours, atol=1e-3)


def test_feature_pictures_fit_one_projection_per_row_across_resolutions(veca_dir, photo):
    image = evaluation.load_image(photo)
    model = evaluation.ProbeModel(str(veca_dir), device="cpu")
    pictures = evaluation.feature_pictures([model], image, [32, 64], budgets=[16], projection="pca")
    (row,) = pictures.rows
    features = [picture.patch_features for picture in row.pictures]
    joint, _ = evaluation.project_to_rgb(features, "pca", normalize=True)
    for picture, colours, alone in zip(row.pictures, joint, features, strict=True):
        torch.testing.assert_close(picture.colours, colours, rtol=0, atol=0)
        (separate,), _ = evaluation.project_to_rgb([alone], "pca", normalize=True)
        assert not torch.allclose(picture.colours, separate, atol=1e-3)


def test_max_side_bounds_the_long_side(veca_dir, photo, caplog):
    image = evaluation.load_image(photo)  # 120 x 90
    model = evaluation.ProbeModel(str(veca_dir), device="cpu")
    with caplog.at_level(logging.WARNING, logger=feature_maps.__name__):
        pictures = evaluation.feature_pictures([model], image, [32, 64], budgets=[8], projection="pca", max_side=48)
    assert [picture.size for picture in pictures.rows[0].pictures] == [(32, 48), (32, 48)]
    assert "64 px: the long side is capped at max_side 48" in caplog.text and "32 px" not in caplog.text


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
def test_patch_core_attention_sums_to_one_over_the_active_cores(moving_veca, pixel_values, implementation):
    moving_veca.set_attn_implementation(implementation)
    image = pixel_values[:1]  # (1, 3, 64, 48): 4 x 3 patches
    for budget in (8, 16):
        profiles = evaluation.patch_core_attention(moving_veca, image, budget)
        assert profiles.shape == (3, 4, 3, budget) and bool((profiles >= 0).all())
        torch.testing.assert_close(profiles.sum(-1), torch.ones(3, 4, 3))
        with torch.no_grad():
            attentions = moving_veca(image, num_core_tokens=budget, output_attentions=True).attentions
        for layer, attention in enumerate(attentions):  # (1, H, T, T): patches' rows, cores' columns
            expected = attention[0, :, budget:, :budget].mean(0).reshape(4, 3, budget)
            torch.testing.assert_close(profiles[layer], expected, rtol=0, atol=0)
            assert bool((attention[0, :, budget:, budget:] == 0).all())
    moving_veca.set_attn_implementation("sdpa")


@pytest.mark.parametrize("resolution", [64, 96])
def test_visualize_cores_attention_view_writes_png_and_json(veca_dir, photo, tmp_path, resolution):
    output = tmp_path / "attention.png"
    pictures = load_script("visualize_cores").main([
        "--view", "attention", "--model_name_or_path", str(veca_dir), "--image", str(photo), "--budgets", "8,16",
        "--resolution", str(resolution), "--projection", "pca", "--output", str(output),
    ])  # fmt: skip
    with Image.open(output) as drawn:
        assert drawn.format == "PNG" and drawn.width > 300 and drawn.height > 150
    grid = resolution // 16
    assert pictures.projection == "pca" and pictures.grid == (grid, grid)
    for budget in (8, 16):
        assert pictures.profiles[budget].shape == (2, grid, grid, budget)
        assert pictures.colours[budget].shape == (2, grid, grid, 3)
        torch.testing.assert_close(pictures.profiles[budget].sum(-1), torch.ones(2, grid, grid))
    summary = json.loads(output.with_suffix(".json").read_text())
    assert summary["projection"] == "pca" and summary["grid"] == [grid, grid]
    assert summary["budgets"]["16"]["profiles_shape"] == [2, grid, grid, 16]
    assert all(0 <= value <= 1 + 1e-6 for value in summary["budgets"]["8"]["mean_normalised_entropy"])


def test_umap_without_umap_learn_is_a_clear_error_and_auto_falls_back_to_pca(
    veca_dir, photo, tmp_path, monkeypatch, caplog
):
    monkeypatch.setitem(sys.modules, "umap", None)  # `import umap` now raises ImportError
    script = load_script("visualize_features")
    arguments = ["--model_name_or_path", str(veca_dir), "--image", str(photo), "--resolutions", "32,48"]
    with pytest.raises(ImportError, match=r"umap-learn.*viz"):
        script.main([*arguments, "--projection", "umap", "--output", str(tmp_path / "umap.png")])
    assert not (tmp_path / "umap.png").exists()
    with pytest.raises(ImportError, match=r"viz"):
        evaluation.project_to_rgb([torch.randn(8, 4)], "umap")
    with caplog.at_level(logging.WARNING, logger=feature_maps.__name__):
        pictures = script.main([*arguments, "--projection", "auto", "--output", str(tmp_path / "auto.png")])
    assert pictures.projection == "pca" and "umap-learn is not installed" in caplog.text and "PCA" in caplog.text
    assert json.loads((tmp_path / "auto.json").read_text())["projection"] == "pca"


def test_bad_inputs_are_value_errors_naming_them(veca_dir, dinov3_dir, photo, tmp_path):
    features_script, cores_script = load_script("visualize_features"), load_script("visualize_cores")
    common = ["--image", str(photo), "--output", str(tmp_path / "out.png")]
    with pytest.raises(ValueError, match=r"40 is not a multiple of veca-tiny's patch size 16"):
        features_script.main(["--model_name_or_path", str(veca_dir), *common, "--resolutions", "32,40"])
    with pytest.raises(ValueError, match=r"40 is not a multiple of dinov3-tiny's patch size 16"):
        features_script.main(["--model_name_or_path", str(dinov3_dir), *common, "--resolutions", "40"])
    with pytest.raises(ValueError, match=r"--resolution 40 is not a multiple of the patch size 16"):
        cores_script.main(
            ["--view", "attention", "--model_name_or_path", str(veca_dir), *common, "--resolution", "40"]
        )
    missing = str(tmp_path / "no-such-photo.jpg")
    with pytest.raises(ValueError, match="no-such-photo.jpg"):
        features_script.main(["--model_name_or_path", str(veca_dir), "--image", missing, "--resolutions", "32"])
    with pytest.raises(ValueError, match="no-such-photo.jpg"):
        cores_script.main(["--view", "attention", "--model_name_or_path", str(veca_dir), "--image", missing])
    with pytest.raises(ValueError, match="not a valid budget"):
        features_script.main(
            ["--model_name_or_path", str(veca_dir), *common, "--resolutions", "32", "--budgets", "24"]
        )
    assert not (tmp_path / "out.png").exists()


@pytest.mark.slow
def test_umap_projection_when_installed():
    pytest.importorskip("umap")
    generator = torch.Generator().manual_seed(0)
    sets = [torch.randn(4, 5, 16, generator=generator), torch.randn(6, 7, 16, generator=generator)]
    colours, method = evaluation.project_to_rgb(sets, "umap", normalize=True)
    assert method == "umap" and [tuple(c.shape) for c in colours] == [(4, 5, 3), (6, 7, 3)]
    assert all(bool((c >= 0).all() and (c <= 1).all()) for c in colours)
    assert evaluation.resolve_projection("auto") == "umap"
