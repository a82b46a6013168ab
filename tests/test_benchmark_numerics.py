"""`benchmarks/numerics.py` on tiny models: `precision` reports cosines and errors of bf16 and the attention backends
against fp32, on noise and on images; `int8` times, compares and probes every candidate."""

import json
import statistics
import sys

import pytest
import torch
from benchmark_support import import_benchmark, run_script
from conftest import random_pil_images


@pytest.mark.processes
@pytest.mark.parametrize("inputs", ["noise", "images"])
def test_precision_reports_cosines(tmp_path, inputs):
    output = tmp_path / "out" / "results.json"
    extra = []
    if inputs == "images":  # real-image path: a folder of (generated) photos through the processor
        for index, image in enumerate(random_pil_images(3, size=(90, 70))):
            image.save(tmp_path / f"{index}.png")
        extra = ["--images_dir", str(tmp_path), "--batch_size", "3"]
    run_script("numerics.py", "precision", "--tiny", "--resolutions", "64", "--threads", "1", "--bf16_probe_size",
               "0", "--output_dir", str(output.parent), *extra)  # fmt: skip
    result = json.loads(output.read_text())
    assert result["inputs"] == (str(tmp_path) if inputs == "images" else "gaussian noise")
    rows = {(r["model"], r["check"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in ("VECA", "DINOv3") for c in ("bf16_autocast", "bf16_weights", "eager_sdpa")}
    for (_model, check), row in rows.items():
        assert 0.99 < row["last_hidden_state_cosine_min"] <= row["last_hidden_state_cosine_mean"] <= 1.0 + 1e-6
        if check == "eager_sdpa":  # fp32: the two backends agree to rounding
            assert row["relative_error"] < 1e-4
    assert result["machine"]["bf16"]["flags"] is not None or sys.platform != "linux"


def test_images_dir_with_too_few_images_names_the_fix(tmp_path):
    numerics = import_benchmark("numerics")
    random_pil_images(1)[0].save(tmp_path / "only.png")
    with pytest.raises(ValueError, match="holds 1 images, fewer than --batch_size 2"):
        numerics.load_images(str(tmp_path), 2)
    processor_input = numerics.make_inputs(
        numerics.parse_args(["precision", "--tiny"]), 32, numerics.load_images(str(tmp_path), 1)
    )
    assert processor_input.shape == (1, 3, 32, 32)


def test_unknown_checks_and_candidates_are_rejected():
    numerics = import_benchmark("numerics")
    for argv in (["precision", "--checks", "fp16"], ["int8", "--candidates", "int4"]):
        with pytest.raises(SystemExit):
            numerics.parse_args(argv)
    assert numerics.parse_args(["precision", "--checks", "eager_sdpa"]).checks == ["eager_sdpa"]


def test_cpu_bf16_support_flags_only():
    from veca_hf.cpu.hardware import cpu_bf16_support

    info = cpu_bf16_support(measure_size=None)
    assert "mm_size" not in info and info["fast_bf16"] in (True, False, None)
    if info["flags"] is not None:
        assert info["fast_bf16"] == bool({"avx512_bf16", "amx_bf16"} & set(info["flags"]))


@pytest.mark.processes
def test_int8_times_compares_and_probes_every_candidate(tmp_path):
    pytest.importorskip("onnxruntime")
    from conftest import tiny_config

    from veca_hf import VecaModel

    torch.manual_seed(0)
    VecaModel(tiny_config()).save_pretrained(tmp_path / "tiny")
    (tmp_path / "photos").mkdir()
    for index, image in enumerate(random_pil_images(3, size=(90, 70))):
        image.save(tmp_path / "photos" / f"{index}.png")
    import numpy as np
    from conftest import write_idx

    (tmp_path / "fashion").mkdir()
    rng = np.random.default_rng(0)
    for prefix in ("train", "t10k"):
        write_idx(tmp_path / "fashion", prefix, 30, rng)
    run_script("numerics.py", "int8", "--tiny", "--budget", "8", "--speed_resolutions", "64", "--rounds", "2",
               "--resolutions", "64", "--veca_model", str(tmp_path / "tiny"), "--images_dir", str(tmp_path / "photos"),
               "--num_images", "3", "--fashion_mnist_dir", str(tmp_path / "fashion"), "--probe_resolution", "64",
               "--probe_samples", "30", "--threads", "1", "--bf16_probe_size", "0",
               "--output_dir", str(tmp_path / "out"))  # fmt: skip
    result = json.loads((tmp_path / "out" / "results.json").read_text())
    candidates = ["torch_int8_x86", "torch_int8_onednn", "onnxruntime_int8"]
    assert [row["runner"] for row in result["speed"]] == ["fp32", "bf16", *candidates]
    for row in result["speed"]:
        ratios = [a / b for a, b in zip(row["seconds"], result["speed"][0]["seconds"], strict=True)]
        assert len(row["seconds"]) == 2 and row["over_fp32"] == pytest.approx(statistics.median(ratios))
    assert [row["runner"] for row in result["fidelity"]] == candidates  # fp32 is the reference
    for row in result["fidelity"]:
        assert 0.9 < row["global_cosine_min"] <= row["global_cosine_mean"] + 1e-6 <= 1 + 2e-6
        assert 0.9 < row["patch_cosine_min"] <= row["patch_cosine_mean"] + 1e-6 <= 1 + 2e-6
    probes = {row["runner"]: row for row in result["probe"]}
    assert probes["fp32"]["minus_fp32"] == 0 and probes["fp32"]["minus_fp32_interval"] == [0, 0]
    for name, verdict in result["verdicts"].items():
        row = next(r for r in result["fidelity"] if r["runner"] == name)
        assert verdict["worst_cosine"] == min(row["global_cosine_min"], row["patch_cosine_min"])
        low, high = probes[name]["minus_fp32_interval"]
        assert verdict["fit_to_offer"] == (verdict["worst_cosine"] >= 0.99 and low <= 0 <= high)
    assert result["machine"]["bf16"]["flags"] is not None or sys.platform != "linux"
