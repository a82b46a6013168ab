"""Tests for the streaming data pieces (`veca_hf.data`): loading, decoding, transforms, the deterministic stream.

Every dataset is generated in a temporary folder. Each good image is one constant grey level (`LEVELS`), whatever
its mode, so an output tensor identifies its example by its mean (`_key`), across ranks, workers and epochs.
"""

import functools
import io
import itertools
import json
import random
import tarfile
from collections import Counter
from pathlib import Path

import datasets
import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from PIL import Image, ImageFilter
from torchvision.transforms import v2
from transformers import ViTImageProcessorPil

import veca_hf.data
import veca_hf.data.stream
from veca_hf.data import (
    ImageStream,
    build_transform,
    collate_images,
    decode_image,
    detect_image_column,
    infinite_batches,
    load_image_dataset,
    resize_batch,
    resume_plan,
)
from veca_hf.data.resume import POSITION_COLUMN, ParquetResume, parquet_files_of
from veca_hf.model.image_processing_pil_veca import VecaImageProcessorPil
from veca_hf.model.image_processing_veca import VecaImageProcessor


MEAN = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1)
STD = torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
RESOLUTION = 32
PIL_VS_TORCHVISION_ATOL = 0.04  # 2 uint8 levels on smooth content, see image_processing_veca.py
LEVELS = [20 + 15 * i for i in range(14)]  # one grey level per good example: 20, 35, ..., 215


def _key(pixel_values: torch.Tensor) -> int:
    """The index into LEVELS of a constant-grey example (robust to JPEG noise, resizing and normalisation)."""
    level = float((pixel_values * STD + MEAN).mean()) * 255
    return round((level - 20) / 15)


def _keys(items) -> list[int]:
    return [_key(item["pixel_values"]) for item in items if item["pixel_values"] is not None]


def _grey(level: int, size: tuple[int, int], mode: str) -> Image.Image:
    """A constant `level` grey image of `size` (width, height) in PIL `mode`."""
    width, height = size
    if mode == "I;16":
        return Image.fromarray(np.full((height, width), level * 257, dtype=np.uint16))
    if mode == "CMYK":
        return Image.new("CMYK", size, (0, 0, 0, 255 - level))
    if mode == "P":
        image = Image.new("P", size, 1)
        image.putpalette([0, 0, 0, level, level, level] + [0] * (256 * 3 - 6))
        return image
    return Image.new("RGB", size, (level, level, level)).convert(mode)


def _encode(image: Image.Image, format: str) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=format)
    return buffer.getvalue()


# (file name, mode, size): mixed sizes, grayscale, RGBA, CMYK JPEG, palette PNG, 16-bit PNG.
FOLDER_IMAGES = [
    ("a00.jpg", "RGB", (48, 40)),
    ("a01.png", "RGB", (64, 36)),
    ("a02.jpg", "L", (40, 52)),
    ("a03.png", "L", (36, 36)),
    ("a04.png", "LA", (50, 44)),
    ("a05.png", "RGBA", (44, 60)),
    ("a06.jpg", "CMYK", (56, 40)),
    ("a07.png", "P", (40, 40)),
    ("a08.png", "I;16", (38, 46)),
    ("a09.jpeg", "RGB", (80, 60)),
    ("a10.png", "RGB", (40, 90)),
    ("a11.jpg", "L", (70, 40)),
]
FOLDER_BAD = {"b_corrupt.jpg": "undecodable", "b_truncated.jpg": "undecodable", "b_tiny.png": "too_small"}


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory) -> Path:
    """12 good images of different modes and sizes, plus a corrupt, a truncated and an 8x8 one."""
    folder = tmp_path_factory.mktemp("images")
    for index, (name, mode, size) in enumerate(FOLDER_IMAGES):
        _grey(LEVELS[index], size, mode).save(folder / name)
    rng = np.random.default_rng(0)
    (folder / "b_corrupt.jpg").write_bytes(rng.integers(0, 256, 2000, dtype=np.uint8).tobytes())
    noise = Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8))
    jpeg = _encode(noise, "JPEG")
    (folder / "b_truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    _grey(100, (8, 8), "RGB").save(folder / "b_tiny.png")
    return folder


@pytest.fixture(scope="module")
def parquet_folder(tmp_path_factory) -> Path:
    """4 parquet shards of 3 images each (levels 0..11)."""
    folder = tmp_path_factory.mktemp("parquet")
    for shard in range(4):
        images = [_grey(LEVELS[3 * shard + row], (40 + row, 36), "RGB") for row in range(3)]
        table = datasets.Dataset.from_dict({"image": images, "id": [3 * shard + row for row in range(3)]})
        table.cast_column("image", datasets.Image()).to_parquet(str(folder / f"part-{shard:05d}.parquet"))
    return folder


@pytest.fixture(scope="module")
def tar_folder(tmp_path_factory) -> Path:
    """2 webdataset shards of 3 samples each (`<key>.jpg` + `<key>.cls`)."""
    folder = tmp_path_factory.mktemp("webdataset")
    for shard in range(2):
        with tarfile.open(folder / f"shard-{shard:05d}.tar", "w") as tar:
            for row in range(3):
                index = 3 * shard + row
                for extension, data in [
                    ("jpg", _encode(_grey(LEVELS[index], (40, 40), "RGB"), "JPEG")),
                    ("cls", str(index).encode()),
                ]:
                    info = tarfile.TarInfo(f"sample{index:04d}.{extension}")
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return folder


@pytest.fixture(autouse=True)
def _no_parquet_shutdown_sleep(monkeypatch):
    # NOTE: datasets 5.2 sleeps 5 s whenever a shuffled multi-shard parquet stream ends (apache/arrow#45214);
    # harmless once per epoch in training, too slow for a test file that streams parquet a dozen times.
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0.01)


