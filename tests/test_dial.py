"""The budget dial's pictures (`veca_hf.demo.dial`): shapes at every budget, one PCA basis for all budgets, a
click on the right patch, cores over the image, attention costs that grow with the budget, the drawn pictures and
`dial` (every picture of the demo, with a teacher beside), clear errors; a too-large upload refused from its header
before any decode; one core's attention computed without any `(T, T)` map."""

import zlib

import numpy as np
import PIL.Image
import PIL.ImageFile
import pytest
import torch
from conftest import tiny_config
from torch.utils._python_dispatch import TorchDispatchMode

from veca_hf import VecaModel
from veca_hf.demo.dial import (
    MAX_PIXELS,
    DialImage,
    attention_cost,
    core_attention,
    core_pixels,
    cost_plot,
    dial,
    draw_cores,
    heatmap,
    patch_at,
    patch_colours,
    patch_features_by_budget,
    patch_picture,
    similarity_map,
    timed_forward,
)
from veca_hf.evaluation.core_tracing import core_attention_in_block
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
    odd = DialImage.prepare(np.zeros((100, 2000, 3), np.uint8), 28, 14, max_side=1024)  # 1024 is no multiple of 14
    assert max(odd.pixel_values.shape[-2:]) <= 1022 and odd.pixel_values.shape[-1] % 14 == 0


def test_bad_uploads_and_resolutions_are_clear_errors():
    with pytest.raises(ValueError, match="upload a JPEG, PNG or WebP"):
        DialImage.prepare("notes.txt", 32, 16)
    with pytest.raises(ValueError, match=r"got \(4, 4\) float64"):
        DialImage.prepare(np.zeros((4, 4)), 32, 16)
    with pytest.raises(ValueError, match="not a positive multiple of the patch size 16"):
        DialImage.prepare(np.zeros((40, 40, 3), np.uint8), 40, 16)


