"""The budget dial's pictures (`veca_hf.evaluation.dial`): shapes at every budget, one PCA basis for all budgets, a
click on the right patch, cores over the image, attention costs that grow with the budget, clear errors."""

import numpy as np
import PIL.Image
import pytest
import torch
from conftest import tiny_config

from veca_hf import VecaModel
from veca_hf.evaluation.dial import (
    DialImage,
    attention_cost,
    core_attention,
    core_pixels,
    patch_at,
    patch_colours,
    patch_features_by_budget,
    similarity_map,
    timed_forward,
)
from veca_hf.evaluation.feature_maps import project_to_rgb


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return VecaModel(tiny_config()).eval()  # patch 16, budgets 8 and 16, 2 blocks


@pytest.fixture(scope="module")
def dial_image():
    rng = np.random.default_rng(0)
    return DialImage.prepare(PIL.Image.fromarray(rng.integers(0, 256, (60, 90, 3), dtype=np.uint8)), 32, 16)


def test_an_image_is_prepared_at_the_resolution_and_bounded_in_size(dial_image):
    assert dial_image.pixel_values.shape == (1, 3, 32, 48) and dial_image.grid == (2, 3)
    assert dial_image.image.size == (48, 32) and dial_image.resized_from is None
    large = DialImage.prepare(np.zeros((200, 1000, 3), np.uint8), 64, 16, max_side=256)
    assert large.resized_from == (1000, 200) and max(large.image.size) <= 256


def test_bad_uploads_and_resolutions_are_clear_errors():
    with pytest.raises(ValueError, match="upload a JPEG, PNG or WebP"):
        DialImage.prepare("notes.txt", 32, 16)
    with pytest.raises(ValueError, match=r"got \(4, 4\) float64"):
        DialImage.prepare(np.zeros((4, 4)), 32, 16)
    with pytest.raises(ValueError, match="not a positive multiple of the patch size 16"):
        DialImage.prepare(np.zeros((40, 40, 3), np.uint8), 40, 16)


def test_colours_share_one_basis_across_budgets(model, dial_image):
    features = patch_features_by_budget(model, dial_image.pixel_values, [8, 16])
    assert {budget: tuple(f.shape) for budget, f in features.items()} == {8: (2, 3, 64), 16: (2, 3, 64)}
    colours = patch_colours(features)
    assert {budget: c.shape for budget, c in colours.items()} == {8: (2, 3, 3), 16: (2, 3, 3)}
    assert all(c.dtype == np.uint8 for c in colours.values())
    # one basis: the colours of budget 8 depend on budget 16's features too (a joint fit), unlike a fit of 8 alone
    alone = (project_to_rgb([features[8]], method="pca")[0][0].numpy() * 255).round().astype(np.uint8)
    assert not np.array_equal(alone, colours[8])


def test_a_click_maps_to_the_patch_under_it_and_its_similarity_is_one(model, dial_image):
    grid, size = dial_image.grid, dial_image.image.size  # (2, 3), (48, 32)
    assert patch_at(0, 0, size, grid) == (0, 0)
    assert patch_at(47.9, 31.9, size, grid) == (1, 2)
    assert patch_at(20, 10, size, grid) == (0, 1)
    with pytest.raises(ValueError, match="outside the 48 x 32 image"):
        patch_at(48, 0, size, grid)
    features = patch_features_by_budget(model, dial_image.pixel_values, [8])[8]
    similarity = similarity_map(features, 0, 1)
    assert similarity.shape == (2, 3) and similarity[0, 1] == pytest.approx(1.0, abs=1e-5)
    assert similarity.max() <= 1 + 1e-5


def test_cores_sit_over_the_image_and_attend_to_its_patches(model, dial_image):
    for budget in (8, 16):
        pixels = core_pixels(model, dial_image, budget, block=1)
        assert pixels.shape == (budget, 2)
        assert (pixels >= 0).all() and (pixels[:, 0] <= 48).all() and (pixels[:, 1] <= 32).all()
        attention = core_attention(model, dial_image, budget, block=0, core=budget - 1)
        assert attention.shape == (2, 3) and 0 < float(attention.sum()) <= 1 + 1e-5  # the rest goes to the cores
    with pytest.raises(ValueError, match=r"block must be in \[0, 2\)"):
        core_pixels(model, dial_image, 8, block=2)
    assert timed_forward(model, dial_image.pixel_values, 8) > 0


def test_attention_costs_grow_with_the_budget_and_stay_below_dense():
    config = tiny_config()
    small, large = attention_cost(config, 8, [64, 256]), attention_cost(config, 16, [64, 256])
    assert [row["resolution"] for row in small] == [64, 256]
    assert all(a["veca_flops"] < b["veca_flops"] for a, b in zip(small, large, strict=True))
    assert small[1]["dense_flops"] == large[1]["dense_flops"] and small[1]["ratio"] < small[0]["ratio"] < 1.5
    assert large[1]["ratio"] < 1  # 256 patches: dense attention's N^2 dominates