def _stream(dataset, train=True, **kwargs):
    kwargs.setdefault("seed", 0)
    return ImageStream(dataset, detect_image_column(dataset), build_transform(RESOLUTION, train=train), **kwargs)


def _load(name: str):
    return load_image_dataset(name)


# ----------------------------------------------------------------------------------------------------------------
# Loading and column detection
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "source, pattern, column, count",
    [
        ("image_folder", None, "image", 15),
        ("image_folder", "*.png", "image", 8),
        ("parquet_folder", None, "image", 12),
        ("parquet_folder", "*.parquet", "image", 12),
        ("tar_folder", None, "jpg", 6),
        ("tar_folder", "*.tar", "jpg", 6),
    ],
)
def test_load_image_dataset_sources(request, source, pattern, column, count):
    folder = request.getfixturevalue(source)
    dataset = _load(str(folder / pattern) if pattern else str(folder))
    assert isinstance(dataset, datasets.IterableDataset)
    assert detect_image_column(dataset) == column
    assert isinstance(dataset.features[column], datasets.Image)
    items = list(_stream(dataset, train=False, shuffle_buffer_size=0, image_root=folder))
    assert len(items) == count and not any(item.get("skipped") == "path_not_allowed" for item in items)


def test_webdataset_columns_named_by_extension(tar_folder):
    dataset = _load(str(tar_folder))
    assert dataset.num_shards == 2
    assert {"jpg", "cls", "__key__", "__url__"} <= set(dataset.column_names)
    assert sorted(_keys(_stream(dataset, train=False))) == list(range(6))


def test_hub_ids_go_to_load_dataset(monkeypatch):
    calls = []
    monkeypatch.setattr(datasets, "load_dataset", lambda *args, **kwargs: calls.append((args, kwargs)))
    load_image_dataset("some-user/some-images", "default", split="validation")
    assert calls == [(("some-user/some-images", "default"), {"split": "validation", "streaming": True})]


def test_load_image_dataset_errors(tmp_path):
    missing = str(tmp_path / "does_not_exist")
    with pytest.raises(ValueError, match="does_not_exist"):
        load_image_dataset(missing)
    with pytest.raises(ValueError, match="empty"):
        load_image_dataset(str(tmp_path))
    with pytest.raises(ValueError, match="No files match"):
        load_image_dataset(str(tmp_path / "*.parquet"))
    (tmp_path / "notes.txt").write_text("no images here")
    with pytest.raises(ValueError, match="no image, parquet or webdataset"):
        load_image_dataset(str(tmp_path))
    with pytest.raises(ValueError, match="empty"):
        load_image_dataset("")


def test_detect_image_column():
    features = datasets.Features({"label": datasets.Value("int64"), "photo": datasets.Image()})
    dataset = datasets.Dataset.from_dict({"label": [], "photo": []}, features=features)
    assert detect_image_column(dataset) == "photo"
    assert detect_image_column(dataset, "label") == "label"
    with pytest.raises(ValueError, match=r"'pixels' not found.*\['label', 'photo'\]"):
        detect_image_column(dataset, "pixels")

    named = datasets.Dataset.from_dict({"id": [1], "img": [b"raw"]})  # no Image feature: falls back to names
    assert detect_image_column(named) == "img"
    unnamed = datasets.Dataset.from_dict({"id": [1], "blob": [b"raw"]})
    with pytest.raises(ValueError, match=r"\['id', 'blob'\].*--image_column"):
        detect_image_column(unnamed)


# ----------------------------------------------------------------------------------------------------------------
# Decoding
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["RGB", "L", "LA", "RGBA", "CMYK", "P", "I;16", "1", "YCbCr"])
def test_decode_image_modes_become_rgb(mode):
    level = 0 if mode == "1" else 120
    image, reason = decode_image(_grey(level, (40, 34), mode))
    assert reason is None and image.mode == "RGB" and image.size == (40, 34)
    assert np.abs(np.asarray(image, dtype=np.float64) - level).max() <= 2


