"""Embedding a dataset with `examples/extract_features.py`: every image exactly once, equal to a direct forward of the
saved model through the saved processor, across processes, after a SIGKILL, over a flaky server, with broken images.
"""

import importlib.util
import io
import json
import logging
import os
import signal
import subprocess
import sys
import tarfile

import datasets
import numpy as np
import pytest
import torch
import warm_python
from conftest import tiny_config, tiny_dinov3_config
from PIL import Image
from shard_server import ShardServer
from test_distill_script import ROOT, run_env, two_cpu_processes
from transformers import AutoImageProcessor, AutoModel, DINOv3ViTModel

from veca_hf import AdaptiveBudget, VecaImageProcessor, VecaModel
from veca_hf.budget_policy import relative_costs
from veca_hf.cpu import hardware
from veca_hf.embedding import part_info, resolution_overrides


SCRIPT = ROOT / "examples" / "extract_features.py"
FAULTS_SCRIPT = ROOT / "tests" / "extract_with_faults.py"
ATOL = 1e-5


def load_script():
    spec = importlib.util.spec_from_file_location("extract_features", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny random VECA (patch 16, budgets 8 and 16) saved with a 32 px processor."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("extract") / "veca"
    VecaModel(tiny_config()).save_pretrained(path)
    VecaImageProcessor.for_resolution(32).save_pretrained(path)
    return path


def photo(rng, height: int, width: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def image_folder(tmp_path_factory):
    """21 images of different sizes in two class folders, one undecodable file and one empty file."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    names = []
    for index in range(21):
        name = f"{'cat' if index % 2 else 'dog'}/image-{index:02d}.png"
        (root / name).parent.mkdir(exist_ok=True)
        photo(rng, 30 + 3 * index, 70 - 2 * index).save(root / name)
        names.append(name)
    (root / "cat" / "broken.jpg").write_bytes(b"not a jpeg")
    (root / "dog" / "empty.png").write_bytes(b"")
    return root, sorted(names)


@pytest.fixture(scope="module")
def parquet_shards(tmp_path_factory):
    """3 parquet shards of 7 images each (two row groups), the last image of the second shard undecodable."""
    root = tmp_path_factory.mktemp("parquet")
    rng = np.random.default_rng(1)
    features = datasets.Features({"image": datasets.Image()})
    for shard in range(3):
        images = []
        for row in range(7):
            buffer = io.BytesIO()
            photo(rng, 40 + row, 36 + shard).save(buffer, format="PNG")
            images.append({"bytes": buffer.getvalue() if (shard, row) != (1, 6) else b"broken", "path": None})
        datasets.Dataset.from_dict({"image": images}, features=features).to_parquet(
            str(root / f"train-{shard:05d}.parquet"), batch_size=4
        )
    return root


def rows_of(output_dir) -> dict[str, dict]:
    """The rows of every part file, by id; fails on an id written twice."""
    table = datasets.load_dataset("parquet", data_files=str(output_dir / "part-*.parquet"), split="train")
    rows = {}
    for row in table:
        assert row["id"] not in rows, f"{row['id']} written twice"
        rows[row["id"]] = row
    return rows


def reference(model_dir, image: Image.Image, num_core_tokens=None, **overrides):
    """The saved model's output for one image through the saved processor (with `overrides`)."""
    model = AutoModel.from_pretrained(model_dir).eval()
    processor = AutoImageProcessor.from_pretrained(model_dir)
    with torch.no_grad():
        inputs = processor(images=image.convert("RGB"), return_tensors="pt", **overrides)
        return model(**inputs, num_core_tokens=num_core_tokens)


def run_script(args: list[str], launcher=None, faults: dict | None = None, check=True):
    command = (launcher or [sys.executable]) + [str(FAULTS_SCRIPT if faults else SCRIPT)] + [str(a) for a in args]
    env = {**run_env(), "ACCELERATE_USE_CPU": "true", **(faults or {})}
    runner = subprocess.run if launcher else warm_python.run  # the launcher's workers start as fresh interpreters
    result = runner(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-6000:]
    return result


@pytest.mark.processes
def test_two_processes_embed_every_image_once_as_a_direct_forward_does(model_dir, image_folder, tmp_path):
    root, names = image_folder
    output_dir = tmp_path / "embeddings"
    args = ["--model_name_or_path", model_dir, "--dataset_name", root, "--output_dir", output_dir,
            "--num_core_tokens", "8", "--rows_per_file", "4", "--per_device_eval_batch_size", "3",
            "--dataloader_num_workers", "1", "--patch_features", "mean"]  # fmt: skip
    result = run_script(args, launcher=two_cpu_processes(29541))

    rows = rows_of(output_dir)
    assert sorted(rows) == names
    for name in names[::4]:
        expected = reference(model_dir, Image.open(root / name), num_core_tokens=8)
        torch.testing.assert_close(torch.tensor(rows[name]["embedding"]), expected.pooler_output[0], atol=ATOL, rtol=0)
        patches = expected.last_hidden_state[0, 8:]  # after the 8 active cores
        torch.testing.assert_close(torch.tensor(rows[name]["patch_mean"]), patches.mean(0), atol=ATOL, rtol=0)
    metadata = json.loads((output_dir / "metadata.json").read_text())
    assert (metadata["num_images"], metadata["num_rows"], metadata["num_skipped"]) == (21, 23, 2)
    assert {s["id"]: s["reason"] for s in metadata["skipped"]} == {
        "cat/broken.jpg": "undecodable", "dog/empty.png": "undecodable"
    }  # fmt: skip
    assert metadata["num_core_tokens"] == 8 and metadata["num_files"] == 6  # 23 rows of one source, 4 per file
    # both processes worked: each wrote every other part of the folder's single source
    assert "process 0" in result.stderr and "process 1" in result.stderr
    assert "Embedded 21 images (2 skipped" in result.stderr


@pytest.mark.processes
def test_killed_while_writing_the_same_command_finishes_with_the_same_rows(model_dir, parquet_shards, tmp_path):
    args = ["--model_name_or_path", model_dir, "--dataset_name", parquet_shards, "--rows_per_file", "3",
            "--per_device_eval_batch_size", "2", "--dataloader_num_workers", "2",
            "--patch_features", "all"]  # fmt: skip
    run_script([*args, "--output_dir", tmp_path / "clean"])
    clean = rows_of(tmp_path / "clean")

    output_dir = tmp_path / "killed"
    killed = run_script([*args, "--output_dir", output_dir], faults={"VECA_HF_TEST_KILL_AT_PART": "4"}, check=False)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-3000:]
    finished = sorted(p.name for p in output_dir.glob("part-*.parquet"))
    assert len(finished) == 3 and len(list(output_dir.glob(".part-*.tmp*"))) == 1  # the 4th, half-written
    assert not (output_dir / "metadata.json").exists()
    before = {name: (output_dir / name).stat().st_mtime_ns for name in finished}

    resumed = run_script([*args, "--output_dir", output_dir])
    assert "Removed 1 partly written file" in resumed.stderr
    assert {name: (output_dir / name).stat().st_mtime_ns for name in finished} == before  # kept, not redone
    rows = rows_of(output_dir)
    assert sorted(rows) == sorted(clean) and len(rows) == 20  # 3 x 7 rows, one undecodable
    assert "shard-00001#6" not in rows and "shard-00002#6" in rows
    for key, row in rows.items():
        assert row["embedding"] == clean[key]["embedding"] and row["patch_features"] == clean[key]["patch_features"]
        assert (row["grid_height"], row["grid_width"]) == (2, 2)  # 32 px / patch 16
    metadata = json.loads((output_dir / "metadata.json").read_text())
    assert metadata["num_skipped"] == 1 and metadata["skipped"][0]["id"] == "shard-00001#6"
    # 3 sources x ceil(7 / 3) parts; the last of source 1 is its broken image alone: a marker, not a Parquet file
    assert metadata["num_files"] == 8 and (output_dir / ".progress" / "part-00001-00002.json").exists()


@pytest.mark.processes
def test_remote_shards_over_a_flaky_server_give_the_rows_of_local_ones(model_dir, parquet_shards, tmp_path):
    args = ["--model_name_or_path", model_dir, "--rows_per_file", "4", "--dataloader_num_workers", "0",
            "--stream_retries", "5", "--stream_retry_wait", "0.1"]  # fmt: skip
    run_script([*args, "--dataset_name", parquet_shards, "--output_dir", tmp_path / "local"])
    local = rows_of(tmp_path / "local")
    # a 503 on first contact with every shard, then a dropped transfer of each
    faults = {f"/train-{shard:05d}.parquet": ["any:503", "drop"] for shard in range(3)}
    with ShardServer(parquet_shards, faults=faults) as server:
        run_script([*args, "--dataset_name", server.url("train-{00000..00002}.parquet"), "--output_dir",
                    tmp_path / "remote"])  # fmt: skip
        injected = sorted(fault for _, _, fault in server.requests if fault is not None)
    assert injected == ["503"] * 3 + ["drop"] * 3
    remote = rows_of(tmp_path / "remote")
    assert sorted(remote) == sorted(local)
    assert all(remote[key]["embedding"] == local[key]["embedding"] for key in local)


def test_each_image_at_its_own_size_equals_its_own_forward(model_dir, image_folder, tmp_path):
    root, names = image_folder
    output_dir = tmp_path / "own-size"
    load_script().main(["--model_name_or_path", str(model_dir), "--dataset_name", str(root), "--output_dir",
                        str(output_dir), "--keep_size", "--max_image_side", "64", "--per_device_eval_batch_size", "5",
                        "--dataloader_num_workers", "0", "--patch_features", "all"])  # fmt: skip
    rows = rows_of(output_dir)
    assert sorted(rows) == names
    for name in names[::3]:
        image = Image.open(root / name)
        size = {"shortest_edge": min(image.size), "longest_edge": 64}
        expected = reference(model_dir, image, size=size, do_center_crop=False, ensure_multiple_of=16)
        grid = (rows[name]["grid_height"], rows[name]["grid_width"])
        patches = expected.last_hidden_state[0, 16:]  # the default budget: the whole bank of 16
        assert grid[0] * grid[1] == len(patches) and len(rows[name]["patch_features"]) == len(patches)
        torch.testing.assert_close(torch.tensor(rows[name]["embedding"]), expected.pooler_output[0], atol=ATOL, rtol=0)
        torch.testing.assert_close(torch.tensor(rows[name]["patch_features"]), patches, atol=ATOL, rtol=0)
    assert len({(row["grid_height"], row["grid_width"]) for row in rows.values()}) > 3  # really mixed sizes


def test_webdataset_keys_are_the_ids_and_dino_models_work_too_in_bf16(tmp_path, monkeypatch, caplog):
    shards = tmp_path / "tars"
    shards.mkdir()
    rng = np.random.default_rng(2)
    for shard in range(2):
        with tarfile.open(shards / f"shard-{shard:05d}.tar", "w") as tar:
            for row in range(3):
                buffer = io.BytesIO()
                photo(rng, 40, 40).save(buffer, format="JPEG")
                info = tarfile.TarInfo(f"sample-{shard}{row}.jpg")
                info.size = len(buffer.getvalue())
                tar.addfile(info, io.BytesIO(buffer.getvalue()))
    torch.manual_seed(0)
    dino = tmp_path / "dino"
    DINOv3ViTModel(tiny_dinov3_config()).save_pretrained(dino)
    VecaImageProcessor.for_resolution(32).save_pretrained(dino)  # any processor; this one gives 32 px crops
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2"})  # a CPU without bf16 instructions
    with caplog.at_level(logging.WARNING, logger="veca_hf.cpu.hardware"):
        load_script().main(["--model_name_or_path", str(dino), "--dataset_name", str(shards),
                            "--output_dir", str(tmp_path / "out"), "--dataloader_num_workers", "0",
                            "--dtype", "bfloat16"])  # fmt: skip
    assert any(message.startswith("--dtype bfloat16: this CPU") for message in caplog.messages)
    assert json.loads((tmp_path / "out" / "metadata.json").read_text())["dtype"] == "bfloat16"  # run as asked
    rows = rows_of(tmp_path / "out")
    assert sorted(rows) == [f"sample-{s}{r}" for s in range(2) for r in range(3)]
    assert len(rows["sample-00"]["embedding"]) == tiny_dinov3_config().hidden_size


def test_a_folder_of_other_settings_and_bad_flags_are_clear_errors(model_dir, image_folder, tmp_path):
    root, _ = image_folder
    script = load_script()
    base = ["--model_name_or_path", str(model_dir), "--dataset_name", str(root), "--dataloader_num_workers", "0"]
    script.main([*base, "--output_dir", str(tmp_path / "out"), "--num_core_tokens", "8"])
    with pytest.raises(ValueError, match=r"other settings \(num_core_tokens: 8 there, 16 now\)"):
        script.main([*base, "--output_dir", str(tmp_path / "out"), "--num_core_tokens", "16"])
    bad = {
        ("--patch_features", "some"): "--patch_features 'some' is not one of",
        ("--dtype", "fp8"): "--dtype 'fp8' is not one of",
        ("--num_core_tokens", "12"): "num_core_tokens=12 is not a valid budget",
        ("--resolution", "40"): "--resolution 40 is not a multiple of the patch size 16",
        ("--keep_size", "--resolution", "32"): "do not pass --resolution with it",
        ("--rows_per_file", "0"): "--rows_per_file must be >= 1",
    }
    for flags, message in bad.items():
        with pytest.raises(ValueError, match=message):
            script.main([*base, "--output_dir", str(tmp_path / "bad"), *flags])
    no_processor = tmp_path / "bare"
    VecaModel(tiny_config()).save_pretrained(no_processor)
    with pytest.raises(ValueError, match="No image processor in"):
        script.main([*base[:1], str(no_processor), *base[2:], "--output_dir", str(tmp_path / "bad")])


def test_resolution_overrides_keep_the_processors_resize_ratio():
    assert resolution_overrides(VecaImageProcessor(), 512) == {
        "size": {"shortest_edge": 576}, "crop_size": {"height": 512, "width": 512}
    }  # fmt: skip
    squashing = VecaImageProcessor(do_center_crop=False, size={"height": 224, "width": 224})
    assert resolution_overrides(squashing, 448) == {"size": {"height": 448, "width": 448}, "do_center_crop": False}


def test_part_files_carry_their_row_counts_and_load_for_a_nearest_neighbour_search(model_dir, image_folder, tmp_path):
    root, _ = image_folder
    load_script().main(["--model_name_or_path", str(model_dir), "--dataset_name", str(root), "--output_dir",
                        str(tmp_path / "out"), "--rows_per_file", "10", "--dataloader_num_workers", "0"])  # fmt: skip
    infos = [part_info(tmp_path / "out", 0, part) for part in range(3)]
    assert [info["rows"] for info in infos] == [10, 10, 3]
    assert sum(len(info["skipped"]) for info in infos) == 2
    assert os.listdir(tmp_path / "out" / ".progress") == ["source-00000.json"]
    # docs/usage.md's search: each image's nearest neighbour is itself
    from sklearn.neighbors import NearestNeighbors

    table = datasets.load_dataset("parquet", data_files=str(tmp_path / "out" / "part-*.parquet"), split="train")
    embeddings = np.asarray(table["embedding"], dtype=np.float32)  # (21, 64)
    _, neighbours = NearestNeighbors(n_neighbors=2, metric="cosine").fit(embeddings).kneighbors(embeddings)
    assert embeddings.shape == (21, 64) and (neighbours[:, 0] == np.arange(21)).all()


def test_a_folder_started_with_the_short_dtype_spelling_resumes(tmp_path):
    from veca_hf.embedding import SETTINGS_FILE, EmbeddingSettings

    values = dict(model="m", model_type="veca", num_core_tokens=8, resolution=64, keep_size=False, max_image_side=None,
                  patch_features="none", dtype="bf16", rows_per_file=4, image_column="image", dataset="d",
                  min_image_size=1)  # fmt: skip
    EmbeddingSettings(**values).check_against(tmp_path)  # a folder whose settings hold the short spelling
    assert json.loads((tmp_path / SETTINGS_FILE).read_text())["dtype"] == "bf16"
    EmbeddingSettings(**{**values, "dtype": "bfloat16"}).check_against(tmp_path)  # the same run: no error
    with pytest.raises(ValueError, match="dtype: 'bfloat16' there, 'float32' now"):
        EmbeddingSettings(**{**values, "dtype": "float32"}).check_against(tmp_path)


def test_auto_gives_each_image_its_policys_budget_and_its_own_forward(model_dir, image_folder, tmp_path):
    root, names = image_folder
    model = VecaModel.from_pretrained(model_dir).eval()
    torch.manual_seed(1)
    held_out = torch.randn(40, 3, 32, 32)
    costs = relative_costs(model.config, 32, 32, [8, 16])
    AdaptiveBudget.fit(model, held_out, target_mean_cost=float(costs[0]) + 0.5)  # about half the images go on to 16
    policy_dir = tmp_path / "veca-auto"
    model.save_pretrained(policy_dir)
    AutoImageProcessor.from_pretrained(model_dir).save_pretrained(policy_dir)
    script = load_script()
    base = ["--dataset_name", str(root), "--dataloader_num_workers", "0", "--per_device_eval_batch_size", "4"]
    script.main(["--model_name_or_path", str(policy_dir), *base, "--output_dir", str(tmp_path / "out"),
                 "--num_core_tokens", "auto", "--patch_features", "mean"])  # fmt: skip
    rows = rows_of(tmp_path / "out")
    assert sorted(rows) == names
    budgets = {name: row["num_core_tokens"] for name, row in rows.items()}
    assert set(budgets.values()) == {8, 16}, budgets  # the policy really picks per image
    settings = json.loads((tmp_path / "out" / "extraction.json").read_text())
    assert settings["num_core_tokens"] == "auto" and settings["budget_policy"] == model.config.adaptive_budget
    for name in names[::2]:
        image = Image.open(root / name)
        picked = reference(policy_dir, image, num_core_tokens="auto").core_mask.sum()
        assert picked == budgets[name]
        expected = reference(policy_dir, image, num_core_tokens=budgets[name])  # that image alone at its budget
        torch.testing.assert_close(torch.tensor(rows[name]["embedding"]), expected.pooler_output[0], atol=ATOL, rtol=0)
        patch_mean = expected.last_hidden_state[0, budgets[name] :].mean(0)
        torch.testing.assert_close(torch.tensor(rows[name]["patch_mean"]), patch_mean, atol=ATOL, rtol=0)
    bad = {
        ("--num_core_tokens", "eight"): "must be a budget or 'auto', got 'eight'",
        ("--num_core_tokens", "auto"): "needs a budget policy in config.adaptive_budget",  # a model without one
    }
    for flags, message in bad.items():
        with pytest.raises(ValueError, match=message):
            script.main(["--model_name_or_path", str(model_dir), *base, "--output_dir", str(tmp_path / "bad"), *flags])
