"""The README's main job around `examples/distill.py`: its distillation pool and its closing probe against a random
network (`veca_hf.demo.main_job`, `python -m veca_hf.demo pool|probe`)."""

import json

import datasets
import numpy as np
import pytest
import torch
import yaml
from conftest import tiny_config, tiny_dinov3_config, write_idx
from PIL import Image
from transformers import DINOv3ViTModel

from veca_hf import VecaModel
from veca_hf.demo import __main__ as demo_cli
from veca_hf.demo.main_job import (
    FASHION_MNIST_ENV,
    PoolSettings,
    ProbeRow,
    find_fashion_mnist,
    probe_distilled_student,
    probe_table,
    write_distillation_pool,
)


@pytest.fixture
def fashion_mnist_dir(tmp_path):
    folder = tmp_path / "fashion-mnist"
    folder.mkdir()
    rng = np.random.default_rng(0)
    write_idx(folder, "train", 40, rng)
    write_idx(folder, "t10k", 300, rng)
    return folder


@pytest.fixture
def photos_dir(tmp_path):
    folder = tmp_path / "photos"
    folder.mkdir()
    rng = np.random.default_rng(1)
    for index in range(5):
        Image.fromarray(rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)).save(folder / f"photo_{index}.png")
    return folder


SMALL_POOL = PoolSettings(
    photo_crops=3, heldout_photos=2, heldout_photo_crops=2, validation_fashion_mnist=6, num_shards=2, side=48
)


def test_pool_holds_fashion_mnist_and_photo_views_and_is_written_once(tmp_path, fashion_mnist_dir, photos_dir):
    pool = write_distillation_pool(tmp_path / "pool", photos_dir, fashion_mnist_dir, SMALL_POOL)
    manifest = json.loads((pool / "manifest.json").read_text())
    assert manifest["train"] == {"images": 40 + 3 * 3, "photo_views": 9, "shards": 2}
    assert manifest["validation"] == {"images": 6 + 2 * 2, "photo_views": 4, "shards": 1}
    train = datasets.load_dataset("parquet", data_files=str(pool / "train-*.parquet"), split="train")
    validation = datasets.load_dataset("parquet", data_files=str(pool / "validation-*.parquet"), split="train")
    assert len(train) == 49 and len(validation) == 10
    held_out = {"photo_0", "photo_1"}  # the first photos by name
    assert not any(source.split("/")[1] in held_out for source in train["source"] if source.startswith("photo/"))
    assert {source.split("/")[1] for source in validation["source"] if source.startswith("photo/")} == held_out
    assert all(s.startswith("fashion-mnist/test/") for s in validation["source"] if s.startswith("fashion"))
    assert min(min(image.size) for image in train["image"]) == 28  # Fashion-MNIST, stored as it is
    assert min(min(image.size) for image in validation["image"] if image.size != (28, 28)) == 48  # the views' side

    stamp = (pool / "manifest.json").stat().st_mtime_ns
    write_distillation_pool(pool, photos_dir, fashion_mnist_dir, SMALL_POOL)
    assert (pool / "manifest.json").stat().st_mtime_ns == stamp  # complete: kept as it is
    (pool / "manifest.json").unlink()
    (pool / "stale.parquet").write_bytes(b"half a file")
    write_distillation_pool(pool, photos_dir, fashion_mnist_dir, SMALL_POOL)
    assert (pool / "manifest.json").exists() and not (pool / "stale.parquet").exists()  # incomplete: written again


def test_pool_needs_more_photos_than_it_holds_out(tmp_path, fashion_mnist_dir, photos_dir):
    with pytest.raises(ValueError, match="5 photos; 5 are held out"):
        write_distillation_pool(tmp_path / "pool", photos_dir, fashion_mnist_dir, PoolSettings(heldout_photos=5))


def test_fashion_mnist_is_found_or_the_error_says_how_to_get_it(tmp_path, fashion_mnist_dir, monkeypatch):
    assert find_fashion_mnist(fashion_mnist_dir) == fashion_mnist_dir
    monkeypatch.setenv(FASHION_MNIST_ENV, str(fashion_mnist_dir))
    assert find_fashion_mnist() == fashion_mnist_dir
    with pytest.raises(ValueError, match="apt-get install dataset-fashion-mnist"):
        find_fashion_mnist(tmp_path / "empty")


def rows(student_correct: np.ndarray, random_correct: np.ndarray) -> list[ProbeRow]:
    teacher = [ProbeRow("teacher", None, f, np.ones(len(student_correct), bool)) for f in ("global", "patches")]
    return teacher + [
        ProbeRow(model, budget, feature, correct)
        for budget in (8, 16)
        for feature in ("global", "patches")
        for model, correct in (("student", student_correct), ("random", random_correct))
    ]


def test_probe_table_says_whether_the_student_beats_the_random_network():
    better, worse = np.arange(200) % 10 != 0, np.arange(200) % 2 == 0  # 90% and 50% right
    table, beats = probe_table(rows(better, worse))
    assert beats and "| C=16 | patches | 90.0 [" in table and "| +40.0 [" in table
    assert not probe_table(rows(worse, better))[1]
    assert not probe_table(rows(better, better))[1]  # a tie is not a win


def test_probe_of_an_untrained_student_reports_no_gain(tmp_path, fashion_mnist_dir, capsys):
    """The closing probe end to end, on a saved student that is its own random initialisation: every difference is
    zero, so the verdict must say that it does not beat the random network."""
    torch.manual_seed(0)
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(tmp_path / "teacher")
    torch.manual_seed(0)
    VecaModel(tiny_config()).save_pretrained(tmp_path / "student")
    config = {
        "teacher_name_or_path": str(tmp_path / "teacher"),
        "output_dir": str(tmp_path / "student"),
        "resolution": "32",
        "seed": 0,
    }
    config_file = tmp_path / "distill.yaml"
    config_file.write_text(yaml.safe_dump(config))
    assert not probe_distilled_student(config_file, fashion_mnist_dir, num_images=200, probe_steps=100)
    printed = capsys.readouterr().out
    assert "Linear probe on 100 held-out Fashion-MNIST test images (trained on 100 others), 32 px" in printed
    assert "does NOT beat a random VECA" in printed
    results = json.loads((tmp_path / "student" / "probe_against_random.json").read_text())
    assert results["student_beats_random_everywhere"] is False
    accuracy = {(r["model"], r["budget"], r["feature"]): r["accuracy"] for r in results["rows"]}
    assert len(accuracy) == 2 + 2 * 2 * 2  # the teacher, then student and random at budgets 8 and 16, two features
    for budget in (8, 16):
        for feature in ("global", "patches"):
            assert accuracy[("student", budget, feature)] == accuracy[("random", budget, feature)]

    (tmp_path / "student" / "config.json").unlink()
    with pytest.raises(ValueError, match="holds no saved student"):
        demo_cli.main(["probe", str(config_file), "--fashion_mnist_dir", str(fashion_mnist_dir)])