def test_decode_image_composites_transparency_on_white():
    rgba = np.zeros((40, 40, 4), dtype=np.uint8)  # black, transparent on the left, opaque on the right
    rgba[:, 20:, 3] = 255
    image, _ = decode_image(Image.fromarray(rgba))
    array = np.asarray(image)
    assert (array[:, :20] == 255).all() and (array[:, 20:] == 0).all()


def test_decode_image_inputs(tmp_path):
    encoded = _encode(_grey(90, (40, 40), "RGB"), "PNG")
    path = tmp_path / "x.png"
    path.write_bytes(encoded)
    for value in [encoded, {"bytes": encoded, "path": None}, {"bytes": None, "path": str(path)}, str(path), path]:
        image, reason = decode_image(value, root=tmp_path)
        assert reason is None and image.mode == "RGB" and np.asarray(image).mean() == 90


def test_decode_image_bad_data_never_raises(image_folder):
    for name, reason in FOLDER_BAD.items():
        assert decode_image(str(image_folder / name), root=image_folder) == (None, reason)
    truncated = (image_folder / "b_truncated.jpg").read_bytes()
    assert decode_image({"bytes": truncated, "path": None}) == (None, "undecodable")
    for value in [None, 3, b"", {"bytes": None, "path": None}, str(image_folder / "no_such_file.jpg")]:
        assert decode_image(value, root=image_folder) == (None, "undecodable")
    assert decode_image(_grey(50, (40, 31), "RGB")) == (None, "too_small")
    assert decode_image(_grey(50, (40, 31), "RGB"), min_size=31)[1] is None


# ----------------------------------------------------------------------------------------------------------------
# Transforms and resizing
# ----------------------------------------------------------------------------------------------------------------


def test_train_transform_shape_and_normalisation():
    grey = Image.new("RGB", (70, 50), (128, 128, 128))
    output = build_transform(RESOLUTION, train=True)(grey)
    assert type(output) is torch.Tensor and output.shape == (3, RESOLUTION, RESOLUTION)
    assert output.dtype == torch.float32
    assert torch.isfinite(output).all()
    photo = Image.fromarray(np.random.default_rng(0).integers(0, 256, (50, 70, 3), dtype=np.uint8))
    assert build_transform(28, train=True)(photo).shape == (3, 28, 28)  # patch-14 teachers


def test_eval_transform_is_resize_then_center_crop():
    photo = Image.fromarray(np.random.default_rng(1).integers(0, 256, (60, 90, 3), dtype=np.uint8))
    output = build_transform(RESOLUTION, train=False)(photo)
    short = round(1.125 * RESOLUTION)  # 36: the 90x60 image becomes 54x36
    resized = photo.resize((54, short), Image.Resampling.BICUBIC)
    left, top = (54 - RESOLUTION) // 2, (short - RESOLUTION) // 2
    crop = resized.crop((left, top, left + RESOLUTION, top + RESOLUTION))
    expected = (torch.from_numpy(np.array(crop)).permute(2, 0, 1).float() / 255 - MEAN) / STD
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(build_transform(RESOLUTION, train=False)(photo), output, atol=0, rtol=0)

    mid_grey = build_transform(RESOLUTION, train=False)(Image.new("RGB", (40, 40), (128, 128, 128)))
    torch.testing.assert_close(mid_grey, ((128 / 255 - MEAN) / STD).expand(3, RESOLUTION, RESOLUTION))
    assert torch.allclose(mid_grey, ((0.5 - MEAN) / STD).expand_as(mid_grey), atol=0.02)


def _natural_photo(height: int, width: int, seed: int) -> Image.Image:
    """Blurred noise: smooth content, on which PIL and torchvision resizing agree to 2 uint8 levels."""
    noise = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(noise).filter(ImageFilter.GaussianBlur(2))


@pytest.mark.parametrize("size", [(60, 90), (97, 131), (300, 400), (131, 97), (40, 40)])
def test_eval_transform_equals_the_processor(size):
    photo = _natural_photo(*size, seed=sum(size))
    pil_processor = VecaImageProcessorPil.for_resolution(RESOLUTION)
    expected = pil_processor(photo, return_tensors="pt")["pixel_values"][0]
    output = build_transform(pil_processor, train=False)(photo)
    torch.testing.assert_close(output, expected, atol=1e-5, rtol=0)  # both resize with PIL: float rounding only
    torch.testing.assert_close(build_transform(RESOLUTION, train=False)(photo), output, atol=0, rtol=0)
    torchvision_processor = VecaImageProcessor.for_resolution(RESOLUTION)
    torch.testing.assert_close(build_transform(torchvision_processor, train=False)(photo), output, atol=0, rtol=0)
    tv = torchvision_processor(photo, return_tensors="pt")["pixel_values"][0]
    assert (tv - output).abs().max() <= PIL_VS_TORCHVISION_ATOL  # the documented PIL / torchvision tolerance