def png_header_only(path, width: int, height: int):
    """A valid 1-bit PNG of `width x height` pixels, written without ever holding its pixels: a few KB on disk that
    decode to `width * height` bytes in PIL (`* 3` as RGB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return len(data).to_bytes(4, "big") + kind + data + zlib.crc32(kind + data).to_bytes(4, "big")

    header = width.to_bytes(4, "big") + height.to_bytes(4, "big") + bytes([1, 0, 0, 0, 0])  # 1 bit, grey
    compressor, row = zlib.compressobj(9), bytes(1 + (width + 7) // 8)  # filter byte + packed bits, all zero
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b""))
    return path


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's warning past 89 megapixels
def test_a_too_large_upload_is_refused_from_its_header_before_any_decode(tmp_path, monkeypatch):
    huge = png_header_only(tmp_path / "huge.png", 12_000, 12_000)  # 144 megapixels in a few KB
    assert huge.stat().st_size < 100_000 and MAX_PIXELS < 12_000**2

    def no_decode(image):
        raise AssertionError("the image was decoded")

    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", no_decode)  # PNG decoding goes through it
    for upload in (huge, str(huge), PIL.Image.open(huge)):
        with pytest.raises(ValueError, match=r"12000 x 12000 pixels \(144 megapixels\).*limit of 50 megapixels"):
            DialImage.prepare(upload, 224, 16)
    with pytest.raises(ValueError, match="upload a JPEG, PNG or WebP"):
        DialImage.prepare(tmp_path / "missing.png", 224, 16)
    bomb = png_header_only(tmp_path / "bomb.png", 20_000, 20_000)  # past PIL's own limit, which refuses it on open
    with pytest.raises(ValueError, match=r"exceeds limit of 178956970 pixels.*at most 50 megapixels"):
        DialImage.prepare(bomb, 224, 16)
    monkeypatch.undo()
    small = png_header_only(tmp_path / "small.png", 90, 60)
    prepared = DialImage.prepare(str(small), 32, 16)  # a path within the limit: opened, decoded, prepared
    assert prepared.image.mode == "RGB" and prepared.pixel_values.shape == (1, 3, 32, 48)
    with pytest.raises(ValueError, match=r"90 x 60 pixels .* limit of 0.001 megapixels"):
        DialImage.prepare(str(small), 32, 16, max_pixels=1000)


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


class LargestSquare(TorchDispatchMode):
    """Records every op output whose last two sides are both `side` (a `(T, T)` attention map)."""

    def __init__(self, side: int):
        super().__init__()
        self.side, self.found = side, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(tensor, torch.Tensor) and tensor.ndim >= 2 and tensor.shape[-2:] == (self.side,) * 2:
                self.found.append((str(func), tuple(tensor.shape)))
        return out


def test_one_cores_attention_is_its_row_of_the_full_map_without_building_the_map(dial_image):
    torch.manual_seed(0)
    model = VecaModel(tiny_config(num_hidden_layers=3, core_coordinate_step_init=0.5)).eval()
    model.set_attn_implementation("eager")
    with torch.no_grad():
        full = model(dial_image.pixel_values, num_core_tokens=16, output_attentions=True).attentions  # (1, H, T, T)
    for block, core in ((0, 0), (1, 5), (2, 15), (-1, 3)):
        row = core_attention_in_block(model, dial_image.pixel_values, 16, block=block, core=core)  # (H, T)
        torch.testing.assert_close(row, full[block][0, :, core], rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(row.sum(-1), torch.ones(2))
    picture = core_attention(model, dial_image, 16, block=1, core=5)
    torch.testing.assert_close(picture, full[1][0, :, 5, 16:].mean(0).reshape(2, 3), rtol=1e-5, atol=1e-7)
    num_tokens = 16 + 2 * 3
    with LargestSquare(num_tokens) as spy:
        core_attention(model, dial_image, 16, block=2, core=0)
    assert spy.found == []  # O(T): no (T, T) map, not even for the block shown
    with pytest.raises(ValueError, match=r"block must be in \[-3, 3\)"):
        core_attention_in_block(model, dial_image.pixel_values, 16, block=3)
    with pytest.raises(ValueError, match=r"core must be one of the 8 active cores \(0 to 7\), got 8"):
        core_attention_in_block(model, dial_image.pixel_values, 8, core=8)


def test_attention_costs_grow_with_the_budget_and_stay_below_dense():
    config = tiny_config()
    small, large = attention_cost(config, 8, [64, 256]), attention_cost(config, 16, [64, 256])
    assert [row["resolution"] for row in small] == [64, 256]
    assert all(a["veca_flops"] < b["veca_flops"] for a, b in zip(small, large, strict=True))
    assert small[1]["dense_flops"] == large[1]["dense_flops"] and small[1]["ratio"] < small[0]["ratio"] < 1.5
    assert large[1]["ratio"] < 1  # 256 patches: dense attention's N^2 dominates


def test_values_are_drawn_one_square_per_patch(dial_image):
    colours = np.arange(18, dtype=np.uint8).reshape(2, 3, 3) * 10
    picture = patch_picture(colours, (48, 32))
    assert picture.size == (48, 32) and picture.getpixel((20, 10)) == tuple(colours[0, 1])  # 16 px per patch
    values = torch.tensor([[0.0, 0.5, 1.0], [1.0, 0.5, 0.0]])
    over = heatmap(values, dial_image.image, value_range=(0.0, 1.0), alpha=1.0)  # the colours alone
    assert over.size == dial_image.image.size
    assert sum(over.getpixel((40, 8))) > sum(over.getpixel((8, 8)))  # magma: high values bright
    assert over.getpixel((8, 8)) == over.getpixel((40, 24))  # equal values, equal colours
    dots = draw_cores(dial_image.image, np.array([[10.0, 10.0], [30.0, 20.0]]), chosen=1)
    assert dots.size == dial_image.image.size and dots.getpixel((10, 10)) == (0, 255, 255)
    plot = cost_plot(attention_cost(tiny_config(), 8, [64, 128]), 64)
    assert plot.mode == "RGB" and plot.size == (420, 280)


def test_dial_gives_every_picture_for_one_budget_and_a_teacher_beside(model):
    from transformers import Dinov2Config, Dinov2Model

    torch.manual_seed(0)
    teacher = Dinov2Model(Dinov2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                       intermediate_size=64, patch_size=14, image_size=56)).eval()  # fmt: skip
    image = np.random.default_rng(1).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    answers = {}
    for budget in (8, 16):
        out = dial(model, image, budget, 64, block=-1, core=2, click=(5, 60), teacher=teacher)
        size = out.patches.size
        assert size == (96, 64)  # short side 64, multiples of 16
        for picture in (out.similarity, out.cores, out.core_attention, out.teacher_patches, out.teacher_similarity):
            assert picture.size == size
        assert out.clicked_patch == (3, 0) and out.seconds > 0 and out.notes == []
        answers[budget] = out.attention_flops
    assert answers[8] < answers[16]  # (at 16 patches, dense attention is cheaper than 16 cores: the plot shows where)
    assert dial(model, image, 8, 64, teacher=None).teacher_patches is None
    patch14 = VecaModel(tiny_config(patch_size=14)).eval()  # its cost plot's sides: multiples of 14 up to 1022
    assert dial(patch14, image, 8, 56, cost_resolutions=(224, 1024)).attention_flops > 0
    bounded = dial(model, np.zeros((64, 640, 3), np.uint8), 8, 64, max_side=256)
    assert "long side would pass 256 px" in bounded.notes[0]
    for kwargs, message in (
        ({"budget": 12}, "budget=12 is not a valid budget"),
        ({"block": 2}, r"block must be in \[-2, 2\)"),
        ({"core": 8}, r"one of the 8 active cores \(0 to 7\)"),
        ({"click": (500, 0)}, "outside the 96 x 64 image"),
    ):
        with pytest.raises(ValueError, match=message):
            dial(model, image, **{"budget": 8, "resolution": 64, **kwargs})


def test_dial_shows_the_budget_the_fitted_policy_picks():
    from veca_hf import AdaptiveBudget

    torch.manual_seed(0)
    model = VecaModel(tiny_config(core_bank_size=32)).eval()
    image = np.random.default_rng(2).integers(0, 256, (70, 100, 3), dtype=np.uint8)
    assert dial(model, image, 8, 64).policy_budget is None  # no policy fitted
    AdaptiveBudget.fit(model, torch.randn(30, 3, 64, 96, generator=torch.Generator().manual_seed(0)), 0.9)
    out = dial(model, image, 8, 64)
    pixel_values = DialImage.prepare(PIL.Image.fromarray(image), 64, 16).pixel_values
    with torch.no_grad():
        expected = int(model(pixel_values, num_core_tokens="auto").core_mask.sum())
    assert out.policy_budget == expected and expected in (8, 16, 32)
