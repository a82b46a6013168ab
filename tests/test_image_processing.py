"""Tests for the VECA image processors: `VecaImageProcessorPil` (PIL backend), `VecaImageProcessor` (torchvision
backend), their shared settings, the saved folder's remote code, and the deprecated names."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageFilter
from transformers import AutoImageProcessor

import veca_hf
from veca_hf.model.image_processing_pil_veca import VecaImageProcessorPil
from veca_hf.model.image_processing_veca import VecaImageProcessor


MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float64)
STD = np.array([0.229, 0.224, 0.225], dtype=np.float64)
BLACK = -MEAN / STD  # normalized value of a 0 pixel
WHITE = (1.0 - MEAN) / STD  # normalized value of a 255 pixel

# Measured max |PIL - torchvision| on natural-like content is 2 uint8 levels = 2 / 255 / 0.224 ~= 0.035 (see the
# docstring of image_processing_veca.py); the mean difference stays below ~3e-4.
PIL_VS_TORCHVISION_ATOL = 0.04
PIL_VS_TORCHVISION_MEAN_TOL = 1e-3

SRC_DIR = Path(__file__).resolve().parents[1] / "src"
PIL_MODULE_PATH = SRC_DIR / "veca_hf" / "model" / "image_processing_pil_veca.py"


def random_image(height=300, width=400, seed=0, mode="RGB"):
    rng = np.random.RandomState(seed)
    image = Image.fromarray(rng.randint(0, 256, (height, width, 3), dtype=np.uint8))
    return image if mode == "RGB" else image.convert(mode)


def natural_like_image(height, width, seed):
    """Blurred noise: smooth content without saturated high-frequency detail."""
    return random_image(height, width, seed).filter(ImageFilter.GaussianBlur(2))


def pixel_values(processor, images, **kwargs):
    return processor(images, return_tensors="pt", **kwargs)["pixel_values"]


@pytest.fixture(scope="module")
def processor():
    return VecaImageProcessorPil()


@pytest.fixture(scope="module")
def torchvision_processor():
    pytest.importorskip("torchvision")
    return VecaImageProcessor()


def test_defaults(processor):
    assert processor.size == {"shortest_edge": 288}
    assert processor.crop_size == {"height": 256, "width": 256}
    assert int(processor.resample) == 3  # PILImageResampling.BICUBIC
    assert processor.do_resize and processor.do_center_crop and processor.do_rescale and processor.do_normalize
    assert processor.do_convert_rgb
    assert processor.rescale_factor == pytest.approx(1 / 255)
    assert tuple(processor.image_mean) == pytest.approx(tuple(MEAN))
    assert tuple(processor.image_std) == pytest.approx(tuple(STD))
    assert processor.model_input_names == ["pixel_values"]


def test_default_output_shape_non_square(processor):
    out = processor(random_image(300, 400), return_tensors="pt")
    assert list(out.keys()) == ["pixel_values"]
    assert out["pixel_values"].shape == (1, 3, 256, 256)
    assert out["pixel_values"].dtype == torch.float32
    # portrait and a batch of mixed sizes
    assert pixel_values(processor, random_image(500, 333)).shape == (1, 3, 256, 256)
    assert pixel_values(processor, [random_image(300, 400), random_image(97, 131, seed=1)]).shape == (2, 3, 256, 256)


@pytest.mark.parametrize("mode", ["L", "RGBA", "CMYK", "P", "LA"])
def test_non_rgb_modes_become_rgb(processor, mode):
    image = random_image(300, 400, mode=mode)
    assert image.mode == mode
    assert pixel_values(processor, image).shape == (1, 3, 256, 256)


def test_mode_conversion_values(processor):
    rgb = random_image(300, 400)
    reference = pixel_values(processor, rgb)
    # RGB -> CMYK -> RGB is lossless in PIL, and an opaque RGBA image equals its RGB content.
    torch.testing.assert_close(pixel_values(processor, rgb.convert("CMYK")), reference, atol=1e-6, rtol=0)
    torch.testing.assert_close(pixel_values(processor, rgb.convert("RGBA")), reference, atol=1e-6, rtol=0)
    # A grayscale image gives three identical channels before normalization.
    gray = pixel_values(processor, rgb.convert("L"))[0].numpy()
    unnormalized = gray * STD[:, None, None] + MEAN[:, None, None]
    np.testing.assert_allclose(unnormalized[0], unnormalized[1], atol=1e-5)
    np.testing.assert_allclose(unnormalized[0], unnormalized[2], atol=1e-5)
    # A fully transparent RGBA image is composited on white.
    transparent = Image.fromarray(np.zeros((300, 400, 4), dtype=np.uint8), mode="RGBA")
    out = pixel_values(processor, transparent)[0].numpy()
    np.testing.assert_allclose(out, np.broadcast_to(WHITE[:, None, None], out.shape), atol=1e-5)


def test_normalization_by_hand(processor):
    # round(255 * (0.485, 0.456, 0.406)) = (124, 116, 104)
    out = pixel_values(processor, Image.new("RGB", (400, 300), (124, 116, 104)))[0].numpy()
    # Hand computation: (124 / 255 - 0.485) / 0.229 = (0.4862745 - 0.485) / 0.229 = 0.0055655
    #                   (116 / 255 - 0.456) / 0.224 = (0.4549020 - 0.456) / 0.224 = -0.0049020
    #                   (104 / 255 - 0.406) / 0.225 = (0.4078431 - 0.406) / 0.225 = 0.0081918
    expected = np.array([0.0055655, -0.0049020, 0.0081918])
    np.testing.assert_allclose(out, np.broadcast_to(expected[:, None, None], out.shape), atol=1e-5)
    assert abs(out[0]).max() < 0.01  # 255 * 0.485 -> ~0 in channel 0

    # Black and white: -mean / std and (1 - mean) / std.
    black = pixel_values(processor, Image.new("RGB", (400, 300), (0, 0, 0)))[0].numpy()
    white = pixel_values(processor, Image.new("RGB", (400, 300), (255, 255, 255)))[0].numpy()
    np.testing.assert_allclose(black[:, 0, 0], [-2.1179039, -2.0357143, -1.8044444], atol=1e-5)
    np.testing.assert_allclose(white[:, 0, 0], [2.2489083, 2.4285714, 2.6400000], atol=1e-5)
    np.testing.assert_allclose(black, np.broadcast_to(BLACK[:, None, None], black.shape), atol=1e-5)
    np.testing.assert_allclose(white, np.broadcast_to(WHITE[:, None, None], white.shape), atol=1e-5)


def _column_profile(out):
    """Channel-0 mean of every column, mapped back to [0, 1] (0 = black, 1 = white)."""
    return (out[0, 0].numpy().mean(axis=0) - BLACK[0]) / (WHITE[0] - BLACK[0])


def test_resize_short_side_then_center_crop_landscape(processor):
    # 400 x 300 (W x H), black for x < 100, white elsewhere.
    # Resize: short side 300 -> 288, so width 400 -> 384 (scale 0.96); the edge moves to x = 96.
    # Center crop 256: left offset (384 - 256) / 2 = 64, so the edge lands at crop column 96 - 64 = 32.
    # (A plain 256x256 resize without crop would put it at column 64.)
    array = np.full((300, 400, 3), 255, dtype=np.uint8)
    array[:, :100] = 0
    out = pixel_values(processor, Image.fromarray(array))
    assert out.shape == (1, 3, 256, 256)
    profile = _column_profile(out)
    assert np.all(np.abs(profile[:29]) < 0.02)  # black
    assert np.all(np.abs(profile[36:] - 1) < 0.02)  # white
    assert profile[31] < 0.5 < profile[32]  # the transition is exactly at crop column 32
    # Rows are all identical: the content is only a function of x.
    rows = out[0, 0].numpy()
    np.testing.assert_allclose(rows, np.broadcast_to(rows[128], rows.shape), atol=1e-5)


def test_resize_short_side_then_center_crop_portrait(processor):
    # 300 x 600 (W x H), black for y < 270. Resize: 300 -> 288 (scale 0.96), height 600 -> 576, edge at y = 259.2.
    # Center crop 256: top offset (576 - 256) / 2 = 160, so the edge lands at crop row 99.2.
    array = np.full((600, 300, 3), 255, dtype=np.uint8)
    array[:270] = 0
    out = pixel_values(processor, Image.fromarray(array))
    row_profile = (out[0, 0].numpy().mean(axis=1) - BLACK[0]) / (WHITE[0] - BLACK[0])
    assert np.all(np.abs(row_profile[:96]) < 0.02)
    assert np.all(np.abs(row_profile[103:] - 1) < 0.02)
    assert row_profile[98] < 0.5 < row_profile[99]  # row 99 covers [99, 100): 80% white


def test_aspect_ratio_is_preserved(processor):
    # A centred black disk of radius 100 on a 400x300 white image: after the x0.96 resize it is a disk of radius
    # 96 centred in the crop, i.e. the black area must be ~pi * 96^2 pixels and as wide as it is tall.
    yy, xx = np.mgrid[0:300, 0:400]
    array = np.full((300, 400, 3), 255, dtype=np.uint8)
    array[(yy - 150) ** 2 + (xx - 200) ** 2 < 100**2] = 0
    out = pixel_values(processor, Image.fromarray(array))[0, 0].numpy()
    black = out < (BLACK[0] + WHITE[0]) / 2
    assert abs(black.sum() - np.pi * 96**2) / (np.pi * 96**2) < 0.02
    rows, cols = np.nonzero(black)
    assert abs((rows.max() - rows.min()) - (cols.max() - cols.min())) <= 1
    assert abs(rows.mean() - 127.5) < 0.5 and abs(cols.mean() - 127.5) < 0.5


def test_save_pretrained_round_trip(processor, tmp_path):
    processor.save_pretrained(tmp_path / "default")
    assert (tmp_path / "default" / "preprocessor_config.json").is_file()
    reloaded = VecaImageProcessorPil.from_pretrained(tmp_path / "default")
    assert reloaded.to_dict() == processor.to_dict()
    assert reloaded.to_dict()["image_processor_type"] == "VecaImageProcessor"
    image = random_image(300, 400)
    torch.testing.assert_close(pixel_values(reloaded, image), pixel_values(processor, image), atol=0, rtol=0)

    # Non-default settings survive the round trip too.
    custom = VecaImageProcessorPil(
        size={"shortest_edge": 352},
        crop_size={"height": 320, "width": 224},
        resample=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        do_convert_rgb=False,
    )
    custom.save_pretrained(tmp_path / "custom")
    reloaded = VecaImageProcessorPil.from_pretrained(tmp_path / "custom")
    assert reloaded.to_dict() == custom.to_dict()
    assert reloaded.size == {"shortest_edge": 352}
    assert reloaded.crop_size == {"height": 320, "width": 224}
    assert int(reloaded.resample) == 2
    assert tuple(reloaded.image_mean) == (0.5, 0.5, 0.5)
    assert reloaded.do_convert_rgb is False
    torch.testing.assert_close(pixel_values(reloaded, image), pixel_values(custom, image), atol=0, rtol=0)


def test_integer_size_means_shortest_edge():
    assert VecaImageProcessorPil(size=320).size == {"shortest_edge": 320}


def test_non_default_crop_size(processor):
    crop = {"height": 320, "width": 224}
    # 333 x 500 (W x H): resized to 288 x 432, which contains a 320 x 224 crop.
    image = random_image(500, 333)
    assert pixel_values(VecaImageProcessorPil(crop_size=crop), image).shape == (1, 3, 320, 224)
    # As a call-time override, identical to the init-time setting.
    torch.testing.assert_close(
        pixel_values(processor, image, crop_size=crop),
        pixel_values(VecaImageProcessorPil(crop_size=crop), image),
        atol=0,
        rtol=0,
    )
    # Landscape 400 x 300: resized to 384 x 288; a 320-high crop is zero-padded (before normalization) top and bottom.
    out = pixel_values(processor, random_image(300, 400), crop_size=crop)[0].numpy()
    assert out.shape == (3, 320, 224)
    np.testing.assert_allclose(out[:, :16], np.broadcast_to(BLACK[:, None, None], (3, 16, 224)), atol=1e-5)
    np.testing.assert_allclose(out[:, -16:], np.broadcast_to(BLACK[:, None, None], (3, 16, 224)), atol=1e-5)


@pytest.mark.parametrize("height,width,seed", [(300, 400, 0), (500, 333, 1), (288, 288, 2), (150, 200, 3)])
def test_pil_and_torchvision_agree(processor, torchvision_processor, height, width, seed):
    image = natural_like_image(height, width, seed)
    slow = pixel_values(processor, image)
    tv = pixel_values(torchvision_processor, image)
    assert tv.shape == slow.shape == (1, 3, 256, 256)
    diff = (slow - tv).abs()
    assert diff.max().item() <= PIL_VS_TORCHVISION_ATOL
    assert diff.mean().item() <= PIL_VS_TORCHVISION_MEAN_TOL


def _settings(image_processor):
    # `image_processor_type` names the class; `auto_map` appears once a class is registered for remote code.
    return {k: v for k, v in image_processor.to_dict().items() if k not in ("image_processor_type", "auto_map")}


def test_torchvision_same_defaults_and_config(processor, torchvision_processor, tmp_path):
    assert _settings(processor) == _settings(torchvision_processor)
    # The torchvision processor loads a config saved by the PIL one with the same settings.
    processor.save_pretrained(tmp_path)
    assert _settings(type(torchvision_processor).from_pretrained(tmp_path)) == _settings(processor)
    # Modes and custom crops behave the same way.
    for mode in ("L", "RGBA", "CMYK"):
        image = natural_like_image(300, 400, 5).convert(mode)
        difference = pixel_values(processor, image) - pixel_values(torchvision_processor, image)
        assert difference.abs().max() <= PIL_VS_TORCHVISION_ATOL
    crop = {"height": 320, "width": 224}
    image = natural_like_image(500, 333, 6)
    slow = pixel_values(processor, image, crop_size=crop)
    tv = pixel_values(torchvision_processor, image, crop_size=crop)
    assert slow.shape == tv.shape == (1, 3, 320, 224)
    assert (slow - tv).abs().max() <= PIL_VS_TORCHVISION_ATOL


@pytest.mark.processes
def test_base_install_without_torchvision(processor, tmp_path):
    """`pip install veca_hf` has no torchvision: the package imports, the PIL processor works (also as a lone file),
    `AutoImageProcessor` picks it, and the torchvision processor says what is missing."""
    processor.save_pretrained(tmp_path / "folder")
    script = textwrap.dedent(
        f"""
        import importlib.util
        import sys

        sys.modules["torchvision"] = None  # any `import torchvision` now raises ImportError
        import numpy as np
        from PIL import Image

        spec = importlib.util.spec_from_file_location("image_processing_pil_veca", {str(PIL_MODULE_PATH)!r})
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)  # the file alone, as a flat remote-code folder holds it

        import veca_hf
        from transformers import AutoImageProcessor

        rng = np.random.RandomState(0)
        image = Image.fromarray(rng.randint(0, 256, (300, 400, 3), dtype=np.uint8))
        out = module.VecaImageProcessorPil()(image, return_tensors="np")["pixel_values"]
        assert out.shape == (1, 3, 256, 256), out.shape
        auto = AutoImageProcessor.from_pretrained({str(tmp_path / "folder")!r})
        assert type(auto) is veca_hf.VecaImageProcessorPil, type(auto)
        assert np.array_equal(auto(image, return_tensors="np")["pixel_values"], out)
        try:
            veca_hf.VecaImageProcessor()
        except ImportError as error:
            assert "Torchvision" in str(error), error
        else:
            raise AssertionError("VecaImageProcessor() built without torchvision")
        assert sys.modules["torchvision"] is None
        np.save({str(tmp_path / "out.npy")!r}, out)
        """
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    out = np.load(tmp_path / "out.npy")
    expected = processor(random_image(300, 400), return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(out, expected)


# ---------------------------------------------------------------------------------------------------------------------
# One source of settings: `for_resolution`, and the saved folder's remote code
# ---------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("processor_class", [VecaImageProcessorPil, VecaImageProcessor])
def test_for_resolution_uses_the_stored_ratio(processor_class):
    if processor_class is VecaImageProcessor:
        pytest.importorskip("torchvision")
    default = processor_class()
    assert processor_class.for_resolution(256).to_dict() == default.to_dict()  # 288 / 256 is the stored ratio
    for resolution, short in [(224, 252), (32, 36), (512, 576), (28, 32), (14, 16)]:  # round(r * 1.125)
        made = processor_class.for_resolution(resolution, image_mean=[0.5, 0.5, 0.5])
        assert made.size == {"shortest_edge": short}
        assert made.crop_size == {"height": resolution, "width": resolution}
        assert tuple(made.image_mean) == (0.5, 0.5, 0.5) and int(made.resample) == int(default.resample)
    for bad in (0, -16, 2.5, None, True):
        with pytest.raises(ValueError, match="resolution"):
            processor_class.for_resolution(bad)


@pytest.mark.parametrize("processor_class", [VecaImageProcessorPil, VecaImageProcessor])
def test_saved_folder_ships_both_processors(processor_class, tmp_path):
    if processor_class is VecaImageProcessor:
        pytest.importorskip("torchvision")
    processor_class.for_resolution(224).save_pretrained(tmp_path)
    assert {"image_processing_veca.py", "image_processing_pil_veca.py"} <= {p.name for p in tmp_path.iterdir()}
    saved = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert saved["image_processor_type"] == "VecaImageProcessor"  # transformers drops the "Pil" of the PIL class
    assert saved["auto_map"] == {
        "AutoImageProcessor": {
            "pil": "image_processing_pil_veca.VecaImageProcessorPil",
            "torchvision": "image_processing_veca.VecaImageProcessor",
        }
    }
    assert saved["size"] == {"shortest_edge": 252}
    assert type(AutoImageProcessor.from_pretrained(tmp_path, backend="pil")) is VecaImageProcessorPil


# Written by the processors before the backend renaming (PIL `VecaImageProcessor`, torchvision
# `VecaImageProcessorFast`); the PIL one carried `auto_map` and its code (here left out: `import veca_hf` wins).
OLD_PREPROCESSOR_CONFIG = {
    "crop_size": {"height": 256, "width": 256},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": [0.485, 0.456, 0.406],
    "image_std": [0.229, 0.224, 0.225],
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 288},
}


@pytest.mark.parametrize(
    "old_type, auto_map",
    [
        ("VecaImageProcessor", {"AutoImageProcessor": "image_processing_veca.VecaImageProcessor"}),
        ("VecaImageProcessorFast", None),
    ],
)
def test_folders_saved_before_the_renaming_still_load(tmp_path, processor, old_type, auto_map):
    config = dict(OLD_PREPROCESSOR_CONFIG, image_processor_type=old_type)
    if auto_map:
        config["auto_map"] = auto_map
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config, indent=2))
    image = natural_like_image(300, 400, 7)
    pil = AutoImageProcessor.from_pretrained(tmp_path, backend="pil")
    assert type(pil) is VecaImageProcessorPil
    torch.testing.assert_close(pixel_values(pil, image), pixel_values(processor, image), atol=0, rtol=0)
    pytest.importorskip("torchvision")
    default = AutoImageProcessor.from_pretrained(tmp_path)  # torchvision installed: the torchvision backend
    assert type(default) is VecaImageProcessor
    assert (pixel_values(default, image) - pixel_values(processor, image)).abs().max() <= PIL_VS_TORCHVISION_ATOL
    with pytest.raises(AttributeError, match="VecaImageProcessorSlow"):
        veca_hf.VecaImageProcessorSlow  # noqa: B018


# ---------------------------------------------------------------------------------------------------------------------
# Bad settings: a ValueError naming the setting, at construction and as a per-call override
# ---------------------------------------------------------------------------------------------------------------------

BAD_SETTINGS = [
    ("image_std", [0.0, 0.0, 0.0], r"image_std=\(0.0, 0.0, 0.0\) must be positive finite numbers"),
    ("image_std", [1.0, float("inf"), 1.0], r"image_std=\(1.0, inf, 1.0\) must be positive finite numbers"),
    ("image_std", [0.5, 0.5], r"image_std=\(0.5, 0.5\) must be .* one per RGB channel"),
    ("image_mean", [float("nan")] * 3, r"image_mean=\(nan, nan, nan\) must be finite numbers"),
    ("rescale_factor", float("inf"), "rescale_factor=inf must be a positive finite number"),
    ("crop_size", 0, r"crop_size=\{'height': 0, 'width': 0\} has height=0: every side must be a positive int"),
    ("crop_size", {"height": 8, "width": -2}, "crop_size=.* has width=-2: every side must be a positive int"),
    ("size", -5, r"size=\{'shortest_edge': -5\} has shortest_edge=-5: every side must be a positive int"),
    ("size", {"height": 4, "width": 0}, "size=.* has width=0: every side must be a positive int"),
    ("pad_size", {"height": 0, "width": 8}, "pad_size=.* has height=0: every side must be a positive int"),
    ("resample", 99, r"resample=99 is not a resampling filter: use .*BICUBIC \(3\)"),
    ("resample", "bicubic", "resample='bicubic' is not a resampling filter"),
    ("ensure_multiple_of", 0, "ensure_multiple_of=0 must be a positive int"),
]


@pytest.mark.parametrize("setting, value, message", BAD_SETTINGS)
@pytest.mark.parametrize("processor_class", [VecaImageProcessorPil, VecaImageProcessor])
def test_bad_settings_are_value_errors_at_construction_and_per_call(processor_class, setting, value, message):
    if processor_class is VecaImageProcessor:
        pytest.importorskip("torchvision")
    with pytest.raises(ValueError, match=message):
        processor_class(**{setting: value})
    processor = processor_class()
    with pytest.raises(ValueError, match=message):
        processor(random_image(30, 40), return_tensors="pt", **{setting: value})


@pytest.mark.parametrize("processor_class", [VecaImageProcessorPil, VecaImageProcessor])
def test_per_call_settings_of_the_wrong_type_are_value_errors(processor_class):
    if processor_class is VecaImageProcessor:
        pytest.importorskip("torchvision")
    processor = processor_class()
    # transformers checks the types of per-call settings only, and raises a huggingface_hub error that is no ValueError
    with pytest.raises(ValueError, match=r"image_std=\[0, 0, 0\] is not of type .*: pass e.g. image_std=\(0.229,"):
        processor(random_image(30, 40), image_std=[0, 0, 0])
    with pytest.raises(ValueError, match="do_resize='yes' is not of type bool"):
        processor(random_image(30, 40), do_resize="yes")


@pytest.mark.parametrize("processor_class", [VecaImageProcessorPil, VecaImageProcessor])
def test_good_settings_still_work(processor_class):
    if processor_class is VecaImageProcessor:
        pytest.importorskip("torchvision")
    from torchvision.transforms import InterpolationMode

    for settings in (
        dict(image_std=0.5, image_mean=0.5),
        dict(image_std=[1, 2, 3], image_mean=[0, 0, 0]),  # ints are numbers too at construction
        dict(resample=InterpolationMode.BILINEAR),
        dict(resample=0),
        dict(do_convert_rgb=False, image_mean=[0.5], image_std=[0.5]),  # 1 channel images
    ):
        assert pixel_values(processor_class(**settings), random_image(30, 40, mode="L")).shape[-2:] == (256, 256)