def test_eval_transform_follows_every_processor_setting():
    photo = _natural_photo(70, 50, seed=3)
    custom = VecaImageProcessorPil(
        size={"shortest_edge": 40}, crop_size={"height": 32, "width": 24}, resample=2, image_mean=[0.5, 0.4, 0.3],
        image_std=[0.2, 0.3, 0.4],
    )  # fmt: skip
    expected = custom(photo, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(build_transform(custom, train=False)(photo), expected, atol=1e-5, rtol=0)
    # Another model's processor: ViT resizes to a fixed height x width with bilinear filtering, no crop.
    vit = ViTImageProcessorPil(size={"height": 48, "width": 40})
    expected = vit(photo, return_tensors="pt")["pixel_values"][0]
    torch.testing.assert_close(build_transform(vit, train=False)(photo), expected, atol=1e-5, rtol=0)


def test_train_transforms_take_the_processor_settings():
    custom = VecaImageProcessorPil.for_resolution(
        48, resample=2, image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4]
    )
    distillation = build_transform(custom, train=True).transforms
    assert [type(t).__name__ for t in distillation] == [
        "Resize", "RandomCrop", "RandomHorizontalFlip", "TrivialAugmentWide", "ToImage", "ToDtype", "Normalize",
        "ToPureTensor",
    ]  # fmt: skip
    resize, crop, normalize = distillation[0], distillation[1], distillation[6]
    assert resize.size == [54] and resize.interpolation == v2.InterpolationMode.BILINEAR and resize.antialias
    assert tuple(crop.size) == (48, 48)
    assert normalize.mean == [0.5, 0.4, 0.3] and normalize.std == [0.2, 0.3, 0.4]
    finetune = build_transform(custom, train=True, recipe="finetune").transforms
    assert [type(t).__name__ for t in finetune[:2]] == ["RandomResizedCrop", "RandomHorizontalFlip"]
    assert tuple(finetune[0].size) == (48, 48) and finetune[0].interpolation == v2.InterpolationMode.BILINEAR
    assert finetune[-2].mean == [0.5, 0.4, 0.3]
    photo = _natural_photo(70, 50, seed=4)
    for train_transform in (build_transform(custom, train=True), build_transform(custom, True, recipe="finetune")):
        assert train_transform(photo).shape == (3, 48, 48)
    with pytest.raises(ValueError, match="recipe"):
        build_transform(custom, train=True, recipe="mixup")


def test_resolution_is_short_for_the_processor_at_that_crop():
    photo = _natural_photo(50, 70, seed=5)
    from_processor = build_transform(VecaImageProcessorPil.for_resolution(28), train=True)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        expected = from_processor(photo)
        torch.manual_seed(0)
        torch.testing.assert_close(build_transform(28, train=True)(photo), expected, atol=0, rtol=0)


@pytest.mark.parametrize("resolution", [0, -16, 2.5, None])
def test_bad_resolution(resolution):
    with pytest.raises(ValueError, match="resolution"):
        build_transform(resolution, train=True)
    with pytest.raises(ValueError, match="resolution"):
        resize_batch(torch.zeros(1, 3, 8, 8), resolution)


def test_resize_batch():
    batch = torch.randn(2, 3, 48, 48)
    assert resize_batch(batch, 48) is batch
    assert resize_batch(batch, 32).shape == (2, 3, 32, 32)
    assert resize_batch(batch, 64).shape == (2, 3, 64, 64)
    half = resize_batch(batch.bfloat16(), 16)
    assert half.shape == (2, 3, 16, 16) and half.dtype == torch.bfloat16
    constant = torch.full((1, 3, 40, 40), 0.7)
    torch.testing.assert_close(resize_batch(constant, 20), torch.full((1, 3, 20, 20), 0.7))
    with pytest.raises(ValueError, match="shape"):
        resize_batch(torch.zeros(3, 8, 8), 4)


# ----------------------------------------------------------------------------------------------------------------
# The stream
# ----------------------------------------------------------------------------------------------------------------


def test_stream_reports_bad_images_and_keeps_going(image_folder):
    items = list(_stream(_load(str(image_folder)), image_root=image_folder))
    assert len(items) == 15
    assert Counter(item["skipped"] for item in items if item["pixel_values"] is None) == Counter(
        {"undecodable": 2, "too_small": 1}
    )
    good = [item["pixel_values"] for item in items if item["pixel_values"] is not None]
    assert all(x.shape == (3, RESOLUTION, RESOLUTION) and x.dtype == torch.float32 for x in good)

    batches = list(torch.utils.data.DataLoader(items, batch_size=4, collate_fn=collate_images))
    assert sum(batch["num_skipped"] for batch in batches) == 3
    assert sum((batch["skipped_reasons"] for batch in batches), Counter()) == Counter(
        {"undecodable": 2, "too_small": 1}
    )
    assert sum(batch["pixel_values"].shape[0] for batch in batches if batch["pixel_values"] is not None) == 12


