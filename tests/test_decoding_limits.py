"""What the data pipeline refuses before paying for it: images with too many pixels (read from the file's header, never
decoded), and images given as a path outside the dataset's own folder (rows carry bytes; a path is read only inside
the image folder being streamed, and only when it is a regular file)."""

import importlib.util
import io
import json
import os
import struct
import threading
import time
import zlib
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import fsspec
import numpy as np
import PIL.Image
import PIL.ImageFile
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from veca_hf.data import (
    DEFAULT_MAX_IMAGE_PIXELS,
    ImageStream,
    build_transform,
    collate_images,
    dataset_root,
    decode_image,
    load_image_dataset,
)


ROOT = Path(__file__).parent.parent


def _blank_png(width: int, height: int, bit_depth: int) -> bytes:
    """A black greyscale PNG of any size, written row by row without ever holding its pixels: 12000 x 12000 at 1 bit
    is a few KB (at 16 bits, 280 KB: the file that once cost a DataLoader worker 12 s and 4.5 GB)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = bytes(1 + (width * bit_depth + 7) // 8)  # filter type 0, then zeros
    compressor = zlib.compressobj(9)
    pixels = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, bit_depth, 0, 0, 0, 0)  # colour type 0: greyscale
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", pixels) + chunk(b"IEND", b"")


def _png(level: int, size=(40, 36)) -> bytes:
    buffer = io.BytesIO()
    PIL.Image.new("RGB", size, (level, level, level)).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture
def loads(monkeypatch) -> list:
    """Every full decode (`ImageFile.load`) from here on, recorded; the test fails if a refused image is decoded."""
    calls, load = [], PIL.ImageFile.ImageFile.load

    def spy(image):
        calls.append(image.size)
        return load(image)

    monkeypatch.setattr(PIL.ImageFile.ImageFile, "load", spy)
    return calls


# ----------------------------------------------------------------------------------------------------------------
# Too many pixels
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")  # PIL's own warning at 89 MP
def test_a_huge_image_is_skipped_from_its_header_without_decoding(tmp_path, loads):
    huge = _blank_png(12000, 12000, bit_depth=1)  # 144 megapixels
    assert len(huge) < 100_000
    (tmp_path / "huge.png").write_bytes(huge)
    values = [huge, {"bytes": huge, "path": None}, PIL.Image.open(io.BytesIO(huge))]
    start = time.perf_counter()
    results = [decode_image(value) for value in values]
    results.append(decode_image(str(tmp_path / "huge.png"), root=tmp_path))
    assert results == [(None, "too_large")] * 4
    assert loads == []  # refused from the header: not one pixel decoded
    assert time.perf_counter() - start < 2.0


def test_the_pixel_limit_is_width_times_height_and_none_lifts_it(loads):
    image = _png(90, size=(100, 80))
    assert decode_image(image, max_pixels=100 * 80 - 1) == (None, "too_large")
    assert loads == []  # refused undecoded
    assert decode_image(image, max_pixels=100 * 80)[1] is None  # at the limit: kept, as PIL's MAX_IMAGE_PIXELS
    assert decode_image(image, max_pixels=None)[1] is None
    assert set(loads) == {(100, 80)}
    assert DEFAULT_MAX_IMAGE_PIXELS == 64_000_000 and PIL.Image.MAX_IMAGE_PIXELS == 89478485  # PIL's global untouched
    for bad in (0, -5, 2.5, True, "64000000"):
        with pytest.raises(ValueError, match=f"`max_pixels` must be a positive int or None, got {bad!r}"):
            decode_image(image, max_pixels=bad)


def test_a_decompression_bomb_counts_as_too_large_even_without_a_limit():
    bomb = _blank_png(20000, 20000, bit_depth=1)  # 400 MP: beyond PIL's own 2 x MAX_IMAGE_PIXELS, raised at open
    assert decode_image(bomb, max_pixels=None) == (None, "too_large")


def test_a_16_bit_image_is_converted_in_float32(monkeypatch):
    """The one float copy of the pipeline (16/32-bit greyscale to 8 bits) is float32, after the pixel check."""
    copies = []
    asarray = np.asarray

    def spy(value, *args, **kwargs):
        array = asarray(value, *args, **kwargs)
        copies.append(array.dtype)
        return array

    monkeypatch.setattr("veca_hf.data.decoding.np.asarray", spy)
    image, reason = decode_image(PIL.Image.fromarray(np.full((36, 40), 120 * 257, dtype=np.uint16)))
    assert reason is None and np.asarray(image).max() == 120 and copies[0] == np.float32


# ----------------------------------------------------------------------------------------------------------------
# Paths
# ----------------------------------------------------------------------------------------------------------------


@pytest.fixture
def folders(tmp_path) -> tuple[Path, Path]:
    """`images/` (the dataset: a.png, sub/b.png, a directory, links in and out) and `outside/secret.png`."""
    images, outside = tmp_path / "images", tmp_path / "outside"
    (images / "sub").mkdir(parents=True)
    outside.mkdir()
    (images / "a.png").write_bytes(_png(60))
    (images / "sub" / "b.png").write_bytes(_png(70))
    (outside / "secret.png").write_bytes(_png(80))
    (images / "inside_link.png").symlink_to(images / "sub" / "b.png")
    (images / "outside_link.png").symlink_to(outside / "secret.png")
    return images, outside


def test_a_path_is_read_only_inside_the_root(folders):
    images, outside = folders
    for value in [str(images / "a.png"), images / "a.png", {"bytes": None, "path": str(images / "a.png")}]:
        assert decode_image(value) == (None, "path_not_allowed")  # no root: rows must carry their bytes
        image, reason = decode_image(value, root=images)
        assert reason is None and np.asarray(image).mean() == 60
    assert decode_image(str(images / "inside_link.png"), root=str(images))[1] is None
    refused = [
        outside / "secret.png",
        images / "outside_link.png",  # a link is resolved before the check
        images / ".." / "outside" / "secret.png",
        images / "sub",  # a directory
        "http://127.0.0.1:9/a.png",  # a URL under a local root: never fetched
    ]
    for path in refused:
        assert decode_image({"bytes": None, "path": str(path)}, root=images) == (None, "path_not_allowed"), path
    assert decode_image(str(images / "missing.png"), root=images) == (None, "undecodable")
    # bytes win over the path, wherever it points
    assert decode_image({"bytes": _png(90), "path": str(outside / "secret.png")})[1] is None


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_inside_the_root_is_refused_without_blocking(tmp_path):
    fifo = tmp_path / "image.png"
    os.mkfifo(fifo)
    result = []
    reader = threading.Thread(target=lambda: result.append(decode_image(str(fifo), root=tmp_path)), daemon=True)
    reader.start()
    reader.join(timeout=5)
    if reader.is_alive():  # opening a FIFO without O_NONBLOCK waits for a writer: give it one, then fail
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        reader.join(timeout=5)
        pytest.fail("decode_image blocked on a FIFO")
    assert result == [(None, "path_not_allowed")]


@pytest.mark.skipif(not os.path.exists("/dev/zero"), reason="needs /dev/zero")
def test_a_device_is_refused(loads):
    assert decode_image("/dev/zero", root="/dev") == (None, "path_not_allowed")


def test_remote_paths_are_read_only_under_a_remote_root():
    memory = fsspec.filesystem("memory")
    memory.pipe("/veca-images/a.png", _png(50))
    memory.pipe("/veca-private/b.png", _png(50))
    try:
        image, reason = decode_image("memory://veca-images/a.png", root="memory://veca-images")
        assert reason is None and np.asarray(image).mean() == 50
        for path, root in [
            ("memory://veca-private/b.png", "memory://veca-images"),  # a sibling with a common prefix
            ("memory://veca-images/../veca-private/b.png", "memory://veca-images/"),
            ("memory://veca-images/%2e%2e/veca-private/b.png", "memory://veca-images/"),
            ("memory://veca-images/a.png", None),
            ("memory://veca-images/a.png", "/tmp"),  # a local root never allows a URL
        ]:
            assert decode_image(path, root=root) == (None, "path_not_allowed"), (path, root)
    finally:
        memory.rm("/veca-images", recursive=True)
        memory.rm("/veca-private", recursive=True)


def test_dataset_root_is_where_load_image_dataset_finds_the_files(tmp_path):
    (tmp_path / "shards").mkdir()
    (tmp_path / "a.png").write_bytes(_png(10))
    assert dataset_root(str(tmp_path)) == str(tmp_path)
    assert dataset_root(str(tmp_path / "a.png")) == str(tmp_path)
    assert dataset_root(str(tmp_path / "shards" / "**" / "*.jpg")) == str(tmp_path / "shards")
    assert dataset_root("https://user:pw@host/data/img-{0..7}.png") == "https://user:pw@host/data/"
    assert dataset_root("https://host/data/img.png?X-Amz-Signature=abc") == "https://host/data/"
    assert dataset_root("https://host/a/x/1.png https://host/a/y/2.png") == "https://host/a/"
    assert dataset_root("s3://bucket/prefix/*.tar") == "s3://bucket/prefix/"
    assert dataset_root("hf://datasets/org/name/data/*.parquet") == "hf://datasets/org/name/data/"
    assert dataset_root("org/name") == "hf://datasets/org/name@"  # datasets resolves Hub files at a revision
    assert dataset_root("https://a.example/1.png https://b.example/2.png") is None  # no common folder
    assert dataset_root(str(tmp_path / "missing" / "folder")) is None


# ----------------------------------------------------------------------------------------------------------------
# The stream
# ----------------------------------------------------------------------------------------------------------------


def _parquet_with_paths(path: Path, images: list[dict]) -> None:
    """A parquet shard as `datasets` writes one for an `Image` column, rows given as `{"bytes", "path"}`."""
    column = pa.array(images, pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    metadata = {"huggingface": json.dumps({"info": {"features": {"image": {"_type": "Image"}}}})}
    pq.write_table(pa.table({"image": column}).replace_schema_metadata(metadata), path)


def test_stream_counts_large_images_and_refused_paths(tmp_path, folders):
    images, outside = folders
    (tmp_path / "shards").mkdir()
    _parquet_with_paths(
        tmp_path / "shards" / "train-00000.parquet",
        [
            {"bytes": _png(40), "path": None},
            {"bytes": _png(50, size=(300, 300)), "path": None},  # above the limit below
            {"bytes": None, "path": str(outside / "secret.png")},  # a row that names a local file
            {"bytes": None, "path": "http://127.0.0.1:9/secret.png"},  # or a URL
        ],
    )
    dataset = load_image_dataset(str(tmp_path / "shards"))
    assert dataset_root(str(tmp_path / "shards")) == str(tmp_path / "shards")
    transform = build_transform(32, train=False)
    stream = ImageStream(
        dataset, "image", transform, seed=0, shuffle_buffer_size=0, max_image_pixels=200 * 200,
        image_root=dataset_root(str(tmp_path / "shards")),
    )  # fmt: skip
    batch = collate_images(list(stream))
    assert batch["skipped_reasons"] == Counter({"too_large": 1, "path_not_allowed": 2})
    assert batch["pixel_values"].shape == (1, 3, 32, 32)


def test_stream_reads_its_image_folder_and_nothing_else(folders, caplog):
    images, _ = folders
    dataset = load_image_dataset(str(images))
    transform = build_transform(32, train=False)
    stream = ImageStream(
        dataset, "image", transform, seed=0, shuffle_buffer_size=0, image_root=dataset_root(str(images))
    )
    items = list(stream)
    assert Counter(item.get("skipped") for item in items) == Counter({None: 3, "path_not_allowed": 1})
    assert sorted(item["source"] for item in items if "skipped" in item) == [str(images / "outside_link.png")]

    # Without a root, an image folder yields nothing, and the log says what to pass.
    with caplog.at_level("WARNING"):
        items = list(ImageStream(dataset, "image", transform, seed=0, shuffle_buffer_size=0))
    assert Counter(item.get("skipped") for item in items) == Counter({"path_not_allowed": 4})
    assert "image_root=veca_hf.data.dataset_root" in caplog.text


def test_image_stream_refuses_a_bad_pixel_limit(folders):
    dataset = load_image_dataset(str(folders[0]))
    transform = build_transform(32, train=False)
    for bad in (0, -1, 1.5):
        with pytest.raises(ValueError, match=f"`max_image_pixels` must be a positive int or None, got {bad!r}"):
            ImageStream(dataset, "image", transform, seed=0, max_image_pixels=bad)


# ----------------------------------------------------------------------------------------------------------------
# The training script's flag
# ----------------------------------------------------------------------------------------------------------------


def _distill():
    spec = importlib.util.spec_from_file_location("distill_pixels", ROOT / "examples" / "distill.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_distill_threads_the_pixel_limit_and_the_image_root(folders):
    distill = _distill()
    images, _ = folders
    _, data_args, args = distill.parse_args(
        ["--dataset_name", str(images), "--max_image_pixels", "1000000", "--validation_size", "1"]
    )
    accelerator = SimpleNamespace(process_index=0, num_processes=1)
    train, _, validation = distill.build_data(accelerator, data_args, args, build_transform(32, train=True), 32)
    for stream in (train, validation):
        assert stream.max_image_pixels == 1_000_000 and stream.image_root == str(images)
    assert distill.parse_args(["--dataset_name", "x"])[1].max_image_pixels == DEFAULT_MAX_IMAGE_PIXELS
    with pytest.raises(ValueError, match="--max_image_pixels must be at least 1, got 0"):
        distill.parse_args(["--dataset_name", "x", "--max_image_pixels", "0"])
    assert torch.is_tensor(next(iter(train))["pixel_values"])