def test_collate_all_skipped():
    batch = collate_images([{"pixel_values": None, "skipped": "too_small"}] * 2)
    assert batch == {
        "pixel_values": None,
        "num_skipped": 2,
        "skipped_reasons": Counter({"too_small": 2}),
        "sources": [],
        "worker": 0,
    }
    good = collate_images(
        [{"pixel_values": torch.zeros(3, 4, 4), "source": "a.jpg"}, {"pixel_values": None, "skipped": "undecodable"}]
    )
    assert good["pixel_values"].shape == (1, 3, 4, 4) and good["num_skipped"] == 1 and good["sources"] == ["a.jpg"]


@pytest.mark.parametrize("source, world_size", [("image_folder", 2), ("parquet_folder", 2), ("parquet_folder", 3)])
def test_ranks_read_disjoint_parts(request, source, world_size):
    folder = request.getfixturevalue(source)
    dataset = _load(str(folder))
    parts = [
        _keys(_stream(dataset, train=False, rank=rank, world_size=world_size, image_root=folder))
        for rank in range(world_size)
    ]
    assert all(parts)
    assert sorted(itertools.chain(*parts)) == list(range(12))  # disjoint, and everything once


def _worker_batches(stream, **kwargs):
    loader = torch.utils.data.DataLoader(stream, batch_size=2, num_workers=2, collate_fn=collate_images, **kwargs)
    return list(loader)


@pytest.mark.processes
def test_dataloader_workers_single_shard_folder(image_folder):
    """A streamed folder is one shard: both workers walk it and each decodes every other example."""
    dataset = _load(str(image_folder))
    assert dataset.num_shards == 1
    batches = _worker_batches(_stream(dataset, train=False, image_root=image_folder))
    assert sum(batch["num_skipped"] for batch in batches) == 3
    keys = [_key(x) for batch in batches if batch["pixel_values"] is not None for x in batch["pixel_values"]]
    assert sorted(keys) == list(range(12))  # no duplicates, nothing missing

    # Round robin over the same stream: each example gets the same augmentation as without workers.
    single = [
        item["pixel_values"] for item in _stream(dataset, image_root=image_folder) if item["pixel_values"] is not None
    ]
    batches = _worker_batches(_stream(dataset, image_root=image_folder))
    multi = [x for batch in batches if batch["pixel_values"] is not None for x in batch["pixel_values"]]
    assert len(multi) == len(single) == 12
    assert sorted(next(i for i, y in enumerate(single) if torch.equal(x, y)) for x in multi) == list(range(12))


@pytest.mark.processes
def test_dataloader_workers_whole_shards(parquet_folder):
    dataset = _load(str(parquet_folder))
    assert dataset.num_shards == 4
    for world_size in (1, 2):
        keys = []
        for rank in range(world_size):
            stream = _stream(dataset, train=False, rank=rank, world_size=world_size)
            keys += [_key(x) for batch in _worker_batches(stream) for x in batch["pixel_values"]]
        assert sorted(keys) == list(range(12))


def test_stream_is_deterministic_and_leaves_global_rng_alone(image_folder):
    dataset = _load(str(image_folder))
    torch_state, python_state, numpy_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    first = list(_stream(dataset, image_root=image_folder, seed=3))
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert random.getstate() == python_state
    assert all(np.array_equal(a, b) for a, b in zip(np.random.get_state(), numpy_state, strict=True))

    second = list(_stream(dataset, image_root=image_folder, seed=3))
    assert len(first) == len(second) == 15
    for a, b in zip(first, second, strict=True):
        assert a.get("skipped") == b.get("skipped")
        assert (a["pixel_values"] is None and b["pixel_values"] is None) or torch.equal(
            a["pixel_values"], b["pixel_values"]
        )

    order = _keys(_stream(dataset, image_root=image_folder, train=False, seed=3))
    assert _keys(_stream(dataset, image_root=image_folder, train=False, seed=3)) == order
    next_epoch = _stream(dataset, image_root=image_folder, train=False, seed=3)
    next_epoch.set_epoch(1)
    assert next_epoch.epoch == 1
    assert sorted(_keys(next_epoch)) == sorted(order) and _keys(next_epoch) != order


def test_skipping_consumed_items_replays_the_rest_exactly(image_folder):
    """The resume property: a rebuilt stream, with the first k items discarded, continues bit for bit."""
    dataset = _load(str(image_folder))
    stream = _stream(dataset, image_root=image_folder, seed=5)
    stream.set_epoch(2)
    full = list(stream)
    for k in (1, 7):
        resumed = _stream(dataset, image_root=image_folder, seed=5)
        resumed.set_epoch(2)
        rest = list(itertools.islice(resumed, k, None))
        assert len(rest) == len(full) - k
        for a, b in zip(full[k:], rest, strict=True):
            assert a.get("skipped") == b.get("skipped")
            assert a["pixel_values"] is None or torch.equal(a["pixel_values"], b["pixel_values"])


def _same_batches(expected: list[dict], actual: list[dict]) -> None:
    assert len(actual) == len(expected)
    for a, b in zip(expected, actual, strict=True):
        assert a["sources"] == b["sources"] and a["num_skipped"] == b["num_skipped"] and a["worker"] == b["worker"]
        assert (a["pixel_values"] is None and b["pixel_values"] is None) or torch.equal(
            a["pixel_values"], b["pixel_values"]
        )


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-core machine
@pytest.mark.parametrize(
    "source, num_workers, batch_size",
    [
        ("image_folder", 0, 4),  # no workers
        ("image_folder", 2, 2),  # one shard: round robin over examples; bad images inside batches
        ("image_folder", 2, 1),  # the workers run out at different batches
        ("parquet_folder", 3, 2),  # whole shards: worker 0 gets 2 shards, 1 and 2 one each (they run out first)
    ],
)
def test_resume_skips_consumed_samples_and_continues_exactly(request, source, num_workers, batch_size):
    """Interrupted after any number of batches, a fresh DataLoader with `resume_plan` yields the same remaining
    batches, bit for bit, in the same order."""
    folder = request.getfixturevalue(source)
    dataset = _load(str(folder))

    def batches(skip=None):
        stream = _stream(dataset, seed=1, image_root=folder)
        stream.set_epoch(1)
        stream.set_skip(skip)
        return list(
            torch.utils.data.DataLoader(
                stream, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_images
            )
        )

    full = batches()
    assert len(full) >= 4
    for consumed in range(1, len(full)):
        worker_batches = [0] * max(1, num_workers)
        for batch in full[:consumed]:
            worker_batches[batch["worker"]] += 1
        skip, discard = resume_plan(worker_batches, full[consumed - 1]["worker"], batch_size)
        assert discard < max(1, num_workers)  # at most W-1 consumed batches are decoded again
        _same_batches(full[consumed:], batches(skip)[discard:])


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:This DataLoader will create")
@pytest.mark.parametrize("num_workers", [0, 2])
def test_infinite_batches_resume_from_a_saved_position_across_epochs(parquet_folder, num_workers):
    """`infinite_batches` (the training loop's stream): stopped after k batches, a new one started from the saved
    `position` yields the same next batches, bit for bit, also across the epoch boundary."""
    dataset = _load(str(parquet_folder))
    loader_kwargs = dict(batch_size=5, collate_fn=collate_images, num_workers=num_workers)  # 12 images, 3-4 batches

    def run(position, count):
        batches = infinite_batches(_stream(dataset, seed=2), loader_kwargs, 2, position, "empty")
        return [next(batches) for _ in range(count)]

    position = {"epoch": 0, "batches": 0}
    expected, saved = [], []
    batches = infinite_batches(_stream(dataset, seed=2), loader_kwargs, 2, position, "empty")
    for _ in range(9):  # two epochs and more
        expected.append(next(batches))
        saved.append(json.loads(json.dumps(position)))  # what a checkpoint stores
    epochs = [p["epoch"] for p in saved]
    first_of_epoch_1 = epochs.index(1)
    assert epochs[-1] == 2 and first_of_epoch_1 >= 3
    for consumed in (1, 2, first_of_epoch_1, first_of_epoch_1 + 1):  # mid-epoch, at and after the boundary
        _same_batches(expected[consumed:], run(dict(saved[consumed - 1]), len(expected) - consumed))
    with pytest.raises(ValueError, match="written with 3 DataLoader worker"):
        run({**saved[1], "worker_batches": [1, 1, 0]}, 1)


def test_infinite_batches_on_an_empty_split_raise_the_callers_message(parquet_folder):
    empty = _load(str(parquet_folder)).take(0)
    loader_kwargs = dict(batch_size=2, collate_fn=collate_images, num_workers=0)
    with pytest.raises(ValueError, match="the held-out split took every image"):
        next(
            infinite_batches(
                _stream(empty), loader_kwargs, 0, {"epoch": 0, "batches": 0}, "the held-out split took every image"
            )
        )


@pytest.fixture(scope="module")
def row_group_folder(tmp_path_factory) -> Path:
    """5 parquet shards of 10-17 noise images each, in row groups of 4 (ids 0..64 in the `id` column)."""
    folder = tmp_path_factory.mktemp("row_groups")
    rng = np.random.default_rng(3)
    next_id = 0
    for shard, count in enumerate([12, 17, 10, 13, 13]):
        images = [Image.fromarray(rng.integers(0, 256, (36, 40, 3), dtype=np.uint8)) for _ in range(count)]
        ids = list(range(next_id, next_id + count))
        next_id += count
        table = datasets.Dataset.from_dict({"image": images, "id": ids}).cast_column("image", datasets.Image())
        pq.write_table(table.data.table, folder / f"part-{shard:05d}.parquet", row_group_size=4)
    return folder


@pytest.mark.processes
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-core machine
@pytest.mark.parametrize("world_size, rank, num_workers", [(1, 0, 0), (2, 1, 0), (1, 0, 2), (2, 0, 3)])
def test_position_twin_streams_in_the_real_order(row_group_folder, world_size, rank, num_workers):
    """The resume of parquet shards rests on this: the twin of row positions, shuffled, split and read by workers
    as the real shards are (also after a held-out `skip` or `take`), yields the same rows in the same order (a change
    in `datasets` would fail here)."""
    loaded = _load(str(row_group_folder))
    for dataset, operations in ((loaded, []), (loaded.skip(5), ["skip"]), (loaded.take(30), ["take"])):
        files, options, replayed = parquet_files_of(dataset)
        assert [operation for operation, _ in replayed] == operations
        resume = ParquetResume(files, options, "id", dataset.features["id"], replayed)
        twin = resume.build()
        ids = {  # position -> id, read from the shards
            (shard << 40) + row: value
            for shard in range(len(files))
            for group in range(len(resume.boundaries[shard]) - 1)
            for row, value in enumerate(resume.read_group(shard, group), start=int(resume.boundaries[shard][group]))
        }
        stream = _stream(dataset, seed=4, shuffle_buffer_size=8, rank=rank, world_size=world_size)
        for epoch in (0, 1):
            real = stream._rank_dataset(epoch, dataset).select_columns(["id"])
            positions = stream._rank_dataset(epoch, twin)
            load = functools.partial(torch.utils.data.DataLoader, batch_size=None, num_workers=num_workers)
            expected = [int(example["id"]) for example in load(real.with_format("torch"))]
            actual = [ids[int(example[POSITION_COLUMN])] for example in load(positions.with_format("torch"))]
            assert actual == expected and len(expected) > 10
    assert parquet_files_of(loaded.map(lambda example: example)) is None  # anything else: no twin


def test_parquet_resume_reads_only_the_row_groups_still_needed(row_group_folder, monkeypatch):
    """Resumed mid-epoch, the stream yields exactly the rest of the epoch and reads each row group holding a sample
    still to come once, and no other (what was consumed, and is out of the shuffle buffer, is not read)."""
    dataset = _load(str(row_group_folder))
    reads = []
    read_group = ParquetResume.read_group
    monkeypatch.setattr(
        ParquetResume,
        "read_group",
        lambda self, shard, group: reads.append((shard, group)) or read_group(self, shard, group),
    )

    def run(skip):
        stream = _stream(dataset, seed=6, shuffle_buffer_size=8)
        stream.set_epoch(1)
        stream.set_skip(skip)
        return stream, list(stream)

    _, full = run(None)
    assert not reads and len(full) == 65
    for skip in (1, 20, 41, 64):
        reads.clear()
        stream, rest = run([skip])
        assert stream._resume is not None
        assert [item["source"] for item in rest] == [item["source"] for item in full[skip:]]
        for a, b in zip(full[skip:], rest, strict=True):
            assert torch.equal(a["pixel_values"], b["pixel_values"])
        # the row groups that hold a sample still to come, from the twin's positions
        twin_positions = stream._indexed_values(stream._rank_dataset(1, stream._twin), 1, 0, skip, POSITION_COLUMN)
        needed = set()
        for _, _, position in twin_positions:
            shard, row = position >> 40, position & ((1 << 40) - 1)
            needed.add((shard, int(np.searchsorted(stream._resume.boundaries[shard], row, side="right")) - 1))
        assert sorted(reads) == sorted(needed)  # each once, nothing else
    assert len(needed) < 18  # 18 row groups in all: the end of the epoch needs few of them


def test_skipped_samples_are_not_decoded(image_folder, monkeypatch):
    decoded = []
    decode = veca_hf.data.decode_image
    monkeypatch.setattr(
        veca_hf.data.stream, "decode_image", lambda value, **kwargs: decoded.append(1) or decode(value, **kwargs)
    )
    stream = _stream(_load(str(image_folder)), seed=1, image_root=image_folder)
    stream.set_skip([10])
    assert len(list(stream)) == 15 - 10 and len(decoded) == 15 - 10
    stream.set_skip([1, 2])
    with pytest.raises(ValueError, match="2 counts .* 1 DataLoader worker"):
        list(stream)
    with pytest.raises(ValueError, match="non-negative"):
        stream.set_skip([-1])


def test_resume_plan():
    assert resume_plan([3], 0, 4) == ([12], 0)  # no workers: skip everything consumed
    assert resume_plan([3, 3], 1, 2) == ([6, 6], 0)  # a complete cycle: worker 0 is next anyway
    assert resume_plan([3, 2], 0, 2) == ([4, 4], 1)  # worker 1 is next: worker 0 replays one batch, discarded
    assert resume_plan([2, 2, 1], 1, 5) == ([5, 5, 5], 2)
    with pytest.raises(ValueError, match="last_worker"):
        resume_plan([1, 1], 2, 4)


@pytest.mark.processes
def test_persistent_workers_follow_set_epoch(parquet_folder):
    dataset = _load(str(parquet_folder))
    stream = _stream(dataset, train=False)
    loader = torch.utils.data.DataLoader(
        stream, batch_size=3, num_workers=2, persistent_workers=True, collate_fn=collate_images
    )
    epochs = []
    for epoch in range(2):
        stream.set_epoch(epoch)
        epochs.append([_key(x) for batch in loader for x in batch["pixel_values"]])
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(12))
    assert epochs[0] != epochs[1]


def test_image_stream_argument_errors(image_folder):
    dataset = _load(str(image_folder))
    transform = build_transform(RESOLUTION, train=False)
    with pytest.raises(ValueError, match=r"'pixels' not found.*\['image'\]"):
        ImageStream(dataset, "pixels", transform, seed=0)
    with pytest.raises(ValueError, match="rank"):
        ImageStream(dataset, "image", transform, seed=0, rank=2, world_size=2)
    with pytest.raises(ValueError, match="seed"):
        ImageStream(dataset, "image", transform, seed=-1)


def test_unshuffled_stream_keeps_the_stored_order_every_epoch(parquet_folder):
    stream = _stream(_load(str(parquet_folder)), train=False, shuffle_buffer_size=0)
    assert _keys(stream) == list(range(12))
    stream.set_epoch(3)
    assert _keys(stream) == list(range(12))


# ----------------------------------------------------------------------------------------------------------------
# Broken shards
# ----------------------------------------------------------------------------------------------------------------


def _copy_with_a_truncated_shard(source: Path, destination: Path, broken: str) -> Path:
    destination.mkdir()
    for file in sorted(source.iterdir()):
        data = file.read_bytes()
        (destination / file.name).write_bytes(data[: len(data) // 2] if file.name == broken else data)
    return destination


@pytest.mark.parametrize("pattern", [None, "*.parquet"])
def test_truncated_parquet_shard_is_skipped_with_its_name(parquet_folder, tmp_path, pattern, caplog):
    folder = _copy_with_a_truncated_shard(parquet_folder, tmp_path / "shards", "part-00001.parquet")
    name = str(folder / pattern) if pattern else str(folder)
    with caplog.at_level("WARNING"):
        dataset = load_image_dataset(name)
    assert "Skipping 1 broken shard(s)" in caplog.text and "part-00001.parquet" in caplog.text
    assert sorted(_keys(_stream(dataset, train=False))) == [0, 1, 2, 6, 7, 8, 9, 10, 11]  # shard 1 held 3, 4, 5
    with pytest.raises(
        ValueError, match=r"1 shard\(s\) of .* cannot be read: .*part-00001.parquet .*--broken_shards skip"
    ):
        load_image_dataset(name, broken_shards="error")


def test_truncated_tar_shard_is_found(tar_folder, tmp_path):
    folder = _copy_with_a_truncated_shard(tar_folder, tmp_path / "tars", "shard-00000.tar")
    broken = veca_hf.data.find_broken_shards(sorted(str(p) for p in folder.iterdir()))
    assert list(broken) == [str(folder / "shard-00000.tar")] and "cut" in broken[str(folder / "shard-00000.tar")]
    assert sorted(_keys(_stream(load_image_dataset(str(folder)), train=False))) == [3, 4, 5]


def test_a_shard_that_breaks_while_streaming_stops_with_a_clear_error(parquet_folder, tmp_path):
    """A shard not checked when loading (a Hub dataset; or broken since): the stream says what failed, and where."""
    folder = _copy_with_a_truncated_shard(parquet_folder, tmp_path / "shards", "part-00002.parquet")
    files = sorted(str(p) for p in folder.iterdir())
    dataset = datasets.load_dataset("parquet", data_files={"train": files}, split="train", streaming=True)
    with pytest.raises(RuntimeError, match=r"Reading the data stream failed \(rank 0, epoch 0.*truncated or corrupt"):
        list(_stream(dataset, train=False, shuffle_buffer_size=0))
